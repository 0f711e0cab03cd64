"""A paged attention kernel in Triton that reads the block tables itself and reads no value on the host.

The attention a captured decode step binds (:class:`~pagedattn.backends.static_paged.StaticPagedBackend`) on CUDA,
where the kernel applies (:func:`usable`). The portable static attention gathers each token's whole block-table
row and runs a masked dense attention over it: on an H100 that took 1.46 ms of a 64-sequence decode step whose KV
reads need 0.26 ms, in a step of 68 launches a layer (``benchmarks/RESULTS.md``, issue 17). Here one launch attends every
token, and a second one merges the splits (plus one for the cache write, :func:`write`):

- grid ``(tokens, KV heads, splits)``: a program takes one token, one KV head with all its query heads (K/V are read
  once per KV head, not once per query head) and one split of the token's block-table row (flash-decoding: long
  rows are cut so that a small batch still fills the GPU);
- a program finds its token's sequence and position from ``query_start_loc`` and ``seq_lens`` itself, reads only
  the keys it may see (``[first visible, last visible]``: the sequence's length, the causal bound, a window or
  chunk) in tiles of 64 keys (:func:`key_tile`), each key's block looked up in the table, so that a tile's loads are
  in flight together, and keeps an online softmax (running maximum and sum) in float32. Products run on the tensor
  cores in TF32 where the inputs hold 16-bit values (exact products, float32 sums; the probabilities round to
  TF32), in IEEE float32 for float32 inputs (:func:`tf32_exact`);
- a step with more tokens than sequences (prefills, mixed steps: :func:`queries_per_tile`) runs the tile kernel
  instead: a program takes up to ``TILE_ROWS`` query rows (consecutive tokens of one sequence, each with the KV
  head's query heads), so that each tile of K/V serves them all, every row with its own visible keys;
- the merge weighs the splits' partial sums by their maxima, with the sink logits (if any) in the normaliser.

Every shape follows from the input shapes (the split count from the table's width), so a CUDA graph captures it.
Semantics are :mod:`pagedattn.backends.reference`'s: scale, soft-cap, ALiBi, causal / window / chunk visibility,
bidirectional attention over the sequence's keys, sinks, grouped-query heads; a token that sees no key, and a
padding token, gets zeros. Position programs are not covered (:func:`usable` says so): they keep the static path.

Triton is imported on first use. In a process started with ``TRITON_INTERPRET=1`` the kernel runs in Triton's
interpreter on CPU tensors, which is how the tests check it without a GPU (``tests/backends/triton_cases.py``).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Optional

import torch
from torch import Tensor

from pagedattn.backends.metadata import AttentionMetadata
from pagedattn.backends.params import AttentionParams

log = logging.getLogger("pagedattn")

__all__ = ["available", "usable", "unusable_reasons", "attend", "variant", "write_variant", "split_plan", "write",
           "write_usable", "CheckedKernels", "AGREE", "key_tile", "tf32_exact", "queries_per_tile", "launch_plan", "TILE_ROWS",
           "MAX_HEAD_SIZE", "MAX_SPLITS", "TARGET_PROGRAMS"]

MAX_HEAD_SIZE = 256
MAX_SPLITS = 16  # a row of W blocks is cut into at most this many splits
TILE_ROWS = 64  # query rows (tokens x query heads of a KV head) a prefill program takes
TARGET_PROGRAMS = 1024  # ~8 per streaming multiprocessor of an H100 or H200 (132): loads in flight to hide latency
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_HALF = (torch.bfloat16, torch.float16)


def _interpret() -> bool:
    """Triton's interpreter is on (for the whole process: Triton reads it when it is imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _triton_version() -> Optional[str]:
    try:
        import triton
    except Exception:  # noqa: BLE001 - missing or broken: the static path serves
        return None
    return triton.__version__


def available(device: torch.device | str) -> bool:
    """Whether the kernel can run on ``device``: Triton importable, and a CUDA device (or any device under
    ``TRITON_INTERPRET=1``, Triton's interpreter)."""
    if _triton_version() is None:
        return False
    return torch.device(device).type == "cuda" or _interpret()


def unusable_reasons(query: Tensor, kv_cache: Tensor, params: AttentionParams) -> list[str]:
    """Why the kernel does not attend this call (empty: it does)."""
    reasons = []
    if not available(query.device):
        reasons.append("Triton is not installed" if _triton_version() is None else "not a CUDA device")
    if params.position_mod:
        reasons.append("a position program (the static path evaluates it)")
    if kv_cache.dim() != 5 or kv_cache.stride(-1) != 1 or query.stride(-1) != 1:
        reasons.append("head dimensions not contiguous")
        return reasons
    _, _, bs, hkv, d = kv_cache.shape
    if query.dtype not in _DTYPES or kv_cache.dtype not in _DTYPES:
        reasons.append(f"dtype {query.dtype}/{kv_cache.dtype}")
    if bs < 16 or bs & (bs - 1):
        reasons.append(f"block size {bs} (the kernel's tiles need a power of two >= 16)")
    if query.shape[-1] != d or d > MAX_HEAD_SIZE:
        reasons.append(f"head size {query.shape[-1]} over a cache of {d} (at most {MAX_HEAD_SIZE})")
    if query.shape[1] % hkv:
        reasons.append(f"{query.shape[1]} query heads over {hkv} KV heads")
    return reasons


def usable(query: Tensor, kv_cache: Tensor, params: AttentionParams) -> bool:
    """Whether :func:`attend` takes this call (see :func:`unusable_reasons`)."""
    return not unusable_reasons(query, kv_cache, params)


def variant(query: Tensor, kv_cache: Tensor, metadata: AttentionMetadata, params: AttentionParams) -> tuple:
    """What decides which kernel a call compiles and which of its branches run: dtypes, head sizes, query heads
    per KV head, the query tokens a program takes (:func:`queries_per_tile`), block size, the site's kinds of score
    terms and visibility, and how Triton specialises the integer arguments (a value of 1, a multiple of 16: each
    combination is compiled on its own)."""
    S, group = metadata.block_tables.shape[0], query.shape[1] // kv_cache.shape[3]
    bq, _, num_splits, per = launch_plan(query.shape[0], S, group, kv_cache.shape[3], metadata.block_tables.shape[1])
    ints = (S, group, per * kv_cache.shape[2], num_splits, params.window, params.chunk, *query.stride()[:2],
            *kv_cache.stride()[1:4], metadata.block_tables.stride(0))
    return (query.dtype, kv_cache.dtype, query.shape[-1], kv_cache.shape[-1], group, bq, kv_cache.shape[2],
            params.softcap > 0, params.alibi_slopes is not None, params.sinks is not None, params.causal,
            params.window > 0, params.chunk > 0, _pow2(S), _pow2(num_splits), _specialised(ints))


def write_variant(key: Tensor, value: Tensor, kv_cache: Tensor) -> tuple:
    """As :func:`variant`, for :func:`write`: dtypes, the cache's slot geometry, and the strides as Triton
    specialises them (those of the rows :func:`write` passes: contiguous copies where a token's are not)."""
    row = key.shape[1] * key.shape[2]
    ints = (key.stride(0) if key[0].is_contiguous() else row, value.stride(0) if value[0].is_contiguous() else row,
            *kv_cache.stride()[1:3], kv_cache.shape[2], row)
    return ("write", key.dtype, value.dtype, kv_cache.dtype, *kv_cache.shape[2:], _pow2(row), _specialised(ints))


def _specialised(ints: tuple) -> tuple:
    """How Triton specialises integer arguments: each compiled on its own when 1, or a multiple of 16."""
    return tuple((v == 1, v % 16 == 0) for v in ints)


def launch_plan(num_tokens: int, num_seqs: int, group: int, num_kv_heads: int, width: int,
                queries: Optional[int] = None, programs: int = TARGET_PROGRAMS) -> tuple[int, int, int, int]:
    """``(queries per program, programs along the tokens, splits, blocks per split)`` of :func:`attend` for a step
    of these shapes (``queries``: :func:`queries_per_tile` unless given): a token a program (the decode kernel), or
    tiles of queries, each sequence's tiles starting at a program of their own (``tokens // queries + sequences``
    programs hold every sequence's tiles)."""
    bq = queries or queries_per_tile(num_tokens, num_seqs, group)
    grid0 = num_tokens if bq == 1 else num_tokens // bq + num_seqs
    return (bq, grid0, *split_plan(width, grid0 * num_kv_heads, programs))


def split_plan(width: int, rows: int, programs: int = TARGET_PROGRAMS) -> tuple[int, int]:
    """``(splits, blocks per split)`` for block-table rows of ``width`` blocks attended by ``rows`` programs
    (tokens x KV heads): enough splits that about ``programs`` programs share the GPU, at most
    ``MAX_SPLITS`` and one block each at least, of equal size. Each split writes its partial output (float32, a
    head's size per query head), so a large batch takes few. Shapes only: a captured graph keeps it."""
    want = -(-programs // max(1, rows))
    splits = max(1, min(width, MAX_SPLITS, want))
    per = -(-width // splits)
    return -(-width // per), per


def key_tile(head_size: int, head_size_v: int) -> int:
    """Keys a program takes per step of its loop: 64, or 32 where a head is over 128 wide (the tile's K and V
    stay in registers)."""
    return 64 if max(head_size, head_size_v) <= 128 else 32


def tf32_exact(query: Tensor, kv_cache: Tensor) -> bool:
    """Whether the kernel's products run in TF32 on the tensor cores: query and cache hold float16 or bfloat16
    values, which TF32 holds exactly (10 stored mantissa bits, float32's exponents), so the scores' products are
    exact and only the probabilities round, below a 16-bit output's own rounding. Else IEEE float32."""
    return query.dtype in _HALF and kv_cache.dtype in _HALF


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _kernels():
    from pagedattn.backends import triton_kernels  # imports Triton

    return triton_kernels


def write_usable(key: Tensor, value: Tensor, kv_cache: Tensor) -> bool:
    """Whether :func:`write` takes these tensors: the kernel runs here, a cache ``[2, nb, bs, Hkv, D]`` whose
    slots are contiguous rows (every head), K and V of the cache's head sizes."""
    return (available(kv_cache.device) and kv_cache.dim() == 5 and key.dim() == 3 and value.dim() == 3
            and kv_cache.dtype in _DTYPES and key.dtype in _DTYPES and value.dtype in _DTYPES
            and kv_cache[0, 0].is_contiguous() and kv_cache.shape[-1] == key.shape[-1] == value.shape[-1]
            and kv_cache.shape[3] == key.shape[1] == value.shape[1])


def write(key: Tensor, value: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write ``key``/``value`` ``[T, Hkv, D]`` into ``kv_cache`` at ``slot_mapping`` ``[T]`` (-1: padding, not
    written), one launch, no value read on the host. Call only where :func:`write_usable` holds."""
    T = key.shape[0]
    if not T:
        return
    key = key if key[0].is_contiguous() else key.contiguous()
    value = value if value[0].is_contiguous() else value.contiguous()
    slot_mapping = slot_mapping.contiguous()  # the kernel reads element t at offset t
    k, v = kv_cache[0], kv_cache[1]
    row = key.shape[1] * key.shape[2]
    _kernels().write_slots[(T,)](key, value, k, v, slot_mapping, key.stride(0), value.stride(0), k.stride(0),
                                 k.stride(1), v.stride(0), v.stride(1), kv_cache.shape[2], row, BLOCK=_pow2(row))


def queries_per_tile(num_tokens: int, num_seqs: int, group: int) -> int:
    """Query tokens a program of :func:`attend` takes: 1 in a step of at most one token per sequence (a decode
    step: the decode kernel, a token's query heads per program), else ``TILE_ROWS // group`` (prefills and mixed
    steps: the tile kernel, so that a tile of K/V serves that many queries). Shapes only: a captured graph keeps
    it."""
    return 1 if num_tokens <= num_seqs else max(1, TILE_ROWS // group)


def attend(query: Tensor, kv_cache: Tensor, metadata: AttentionMetadata, params: AttentionParams, *,
           tile: Optional[int] = None, num_warps: int = 4, programs: int = TARGET_PROGRAMS,
           queries: Optional[int] = None) -> Tensor:
    """Every token of ``query`` ``[T, Hq, D]`` over its sequence's cached keys (its own K/V already written):
    ``[T, Hq, Dv]`` in the query's dtype; padding tokens and tokens that see no key get zeros. Two launches: the
    splits (each program finds its tokens' sequence and visible keys from ``query_start_loc`` and ``seq_lens``),
    then their merge. Call only where :func:`usable` holds. ``tile`` (keys per loop step, a power of two >= 16;
    default :func:`key_tile`), ``num_warps``, ``programs`` (:func:`split_plan`) and ``queries`` (query tokens per
    program; default :func:`queries_per_tile`) are for tests and benchmarks' sweeps: the captured step's backend
    keeps the defaults, which :func:`variant` describes."""
    T, hq, d = query.shape
    _, _, bs, hkv, dv = kv_cache.shape
    dev = query.device
    # the kernel reads the lengths and starts at offsets i, a table row at its stride and its blocks at offsets b
    qsl, seq_lens = metadata.query_start_loc.contiguous(), metadata.seq_lens.contiguous()
    tables = metadata.block_tables
    S = tables.shape[0]
    out = torch.empty((T, hq, dv), dtype=query.dtype, device=dev)
    if T == 0 or S == 0:
        return out.zero_()
    if tables.stride(-1) != 1:
        tables = tables.contiguous()
    group = hq // hkv
    bq, grid0, num_splits, per = launch_plan(T, S, group, hkv, tables.shape[1], queries, programs)
    o_part = torch.empty((T, hq, num_splits, dv), dtype=torch.float32, device=dev)
    m_part = torch.empty((T, hq, num_splits), dtype=torch.float32, device=dev)
    l_part = torch.empty((T, hq, num_splits), dtype=torch.float32, device=dev)
    slopes, sinks = params.alibi_slopes, params.sinks
    k, v = kv_cache[0], kv_cache[1]
    kernels = _kernels()
    args = (query, k, v, tables, qsl, seq_lens,
            o_part if slopes is None else slopes.to(dev, torch.float32).contiguous(), o_part, m_part, l_part,
            query.stride(0), query.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
            v.stride(2), tables.stride(0), S, group, d, dv, per * bs, num_splits, float(params.scale),
            float(params.softcap), params.window if params.causal else 0, params.chunk if params.causal else 0)
    common = dict(BS=bs, KT=tile or key_tile(d, dv), D_PAD=max(16, _pow2(d)), DV_PAD=max(16, _pow2(dv)),
                  S_PAD=_pow2(S), CAUSAL=bool(params.causal), HAS_SOFTCAP=params.softcap > 0,
                  HAS_ALIBI=slopes is not None, TF32=tf32_exact(query, kv_cache), num_warps=num_warps)
    if bq == 1:
        kernels.paged_split[(T, hkv, num_splits)](*args, G_PAD=max(16, _pow2(group)), **common)
    else:
        kernels.paged_tiles[(grid0, hkv, num_splits)](*args, BQ=bq, R=max(16, _pow2(bq * group)), **common)
    kernels.merge_splits[(T, hq)](
        o_part, m_part, l_part, m_part if sinks is None else sinks.to(dev, torch.float32).contiguous(), out, qsl, S,
        out.stride(0), out.stride(1), num_splits, dv, NS_PAD=_pow2(num_splits), DV_PAD=_pow2(dv),
        HAS_SINKS=sinks is not None)
    return out


# how far the kernel's output may be from the portable path's on its first call of a kind, per unit of the outputs'
# largest magnitude (float32 math in the kernel; the portable paths round probabilities to the operands' dtype): a
# kernel compiled wrong is off by far more
AGREE = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 1e-2}


class CheckedKernels:
    """This module's kernels behind a backend, each kind of call (:func:`variant`, :func:`write_variant`) used once
    its first call agreed with the backend's portable path, checked eagerly: a kernel that a Triton or driver
    version compiles wrong, or that fails to compile or launch, is logged and not used again for that kind, so it
    costs speed, not answers. A kind first met while a CUDA graph is being captured (no host read possible) is not
    tried: the portable path serves it."""

    def __init__(self):
        self.verdicts: dict[tuple, bool] = {}  # kind -> the kernel agreed on it

    def attend(self, query: Tensor, kv_cache: Tensor, metadata: AttentionMetadata, params: AttentionParams,
               portable) -> Tensor:
        """:func:`attend` where it applies and its kind agreed, else ``portable()``."""
        if not usable(query, kv_cache, params):
            return portable()
        kind = variant(query, kv_cache, metadata, params)
        verdict = self.verdicts.get(kind)
        if verdict:
            return attend(query, kv_cache, metadata, params)
        if verdict is not None or _capturing(query.device):
            return portable()
        want, got = portable(), []
        if self._first_call(kind, lambda: got.append(attend(query, kv_cache, metadata, params))):
            diff, size = ((float((got[0].float() - want.float()).abs().max()), float(want.float().abs().max()))
                          if want.numel() else (0.0, 0.0))
            # relative to the outputs' size: bf16's rounding grows with the values
            if self._judge(kind, diff <= AGREE[query.dtype] * max(1.0, size), f"differs from the portable path by "
                                                                              f"{diff:.3g}"):
                return got[0]
        return want

    def write(self, key: Tensor, value: Tensor, kv_cache: Tensor, slot_mapping: Tensor, portable) -> None:
        """:func:`write` where it applies and its kind agreed (its first call's rows read back: exactly those
        given), else ``portable()``."""
        if not write_usable(key, value, kv_cache):
            return portable()
        kind = write_variant(key, value, kv_cache)
        verdict = self.verdicts.get(kind)
        if verdict:
            return write(key, value, kv_cache, slot_mapping)
        if verdict is None and not _capturing(kv_cache.device) and \
                self._first_call(kind, lambda: write(key, value, kv_cache, slot_mapping)):
            _, nb, bs, hkv, d = kv_cache.shape
            slots = slot_mapping.long()
            real = slots >= 0
            stored = kv_cache.view(2, nb * bs, hkv, d)[:, slots[real]]  # [2, n, Hkv, D]
            if self._judge(kind, torch.equal(stored[0], key[real].to(kv_cache.dtype))
                           and torch.equal(stored[1], value[real].to(kv_cache.dtype)),
                           "stored other values than it was given"):
                return None
        return portable()  # the portable write stores the step (over what the kernel stored, if it ran)

    def _first_call(self, kind: tuple, run) -> bool:
        """Run a kernel on the first call of its kind, eagerly, for the caller to judge its result; False when it
        does not compile or launch here."""
        try:
            run()
        except Exception as e:  # noqa: BLE001 - whatever the kernel trips on, the portable path serves
            return self._judge(kind, False, f"failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
        return True

    def _judge(self, kind: tuple, ok: bool, why: str) -> bool:
        self.verdicts[kind] = ok
        if not ok:
            log.warning("pagedattn: the Triton kernel %s on %s: this process uses the portable path for such calls",
                        why, kind)
        return ok


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
