"""``rewrite-model serve``: the OpenAI-compatible server over the paged engine, driven by real clients.

One server on the demo model for the module, as ``rewrite-model serve`` runs it: the HTTP side in a thread of
this process on a free localhost port, the engine in a process of its own (built there from a picklable
factory). Greedy answers must equal ``PagedEngine.generate`` (on an engine built the same way in this process)
token for token, and every abort (disconnects, stop strings, shutdown) must give back every KV block, as the
engine process reports it. Servers over an engine of this process (stepped in a thread) are tested for a
failing step and a graceful shutdown; a stand-in engine (``_SlowEngine``) for the engine process's death and
for the server's (the engine process must not outlive it).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import itertools
import os
import random
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("transformers")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from pagedattn import PagedEngine  # noqa: E402
from pagedattn.checkpoint import load_checkpoint  # noqa: E402
from pagedattn.cli import main  # noqa: E402
from pagedattn.runtime.engine import RequestOutput  # noqa: E402
from pagedattn.serve import (  # noqa: E402
    ApiError,
    BackgroundServer,
    EngineProcess,
    ServeConfig,
    TextStream,
    bind,
    chat_prompt_ids,
    create_app,
    run,
)

NEW = 12
TEXTS = ["Beautiful is", "Explicit is better", "Flat is", "Errors should never"]
# a template of the kind tokenizers carry (the demo's has none: chat needs --chat-template)
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
CHAT = [{"role": "user", "content": "Simple is "}, {"role": "user", "content": "better"}]
MAX_SEQS, MAX_QUEUE = 4, 2


def _demo_engine() -> PagedEngine:
    """The module's engine (built in the engine process, and in this one for the reference answers)."""
    ck = load_checkpoint("demo", None, "eager")
    return PagedEngine(ck.model, num_blocks=64, max_num_seqs=MAX_SEQS, max_num_tokens=64, compile=False,
                       progress=False)


@pytest.fixture(scope="module")
def served():
    process = EngineProcess(_demo_engine).launch()  # builds its engine while this process builds the reference
    tok = load_checkpoint("demo", None, "eager").tokenizer
    engine = _demo_engine()
    prompts = [tok(t)["input_ids"] for t in TEXTS] + [chat_prompt_ids(CHAT, tok, TEMPLATE)]
    ref = engine.generate(prompts, max_new_tokens=NEW)
    app = create_app(process, tok, ServeConfig("demo", max_queue=MAX_QUEUE, chat_template=TEMPLATE))
    loop = app.state.engine_loop
    with BackgroundServer(app) as srv:
        client = openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0, timeout=60)
        yield SimpleNamespace(srv=srv, engine=engine, tok=tok, prompts=prompts, ref=ref, client=client, loop=loop)
    assert loop.final is not None and loop.final.blocks_used == 0 and not loop.final.unfinished
    assert not process.proc.is_alive() and process.proc.exitcode == 0


def _wait_until(condition, timeout: float, poll: float = 0.01) -> bool:
    """Poll ``condition()`` until it holds or ``timeout`` seconds pass; whether it holds."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(poll)
    return bool(condition())


def _settled(s, timeout: float = 10.0) -> None:
    """Wait until no request is in flight and the engine, having taken every command sent, holds no request and
    no block."""
    _wait_until(lambda: s.loop.settled, timeout)
    assert s.loop.in_flight == 0 and s.loop.settled, s.loop.gauges


def _text(s, i: int) -> str:
    return s.tok.decode(s.ref[i], skip_special_tokens=True)


def test_models_health_and_metrics(served):
    assert [m.id for m in served.client.models.list()] == ["demo"]
    base = served.srv.url.removesuffix("/v1")
    assert httpx.get(f"{base}/health").json()["status"] == "ok"

    def steps() -> float:
        line = next(x for x in httpx.get(f"{base}/metrics").text.splitlines()
                    if x.startswith("pagedattn_engine_steps_total "))
        return float(line.split()[1])

    before = steps()
    served.client.completions.create(model="demo", prompt=TEXTS[0], max_tokens=2, temperature=0)
    assert steps() - before >= 2  # a prefill step and a decode step, at least
    metrics = httpx.get(f"{base}/metrics").text
    for name in ("pagedattn_requests_running", "pagedattn_requests_waiting", "pagedattn_kv_blocks_used",
                 "pagedattn_output_tokens_per_second", "pagedattn_time_to_first_token_seconds_count",
                 "pagedattn_inter_token_latency_seconds_count"):
        assert name in metrics
    assert 'pagedattn_requests_finished_total{finish_reason="length"}' in metrics
    _settled(served)


def test_greedy_completions_equal_engine_generate(served):
    """Concurrent requests (batched together by the engine) answer exactly what generate() gave."""

    def ask(i):
        return served.client.completions.create(model="demo", prompt=TEXTS[i], max_tokens=NEW, temperature=0,
                                                extra_body={"return_token_ids": True})

    with concurrent.futures.ThreadPoolExecutor(len(TEXTS)) as pool:
        answers = list(pool.map(ask, range(len(TEXTS))))
    for i, a in enumerate(answers):
        c = a.choices[0]
        assert c.token_ids == served.ref[i] and c.text == _text(served, i)
        assert c.finish_reason == ("length" if len(served.ref[i]) == NEW else "stop")
        assert (a.usage.prompt_tokens, a.usage.completion_tokens) == (len(served.prompts[i]), len(served.ref[i]))
    _settled(served)


def test_streaming_completion(served):
    stream = served.client.completions.create(model="demo", prompt=TEXTS[1], max_tokens=NEW, temperature=0,
                                              stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == _text(served, 1) and len([c for c in chunks if c.choices]) > 2  # token by token, not at once
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == NEW and chunks[-1].usage.prompt_tokens == len(served.prompts[1])
    _settled(served)


def test_chat_plain_and_streaming(served):
    a = served.client.chat.completions.create(model="demo", messages=CHAT, max_tokens=NEW, temperature=0)
    assert a.choices[0].message.role == "assistant" and a.choices[0].message.content == _text(served, 4)
    assert a.usage.prompt_tokens == len(served.prompts[4]) and a.usage.completion_tokens == NEW
    chunks = list(served.client.chat.completions.create(model="demo", messages=CHAT, max_tokens=NEW,
                                                        temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == _text(served, 4)
    assert chunks[-1].choices[0].finish_reason == "length"
    _settled(served)


def test_sampling_is_seeded(served):
    def sample(seed):
        # a prompt the demo never saw (token ids), so that its next tokens are far from certain
        return served.client.completions.create(model="demo", prompt=[7, 200, 31, 99], max_tokens=NEW,
                                                temperature=1.5, top_p=0.95, seed=seed).choices[0].text

    a, b, c = sample(1), sample(1), sample(2)
    assert a == b and a != c
    _settled(served)


def test_chat_without_a_template_is_refused():
    tok = SimpleNamespace(chat_template=None)
    with pytest.raises(ApiError, match="no chat template") as e:
        chat_prompt_ids(CHAT, tok)
    assert e.value.status == 400


def test_stop_sequences_end_the_text_before_them(served):
    full = _text(served, 0)  # " better than ugly.\nExpl..."
    stop = full[5:9]
    want = full[: full.index(stop)]
    a = served.client.completions.create(model="demo", prompt=TEXTS[0], max_tokens=NEW, temperature=0,
                                         stop=[stop, "never there"])
    assert a.choices[0].text == want and a.choices[0].finish_reason == "stop"
    assert a.usage.completion_tokens < NEW
    chunks = list(served.client.completions.create(model="demo", prompt=TEXTS[0], max_tokens=NEW, temperature=0,
                                                   stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want and chunks[-1].choices[0].finish_reason == "stop"
    _settled(served)  # the request was aborted at the stop string: its blocks are back


@pytest.mark.parametrize("body, status, words", [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    ({"model": "gpt-9", "prompt": "x"}, 404, "gpt-9"),
    ({"prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": [1, 2, 9999]}, 400, "vocabulary"),
    ({"prompt": [1, 2, True]}, 400, "not an integer"),
    ({"prompt": list(range(200)) * 6, "max_tokens": 4}, 400, "blocks"),  # more than the whole cache
    ({"prompt": "x", "max_tokens": 100000}, 400, "blocks"),
    ({"prompt": ""}, 400, "empty"),
    ({}, 400, "prompt"),
    ({"prompt": "x", "n": 2}, 400, "n=2"),
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "stop": ""}, 400, "stop"),
    ({"prompt": ["a", "b"]}, 400, "batched"),
])
def test_bad_requests_get_a_4xx_naming_the_problem(served, body, status, words):
    url = served.srv.url + "/completions"
    r = httpx.post(url, content=body) if isinstance(body, bytes) else httpx.post(url, json=body)
    assert r.status_code == status, r.text
    message = r.json()["error"]["message"]
    assert words in message and "\n" not in message and "Traceback" not in message


def test_bad_requests_leave_the_others_alone(served):
    """Bad requests in the middle of good ones: the good ones answer as before, the loop goes on."""
    url = served.srv.url + "/completions"
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        good = [pool.submit(served.client.completions.create, model="demo", prompt=TEXTS[i], max_tokens=NEW,
                            temperature=0) for i in range(2)]
        bad = [pool.submit(httpx.post, url, json={"prompt": [9999]}),
               pool.submit(httpx.post, url, content=b"{")]
        assert [f.result().status_code for f in bad] == [400, 400]
        assert [f.result().choices[0].text for f in good] == [_text(served, 0), _text(served, 1)]
    _settled(served)


def test_a_failing_step_fails_its_requests_and_the_loop_goes_on(served, monkeypatch):
    """An engine of this process (stepped in a thread): a step that raises fails its requests with a 500."""
    app = create_app(served.engine, served.tok, ServeConfig("demo"))
    real_step = served.engine.step
    calls = []

    def step_once_broken():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return real_step()

    monkeypatch.setattr(served.engine, "step", step_once_broken)
    with BackgroundServer(app) as srv:
        client = openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.InternalServerError, match="engine failed: RuntimeError: boom"):
            client.completions.create(model="demo", prompt=TEXTS[0], max_tokens=NEW, temperature=0)
        a = client.completions.create(model="demo", prompt=TEXTS[0], max_tokens=NEW, temperature=0)
        assert a.choices[0].text == _text(served, 0)
        _settled(SimpleNamespace(loop=app.state.engine_loop))
    assert served.engine.blocks.num_free == served.engine.num_blocks


def test_client_disconnect_mid_stream_aborts_the_request(served):
    body = {"model": "demo", "prompt": TEXTS[2], "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", served.srv.url + "/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))  # generating
        assert served.loop.in_flight == 1
    _settled(served)  # closed after one token of 400: aborted, every block back


def test_client_that_gives_up_while_queued_aborts_its_request(served):
    """A non-streaming client times out while its request waits (the engine held): the request goes away."""
    with served.loop.paused():
        with pytest.raises(httpx.TimeoutException):
            httpx.post(served.srv.url + "/completions", json={"prompt": TEXTS[0], "max_tokens": 4}, timeout=0.5)
        _wait_until(lambda: not served.loop.in_flight, 10)
        assert served.loop.in_flight == 0  # aborted while still queued, not after the engine resumed
    _settled(served)


def test_full_queue_answers_503_and_loses_nothing(served):
    """MAX_SEQS running plus MAX_QUEUE waiting are admitted; the next gets a 503; all admitted ones finish."""
    capacity = MAX_SEQS + MAX_QUEUE
    with concurrent.futures.ThreadPoolExecutor(capacity) as pool:
        with served.loop.paused():  # nothing finishes until the queue is full
            futures = [pool.submit(served.client.completions.create, model="demo", prompt=TEXTS[i % len(TEXTS)],
                                   max_tokens=NEW, temperature=0) for i in range(capacity)]
            _wait_until(lambda: served.loop.in_flight >= capacity, 30)
            with pytest.raises(openai.APIStatusError) as e:
                served.client.completions.create(model="demo", prompt=TEXTS[0], max_tokens=2)
            assert e.value.status_code == 503 and "capacity" in e.value.message
        texts = [f.result().choices[0].text for f in futures]
    assert texts == [_text(served, i % len(TEXTS)) for i in range(capacity)]
    _settled(served)


def test_graceful_shutdown_aborts_what_is_in_flight_and_frees_everything(served):
    """A second server on the same prepared model (stepped in a thread): stopped while a stream runs and a
    request waits."""
    engine = PagedEngine(served.engine.servable, num_blocks=40, max_num_seqs=1, compile=False)
    app = create_app(engine, served.tok, ServeConfig("demo", max_model_len=620))
    srv = BackgroundServer(app, shutdown_timeout=0.2).start()
    client = openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError, match="620 tokens a request may reach"):
        client.completions.create(model="demo", prompt=TEXTS[0], max_tokens=615)
    body = {"model": "demo", "prompt": TEXTS[0], "max_tokens": 600, "temperature": 0, "stream": True}
    with concurrent.futures.ThreadPoolExecutor(1) as pool, httpx.stream("POST", srv.url + "/completions",
                                                                        json=body) as r:
        waiting = pool.submit(client.completions.create, model="demo", prompt=TEXTS[1], max_tokens=4)
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        # stopped once the server has the waiting request: one still in the listener's backlog when the server
        # closes it gets a connection reset, as from any server, which is not what this test is about
        assert _wait_until(lambda: app.state.engine_loop.in_flight == 2, 30), "the second request never arrived"
        srv.stop()
        rest = [line for line in lines if line]
        assert "shut down" in rest[-2] and rest[-1] == "data: [DONE]"
        with pytest.raises(openai.APIStatusError) as e:
            waiting.result()
        assert e.value.status_code == 503 and "shut down" in e.value.message  # aborted while it waited
    assert engine.blocks.num_free == engine.num_blocks and not engine.has_unfinished()


def test_text_stream_holds_back_partial_characters_and_stop_strings(served):
    tok = served.tok  # byte-level: "é" is two tokens
    ids = tok("caféX", add_special_tokens=False)["input_ids"]
    ts = TextStream(tok)
    assert [ts.push(t) for t in ids] == ["c", "a", "f", "", "é", "X"]
    ts = TextStream(tok, stops=["fé"])
    out = "".join(ts.push(t) for t in ids)
    assert out == "ca" and ts.stopped and ts.flush() == ""
    ts = TextStream(tok, stops=["éY"])  # a prefix of the stop string comes out once it cannot complete
    assert "".join(ts.push(t) for t in ids) + ts.flush() == "caféX" and not ts.stopped


def test_text_stream_pieces_add_up_to_the_whole_decode(served):
    """Random byte tokens (invalid UTF-8 and EOS included): the streamed pieces are exactly decode()'s text."""
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(257) for _ in range(rng.randrange(1, 40))]
        ts = TextStream(served.tok)
        assert "".join(ts.push(t) for t in ids) + ts.flush() == served.tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("args, words", [
    (["serve", "no/such/folder"], "not found"),
    (["serve", "demo", "--port", "70000"], "--port"),
    (["serve", "demo", "--max-queue", "-1"], "--max-queue"),
])
def test_cli_serve_refuses_bad_arguments_in_one_line(args, words):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(args)
    assert code == 2 and words in err.getvalue() and len(err.getvalue().strip().splitlines()) == 1


# ----------------------------------------------------------------------------- the engine process's life


class _SlowEngine:
    """Stands in for ``PagedEngine`` in engine processes that the tests kill (it starts in a second, not 30):
    every request gets token 65 once per 20 ms step."""

    num_blocks, block_size, model = 1000, 16, None
    servable = SimpleNamespace(seq2seq=None)

    def __init__(self):
        self.scheduler = SimpleNamespace(running=[], max_num_seqs=4)
        self.blocks = SimpleNamespace(num_free=self.num_blocks)
        self.requests: dict[int, tuple[list[int], int]] = {}
        self.done: list[RequestOutput] = []
        self.ids = itertools.count()
        self.stats = {"steps": 0}

    def validate(self, prompt, params):
        return None if prompt else "the prompt is empty"

    def length_limit(self):
        return None

    def bound(self):
        return contextlib.nullcontext()

    def add_request(self, prompt, params):
        rid = next(self.ids)
        self.requests[rid] = ([], params.max_new_tokens)
        return rid

    def abort(self, rid):
        self.requests.pop(rid, None)

    def has_unfinished(self):
        return bool(self.requests)

    def step(self):
        time.sleep(0.02)
        self.stats["steps"] += 1
        for rid, (tokens, limit) in list(self.requests.items()):
            tokens.append(65)
            if len(tokens) >= limit:
                self.done.append(RequestOutput(rid, [], tokens, "length"))
                del self.requests[rid]

    def collect(self):
        out, self.done = self.done, []
        return out

    def unfinished_outputs(self, since):
        return {rid: tokens[since.get(rid, 0):] for rid, (tokens, _) in self.requests.items()}


def _alive(pid: int) -> bool:
    """Whether a process runs (a zombie nobody reaped yet counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _gone_within(pid: int, timeout: float) -> bool:
    return _wait_until(lambda: not _alive(pid), timeout, poll=0.05)


def test_a_dead_engine_process_turns_into_500_and_503_not_hangs():
    """The engine process is killed mid-stream: the stream ends with an error event, a waiting non-streaming
    request gets a 500, new requests and /health a 503, and the server still stops cleanly."""
    app = create_app(EngineProcess(_SlowEngine), None, ServeConfig("slow"))
    loop = app.state.engine_loop
    with BackgroundServer(app) as srv:
        client = openai.OpenAI(base_url=srv.url, api_key="unused", max_retries=0, timeout=30)
        body = {"prompt": [1, 2], "max_tokens": 10000, "stream": True}
        with concurrent.futures.ThreadPoolExecutor(1) as pool, \
                httpx.stream("POST", srv.url + "/completions", json=body, timeout=30) as r:
            waiting = pool.submit(client.completions.create, model="slow", prompt=[3], max_tokens=10000)
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            while loop.in_flight < 2:
                time.sleep(0.01)
            os.kill(loop.transport.pid, signal.SIGKILL)
            rest = [line for line in lines if line]
            assert "engine process died" in rest[-2] and rest[-1] == "data: [DONE]"
            with pytest.raises(openai.InternalServerError, match="engine process died"):
                waiting.result()
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model="slow", prompt=[1], max_tokens=2)
        assert e.value.status_code == 503 and "engine is not running" in e.value.message
        health = httpx.get(srv.url.removesuffix("/v1") + "/health")
        assert health.status_code == 503 and health.json()["status"] == "engine down"
    assert loop.in_flight == 0


def _serve_slow_engine() -> None:
    """A server over ``_SlowEngine`` in an engine process, for a test to kill: prints its URL and engine pid."""
    app = create_app(EngineProcess(_SlowEngine), None, ServeConfig("slow"))
    sock = bind("127.0.0.1", 0)
    print(sock.getsockname()[1], app.state.engine_loop.transport.pid, flush=True)
    run(app, sock)


def test_the_engine_process_dies_with_the_server():
    """A server killed outright (no shutdown code runs) takes its engine process with it: no orphans. (A stopped
    server ends it itself: the module's fixture checks that it exited.)"""
    sig = signal.SIGKILL
    code = "from tests.rewriter.test_serve import _serve_slow_engine; _serve_slow_engine()"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    server = subprocess.Popen([sys.executable, "-c", code], cwd=root, stdout=subprocess.PIPE, text=True)
    try:
        port, pid = map(int, server.stdout.readline().split())
        assert _alive(pid)
        body = {"prompt": [1, 2], "max_tokens": 10000, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30) as r:
            assert next(line for line in r.iter_lines() if line.startswith("data:"))  # the engine is stepping
            server.send_signal(sig)
            assert server.wait(30) in (-sig, 0)
        assert _gone_within(pid, 10), f"engine process {pid} outlived its server"
    finally:
        server.kill()
        server.wait()
