"""Prefix-LMs through PagedEngine: requests carry their token types, bidirectional spans (PaliGemma's prefix,
Gemma-3's image blocks) are computed in one step, and greedy tokens equal the model's own greedy forward over
the whole sequence at every step (generated tokens typed as the model types them), under chunked prefill,
preemption and prefix caching."""

import pytest
import torch
from torch import nn

import pagedattn
from pagedattn import PagedEngine

from ..passes.test_prefix_lm_masks import TokenTypeMask
from ..rewriter import zoo


def greedy_with_types(model, req: dict, new: int, generated_type: int) -> list[int]:
    """Greedy decoding through the model's forward over the whole sequence (no cache) at every step."""
    ids, tt = list(req["input_ids"]), list(req["token_type_ids"])
    out = []
    for _ in range(new):
        with torch.no_grad():
            o = model(input_ids=torch.tensor([ids]), token_type_ids=torch.tensor([tt]))
        tok = int(getattr(o, "logits", o)[0, -1].argmax())
        out.append(tok)
        ids.append(tok)
        tt.append(generated_type)
    return out


def typed_requests(vocab: int, layout, inside: int) -> list[dict]:
    """``layout``: per request, its length and its spans of type ``inside``."""
    g = torch.Generator().manual_seed(0)
    reqs = []
    for n, spans in layout:
        tt = [1 - inside] * n
        for a, b in spans:
            tt[a:b] = [inside] * (b - a)
        reqs.append({"input_ids": torch.randint(6, vocab, (n,), generator=g).tolist(), "token_type_ids": tt})
    return reqs


def _sharpen(layers, lm_head) -> None:
    """Random weights whose attention decides the next token: sharper scores, a louder attention output,
    and an output head of its own (a tied one mostly repeats the last token)."""
    with torch.no_grad():
        for layer in layers:
            a = layer.self_attn
            a.q_proj.weight.mul_(3)
            a.k_proj.weight.mul_(3)
            a.o_proj.weight.mul_(10)
        lm_head.weight = nn.Parameter(torch.randn(lm_head.weight.shape, generator=torch.Generator().manual_seed(3)))


def _gemma3():
    from ..rewriter.hf_zoo import tiny_model

    m = tiny_model("gemma3", "eager")  # a sliding (window 6) and a global layer, text and vision
    _sharpen(m.model.language_model.layers, m.lm_head)
    return m


def _paligemma():
    from transformers import PaliGemmaForConditionalGeneration

    from ..rewriter.hf_zoo import tiny_config

    cfg = tiny_config("paligemma")
    cfg.vision_config.image_size, cfg.vision_config.patch_size = 32, 8
    torch.manual_seed(0)
    m = PaliGemmaForConditionalGeneration._from_config(cfg, attn_implementation="eager").eval().float()
    _sharpen(m.model.language_model.layers, m.lm_head)
    return m


# Gemma-3: images (runs of 1s) anywhere, up to four; PaliGemma: one prefix of 0s (image and prompt)
PREFIX_LMS = {
    "gemma3": (_gemma3, 1, [(120, [(3, 40), (50, 51), (70, 100)]), (70, [(20, 60)]), (33, []),
                            (90, [(0, 30), (60, 89)])]),
    "paligemma": (_paligemma, 0, [(120, [(0, 40)]), (70, [(0, 20)]), (33, []), (90, [(0, 60)])]),
}


SETTINGS = {"one_step": dict(max_num_tokens=512, num_blocks=200), "chunked_preempted": dict(max_num_tokens=64,
                                                                                            num_blocks=40)}


# PaliGemma's chunked and preempted run (~10 s, its prefix a span from position 0) runs with the slow tests, to keep
# the main suite within its 8 minutes; Gemma 3's (spans anywhere) stays in it
@pytest.mark.parametrize("arch, settings", [
    pytest.param(arch, SETTINGS[name], id=f"{arch}-{name}",
                 marks=pytest.mark.slow if (arch, name) == ("paligemma", "chunked_preempted") else ())
    for arch in sorted(PREFIX_LMS) for name in SETTINGS])
def test_hugging_face_prefix_lms_generate_like_their_own_forward(arch, settings):
    pytest.importorskip("transformers")
    make, inside, layout = PREFIX_LMS[arch]
    m = make()
    engine = PagedEngine(m, compile=False, block_size=8, progress=False, **settings)
    spec = engine.servable.values
    assert spec is not None and (spec.input, spec.inside) == ("token_type_ids", inside), spec
    assert all(r["status"] == "rewritten" for r in engine.model.report if r["attention"])
    reqs = typed_requests(engine.vocab_size, layout, inside)
    want = [greedy_with_types(m, r, 6, spec.outside) for r in reqs]
    assert engine.generate(reqs, max_new_tokens=6) == want
    if settings["num_blocks"] == 40:
        assert engine.stats["preemptions"] > 0  # and every span was recomputed in one step again
    # the check can fail: the same prompts without their spans generate other tokens
    plain = [greedy_with_types(m, {**r, "token_type_ids": [spec.outside] * len(r["input_ids"])}, 6, spec.outside)
             for r in reqs]
    assert plain != want


# --------------------------------------------------------------- a hand-written prefix-LM


class PrefixLM(nn.Module):
    """Two Gemma-3-style layers (image blocks bidirectional) over learned positions."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.pos = nn.Embedding(64, zoo.C), nn.Embedding(1024, zoo.C)
        self.layers = nn.ModuleList([TokenTypeMask("blocks"), TokenTypeMask("blocks")])
        self.head = nn.Linear(zoo.C, 64)
        with torch.no_grad():
            for a in self.layers:
                a.q.weight.mul_(4)
                a.k.weight.mul_(4)

    def forward(self, input_ids, token_type_ids=None, position_ids=None):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1])[None]
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        h = self.emb(input_ids) + self.pos(position_ids)
        for a in self.layers:
            h = h + a(h, token_type_ids)
        return self.head(h)


@pytest.fixture(scope="module")
def prefix_lm():
    m = PrefixLM().eval()
    return m, PagedEngine(m, compile=False, block_size=4, max_num_tokens=48, num_blocks=128, progress=False)


def test_prefix_caching_shares_blocks_only_with_the_same_spans(prefix_lm):
    m, engine = prefix_lm
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 64, (60,), generator=g).tolist()
    image = {"input_ids": ids, "token_type_ids": [0] * 4 + [1] * 30 + [0] * 26}
    later = {"input_ids": ids, "token_type_ids": [0] * 4 + [1] * 20 + [0] * 36}  # same tokens, another image
    want = [greedy_with_types(m, r, 4, 0) for r in (image, later)]
    assert engine.generate([image], max_new_tokens=4) == want[:1]
    hits = engine.blocks.prefix_hits
    assert engine.generate([image], max_new_tokens=4) == want[:1]
    assert engine.blocks.prefix_hits > hits  # the same image prompt reuses its blocks
    hits = engine.blocks.prefix_hits
    assert engine.generate([later], max_new_tokens=4) == want[1:]
    assert engine.blocks.prefix_hits == hits  # other spans: nothing shared, not even the tokens before them
    with torch.no_grad():  # sharing them would have been wrong: the spans change every position's K/V
        a = m(torch.tensor([ids]), torch.tensor([image["token_type_ids"]]))
        b = m(torch.tensor([ids]), torch.tensor([later["token_type_ids"]]))
    assert (a - b).abs().max() > 1e-2


def test_plain_prompts_and_prompts_with_spans_in_one_batch(prefix_lm):
    m, engine = prefix_lm
    g = torch.Generator().manual_seed(6)
    reqs = [{"input_ids": torch.randint(0, 64, (n,), generator=g).tolist(), "token_type_ids": tt}
            for n, tt in ((50, [0] * 10 + [1] * 40), (30, [1] * 30), (20, [0] * 20))]
    want = [greedy_with_types(m, r, 5, 0) for r in reqs]
    plain = torch.randint(0, 64, (25,), generator=g).tolist()  # a list of ids: no span
    want.append(greedy_with_types(m, {"input_ids": plain, "token_type_ids": [0] * 25}, 5, 0))
    assert engine.generate(reqs + [plain], max_new_tokens=5) == want


@pytest.mark.parametrize("prompt, match", [
    ({"input_ids": list(range(60)), "token_type_ids": [1] * 50 + [0] * 10}, "span of 50 tokens"),
    ({"input_ids": list(range(10)), "token_type_ids": [1] * 9}, "one integer type per prompt token"),
    ({"input_ids": list(range(12)), "token_type_ids": [1, 0] * 6}, "6 runs of 1s"),
    ({"input_ids": list(range(4)), "token_type_ids": [0, 2, 1, 0]}, "values other than 0 and 1"),
    ({"input_ids": list(range(4)), "pixel_values": [0.0]}, "'pixel_values' is not one this model takes"),
    ({"token_type_ids": [0]}, "needs 'input_ids'"),
])
def test_requests_outside_what_was_proven_are_refused_saying_why(prefix_lm, prompt, match):
    _, engine = prefix_lm
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt, max_new_tokens=2)


def test_more_image_blocks_per_request_when_the_engine_is_built_for_them(prefix_lm):
    # the default proof covers 4 runs of 1s per sequence (requests with 6 are refused, naming the knob); built
    # with token_type_runs=6, the engine proves its masks for 6 and serves them like the model's forward
    m, default = prefix_lm
    g = torch.Generator().manual_seed(0)
    types = ([0] + [1] * 5) * 6
    requests = [{"input_ids": torch.randint(0, 64, (36,), generator=g).tolist(), "token_type_ids": types}
                for _ in range(8)]
    with pytest.raises(ValueError, match=r"6 runs of 1s .* at most 4 .* token_type_runs=6"):
        default.add_request(requests[0], max_new_tokens=2)
    engine = PagedEngine(m, compile=False, block_size=4, max_num_tokens=48, num_blocks=128, progress=False,
                         token_type_runs=6)
    assert engine.servable.values.runs == 6
    want = [greedy_with_types(m, r, 5, 0) for r in requests]
    assert engine.generate(requests, max_new_tokens=5) == want
    # the check can fail: the same prompts without their spans generate other tokens
    assert [greedy_with_types(m, {**r, "token_type_ids": [0] * 36}, 5, 0) for r in requests] != want


def test_models_without_token_types_take_none():
    from ..passes.test_mask_proofs import LongMaskLM

    engine = PagedEngine(LongMaskLM(lambda i, j, T: j <= i).eval(), compile=False, progress=False)
    assert engine.servable.values is None
    with pytest.raises(ValueError, match="'token_type_ids' is not one this model takes"):
        engine.add_request({"input_ids": [1, 2, 3], "token_type_ids": [0, 0, 0]}, max_new_tokens=2)


def test_paged_context_needs_the_steps_values():
    m = PrefixLM().eval()
    rm = pagedattn.rewrite(m, (), {"input_ids": torch.zeros(1, 8, dtype=torch.long),
                                   "token_type_ids": torch.zeros(1, 8, dtype=torch.long)}, block_size=4)
    caches = rm.allocate_kv_caches(4)
    meta = pagedattn.build_metadata([(0, 8, [0, 1])], 4)
    with pytest.raises(ValueError, match="position_values"), pagedattn.paged_context(caches, meta):
        rm(input_ids=torch.zeros(1, 8, dtype=torch.long), token_type_ids=torch.zeros(1, 8, dtype=torch.long))


def test_a_saved_prefix_lm_program_serves_its_spans_after_loading(tmp_path):
    # the archive carries how the masks read token types: the loaded program takes the step's values as the
    # model's own program does, and serves requests with spans exactly
    m = PrefixLM().eval()
    rm = pagedattn.rewrite(m, (), {"input_ids": torch.zeros(1, 8, dtype=torch.long),
                                   "token_type_ids": torch.zeros(1, 8, dtype=torch.long)}, block_size=4)
    rm.save(str(tmp_path / "prefix.pt2"))
    loaded = pagedattn.load(str(tmp_path / "prefix.pt2"))
    assert loaded.value_spec == rm.value_spec and loaded.value_spec is not None
    reqs = typed_requests(64, [(50, [(10, 30)]), (30, [(0, 12), (20, 30)]), (20, [])], 1)
    want = [greedy_with_types(m, r, 5, 0) for r in reqs]
    # eager: the program was exported without specialising sizes 0 and 1, so steps run unpadded, single tokens too
    engine = PagedEngine(loaded, compile=False, block_size=4, max_num_tokens=48, num_blocks=128, progress=False)
    assert loaded.min_sizes == 0 and engine.servable.min_step == 0
    assert engine.servable.values == rm.value_spec
    assert engine.generate(reqs, max_new_tokens=5) == want
    assert engine.generate(reqs[:1], max_new_tokens=5) == want[:1]  # one sequence, single-token decode steps
    # the check can fail: without their spans the same prompts generate other tokens
    assert [greedy_with_types(m, {**r, "token_type_ids": [0] * len(r["input_ids"])}, 5, 0) for r in reqs] != want
