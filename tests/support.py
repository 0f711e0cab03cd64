"""What the tests share; test modules import helpers from here (or the model zoos), never from each other.

- paged batches: random steps over a paged cache (``make_batch``), run through the ops
  (``run_step``) and through the reference semantics in float64 (``reference_step``);
- traced graphs for pass tests (``aten_graph``: a flat ATen graph and its ``PassContext``);
- tiny models: Hugging Face causal LMs (``tiny_model``, from ``hf_models``), a head-size-64 one for the
  GPU kernels, and models with recurrent state (LFM2, Mamba-1, RWKV);
- prompts and the references generation is checked against: Hugging Face ``generate`` and greedy
  decoding by the model's own forward.

The hand-written attention spellings are in ``tests/rewriter/zoo.py``, the Hugging Face zoo harness in
``tests/rewriter/hf_zoo.py`` (both also used by ``benchmarks/``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch.fx import GraphModule

from pagedattn.backends import AttentionMetadata, AttentionParams, build_metadata, get_backend
from pagedattn.backends.reference import dense_attention
from pagedattn.passes import PassContext

from .rewriter.hf_models import TINY, VOCAB, tiny_model  # noqa: F401  (re-exported)

# ------------------------------------------------------------------------------ paged batches

TOL = {torch.float32: 2e-4, torch.bfloat16: 3e-2, torch.float16: 4e-3}

# (context already cached, new tokens) per sequence
SHAPES = {
    "all_prefill": [(0, 7), (0, 19), (0, 1), (0, 33)],
    "all_decode": [(5, 1), (40, 1), (16, 1), (1, 1), (63, 1)],
    "mixed": [(0, 12), (30, 1), (17, 5), (0, 1), (64, 1), (3, 9)],
    "chunked": [(32, 16), (47, 3), (15, 17)],
    "cached_prefix": [(16, 20), (32, 1), (48, 7)],
    "many_blocks": [(300, 1), (257, 40), (0, 130)],
}

ALIBI8 = torch.tensor([2 ** (-8 * (h + 1) / 8) for h in range(8)])  # Press et al.'s slopes for 8 heads
SINKS8 = torch.linspace(-2.0, 4.0, 8)  # large enough to take a real share of every row's probability

# the sites' score terms and visibility every backend is checked under (8 query heads); ALiBi and sinks as flags,
# made tensors by feature_kwargs
FEATURES = [
    {"window": 8},
    {"window": 1},
    {"softcap": 5.0},
    {"softcap": 3.0, "window": 13},
    {"alibi": True},
    {"alibi": True, "window": 10},
    {"causal": False},
    {"scale": 0.3},
    {"sinks": True},
    {"sinks": True, "window": 8},
    {"sinks": True, "softcap": 5.0},
    {"sinks": True, "alibi": True},
    {"sinks": True, "causal": False},
]


def feature_id(feature: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in feature.items()) or "plain"


def feature_kwargs(feature: dict) -> dict:
    """A ``FEATURES`` entry as keyword arguments of ``run_step`` / ``reference_step``."""
    kw = dict(feature)
    if kw.pop("alibi", False):
        kw["alibi"] = ALIBI8
    if kw.pop("sinks", False):
        kw["sinks"] = SINKS8
    return kw


@dataclass
class PagedBatch:
    """One step: new tokens' ``query [T, Hq, D]``, ``key``/``value [T, Hkv, D]`` (padding rows past the
    sequences), a cache already holding each sequence's context, and every sequence's full K/V."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: torch.Tensor
    meta: AttentionMetadata
    full_k: list  # per sequence [context + new, Hkv, D]
    full_v: list
    contexts: list
    q_lens: list


def make_batch(
    seqs: list[tuple[int, int]],
    *,
    num_heads=4,
    num_kv_heads=2,
    head_size=64,
    block_size=16,
    dtype=torch.float32,
    shuffle_blocks=True,
    spare_blocks=3,
    pad_tokens=0,
    generator: Optional[torch.Generator] = None,
) -> PagedBatch:
    """``seqs`` is a list of (context_len, new_tokens); context K/V are already in the cache."""
    g = generator or torch.Generator().manual_seed(1234)
    backend = get_backend("cpu")
    need = [math.ceil((c + n) / block_size) for c, n in seqs]
    num_blocks = sum(need) + spare_blocks
    order = torch.randperm(num_blocks, generator=g).tolist() if shuffle_blocks else list(range(num_blocks))
    tables, pos = [], 0
    for n in need:
        tables.append(order[pos:pos + n])
        pos += n
    cache = backend.allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_size, dtype)
    cache.normal_(generator=g)  # stale garbage in unused slots must never be read
    full_k = [torch.randn(c + n, num_kv_heads, head_size, generator=g).to(dtype) for c, n in seqs]
    full_v = [torch.randn(c + n, num_kv_heads, head_size, generator=g).to(dtype) for c, n in seqs]
    # the cached context, written through the op as an earlier step would have
    ctx_specs = [(0, c, t) for (c, _), t in zip(seqs, tables) if c > 0]
    if ctx_specs:
        ctx_meta = build_metadata(ctx_specs, block_size)
        ks = torch.cat([k[:c] for k, (c, _) in zip(full_k, seqs) if c > 0])
        vs = torch.cat([v[:c] for v, (c, _) in zip(full_v, seqs) if c > 0])
        torch.ops.pagedattn.write_kv_cache(ks, vs, cache, ctx_meta.slot_mapping)
    meta = build_metadata(
        [(c, n, t) for (c, n), t in zip(seqs, tables)], block_size,
        pad_tokens_to=sum(n for _, n in seqs) + pad_tokens,
    )
    total = meta.num_tokens
    key = torch.randn(total, num_kv_heads, head_size, generator=g).to(dtype)
    value = torch.randn(total, num_kv_heads, head_size, generator=g).to(dtype)
    row = 0
    for (c, n), k, v in zip(seqs, full_k, full_v):
        key[row:row + n], value[row:row + n] = k[c:], v[c:]
        row += n
    query = torch.randn(total, num_heads, head_size, generator=g).to(dtype)
    return PagedBatch(query, key, value, cache, meta, full_k, full_v, [c for c, _ in seqs], [n for _, n in seqs])


# position programs (pagedattn.backends.position_mod) written by hand, independent of the pass that reads them
# from models: four sink tokens plus a window of 7 (causal), and a per-head bias by the distance's bucket
# (distances past 5 share one), for 4 query heads
SINKS_WINDOW_MOD = json.dumps({"version": 1, "float": "float32", "nodes": [
    ["q"], ["k"], ["sub", 0, 1], ["int", 7], ["lt", 2, 3], ["int", 4], ["lt", 1, 5], ["or", 4, 6], ["int", 0],
    ["ge", 2, 8], ["and", 7, 9]], "allowed": 10, "bias": None})
BUCKET_BIAS_MOD = json.dumps({"version": 1, "float": "float32", "nodes": [
    ["q"], ["k"], ["sub", 0, 1], ["int", 5], ["lt", 2, 3], ["ite", 4, 2, 3], ["int", 0], ["ge", 2, 6],
    ["int", 4], ["mul", 5, 8], ["h"], ["add", 9, 10], ["real", 0.0], ["lut", "real", 11, 0, 0, 24, 12]],
    "allowed": 7, "bias": 13})
BUCKET_TABLE = torch.linspace(-3.0, 2.0, 24)


def prefix_lm_mod(runs: int) -> str:
    """A prefix-LM program over per-request values written by hand: causal, and bidirectional inside each of
    up to ``runs`` spans of token type 1 (Gemma-3's image blocks; ``["val", 2r]``/``["val", 2r + 1]`` a span's
    start and end)."""
    nodes = [["q"], ["k"], ["le", 1, 0]]
    out = 2
    for r in range(runs):
        at = len(nodes)
        nodes += [["val", 2 * r], ["val", 2 * r + 1], ["ge", 0, at], ["lt", 0, at + 1], ["ge", 1, at],
                  ["lt", 1, at + 1], ["and", at + 2, at + 3], ["and", at + 4, at + 5], ["and", at + 6, at + 7]]
        nodes.append(["or", out, len(nodes) - 1])
        out = len(nodes) - 1
    return json.dumps({"version": 1, "float": "float32", "nodes": nodes, "allowed": out, "bias": None,
                       "values": {"input": "token_type_ids", "kind": "runs", "inside": 1, "outside": 0,
                                  "runs": runs}})


# a prefix length P per request: every key before P is seen, and adds 0.5 to its score; causal after
PREFIX_LEN_MOD = json.dumps({"version": 1, "float": "float32", "nodes": [
    ["q"], ["k"], ["le", 1, 0], ["val", 0], ["lt", 1, 3], ["or", 2, 4], ["real", 0.5], ["real", 0.0],
    ["ite", 4, 6, 7]], "allowed": 5, "bias": 8, "values": {"input": "prefix_len", "kind": "scalar"}})


def span_values(spec_runs: int, spans: Sequence[Sequence[tuple[int, int]]]) -> torch.Tensor:
    """``[S, 2 * runs]`` values of sequences with the given spans (``prefix_lm_mod``'s)."""
    from pagedattn.backends import position_mod

    spec = position_mod.ValueSpec("token_type_ids", "runs", 1, 0, spec_runs)
    rows = []
    for seq in spans:
        n = max((e for _, e in seq), default=0) + 1
        tt = torch.zeros(1, n, dtype=torch.long)
        for a, e in seq:
            tt[0, a:e] = 1
        rows.append(position_mod.values_from_input(spec, tt))
    return torch.cat(rows)


def batch_params(b: PagedBatch, scale, causal=True, window=0, softcap=0.0, alibi=None, sinks=None,
                 mod: Optional[tuple] = None) -> AttentionParams:
    """The step's ``AttentionParams`` (kv heads and value head size from the batch); ``mod`` is a position
    program and its tables (and the sequences' per-request values, for a program that reads some)."""
    extra = {} if mod is None else {"position_mod": mod[0], "position_tables": mod[1]}
    if mod is not None and len(mod) > 2:
        extra["position_data"] = mod[2]
    return AttentionParams(scale, causal, window, softcap, alibi, b.key.shape[1], b.value.shape[2], sinks, **extra)


def run_step(b: PagedBatch, scale, causal=True, window=0, softcap=0.0, alibi=None, pass_kv=True, sinks=None,
             mod=None):
    """Write the step's K/V and attend, through the ops (the active backend for the tensors' device)."""
    torch.ops.pagedattn.write_kv_cache(b.key, b.value, b.kv_cache, b.meta.slot_mapping)
    p = batch_params(b, scale, causal, window, softcap, alibi, sinks, mod)
    return torch.ops.pagedattn.paged_attention(
        b.query, b.key if pass_kv else None, b.value if pass_kv else None, b.kv_cache,
        b.meta.block_tables, b.meta.seq_lens, b.meta.query_start_loc, *p.args(),
    )


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    return x.double().transpose(0, 1)[None]  # [T, H, D] -> [1, H, T, D]


def reference_step(b: PagedBatch, scale, causal=True, window=0, softcap=0.0, alibi=None, sinks=None, mod=None):
    """The step's expected output ``[tokens, Hq, Dv]`` in float64 (padding rows left out): each sequence's
    new queries over its whole K/V, by the reference semantics (``backends/reference.py``)."""
    p = batch_params(b, scale, causal, window, softcap, None if alibi is None else alibi.double(),
                     None if sinks is None else sinks.double(), mod)
    outs, row = [], 0
    for i, (n, k, v) in enumerate(zip(b.q_lens, b.full_k, b.full_v)):
        q = _heads_first(b.query[row:row + n])  # the last n of the sequence's positions
        values = None if p.position_data is None else p.position_data[i:i + 1]
        out = dense_attention(q, _heads_first(k), _heads_first(v), p, exact=True, values=values)  # [1, Hq, n, Dv]
        outs.append(out[0].transpose(0, 1))
        row += n
    return torch.cat(outs)


def check_copy_and_swap(backend, device="cpu"):
    """copy_blocks within a cache and swap_blocks to another, in the [2, blocks, ...] layout."""
    cache = backend.allocate_kv_cache(6, 4, 2, 8, device=device)
    cache.normal_()
    orig = cache.clone()
    backend.copy_blocks(cache, torch.tensor([[0, 3], [2, 5]]))
    assert torch.equal(cache[:, 3], orig[:, 0]) and torch.equal(cache[:, 5], orig[:, 2])
    assert torch.equal(cache[:, 1], orig[:, 1])
    host = torch.zeros_like(cache)
    backend.swap_blocks(cache, host, torch.tensor([[1, 0], [4, 2]]))
    assert torch.equal(host[:, 0], cache[:, 1]) and torch.equal(host[:, 2], cache[:, 4])
    assert torch.all(host[:, 1] == 0)


# ------------------------------------------------------------------------------ graphs for passes


def aten_graph(module, args) -> tuple[GraphModule, PassContext]:
    """The flat ATen graph pagedattn's passes see, and a ``PassContext`` holding its example inputs."""
    from pagedattn.tracing import flat_graph_module

    A = torch.export.Dim.AUTO
    shapes = tuple({i: A for i in range(a.dim())} for a in args)
    ep = torch.export.export(module.eval(), args, dynamic_shapes=shapes, strict=False)
    gm, _, _ = flat_graph_module(ep)
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return gm, PassContext(example_inputs={p.name: a for p, a in zip(phs, args)})


def targets(gm: GraphModule) -> list:
    """The graph's call_function targets, in order."""
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def run_packed(rm, seqs: Sequence[torch.Tensor], block_size: int = 4, backend=None) -> list[torch.Tensor]:
    """Run fresh sequences (``[1, T_i, ...]`` inputs of a rewritten model taking one tensor) packed in one
    ``[1, T]`` paged step, each in blocks of its own; the per-sequence outputs."""
    import pagedattn

    tables, start = [], 0
    for x in seqs:
        n = -(-x.shape[1] // block_size)
        tables.append((0, x.shape[1], list(range(start, start + n))))
        start += n
    caches = rm.allocate_kv_caches(start + 1)
    with torch.no_grad(), pagedattn.paged_context(caches, build_metadata(tables, block_size), backend):
        out = rm(torch.cat(list(seqs), 1))
    return list(out.split([x.shape[1] for x in seqs], 1))


# ------------------------------------------------------------------------------ models


def engine_example(model) -> dict:
    """The example call the engine itself rewrites ``model`` with (``pagedattn.adapter``)."""
    from pagedattn.adapter import accepted_inputs, example_inputs

    return example_inputs(accepted_inputs(model), VOCAB)


def wide_model(arch: str, dtype: torch.dtype, device: str):
    """A tiny Llama/Mistral with head size 64 (xFormers' triton_splitk pages decode at 16-token blocks)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=512, initializer_range=0.1)
    if arch == "mistral":
        kw["sliding_window"] = 24
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(arch, **kw)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    return model.to(device=device, dtype=dtype).eval()


def _from_config(arch: str, **kw):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(arch, **kw)
    torch.manual_seed(0)
    impl = {"attn_implementation": "eager"} if arch == "lfm2" else {}
    return AutoModelForCausalLM.from_config(cfg, **impl).eval()


def tiny_lfm2():
    """LFM2: short-convolution layers (conv state) around a full attention layer."""
    return _from_config("lfm2", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                        layer_types=["conv", "full_attention", "conv"])


def tiny_mamba():
    """Mamba-1: its selective scan reads the carried state on single-token steps only; no attention."""
    return _from_config("mamba", vocab_size=VOCAB, hidden_size=32, state_size=4, num_hidden_layers=2, expand=2,
                        conv_kernel=3, time_step_rank=4)


def tiny_rwkv():
    """RWKV: a ``state`` list in and out of the forward, its running maximum starting at -1e30 (not zeros),
    and a single-token path that broadcasts the rows of a batch into each other."""
    return _from_config("rwkv", vocab_size=VOCAB, hidden_size=32, attention_hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, context_length=256)


# ------------------------------------------------------------------------------ prompts and references

SHORT_PROMPTS = dict(lengths=(5, 17, 9, 30, 2), shared=20)
LONG_PROMPTS = dict(lengths=(5, 37, 9, 70, 2), shared=40)  # cross 16-token blocks several times


def prompts(seed: int = 0, lengths: Sequence[int] = SHORT_PROMPTS["lengths"],
            shared: int = SHORT_PROMPTS["shared"]) -> list[list[int]]:
    """Random prompts of the given lengths, then two that share a ``shared``-token prefix (prefix caching)."""
    g = torch.Generator().manual_seed(seed)
    out = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]
    prefix = torch.randint(0, VOCAB, (shared,), generator=g).tolist()
    return out + [prefix + [7, 8], prefix + [9]]


def hf_generate(model, prompts: Sequence[Sequence[int]], new: int) -> list[list[int]]:
    """Hugging Face greedy ``generate``, one prompt at a time on the model's device (stops at EOS as the
    engine does)."""
    out = []
    dev = next(model.parameters()).device
    for p in prompts:
        ids = torch.tensor([list(p)], device=dev)
        with torch.no_grad():
            g = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                               do_sample=False, pad_token_id=0)
        out.append(g[0, len(p):].tolist())
    return out


def greedy_by_forward(model, prompts: Sequence[Sequence[int]], new: int, positions: bool = False) -> list[list[int]]:
    """Greedy decoding by the whole sequence through ``model(input_ids)`` (and ``position_ids`` with
    ``positions``) at every step, no cache: the reference for plain modules that return logits ``[B, T, V]``."""
    out = []
    for p in prompts:
        ids = list(p)
        for _ in range(new):
            kw = {"position_ids": torch.arange(len(ids))[None]} if positions else {}
            with torch.no_grad():
                ids.append(int(model(torch.tensor([ids]), **kw)[0, -1].argmax()))
        out.append(ids[len(p):])
    return out


def record_decode_masks(monkeypatch) -> list:
    """Wraps the CPU backend's decode kernel call; returns the masks (or None) it was given."""
    from pagedattn.backends import sdpa_cpu

    seen = []
    inner = sdpa_cpu._partial_attention

    def spy(q, k, v, bias, scale, softcap):
        seen.append(bias)
        return inner(q, k, v, bias, scale, softcap)

    monkeypatch.setattr(sdpa_cpu, "_partial_attention", spy)
    return seen


def onnx_step_session(step: "Step", inputs: tuple, path):
    """``step`` exported to ONNX at ``path`` with pagedattn's translations (every input dimension dynamic),
    checked by onnx's full checker, and opened in onnxruntime on the CPU."""
    import onnx
    import onnxruntime as ort

    from pagedattn.onnx_export import translations
    from pagedattn.tracing import quiet_tracing

    dyn = tuple({d: torch.export.Dim.AUTO for d in range(x.dim())} for x in inputs)
    with quiet_tracing():  # torch.onnx's own deprecation notes, as pagedattn.onnx_export.export_onnx keeps them
        prog = torch.onnx.export(step, inputs, dynamo=True, dynamic_shapes=dyn,
                                 custom_translation_table=translations(), opset_version=18, verbose=False)
    prog.save(str(path))
    onnx.checker.check_model(str(path), full_check=True)
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


class Step(torch.nn.Module):
    """One paged step: the functional cache write, then the paged attention over the new cache."""

    def __init__(self, params):
        super().__init__()
        self.params = params

    def forward(self, q, k, v, cache, slots, tables, seq_lens, starts):
        new = torch.ops.pagedattn.write_kv_cache_functional(k, v, cache, slots)
        out = torch.ops.pagedattn.paged_attention(q, k, v, new, tables, seq_lens, starts, *self.params.args())
        return out, new


def skip_unless_missing_prerequisite():
    """Skip where the machine lacks what the native kernel needs; fail where it has it and the build failed."""
    import pytest

    from pagedattn.backends import native

    missing = native.missing_prerequisite()
    if missing is None:
        pytest.fail("the native decode kernel did not build (run with --log-level=DEBUG for the compiler's output)")
    pytest.skip(f"the native decode kernel cannot run here: {missing}")
