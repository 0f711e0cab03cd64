"""PagedEngine on an NVIDIA GPU: swap preemption through the xFormers backend, a model with
attention sinks (gpt_oss), models with state, encoder-decoders (tiny BART; T5 with its relative bias), chunked
local attention and sliding windows, and prefix-LMs whose masks read token types, token for token against
Hugging Face generate or the model's own greedy forward. Skipped without a GPU."""

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA is not available)"),
]
pytest.importorskip("xformers", reason="xformers is not installed (pip install 'pagedattn[cuda]')")

from pagedattn import PagedEngine  # noqa: E402
from pagedattn.backends import get_backend  # noqa: E402

from ..rewriter import hf_zoo  # noqa: E402
from ..support import (  # noqa: E402
    LONG_PROMPTS,
    hf_generate,
    prompts,
    tiny_lfm2,
    tiny_mamba,
    tiny_model,
    wide_model,
)

NEW = 12
SWAP_NEW = 16  # as tests/runtime/test_engine_swap.py
STATE_NEW = 8  # as tests/runtime/test_engine_state.py


def _prompts():
    return prompts(**LONG_PROMPTS)


def _assert_swapped_without_recompute(engine):
    stats = engine.stats
    assert stats["swap_outs"] > 0 and stats["swap_ins"] == stats["swap_outs"], stats
    assert stats["recomputes"] == 0 and stats["preemptions"] == stats["swap_outs"], stats
    assert engine.blocks.num_free_host == engine.blocks.num_host_blocks


@pytest.fixture(scope="module")
def llama_fp16():
    model = wide_model("llama", torch.float16, "cuda")  # head size 64: triton_splitk pages decode at 16-token blocks
    return model, hf_generate(model, _prompts(), NEW)


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("max_num_tokens", [16, 128])  # chunked prefill, or whole prompts
def test_swap_preemption_fp16_matches_hf_generate(llama_fp16, prefix_caching, max_num_tokens):
    model, ref = llama_fp16
    backend = get_backend("cuda")
    backend.paths.clear()
    # 6 blocks of 16 tokens for seven prompts of 2-70 tokens: requests are swapped out and back
    engine = PagedEngine(model, compile=False, target="cuda", num_blocks=6, block_size=16, max_num_tokens=max_num_tokens,
                         enable_prefix_caching=prefix_caching, preemption_mode="swap")
    assert engine.host_kv_caches[0].device.type == "cpu" and engine.kv_caches[0].device.type == "cuda"
    assert engine.generate(_prompts(), max_new_tokens=NEW) == ref
    _assert_swapped_without_recompute(engine)
    assert any(kind == "decode" and op.startswith("triton_splitK") for kind, op in backend.paths), backend.paths


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("max_num_tokens", [16, 128])  # chunked prefill, or whole prompts
def test_every_step_through_the_triton_kernels_matches_hf_generate(llama_fp16, max_num_tokens, compiled):
    # XFormersCudaBackend(triton=True): prefills, chunked prefills and mixed steps through the tile kernel after
    # each kind's first check (decode-only steps run in their CUDA graphs, through the decode kernel)
    from pagedattn.backends.xformers_cuda import XFormersCudaBackend

    model, ref = llama_fp16
    backend = XFormersCudaBackend(triton=True)
    engine = PagedEngine(model, compile=compiled, target=backend, num_blocks=64, block_size=16,
                         max_num_tokens=max_num_tokens)
    assert engine.generate(_prompts(), max_new_tokens=NEW) == ref
    verdicts = backend.triton.verdicts
    assert all(verdicts.values()) and any(kind[5] > 1 for kind in verdicts), verdicts  # [5]: queries per program


def test_swap_preemption_fp32_matches_cpu_generate():
    # fp32 (the SDPA fallback) with 4-token blocks; too little swap space for every victim: some recompute
    cpu_model = tiny_model("llama", "eager")
    ref = hf_generate(cpu_model, prompts(), SWAP_NEW)
    model = cpu_model.to("cuda")
    full = PagedEngine(model, compile=False, target="cuda", num_blocks=14, block_size=4, preemption_mode="swap")
    assert full.generate(prompts(), max_new_tokens=SWAP_NEW) == ref
    _assert_swapped_without_recompute(full)
    small = PagedEngine(model, compile=False, target="cuda", num_blocks=14, block_size=4, preemption_mode="swap",
                        swap_space=4 * full.servable.bytes_per_block())
    assert small.generate(prompts(), max_new_tokens=SWAP_NEW) == ref
    assert small.stats["swap_outs"] > 0 and small.stats["recomputes"] > 0


@pytest.fixture(scope="module")
def gpt_oss():
    model = hf_zoo.tiny_model("gpt_oss", "eager")  # sinks on every layer, alternating sliding-window layers
    ps = hf_zoo.prompts(model)
    return model, ps, hf_zoo.hf_generate(model, ps)


@pytest.mark.parametrize("setting", [{}, {"num_blocks": 8, "preemption_mode": "swap"}], ids=["default", "swap"])
def test_gpt_oss_sinks_on_gpu_match_cpu_generate(gpt_oss, setting):
    model, ps, ref = gpt_oss
    backend = get_backend("cuda")
    backend.paths.clear()
    engine = PagedEngine(model.to("cuda"), compile=False, target="cuda", block_size=4, **setting)
    try:
        assert engine.generate(ps, max_new_tokens=hf_zoo.NEW_TOKENS) == ref
    finally:
        model.to("cpu")
    assert {p for _, p in backend.paths} == {"sinks_math"}, backend.paths
    if setting:
        _assert_swapped_without_recompute(engine)


@pytest.mark.parametrize("make", ["lfm2", "mamba"])
def test_models_with_state_on_gpu_match_cpu_generate(make):
    # recurrent state slots on the GPU beside the xFormers caches: LFM2 (conv state, chunked prefill and
    # preemption by recompute), Mamba-1 (state read a token per step, no attention at all)
    cpu_model = {"lfm2": tiny_lfm2, "mamba": tiny_mamba}[make]()
    ref = hf_generate(cpu_model, prompts(), STATE_NEW)
    model = cpu_model.to("cuda")
    engine = PagedEngine(model, compile=False, target="cuda", block_size=4, num_blocks=20, max_num_tokens=8)
    try:
        assert engine.states.tensors[0].device.type == "cuda"
        assert engine.generate(prompts(), max_new_tokens=STATE_NEW) == ref
    finally:
        cpu_model.to("cpu")
    assert engine.stats["preemptions"] > 0 and engine.states.slot_of == {}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("arch", ["bart", "t5"])
def test_encoder_decoder_on_gpu_matches_cpu_generate(arch, compiled):
    # tiny BART on the GPU: the encoder at admission, cross-attention through the xFormers backend (non-causal
    # over blocks filled once per request), decoder self-attention paged; whole prompts, chunked prefill with
    # preemption by recompute, and swap. T5: its bucketed relative bias as a position program, evaluated on
    # the GPU for the positions each step touches. Compiled: the encoder, the cross writer and the decoder step
    # through Inductor (as PagedEngine's default), with no recompile while serving
    from pagedattn.adapter import prepare_model
    from pagedattn.runtime.shapes import graph_count

    from ..rewriter.seq2seq_models import hf_seq2seq_generate, sources, tiny_seq2seq

    cpu_model = tiny_seq2seq(arch)
    ref = hf_seq2seq_generate(cpu_model, sources(), STATE_NEW)
    model = cpu_model.to("cuda")
    try:
        servable = prepare_model(model, target="cuda", block_size=4, compile=compiled)
        assert (servable.seq2seq.compiled_encoder is not None) == compiled
        graphs = graph_count()
        for kw in (dict(num_blocks=400, max_num_tokens=64), dict(num_blocks=14, max_num_tokens=3),
                   dict(num_blocks=14, max_num_tokens=64, preemption_mode="swap")):
            engine = PagedEngine(servable, **kw)
            assert engine.kv_caches[0].device.type == "cuda"
            assert engine.generate(sources(), max_new_tokens=STATE_NEW) == ref, kw
            if kw["num_blocks"] == 14:
                assert engine.stats["preemptions"] > 0, kw
        assert not compiled or graph_count() == graphs
    finally:
        cpu_model.to("cpu")


@pytest.mark.parametrize("arch", ["llama4_text", "gemma3_text"])
def test_chunked_and_windowed_models_on_gpu_match_cpu_generate(arch):
    # Llama 4's chunked local attention (chunks of 6 in the tiny config) and Gemma 3's sliding window (6) beside
    # global layers, past several chunks and windows; chunked prefill too
    cpu_model = hf_zoo.tiny_model(arch, "eager")
    ref = hf_generate(cpu_model, _prompts(), NEW)
    model = cpu_model.to("cuda")
    try:
        for kw in ({}, {"max_num_tokens": 16}):
            engine = PagedEngine(model, compile=False, target="cuda", block_size=4, **kw)
            kinds = {r["mask"] for r in engine.model.report if r["attention"]}
            assert kinds & {"chunked", "sliding_window"}, kinds
            assert engine.generate(_prompts(), max_new_tokens=NEW) == ref, kw
    finally:
        cpu_model.to("cpu")


@pytest.mark.parametrize("arch", ["gemma3", "paligemma"])
def test_prefix_lms_on_gpu_match_their_own_forward(arch):
    # masks that read token types (image spans bidirectional): the position program on the GPU, the spans
    # computed in one step under chunked prefill
    from .test_engine_prefix_lm import PREFIX_LMS, greedy_with_types, typed_requests

    make, inside, layout = PREFIX_LMS[arch]
    cpu_model = make()
    engine_cpu = PagedEngine(cpu_model, compile=False, target="cpu", block_size=8, progress=False)
    outside = engine_cpu.servable.values.outside
    reqs = typed_requests(engine_cpu.vocab_size, layout, inside)
    want = [greedy_with_types(cpu_model, r, 6, outside) for r in reqs]
    model = cpu_model.to("cuda")
    try:
        engine = PagedEngine(model, compile=False, target="cuda", block_size=8, max_num_tokens=64, num_blocks=60,
                             progress=False)
        assert engine.generate(reqs, max_new_tokens=6) == want
    finally:
        cpu_model.to("cpu")
