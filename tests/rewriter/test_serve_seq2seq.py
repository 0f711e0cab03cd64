"""``rewrite-model serve`` over an encoder-decoder: the prompt is the encoder's input, the completion the decoder's
tokens, equal to Hugging Face ``generate`` token for token; limits of the encoder and of the decoder's positions
are 400s naming them; a speech encoder-decoder is refused in one line.

The server runs over the engine ``rewrite-model serve`` builds for a rewritten OUT folder (``cli._serve_engine``),
built in this process and stepped in a thread (the engine process would compile its decoder step: 30-60 s)."""

from __future__ import annotations

import concurrent.futures
import functools
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

import pagedattn  # noqa: E402
from pagedattn import cli  # noqa: E402
from pagedattn.serve import BackgroundServer, ServeConfig, create_app  # noqa: E402

from .seq2seq_models import hf_seq2seq_generate, sources, tiny_seq2seq  # noqa: E402

NEW = 10


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve_seq2seq")
    model = tiny_seq2seq("bart")
    model.save_pretrained(tmp / "bart")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pagedattn, "PagedEngine", functools.partial(pagedattn.PagedEngine, compile=False, progress=False))
        assert cli.main([str(tmp / "bart"), "-o", str(tmp / "out")]) == 0
        args = cli._serve_parser().parse_args([str(tmp / "out"), "--num-blocks", "96", "--max-num-seqs", "4"])
        engine = cli._serve_engine(args)
    assert engine.servable.seq2seq is not None
    app = create_app(engine, None, ServeConfig("bart", max_queue=8))
    with BackgroundServer(app) as srv:
        client = openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0, timeout=60)
        yield model, engine, srv, client, app.state.engine_loop
    loop = app.state.engine_loop
    assert loop.final is not None and loop.final.blocks_used == 0 and not loop.final.unfinished


def _settled(loop, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not loop.settled and time.monotonic() < deadline:
        time.sleep(0.01)
    assert loop.in_flight == 0 and loop.settled and loop.gauges.blocks_used == 0, loop.gauges


def test_completions_from_encoder_inputs_equal_generate(served):
    """Six requests of ragged encoder lengths at once (four generate, two wait): each completion is the decoder's
    tokens after its start token, as generate gives them."""
    model, _engine, _srv, client, loop = served
    srcs = sources()
    ref = hf_seq2seq_generate(model, srcs, NEW)

    def ask(src):
        r = client.completions.create(model="bart", prompt=src, max_tokens=NEW, temperature=0)
        return r.choices[0].model_extra["token_ids"], r.usage

    with concurrent.futures.ThreadPoolExecutor(len(srcs)) as pool:
        got = list(pool.map(ask, srcs))
    assert [ids for ids, _ in got] == ref
    assert [u.prompt_tokens for _, u in got] == [len(s) for s in srcs]
    assert [u.completion_tokens for _, u in got] == [len(r) for r in ref]
    _settled(loop)


def test_streamed_completion_equals_generate(served):
    model, _engine, srv, _client, loop = served
    src = sources(seed=3, lengths=(21,))[0]
    ids = []
    with httpx.stream("POST", srv.url + "/completions", timeout=60,
                      json={"prompt": src, "max_tokens": NEW, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ids += __import__("json").loads(line[6:])["choices"][0].get("token_ids") or []
    assert ids == hf_seq2seq_generate(model, [src], NEW)[0]
    _settled(loop)


@pytest.mark.parametrize("body, words", [
    ({"prompt": [5] * 137, "max_tokens": 4}, ["encoder input has 137 tokens", "at most 128"]),
    ({"prompt": [5, 6, 7], "max_tokens": 200}, ["max_tokens is 200", "at most 128"]),
    ({"prompt": [5, 10**6], "max_tokens": 4}, ["outside the vocabulary"]),
], ids=["encoder too long", "past the decoder's positions", "bad id"])
def test_limits_of_encoder_and_decoder_are_400s_naming_them(served, body, words):
    """What HF's models raise an IndexError for deep in a forward pass is a 400 here, before any step runs."""
    _model, _engine, srv, _client, loop = served
    r = httpx.post(srv.url + "/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert all(w in message for w in words), message
    _settled(loop)


def test_the_model_lists_the_decoders_room(served):
    _model, _engine, srv, _client, _loop = served
    listed = httpx.get(srv.url + "/models", timeout=10).json()["data"][0]
    assert listed["max_model_len"] == 129  # the start token and 128 generated: positions 0..127 fed back


def test_a_speech_encoder_decoder_is_refused_in_one_line(tmp_path, capsys):
    tiny_seq2seq("whisper").save_pretrained(tmp_path / "whisper")
    args = cli._serve_parser().parse_args([str(tmp_path / "whisper")])
    with pytest.raises(cli.CliError, match="speech encoder-decoder .* not served over HTTP"):
        cli._serve_model(args)
