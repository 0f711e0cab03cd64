"""The xFormers backend on an NVIDIA GPU against the float64 CPU reference, and a tiny Hugging Face
model generating through PagedEngine(target="cuda", compile=False). Skipped without a GPU or xformers."""

import dataclasses
import math

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA is not available)"),
]
pytest.importorskip("xformers", reason="xformers is not installed (pip install 'pagedattn[cuda]')")

from pagedattn.backends import AttentionParams, get_backend, set_validation  # noqa: E402

from ..support import (  # noqa: E402
    ALIBI8,
    LONG_PROMPTS,
    SHAPES,
    SINKS8,
    TOL,
    hf_generate,
    make_batch,
    prompts,
    reference_step,
    run_step,
    wide_model,
)


def _cuda(b):
    return dataclasses.replace(b, query=b.query.cuda(), key=b.key.cuda(), value=b.value.cuda(),
                               kv_cache=b.kv_cache.cuda(), meta=b.meta.to("cuda"))


def _check(b, dtype, **kw):
    """Run ``b`` on the GPU; returns the operators/paths the backend used for it."""
    backend = get_backend("cuda")
    backend.paths.clear()
    scale = kw.pop("scale", 1 / math.sqrt(b.query.shape[-1]))
    gpu = _cuda(b)
    gpu_kw = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}  # ALiBi slopes, sinks
    out = run_step(gpu, scale, pass_kv=gpu_kw.pop("pass_kv", True), **gpu_kw).cpu()
    kw.pop("pass_kv", None)
    ref = reference_step(b, scale, **kw)
    n = ref.shape[0]
    torch.testing.assert_close(out[:n].double(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.all(out[n:] == 0), "padding rows must be zero"
    return dict(backend.paths)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_batch_shapes(shape, dtype):
    paths = _check(make_batch(SHAPES[shape], num_heads=8, num_kv_heads=2, dtype=dtype, pad_tokens=3), dtype)
    assert not any(p in ("sdpa", "softcap_math") for _, p in paths), paths  # all through xFormers


@pytest.mark.parametrize("block_size", [16, 64, 256])
@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (8, 1)], ids=["mha", "gqa4", "mqa"])
def test_layouts(block_size, heads):
    nh, nkv = heads
    b = make_batch(SHAPES["mixed"], num_heads=nh, num_kv_heads=nkv, head_size=128, block_size=block_size,
                   dtype=torch.float16)
    paths = _check(b, torch.float16)
    assert any(kind == "decode" and op.startswith("triton_splitK") for kind, op in paths), paths


@pytest.mark.parametrize("block_size, head_size", [(8, 64), (16, 80), (1, 64)])
def test_decode_outside_triton_splitk_gathers(block_size, head_size):
    # pages under 16 tokens, or a head size triton_splitk lacks: decode gathers K/V, still exact
    b = make_batch(SHAPES["mixed"], num_heads=4, num_kv_heads=2, head_size=head_size, block_size=block_size,
                   dtype=torch.float16)
    _check(b, torch.float16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "feature",
    [{"window": 8}, {"window": 1}, {"causal": False}, {"scale": 0.3}, {"alibi": True},
     {"alibi": True, "window": 10}, {"softcap": 5.0}, {"softcap": 3.0, "window": 13}],
    ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()),
)
def test_features(feature, dtype):
    feature = dict(feature)
    if feature.pop("alibi", False):
        feature["alibi"] = ALIBI8
    _check(make_batch(SHAPES["mixed"], num_heads=8, num_kv_heads=2, dtype=dtype), dtype, **feature)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", ["all_prefill", "all_decode", "mixed", "chunked", "many_blocks"])
def test_sinks_against_softmax_with_a_sink_logit(shape, dtype):
    # prefill, decode and cached-context rows, GQA 8/2: the exact fp32 math path over gathered K/V
    b = make_batch(SHAPES[shape], num_heads=8, num_kv_heads=2, dtype=dtype, pad_tokens=2)
    sinks = SINKS8.to(dtype)
    paths = _check(b, dtype, sinks=sinks)
    assert {p for _, p in paths} == {"sinks_math"}, paths
    scale = 1 / math.sqrt(b.query.shape[-1])
    moved = (reference_step(b, scale) - reference_step(b, scale, sinks=sinks)).abs().max()
    assert moved > 10 * TOL[dtype], "the sinks must change the output for this check to mean anything"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "feature",
    [{"window": 8}, {"window": 1}, {"softcap": 5.0}, {"alibi": True}, {"causal": False}, {"scale": 0.3}],
    ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()),
)
def test_sinks_with_other_features(feature, dtype):
    feature = dict(feature, sinks=SINKS8.to(dtype))
    if feature.pop("alibi", False):
        feature["alibi"] = ALIBI8
    _check(make_batch(SHAPES["mixed"], num_heads=8, num_kv_heads=2, dtype=dtype), dtype, **feature)


@pytest.mark.parametrize("block_size", [1, 16, 64])
@pytest.mark.parametrize("heads", [(8, 8), (8, 1)], ids=["mha", "mqa"])
def test_sinks_layouts(block_size, heads):
    nh, nkv = heads
    b = make_batch(SHAPES["mixed"], num_heads=nh, num_kv_heads=nkv, head_size=128, block_size=block_size,
                   dtype=torch.bfloat16)
    _check(b, torch.bfloat16, sinks=SINKS8.to(torch.bfloat16))


@pytest.mark.parametrize("feature", [{"sinks": True}, {"softcap": 5.0}, {"dtype": torch.float32}],
                         ids=["sinks", "softcap", "fp32"])
def test_exact_math_in_batches_of_sequences(feature, monkeypatch):
    # a step whose padded scores exceed the budget runs in batches of sequences, decodes apart from prefills
    from pagedattn.backends import xformers_cuda

    monkeypatch.setattr(xformers_cuda, "_MATH_BUDGET_BYTES", 700 << 10)  # the eight single-query rows fit together
    feature = dict(feature)
    dtype = feature.pop("dtype", torch.bfloat16)
    if feature.pop("sinks", False):
        feature["sinks"] = SINKS8.to(dtype)
    b = make_batch(SHAPES["mixed"] + SHAPES["all_decode"], num_heads=8, num_kv_heads=2, dtype=dtype, pad_tokens=2)
    _check(b, dtype, **feature)
    (group,) = xformers_cuda._LOCAL.plan.groups[("all",)]
    (batches,) = [v for k, v in group.cache.items() if k[0] == "math_batches"]
    assert len(batches) > 1 and any(set(g.q_lens) == {1} for g in batches), [g.q_lens for g in batches]
    assert sorted(i for g in batches for i in g.seqs) == group.seqs


def test_sinks_memory_is_bounded_for_a_long_mixed_step():
    # 16 decodes over 2-4k tokens beside a 128-token chunk: padded together, the step's fp32 scores
    # [17, 64, 128, 4096] take 2.3 GB per copy (HEAD's backend peaked at 7.7 GiB on an H100); in batches,
    # with K/V never repeated per query head, far less
    g = torch.Generator().manual_seed(0)
    seqs = [(int(torch.randint(2048, 4096, (1,), generator=g)), 1) for _ in range(16)] + [(3968, 128)]
    b = make_batch(seqs, num_heads=64, num_kv_heads=8, head_size=64, dtype=torch.bfloat16, generator=g)
    sinks = torch.linspace(-2.0, 4.0, 64).to(torch.bfloat16)
    gpu = _cuda(b)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = run_step(gpu, 0.125, sinks=sinks.cuda())
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert peak < 1 << 30, f"{peak / 2 ** 30:.2f} GiB"
    torch.testing.assert_close(out.cpu().double(), reference_step(b, 0.125, sinks=sinks), atol=3e-2, rtol=3e-2)


def test_float32_through_sdpa():
    paths = _check(make_batch(SHAPES["mixed"], num_heads=8, num_kv_heads=2), torch.float32)
    assert set(p for _, p in paths) == {"sdpa"}


def test_cross_attention_over_filled_cache():
    b = make_batch([(20, 3), (9, 1), (33, 6)], num_heads=4, num_kv_heads=4, dtype=torch.float16)
    g = _cuda(b)
    torch.ops.pagedattn.write_kv_cache(g.key, g.value, g.kv_cache, g.meta.slot_mapping)
    enc = torch.tensor([c + n for c, n in zip(b.contexts, b.q_lens)], dtype=torch.int32, device="cuda")
    out = torch.ops.pagedattn.paged_attention(g.query, None, None, g.kv_cache, g.meta.block_tables, enc,
                                              g.meta.query_start_loc,
                                              *AttentionParams(0.125, False, 0, 0.0, None, 4, 64).args())
    torch.testing.assert_close(out.cpu().double(), reference_step(b, 0.125, causal=False), atol=4e-3, rtol=4e-3)


@pytest.mark.parametrize("seed", range(8))
def test_random_batches(seed):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 7, (1,), generator=g))
    seqs = [(int(torch.randint(0, 300, (1,), generator=g)), int(torch.randint(1, 40, (1,), generator=g)))
            for _ in range(n)]
    seqs = [(c, 1) if i % 2 else (c, q) for i, (c, q) in enumerate(seqs)]
    window = [0, 0, 17, 64][seed % 4]
    b = make_batch(seqs, num_heads=8, num_kv_heads=2, head_size=64, block_size=[16, 32, 64][seed % 3],
                   dtype=torch.bfloat16, pad_tokens=seed % 3, generator=g)
    _check(b, torch.bfloat16, window=window)


def test_write_copy_swap_on_gpu():
    backend = get_backend("cuda")
    b = make_batch([(0, 4), (5, 1), (17, 3)], pad_tokens=2, dtype=torch.float16)
    g = _cuda(b)
    backend.write(g.key, g.value, g.kv_cache, g.meta.slot_mapping)
    get_backend("cpu").write(b.key, b.value, b.kv_cache, b.meta.slot_mapping)
    assert torch.equal(g.kv_cache.cpu(), b.kv_cache)
    orig = g.kv_cache.clone()
    backend.copy_blocks(g.kv_cache, torch.tensor([[0, 3], [2, 5]], device="cuda"))
    assert torch.equal(g.kv_cache[:, 3], orig[:, 0]) and torch.equal(g.kv_cache[:, 5], orig[:, 2])
    host = torch.zeros_like(g.kv_cache, device="cpu").pin_memory()
    backend.swap_blocks(g.kv_cache, host, torch.tensor([[1, 0], [4, 2]]))
    torch.cuda.synchronize()
    assert torch.equal(host[:, 0], g.kv_cache[:, 1].cpu()) and torch.equal(host[:, 2], g.kv_cache[:, 4].cpu())
    back = torch.zeros_like(g.kv_cache)
    backend.swap_blocks(host, back, torch.tensor([[0, 1]]))
    assert torch.equal(back[:, 1], g.kv_cache[:, 1])


# --------------------------------------------------------------- a tiny HF model end to end


def _prompts():
    return prompts(**LONG_PROMPTS)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
@pytest.mark.parametrize("setting", [{}, {"max_num_tokens": 16}, {"block_size": 64}],
                         ids=["default", "chunked_prefill", "block64"])
@pytest.mark.parametrize("graphs", [False, True], ids=["xformers_decode", "cuda_graphs"])
def test_engine_fp16_matches_hf_generate_on_gpu(arch, setting, graphs):
    from pagedattn import PagedEngine

    model = wide_model(arch, torch.float16, "cuda")
    ref = hf_generate(model, _prompts(), 12)
    backend = get_backend("cuda")
    backend.paths.clear()
    engine = PagedEngine(model, compile=False, target="cuda", cuda_graphs=graphs, **setting)
    set_validation(not graphs)  # full validation reads metadata on the host: the graphs would run eagerly
    try:
        got = engine.generate(_prompts(), max_new_tokens=12)
    finally:
        set_validation(True)  # as tests/conftest.py keeps it
    assert got == ref
    kinds = {k for k, _ in backend.paths}
    assert "fresh" in kinds
    if graphs:  # decode steps replay their graphs (the static attention), not xFormers' decode operator
        assert engine.decode_graphs.stats["replays"] > 0
        if not setting.get("max_num_tokens"):  # (chunked prefill also runs 1-token chunks that end no prompt)
            assert "decode" not in kinds
    else:
        assert "decode" in kinds
    if setting.get("max_num_tokens"):
        assert "chunked" in kinds


@pytest.mark.parametrize("arch", ["bloom", "gemma2"])
def test_engine_alibi_and_softcap_models_on_gpu(arch):
    # bloom: ALiBi as a tensor bias (fp16); gemma2: soft-capped, alternating sliding-window layers (fp32,
    # the same exact soft-cap path as fp16)
    from transformers import AutoConfig, AutoModelForCausalLM

    from pagedattn import PagedEngine

    kw = {"bloom": dict(vocab_size=128, hidden_size=256, n_layer=2, n_head=4),
          "gemma2": dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=24,
                         attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=64,
                         max_position_embeddings=512)}[arch]
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(arch, initializer_range=0.1, tie_word_embeddings=False, **kw)  # untied: no echoing
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    if arch == "bloom":
        model = model.to("cuda", torch.float16)
        ref = hf_generate(model, _prompts(), 12)
    else:  # HF's fp16 eager soft-cap rounds its scores in fp16: compare in fp32, against the CPU
        ref = hf_generate(model, _prompts(), 12)
        model = model.to("cuda")
    backend = get_backend("cuda")
    backend.paths.clear()
    got = PagedEngine(model, compile=False, target="cuda", max_num_tokens=16, cuda_graphs=False).generate(
        _prompts(), max_new_tokens=12)
    assert got == ref
    used = {p for _, p in backend.paths}
    assert (any(p.startswith("triton_splitK") for p in used) if arch == "bloom" else "softcap_math" in used), used


def test_engine_float32_on_gpu_matches_cpu():
    from pagedattn import PagedEngine

    cpu_model = wide_model("llama", torch.float32, "cpu")
    ref = hf_generate(cpu_model, _prompts(), 12)
    got = PagedEngine(wide_model("llama", torch.float32, "cuda"), compile=False, target="cuda").generate(_prompts(), max_new_tokens=12)
    assert got == ref


def test_engine_refuses_a_model_on_another_device():
    from pagedattn import PagedEngine

    with pytest.raises(ValueError, match="move the model first"):
        PagedEngine(wide_model("llama", torch.float32, "cpu"), compile=False, target="cuda")
