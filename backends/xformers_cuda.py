"""Paged attention on CUDA through xFormers' fused attention operators.

Cache layout: ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (K then V). ``cache[0]``
seen as ``[1, num_blocks * block_size, Hkv, D]`` is exactly the key tensor xFormers' paged biases
expect (pages of ``block_size`` tokens addressed through ``block_tables``), and a write is one
``index_copy_`` per K and V on the flattened slots.

GQA never copies K/V: queries are viewed as ``[1, T, Hkv, G, D]`` and K/V as ``[1, N, Hkv, 1, D]``
expanded (stride 0) to ``G``, the grouped layout every xFormers operator folds back without a copy.

One call splits the step's sequences into groups, each one fused-kernel call:

- *fresh* prefill (no cached context, new K/V given): ``BlockDiagonalCausalMask`` over the flattened
  new tokens (``make_local_attention`` for a sliding window), read straight from ``key``/``value``;
  with chunked local attention each chunk of a sequence is a block of its own;
- *decode* (one new token): a paged bias, ``PagedBlockDiagonalPaddedKeysMask`` or, with a window or
  chunks, ``PagedBlockDiagonalCausalWithOffsetGappyKeysMask`` whose key ranges start at the first
  visible key (``reference.earliest_visible_key``);
- *chunked* prefill (new tokens after cached ones): ``PagedBlockDiagonalCausalWithOffsetPaddedKeysMask``
  (with chunks: the queries cut where chunks begin, ``reference.chunk_runs``, each run over its
  chunk's keys through gappy keys) when an operator takes it; otherwise the keys each run can see are
  gathered from the cache and attended with ``BlockDiagonalCausalFromBottomRightMask`` (see
  :meth:`XFormersCudaBackend.fallback_reasons`);
- *cross* (non-causal over a cache): ``PagedBlockDiagonalPaddedKeysMask`` with varying query lengths.

Decode also gathers when triton_splitk cannot page it (blocks under 16 tokens, head sizes other than
16-512 powers of two). ALiBi runs as an additive tensor bias over the sequences' gathered K/V. What
no loaded xFormers operator can run (logit soft-cap, attention sinks, float32, ...) goes through PyTorch
SDPA (or fp32 math for soft-cap and sinks) over the same padded gather, in batches of sequences whose
padded scores and K/V fit ``_MATH_BUDGET_BYTES`` (decodes apart from long prefills). Every fallback
is exact and logs its reason once.

Operators are chosen by their own ``not_supported_reasons``. xFormers wheels are built against one
torch release; on another its C++ extension does not load and xFormers refuses every CUDA operator,
so the ones that never use it (flash through PyTorch's kernel or flash_attn, triton_splitk) are let
through. xFormers is imported lazily, on the first attention call.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch import Tensor

from pagedattn.backends import reference, triton_paged
from pagedattn.backends.base import SplitKVBackend, register_backend
from pagedattn.backends.metadata import AttentionMetadata
from pagedattn.backends.params import AttentionConfig, AttentionParams

if importlib.util.find_spec("xformers") is None:
    raise ImportError("the CUDA backend needs xFormers: pip install 'pagedattn[cuda]' (or xformers)")

log = logging.getLogger("pagedattn.backends.xformers_cuda")

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_KERNEL_DTYPES = (torch.float16, torch.bfloat16)
# xFormers' base support check refuses every CUDA operator when its C++ extension did not load
# (wheels are built against one torch release), although some operators never use it.
_NO_CPP_REASON = "xFormers wasn't build with CUDA support"


# ------------------------------------------------------------------------ xFormers


@dataclass(frozen=True)
class _XFormers:
    bias: object  # xformers.ops.fmha.attn_bias
    Inputs: type
    fresh_ops: tuple  # operators for block-diagonal biases over contiguous keys, best first
    paged_ops: tuple  # operators that may take paged biases (each op's own check decides)
    tensor_bias_ops: tuple
    no_cpp_ops: frozenset  # operators (and their subclasses) that run without xFormers' C++ extension
    cpp_loaded: bool


@functools.cache
def _xformers() -> _XFormers:
    import xformers._cpp_lib as cpp
    from xformers.ops import fmha
    from xformers.ops.fmha import attn_bias, cutlass, flash, flash3, triton_splitk

    cpp_loaded = cpp._build_metadata is not None and cpp._cpp_library_load_exception is None
    no_cpp = {triton_splitk.FwOp}
    if flash.FLASH_VERSION != "0.0.0":  # PyTorch's flash kernel or the flash_attn package
        no_cpp.add(flash.FwOp)
    if not cpp_loaded:
        built = getattr(cpp._cpp_library_load_exception, "build_info", None)
        log.warning("xFormers' C++ extension did not load (built for torch %s, this is %s); using its operators "
                    "that need none: %s", getattr(built, "torch_version", "?"), torch.__version__,
                    ", ".join(sorted(op.NAME for op in no_cpp)))
    return _XFormers(
        bias=attn_bias, Inputs=fmha.Inputs,
        fresh_ops=(flash3.FwOp, flash.FwOp, cutlass.FwOp),
        paged_ops=(flash3.FwOp, flash.FwOp),
        tensor_bias_ops=(cutlass.FwOp, triton_splitk.FwOp),
        no_cpp_ops=frozenset(no_cpp), cpp_loaded=cpp_loaded,
    )


def _splitk_tile(block_size: int) -> Optional[int]:
    """Largest power of two dividing ``block_size``, at most 64; None below 16 (tl.dot's minimum)."""
    tile = min(64, block_size & -block_size)
    return tile if tile >= 16 else None


@functools.cache
def _splitk_op(block_size: int):
    """triton_splitk's operator with a key tile that divides the page size (its paged kernel needs it)."""
    from xformers.ops.fmha import triton_splitk

    tile = _splitk_tile(block_size)
    if tile is None or tile == triton_splitk.FwOp.BLOCK_N:
        return triton_splitk.FwOp if tile else None
    return type(f"FwOp_BN{tile}", (triton_splitk.FwOp,), {"BLOCK_N": tile, "NAME": f"triton_splitKF_bn{tile}"})


class _NoOperator(Exception):
    """No xFormers operator takes these inputs; ``args[0]`` lists each operator's reasons."""


def _op_reasons(op, inp, xf: _XFormers) -> list[str]:
    reasons = op.not_supported_reasons(inp)
    if not xf.cpp_loaded and issubclass(op, tuple(xf.no_cpp_ops)):
        reasons = [r for r in reasons if r != _NO_CPP_REASON]
    return reasons


def _select_op(candidates: Sequence, inp, xf: _XFormers):
    tried = []
    for op in candidates:
        if op is None:
            continue
        reasons = _op_reasons(op, inp, xf)
        if not reasons:
            return op
        tried.append(f"{op.NAME}: {'; '.join(reasons)}")
    raise _NoOperator(tried)


def _xformers_attention(q: Tensor, k: Tensor, v: Tensor, bias, scale: float, candidates: Sequence,
                        op=None) -> tuple[Tensor, object]:
    """``memory_efficient_attention_forward`` with our own operator choice: returns (output, op).

    ``op`` skips the choice (the same group's earlier layers made it).
    """
    xf = _xformers()
    inp = xf.Inputs(query=q, key=k, value=v, attn_bias=bias, p=0.0, scale=scale)
    if op is None:  # checks once per group and step; later layers pass the same shapes
        inp.validate_inputs()
        inp.normalize_bmhk()
        op = _select_op(candidates, inp, xf)
    out, _ = op.apply(inp, needs_gradient=False)
    return out.reshape(*q.shape[:-1], v.shape[-1]), op


_NOTED: set[str] = set()
_NOTED_LOCK = threading.Lock()


def _note(reason: str) -> None:
    """Log each fallback reason once per process."""
    with _NOTED_LOCK:
        if reason in _NOTED:
            return
        _NOTED.add(reason)
    log.warning("%s", reason)


# -------------------------------------------------------------------------- plans


@dataclass
class _Group:
    """Sequences of one step that one kernel call attends."""

    kind: str  # fresh | decode | chunked | cross
    seqs: list[int]
    starts: list[int]  # first query row of each
    q_lens: list[int]
    kv_lens: list[int]
    rows: object = None  # slice of the query rows when contiguous, else a long tensor
    cache: dict = field(default_factory=dict)  # per-step tensors and biases, shared by all layers

    @property
    def contexts(self) -> list[int]:
        return [L - q for L, q in zip(self.kv_lens, self.q_lens)]


def _row_index(group: _Group, device) -> object:
    if all(a + n == b for a, n, b in zip(group.starts, group.q_lens, group.starts[1:])):
        return slice(group.starts[0], group.starts[-1] + group.q_lens[-1])
    rows = [r for a, n in zip(group.starts, group.q_lens) for r in range(a, a + n)]
    return torch.tensor(rows, dtype=torch.long, device=device)


class _StepPlan:
    """Host copies of one step's lengths and its grouping, reused by every layer of the step.

    Holding the metadata tensors keeps their identity meaningful: a later step's tensors are
    different objects, and in-place edits bump ``_version``.
    """

    def __init__(self, seq_lens: Tensor, query_start_loc: Tensor, block_tables: Tensor):
        self.tensors = (seq_lens, query_start_loc, block_tables)
        self.versions = tuple(t._version for t in self.tensors)
        self.qsl = query_start_loc.tolist()
        self.lens = seq_lens.tolist()
        self.groups: dict[tuple, list[_Group]] = {}

    def matches(self, seq_lens, query_start_loc, block_tables) -> bool:
        ts = (seq_lens, query_start_loc, block_tables)
        return all(a is b for a, b in zip(ts, self.tensors)) and \
            tuple(t._version for t in ts) == self.versions

    def grouping(self, has_kv: bool, causal: bool, device) -> list[_Group]:
        key = (has_kv, causal)
        if key not in self.groups:
            buckets: dict[str, _Group] = {}
            for i, L in enumerate(self.lens):
                a, n = self.qsl[i], self.qsl[i + 1] - self.qsl[i]
                if n <= 0:
                    continue
                if has_kv and n == L:
                    kind = "fresh"
                elif not causal:
                    kind = "cross"
                elif n == 1:
                    kind = "decode"
                else:
                    kind = "chunked"
                g = buckets.setdefault(kind, _Group(kind, [], [], [], []))
                g.seqs.append(i)
                g.starts.append(a)
                g.q_lens.append(n)
                g.kv_lens.append(L)
            for g in buckets.values():
                g.rows = _row_index(g, device)
            self.groups[key] = list(buckets.values())
        return self.groups[key]

    def all_seqs(self, device) -> _Group:
        """Every sequence with new tokens as one group (for the padded paths)."""
        key = ("all",)
        if key not in self.groups:
            keep = [i for i in range(len(self.lens)) if self.qsl[i + 1] > self.qsl[i]]
            g = _Group("all", keep, [self.qsl[i] for i in keep], [self.qsl[i + 1] - self.qsl[i] for i in keep],
                       [self.lens[i] for i in keep])
            g.rows = _row_index(g, device) if keep else None
            self.groups[key] = [g]
        return self.groups[key][0]


_LOCAL = threading.local()


def _plan_for(seq_lens: Tensor, query_start_loc: Tensor, block_tables: Tensor) -> _StepPlan:
    plan = getattr(_LOCAL, "plan", None)
    if plan is None or not plan.matches(seq_lens, query_start_loc, block_tables):
        plan = _LOCAL.plan = _StepPlan(seq_lens, query_start_loc, block_tables)
    return plan


def _valid_slots(slot_mapping: Tensor) -> Optional[Tensor]:
    """Rows of ``slot_mapping`` that are not padding (-1), or None when all are; one sync per tensor."""
    cached = getattr(_LOCAL, "slots", None)
    if cached is not None and cached[0] is slot_mapping and cached[1] == slot_mapping._version:
        return cached[2]
    keep = None
    if slot_mapping.numel() and bool((slot_mapping < 0).any()):
        keep = torch.nonzero(slot_mapping >= 0).flatten()
    _LOCAL.slots = (slot_mapping, slot_mapping._version, keep)
    return keep


# ---------------------------------------------------------------------- gathering


def _seq_slots(tables: Tensor, starts: Sequence[int], ends: Sequence[int], block_size: int) -> Tensor:
    """Flat cache slots of key positions ``[starts[i], ends[i])`` of each sequence, concatenated."""
    dev = tables.device
    lens = [e - s for s, e in zip(starts, ends)]
    total = sum(lens)
    seq = torch.repeat_interleave(torch.arange(len(lens), device=dev), torch.tensor(lens, device=dev),
                                  output_size=total)
    offsets = torch.tensor([0] + lens[:-1], device=dev).cumsum(0)
    pos = torch.arange(total, device=dev) - offsets[seq] + torch.tensor(list(starts), device=dev)[seq]
    return tables[seq, pos // block_size].long() * block_size + pos % block_size


def _take(x: Tensor, rows) -> Tensor:
    return x[rows] if isinstance(rows, slice) else x.index_select(0, rows)


def _put(out: Tensor, rows, value: Tensor) -> None:
    if isinstance(rows, slice):
        out[rows] = value
    else:
        out.index_copy_(0, rows, value)


def _grouped(x: Tensor, num_kv_heads: int) -> Tensor:
    """``[T, Hq, D]`` -> ``[1, T, Hkv, G, D]`` (or ``[1, T, H, D]`` without GQA)."""
    t, h, d = x.shape
    if h == num_kv_heads:
        return x[None]
    return x.reshape(1, t, num_kv_heads, h // num_kv_heads, d)


def _expanded(kv: Tensor, group: int) -> Tensor:
    """``[N, Hkv, D]`` -> ``[1, N, Hkv, G, D]`` with stride 0 over G (no copy)."""
    if group == 1:
        return kv[None]
    n, hkv, d = kv.shape
    return kv[None, :, :, None].expand(1, n, hkv, group, d)


@dataclass(frozen=True)
class _Runs:
    """A group's queries cut where chunks begin (``reference.chunk_runs``; one run per sequence without
    chunks). Per run: the group's sequence it belongs to (index into ``_Group.seqs``), its query count,
    and the keys ``[lo, hi)`` it reads: from the first one its first query can see up to its last query
    (for cross-attention, every key)."""

    seq: list[int]
    q_lens: list[int]
    lo: list[int]
    hi: list[int]


def _runs(g: _Group, params: AttentionParams) -> _Runs:
    runs = _Runs([], [], [], [])
    for i, (n, L) in enumerate(zip(g.q_lens, g.kv_lens)):
        for a, b in reference.chunk_runs(L - n, L, params):
            runs.seq.append(i)
            runs.q_lens.append(b - a)
            runs.lo.append(reference.earliest_visible_key(a, params))
            runs.hi.append(b)
    return runs


def _gappy_paged(ab, runs: _Runs, tables: Tensor, block_size: int, device):
    """``PagedBlockDiagonalCausalWithOffsetGappyKeysMask``: run ``i`` over keys ``[lo, hi)`` of row ``i`` of
    ``tables``, causal from the bottom right. Built through the unpaged form's ``make_paged`` (the paged
    class's ``from_seqlens`` trips on its own length check in 0.0.35)."""
    row = tables.shape[1] * block_size
    starts = [i * row + lo for i, lo in enumerate(runs.lo)] + [len(runs.lo) * row]
    lens = [hi - lo for lo, hi in zip(runs.lo, runs.hi)]
    bias = ab.BlockDiagonalCausalWithOffsetGappyKeysMask.from_seqlens(runs.q_lens, starts, lens,
                                                                      device=device)
    return bias.make_paged(tables, block_size, row, ab.PagedBlockDiagonalCausalWithOffsetGappyKeysMask)


# ------------------------------------------------------------------------ backend


class XFormersCudaBackend(SplitKVBackend):
    name = "xformers_cuda"
    device_type = "cuda"
    dtypes = _DTYPES

    def __init__(self, triton: bool = False):
        """``triton``: every attention call that ``triton_paged``'s kernels take (prefills and mixed steps too, not
        only the captured decode steps) goes through them, each kind once its first call agreed with the xFormers
        path; xFormers serves the rest. Off by default until measured against xFormers on a GPU
        (``benchmarks/generate_cuda.py --triton-eager``): it trades xFormers' Python around each call for one or
        two launches."""
        self.paths: Counter = Counter()  # (group kind, operator or fallback) -> calls, for tests/benchmarks
        self.triton = triton_paged.CheckedKernels() if triton else None

    def cache_geometry(self, kv_cache):
        nb, bs, hkv, d = super().cache_geometry(kv_cache)
        if kv_cache[0].stride() != (bs * hkv * d, hkv * d, d, 1):
            raise ValueError("xformers_cuda: each of K and V in kv_cache must be contiguous "
                             "(allocate it with allocate_kv_cache)")
        return nb, bs, hkv, d

    def valid_slots(self, slot_mapping):
        return _valid_slots(slot_mapping)  # cached per step: one host sync for all layers

    def fallback_reasons(self, config: AttentionConfig, block_size: int = 16) -> list[str]:
        """What of ``config`` runs outside xFormers' fused kernels (exactly, but slower), and why.

        Decided from the configuration alone; which operators load is only known on the GPU, and
        each call logs (once) the operators it tried when it has to fall back.
        """
        out = []
        if config.dtype not in _KERNEL_DTYPES:
            out.append(f"dtype {config.dtype}: xFormers' CUDA kernels take float16/bfloat16; PyTorch SDPA runs it")
        if config.params.softcap > 0:
            out.append("logit soft-cap: no xFormers operator applies one (0.0.35's flash op fixes softcap=0); "
                       "fp32 math over the gathered K/V runs it")
        if config.params.alibi_slopes is not None:
            out.append("ALiBi: no xFormers operator takes slopes with paged keys; an additive tensor bias over "
                       "the gathered K/V runs it (cutlass or triton_splitk), else PyTorch SDPA")
        if config.params.position_mod:
            out.append("position program (a mask or bias over positions, and per-request values such as a "
                       "prefix-LM's token types, that no fast kind expresses): evaluated for the step's positions "
                       "into an additive tensor bias over the gathered K/V (cutlass or triton_splitk); with "
                       "soft-cap, sinks or float32, or where no operator takes it, the reference's fp32 math")
        if config.head_size % 8 or config.head_size > 256:
            out.append(f"head size {config.head_size}: xFormers' flash kernels need a multiple of 8 up to 256; "
                       "PyTorch SDPA runs it")
        if config.head_size not in (16, 32, 64, 128, 256, 512):
            out.append(f"head size {config.head_size}: triton_splitk's paged decode takes 16/32/64/128/256/512; "
                       "decode gathers K/V from the cache instead")
        p = config.params
        if p.chunk and p.window:
            out.append("chunked local attention with a sliding window: chunked prefills gather the keys "
                       "in reach from the cache before attending (xFormers' paged biases have no "
                       "local-attention form)")
        if p.chunk and (config.dtype not in _KERNEL_DTYPES or p.softcap > 0 or p.alibi_slopes is not None
                        or p.sinks is not None):
            out.append("chunked local attention on the padded path above: each sequence's keys are read from "
                       "its chunk's first block, with the chunk applied as a mask")
        if _splitk_tile(block_size) is None:
            out.append(f"block size {block_size}: triton_splitk's paged decode needs pages of a multiple of 16 "
                       "tokens; decode gathers K/V from the cache instead")
        return out

    # --- attention

    def attend(self, query, key, value, kv_cache, metadata: AttentionMetadata, params: AttentionParams):
        if self.triton is not None:  # the step's own K/V are in the cache already (written before the attention)
            return self.triton.attend(query, kv_cache, metadata, params,
                                      lambda: self._attend(query, key, value, kv_cache, metadata, params))
        return self._attend(query, key, value, kv_cache, metadata, params)

    def _attend(self, query, key, value, kv_cache, metadata: AttentionMetadata, params: AttentionParams):
        nb, bs, hkv, d = self.cache_geometry(kv_cache)
        block_tables = metadata.block_tables
        alibi_slopes, sinks, softcap = params.alibi_slopes, params.sinks, params.softcap
        if alibi_slopes is not None and alibi_slopes.device != query.device:
            alibi_slopes = alibi_slopes.to(query.device)  # slopes a pass kept on the host
            params = dataclasses.replace(params, alibi_slopes=alibi_slopes)
        if params.position_tables is not None and params.position_tables.device != query.device:
            params = dataclasses.replace(params, position_tables=params.position_tables.to(query.device))
        plan = _plan_for(metadata.seq_lens, metadata.query_start_loc, block_tables)
        c = _Call(query, key, value, kv_cache, block_tables.to(torch.int32), params, hkv, query.shape[1] // hkv,
                  nb, bs, d)
        fused = (query.dtype in _KERNEL_DTYPES and softcap <= 0 and alibi_slopes is None and sinks is None
                 and not params.position_mod)
        groups = plan.grouping(key is not None, params.causal, query.device) if fused else None
        if fused and len(groups) == 1 and isinstance(groups[0].rows, slice) and \
                groups[0].rows == slice(0, query.shape[0]):
            o = self._fused(c, groups[0])  # one group covering every row: its output is the answer
            if o is not None:
                return o
        out = query.new_zeros((query.shape[0], query.shape[1], kv_cache.shape[-1]))
        if not fused:
            group = plan.all_seqs(query.device)
            if group.seqs:
                if query.dtype not in _KERNEL_DTYPES:
                    why = (f"{query.dtype} attention runs through PyTorch SDPA: xFormers' CUDA kernels take "
                           "float16/bfloat16")
                elif sinks is not None:
                    why = ("attention with sinks runs as fp32 math over gathered K/V: no xFormers operator "
                           "takes sink logits")
                elif params.position_mod:
                    why = ("a position program runs as fp32 math over gathered K/V: no xFormers operator "
                           "evaluates it with soft-cap or sinks")
                elif softcap > 0:
                    why = ("soft-capped attention runs as fp32 math over gathered K/V: no xFormers operator "
                           "applies a soft-cap")
                else:
                    why = ""  # ALiBi: set if no operator takes the tensor bias
                self._padded(out, c, group, why)
            return out
        for group in groups:
            o = self._fused(c, group)
            if o is None:  # no operator takes it: the exact padded path, reason logged
                self._padded(out, c, group, group.cache[("why", c.shape_key)])
            else:
                _put(out, group.rows, o)
        return out

    # --- fused paths: one xFormers call per group

    def _fused(self, c: "_Call", g: _Group) -> Optional[Tensor]:
        ck = c.shape_key
        if g.cache.get(("why", ck)):
            return None
        q = _grouped(_take(c.query, g.rows), c.hkv)
        if g.kind == "fresh":
            k, v = _take(c.key, g.rows), _take(c.value, g.rows)
        else:
            k = c.kv_cache[0].view(c.nb * c.bs, c.hkv, c.d)
            v = c.kv_cache[1].view(c.nb * c.bs, c.hkv, c.d)
        prepared = g.cache.get(("prep", ck))
        if prepared is None:
            prepared = g.cache[("prep", ck)] = self._prepare(c, g, q, _expanded(k, c.group))
        bias, candidates, kv_index = prepared
        if kv_index is not None:  # keys gathered into one contiguous run per sequence
            k, v = k.index_select(0, kv_index), v.index_select(0, kv_index)
        k, v = _expanded(k, c.group), _expanded(v, c.group)
        try:
            o, op = _xformers_attention(q, k, v, bias, c.scale, candidates, g.cache.get(("op", ck)))
        except _NoOperator as e:
            g.cache[("why", ck)] = (f"{g.kind} attention{c.local} runs through PyTorch SDPA over gathered "
                                    f"K/V: no xFormers operator takes it ({' | '.join(e.args[0])})")
            return None
        g.cache[("op", ck)] = op
        self.paths[(g.kind, op.NAME)] += 1
        return o.reshape(-1, c.query.shape[1], o.shape[-1])

    def _prepare(self, c: "_Call", g: _Group, q: Tensor, paged_k: Tensor):
        """(bias, candidate operators, key gather index or None) for a group; once per step."""
        xf = _xformers()
        ab, dev = xf.bias, c.query.device
        runs = _runs(g, c.params)
        if g.kind == "fresh":
            if c.causal:
                # a chunked site's sequences cut where chunks begin: each run starts at its chunk's start
                # (earliest_visible_key(a) == a), so each is plain causal attention over its own keys
                bias = ab.BlockDiagonalCausalMask.from_seqlens(runs.q_lens, device=dev)
                if c.window:
                    bias = bias.make_local_attention(c.window)
            else:
                bias = ab.BlockDiagonalMask.from_seqlens(g.q_lens, device=dev)
            return bias, xf.fresh_ops, None
        tables = c.block_tables if len(g.seqs) == c.block_tables.shape[0] else \
            c.block_tables.index_select(0, torch.tensor(g.seqs, device=dev))
        tables = tables.contiguous()
        if len(runs.seq) != len(g.seqs):  # a sequence's block table once per run of its queries
            tables = tables.index_select(0, torch.tensor(runs.seq, device=dev))
        if g.kind == "cross" or (g.kind == "decode" and not (c.window or c.chunk)):
            paged = ab.PagedBlockDiagonalPaddedKeysMask.from_seqlens(g.q_lens, g.kv_lens, tables, c.bs, device=dev)
        elif g.kind == "chunked" and c.window:
            paged = None  # paged biases have no local-attention form
        elif g.kind == "chunked" and not c.chunk:
            paged = ab.PagedBlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens(
                g.q_lens, g.kv_lens, tables, c.bs, device=dev)
        else:
            # decodes with a window or chunks, chunked prefills with chunks: each run's keys start at the
            # first one its queries see, and it sees every key from there up to itself (bottom-right causal)
            paged = _gappy_paged(ab, runs, tables, c.bs, dev)
        candidates = (*xf.paged_ops, _splitk_op(c.bs))
        if paged is not None:
            inp = xf.Inputs(query=q, key=paged_k, value=paged_k, attn_bias=paged, p=0.0, scale=c.scale)
            try:
                _select_op(candidates, inp, xf)
                return paged, candidates, None
            except _NoOperator as e:
                _note(f"{g.kind} attention gathers its keys from the cache (one contiguous run per sequence) "
                      f"before attending: no loaded xFormers operator takes {type(paged).__name__} here "
                      f"({' | '.join(e.args[0])})")
        else:
            _note(f"{g.kind} attention with a sliding window gathers the keys in reach from the cache before "
                  "attending: xFormers' paged biases have no local-attention form")
        # keys gathered into contiguous runs: each run of queries needs only those its first query can see on
        index = _seq_slots(tables, runs.lo, runs.hi, c.bs)
        k_lens = [hi - lo for lo, hi in zip(runs.lo, runs.hi)]
        if c.causal:
            bias = ab.BlockDiagonalCausalFromBottomRightMask.from_seqlens(runs.q_lens, k_lens, device=dev)
            if c.window:
                bias = bias.make_local_attention_from_bottomright(c.window)
        else:
            bias = ab.BlockDiagonalMask.from_seqlens(runs.q_lens, k_lens, device=dev)
        return bias, xf.fresh_ops, index

    # --- padded paths: ALiBi tensor bias, and the exact fallback

    def _padded(self, out: Tensor, c: "_Call", g: _Group, why: str):
        """Sequences padded to ``[S, Qmax]`` queries over ``[S, Lp]`` gathered keys: one batched xFormers call
        for ALiBi, else the reference's exact attention in batches of sequences whose scores and K/V fit
        ``_MATH_BUDGET_BYTES``."""
        p = c.params
        if p.alibi_slopes is not None and p.softcap <= 0 and p.sinks is None and c.query.dtype in _KERNEL_DTYPES \
                and not p.position_mod:
            plan = _cached_pad_plan(c, g)
            q, k, v = _gather_padded(c, plan)
            o, why = self._alibi_tensor_bias(c, g, plan, q, k, v)
            if o is not None:
                _put(out, plan["rows"], o.index_select(0, plan["q_dst"]).to(out.dtype))
                return
        program = p.position_mod and p.softcap <= 0 and p.sinks is None and c.query.dtype in _KERNEL_DTYPES
        for part in _math_batches(c, g):
            plan = _cached_pad_plan(c, part)
            q, k, v = _gather_padded(c, plan)
            values = None if p.position_data is None else \
                p.position_data.index_select(0, torch.tensor(part.seqs, device=p.position_data.device))
            if program:
                o, why = self._program_tensor_bias(c, part, plan, q, k, v, values)
                if o is not None:
                    _put(out, plan["rows"], o.index_select(0, plan["q_dst"]).to(out.dtype))
                    continue
                program = False  # no operator takes it: the exact path for this part and the rest
            _note(why)
            self.paths[(g.kind, "softcap_math" if p.softcap > 0 else "sinks_math" if p.sinks is not None
                        else "sdpa")] += 1
            o = reference.dense_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), p,
                                          plan["q_pos"], plan["k_pos"], plan["present"],
                                          values=values)  # [S, Hq, Qmax, D]
            o = o.transpose(1, 2).reshape(plan["S"] * plan["qmax"], -1, c.d)
            _put(out, plan["rows"], o.index_select(0, plan["q_dst"]).to(out.dtype))

    def _program_tensor_bias(self, c, g, plan, q, k, v, values) -> tuple[Optional[Tensor], str]:
        """A position program's mask and bias (ALiBi's too) evaluated for the padded step's positions, as one
        additive ``[S, Hkv, G, Qmax, Lp]`` bias to an xFormers operator. A query the program lets see no key
        at all sees the first in the bias and gets zeros after, as the reference defines."""
        S, qmax, lp, hq = plan["S"], plan["qmax"], plan["lp"], c.query.shape[1]
        present = plan["present"]
        seq_len = torch.where(present, plan["k_pos"], -1).amax(-1) + 1  # what the program reads as the length
        vis, bias = reference.score_terms(plan["q_pos"], plan["k_pos"], c.params, hq, seq_len, values)
        allowed = present[:, None, :] if vis is None else present[:, None, :] & vis  # [S, Qmax, Lp]
        empty = ~allowed.any(-1, keepdim=True)  # [S, Qmax, 1]: padded rows, and rows the program hides all from
        allowed = allowed | (empty & (torch.arange(lp, device=allowed.device) == 0))
        full = torch.zeros((S, hq, qmax, lp), dtype=torch.float32, device=q.device)
        if bias is not None:
            full += bias
        full = full.masked_fill_(~allowed[:, None], float("-inf")).view(S, c.hkv, c.group, qmax, lp)
        o, why = self._with_tensor_bias(c, g, (S, qmax, lp), q, k, v, full.to(c.query.dtype), "program",
                                        "a position program runs as fp32 math over gathered K/V")
        if o is None:
            return None, why
        o = o.reshape(S, qmax, hq, c.d).masked_fill(empty[..., None], 0.0)
        return o.reshape(S * qmax, hq, c.d), ""

    def _with_tensor_bias(self, c, g, dims: tuple[int, int, int], q, k, v, bias, kind: str,
                          fallback: str) -> tuple[Optional[Tensor], str]:
        """Gathered ``q`` (``[S, Qmax]`` rows of ``dims = (S, Qmax, Lp)``) over ``k``/``v [S, Lp, Hkv, D]`` with an additive ``[S, Hkv, G, Qmax, Lp]``
        bias through an xFormers operator that takes a tensor bias (the one found for this shape, remembered in
        the step's cache, as is its absence): the output, or None and why (``fallback`` says what runs instead)."""
        S, qmax, lp = dims
        qg = q.view(S, qmax, c.hkv, c.group, c.d)
        kg = k[:, :, :, None].expand(S, lp, c.hkv, c.group, c.d)
        vg = v[:, :, :, None].expand(S, lp, c.hkv, c.group, c.d)
        ck, why_key = (f"{kind}_op", c.shape_key), (f"{kind}_why", c.shape_key)
        if g.cache.get(ck) == "none":
            return None, g.cache[why_key]
        try:
            o, op = _xformers_attention(qg, kg, vg, bias, c.scale, _xformers().tensor_bias_ops, g.cache.get(ck))
        except _NoOperator as e:
            why = f"{fallback}: no xFormers operator takes its tensor bias ({' | '.join(e.args[0])})"
            g.cache[ck], g.cache[why_key] = "none", why
            return None, why
        g.cache[ck] = op
        self.paths[(kind, op.NAME)] += 1
        return o, ""

    def _alibi_tensor_bias(self, c, g, plan, q, k, v) -> tuple[Optional[Tensor], str]:
        """ALiBi plus the masks as one additive ``[S, Hkv, G, Qmax, Lp]`` bias to an xFormers operator."""
        S, qmax, lp = plan["S"], plan["qmax"], plan["lp"]
        allowed = plan["present"][:, None, :]
        vis = reference.visible(plan["q_pos"], plan["k_pos"], c.params)
        if vis is not None:
            allowed = allowed & vis
        allowed = allowed | plan["pad_rows"]  # [S, Qmax, Lp]
        bias = reference.alibi_bias(c.params.alibi_slopes, plan["q_pos"], plan["k_pos"])  # [S, Hq, Qmax, Lp]
        bias = bias.view(S, c.hkv, c.group, qmax, lp).masked_fill_(~allowed[:, None, None], float("-inf"))
        o, why = self._with_tensor_bias(c, g, (S, qmax, lp), q, k, v, bias.to(c.query.dtype), "alibi",
                                        "ALiBi attention runs through PyTorch SDPA")
        return (None, why) if o is None else (o.reshape(S * qmax, c.query.shape[1], c.d), "")


@dataclass(frozen=True)
class _Call:
    """One attend call's operands and the cache geometry."""

    query: Tensor
    key: Optional[Tensor]
    value: Optional[Tensor]
    kv_cache: Tensor
    block_tables: Tensor
    params: AttentionParams
    hkv: int
    group: int
    nb: int
    bs: int
    d: int

    @property
    def scale(self) -> float:
        return self.params.scale

    @property
    def causal(self) -> bool:
        return self.params.causal

    @property
    def window(self) -> int:
        return self.params.window

    @property
    def chunk(self) -> int:
        return self.params.chunk

    @property
    def local(self) -> str:
        """`` (window w, chunk c)`` as far as the site has them, for messages."""
        parts = [f"window {self.window}"] * bool(self.window) + [f"chunk {self.chunk}"] * bool(self.chunk)
        return f" ({', '.join(parts)})" if parts else ""

    @property
    def shape_key(self) -> tuple:
        # the layers of one step share its plan: what a group's bias depends on keeps their biases apart
        return (self.window, self.chunk, self.hkv, self.group, self.d, self.query.dtype)


# fp32 scores ([S, Hq, Qmax, Lp]) and K/V ([S, Hkv, Lp, D] each) one exact-math call may hold
_MATH_BUDGET_BYTES = 512 << 20


def _math_batches(c: _Call, g: _Group) -> list[_Group]:
    """``g`` itself when its padded fp32 scores and K/V fit ``_MATH_BUDGET_BYTES``, else its sequences in
    batches that do (a sequence too large alone is a batch of its own), shortest queries first so that
    decodes are not padded to a prefill's length. Once per step and layout."""
    key = ("math_batches", c.query.shape[1], c.hkv, c.d, c.bs, c.window, c.chunk)
    if key not in g.cache:
        hq, bs = c.query.shape[1], c.bs
        firsts = _first_blocks(c, g)

        def score_bytes(idx):
            lp = max((-(-g.kv_lens[i] // bs) - firsts[i]) * bs for i in idx)
            return 4 * len(idx) * lp * (hq * max(g.q_lens[i] for i in idx) + 2 * c.hkv * c.d)

        everything = list(range(len(g.seqs)))
        batches = [[]]
        if score_bytes(everything) > _MATH_BUDGET_BYTES:
            for i in sorted(everything, key=lambda i: (g.q_lens[i], g.kv_lens[i])):
                if batches[-1] and score_bytes(batches[-1] + [i]) > _MATH_BUDGET_BYTES:
                    batches.append([])
                batches[-1].append(i)
        g.cache[key] = [g] if len(batches[0]) in (0, len(g.seqs)) else \
            [_subgroup(g, idx, c.query.device) for idx in batches]
    return g.cache[key]


def _subgroup(g: _Group, idx: list[int], device) -> _Group:
    sub = _Group(g.kind, [g.seqs[i] for i in idx], [g.starts[i] for i in idx], [g.q_lens[i] for i in idx],
                 [g.kv_lens[i] for i in idx])
    sub.rows = _row_index(sub, device)
    return sub


def _cached_pad_plan(c: _Call, g: _Group) -> dict:
    key = ("pad", c.window, c.chunk, c.causal)
    if key not in g.cache:
        g.cache[key] = _pad_plan(c, g)
    return g.cache[key]


def _gather_padded(c: _Call, p: dict) -> tuple[Tensor, Tensor, Tensor]:
    """Queries ``[S, Qmax, Hq, D]`` (zero rows as padding) and K/V ``[S, Lp, Hkv, D]`` gathered from the cache."""
    S, qmax, lp, hq = p["S"], p["qmax"], p["lp"], c.query.shape[1]
    q = c.query.new_zeros((S * qmax, hq, c.d))
    q.index_copy_(0, p["q_dst"], _take(c.query, p["rows"]))
    blocks = p["blocks"].flatten()  # [S * nblk]
    k = c.kv_cache[0].index_select(0, blocks).view(S, lp, c.hkv, c.d)
    v = c.kv_cache[1].index_select(0, blocks).view(S, lp, c.hkv, c.d)
    return q.view(S, qmax, hq, c.d), k, v


def _first_blocks(c: _Call, g: _Group) -> list[int]:
    """Per sequence, the block holding the first key its first query can see (a window's or chunk's
    start; block 0 otherwise): the padded paths read each sequence's keys from there."""
    return [reference.earliest_visible_key(ctx, c.params) // c.bs for ctx in g.contexts]


def _pad_plan(c: _Call, g: _Group) -> dict:
    dev = c.query.device
    S = len(g.seqs)
    qmax = max(g.q_lens)
    firsts = _first_blocks(c, g)
    nblk = max(-(-L // c.bs) - f for L, f in zip(g.kv_lens, firsts))
    lp = nblk * c.bs
    first = torch.tensor(firsts, device=dev)[:, None]  # [S, 1]
    # columns past a table's end hold keys past the sequence's end (never present): any block will do
    cols = (first + torch.arange(nblk, device=dev)).clamp_(max=c.block_tables.shape[1] - 1)  # [S, nblk]
    tables = c.block_tables[torch.tensor(g.seqs, device=dev)[:, None], cols].long()
    q_dst = torch.tensor([s * qmax + j for s, n in enumerate(g.q_lens) for j in range(n)], device=dev)
    j = torch.arange(qmax, device=dev)
    q_pos = torch.tensor(g.contexts, device=dev)[:, None] + j[None]  # [S, Qmax]
    col = torch.arange(lp, device=dev)
    k_pos = first * c.bs + col[None]  # [S, Lp]: the gathered keys' positions
    present = k_pos < torch.tensor(g.kv_lens, device=dev)[:, None]  # [S, Lp]: keys of the sequence
    real = j[None, :] < torch.tensor(g.q_lens, device=dev)[:, None]  # [S, Qmax]
    # padded query rows see the first key in a kernel's bias (their output is dropped): no row is empty
    pad_rows = ~real[:, :, None] & (col == 0)[None, None, :]  # [S, Qmax, Lp]
    return {"S": S, "qmax": qmax, "lp": lp, "blocks": tables, "q_dst": q_dst, "rows": g.rows,
            "q_pos": q_pos, "k_pos": k_pos, "present": present, "pad_rows": pad_rows}


BACKEND = register_backend(XFormersCudaBackend())
