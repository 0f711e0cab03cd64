"""Paged attention on CPU: the native kernels where they apply, the rest through ``scaled_dot_product_attention``.

Decodes (one query per sequence) whose visible keys are one run go to :mod:`pagedattn.backends.native`'s decode
kernel, which reads the blocks in place; it also writes the cache. Prefills without a bias, cap, sinks, chunks or
position program go to its prefill kernel: a step's fresh prompts in one call over the step's own keys, a chunk
after cached keys over its gathered blocks; in bfloat16 on a CPU with AMX tiles, long fresh prompts and causal chunks
after many cached keys go to SDPA's flash kernel instead (:func:`sdpa_prefill_pays`, :func:`sdpa_chunk_pays`).
Where the kernels are not built (no C compiler) or turned off (``PAGEDATTN_NATIVE=0``), decodes take the
flash-decoding path below (gathered blocks, SDPA's flash kernel) and prefills SDPA's own.

Cache layout: ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (K then V). A gather of
whole blocks is a run of contiguous copies, and ``[B, L, Hkv, D]`` transposed to ``[B, Hkv, L, D]``
is a strided view SDPA reads directly.

GQA never repeats K/V: the ``G = Hq / Hkv`` query heads that share a KV head are folded into the
query-length dimension (``[Hkv, G * Q, D]``) and the mask is tiled to match.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import weakref
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedattn.backends import native, position_mod, reference
from pagedattn.backends.base import SplitKVBackend, register_backend
from pagedattn.backends.metadata import AttentionMetadata
from pagedattn.backends.params import AttentionParams

_SDPA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class _Seq(NamedTuple):  # a tuple: a decode step's first call makes one per sequence (a frozen dataclass costs ~5x)
    index: int
    start: int  # first query row
    q_len: int
    kv_len: int

    @property
    def context_len(self) -> int:
        return self.kv_len - self.q_len


@dataclass(frozen=True)
class _Split:
    """A call's sequences by how they are attended: decodes (one query), prefills with no cached keys
    (``fresh``: their keys are the call's ``key``/``value``), and the rest (chunks over cached keys)."""

    single: tuple[_Seq, ...]
    fresh: tuple[_Seq, ...]
    rest: tuple[_Seq, ...]
    single_key: tuple  # the decodes, as the decode plan's memo key
    # [len(fresh), 6]: the fresh prefills as native.prefill's items; None without any (a decode step: no tensor op)
    fresh_items: Optional[Tensor] = field(compare=False)


def _plan(query_start_loc: Tensor, seq_lens: Tensor, has_key: bool) -> _Split:
    """The call's sequences, memoised by the metadata tensors (same objects, unchanged): every layer of a
    step passes the same ones, and at decode sizes reading them on the host costs about what a layer's
    attention does."""
    memo = _LOCAL.__dict__.setdefault("splits", [])
    versions = (query_start_loc._version, seq_lens._version)
    for qsl, lens, seen, key, split in memo:
        if qsl is query_start_loc and lens is seq_lens and seen == versions and key == has_key:
            return split
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    seqs = [_Seq(i, qsl[i], qsl[i + 1] - qsl[i], lens[i]) for i in range(len(lens))]
    single = tuple(s for s in seqs if s.q_len == 1)
    fresh = tuple(s for s in seqs if has_key and s.q_len > 1 and s.kv_len == s.q_len)
    fresh_ids = {s.index for s in fresh}
    rest = tuple(s for s in seqs if s.q_len > 1 and s.index not in fresh_ids)
    items = _fresh_items(fresh) if fresh else None
    split = _Split(single, fresh, rest, tuple((s.index, s.start, s.q_len, s.kv_len) for s in single), items)
    memo.insert(0, (query_start_loc, seq_lens, versions, has_key, split))
    del memo[_MEMO_TABLES:]
    return split


def _fresh_items(fresh) -> Tensor:
    """Fresh prefills as ``native.prefill``'s items ``[n, 6]``: their queries over their own keys, from the first."""
    return torch.tensor([(s.start, s.q_len, 0, s.start, s.q_len, 0) for s in fresh], dtype=torch.int64)


def _fold_gqa(q: Tensor, num_kv_heads: int) -> Tensor:
    # [..., Hq, Q, D] -> [..., Hkv, G * Q, D]
    *lead, hq, qlen, d = q.shape
    return q.reshape(*lead, num_kv_heads, (hq // num_kv_heads) * qlen, d)


def _unfold_gqa(o: Tensor, num_heads: int) -> Tensor:
    # [..., Hkv, G * Q, Dv] -> [..., Hq, Q, Dv]
    *lead, hkv, gq, dv = o.shape
    return o.reshape(*lead, num_heads, gq // (num_heads // hkv), dv)


def _folded_mask(q_pos: Tensor, k_pos: Tensor, params: AttentionParams, group: int) -> Optional[Tensor]:
    """The reference's mask (and ALiBi bias) for folded queries: boolean ``[G*Q, L]`` or additive
    float ``[Hkv, G*Q, L]``; None when every key is visible and there is no bias."""
    allowed = reference.visible(q_pos, k_pos, params)  # [Q, L]
    if params.alibi_slopes is None:
        if allowed is None:
            return None
        return allowed.tile(group, 1) if group > 1 else allowed
    bias = reference.alibi_bias(params.alibi_slopes, q_pos, k_pos)  # [Hq, Q, L]
    if allowed is not None:
        bias = bias.masked_fill(~allowed, float("-inf"))
    return bias.reshape(params.num_kv_heads, group * q_pos.shape[-1], k_pos.shape[-1])


def _with_sinks(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: float, sinks: Tensor,
                num_heads: int) -> Tensor:
    """Folded attention with per-head sink logits -> ``[..., Hq, Q, Dv]``.

    A sink joins the normalisation only: ``out * e^lse / (e^lse + e^sink) = out * sigmoid(lse - sink)``.
    """
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    if mask is not None:
        mask = mask.to(q.dtype)
        while mask.dim() < q.dim():
            mask = mask[None]
    o, lse = _partial_attention(q, k, v, mask, scale, 0.0)  # [..., Hkv, G*Q, Dv], [..., Hkv, G*Q]
    o, lse = _unfold_gqa(o, num_heads), _unfold_gqa(lse[..., None], num_heads)  # [..., Hq, Q, Dv], [..., Hq, Q, 1]
    return (o.float() * torch.sigmoid(lse - sinks.float()[:, None, None])).to(q.dtype)


# ------------------------------------------------------------------------ backend


# what the C++ stand-ins of the paged ops do in this class's place (native_ops): an instance that replaces any of
# them keeps the Python path
_NATIVE_PATH = ("write", "attend", "prepare_write", "prepare_attend", "check_write", "check_attend", "cache_geometry",
                "stored_head_size", "write_checks_slots")


class SdpaCpuBackend(SplitKVBackend):
    name = "sdpa_cpu"
    device_type = "cpu"
    dtypes = _SDPA_DTYPES
    prepares_calls = True

    # --- the cache

    def write(self, key, value, kv_cache, slot_mapping):
        # the native kernel's write: one call, where the generic one costs a host sync and two index_copy_
        lib = native.library()
        if lib is None or not native.write(lib, key, value, kv_cache, slot_mapping):
            super().write(key, value, kv_cache, slot_mapping)

    def native_ops_stand_in(self) -> bool:
        # this class's own methods, its native kernels: what the C++ stand-ins do
        return type(self) is SdpaCpuBackend and not any(map(self._overridden, _NATIVE_PATH)) and \
            native.library() is not None

    def write_checks_slots(self, key, value, kv_cache, slot_mapping) -> bool:
        # the native write reads every slot before it writes any
        return self._native_write_lib(key, value, kv_cache, slot_mapping) is not None

    def _native_write_lib(self, key, value, kv_cache, slot_mapping):
        """The native library where this class's own write runs these tensors natively as they are, else None."""
        lib = native.library()
        if lib is None or self._overridden("write") or not native.write_usable(key, value, kv_cache, slot_mapping):
            return None
        return lib

    def _overridden(self, name: str) -> bool:
        """Whether ``name`` is not this class's own (a subclass's or an instance's): calls prepared from this class's
        code would bypass it."""
        return name in vars(self) or getattr(type(self), name) is not getattr(SdpaCpuBackend, name)

    def prepare_write(self, key, value, kv_cache, slot_mapping):
        lib = self._native_write_lib(key, value, kv_cache, slot_mapping)
        return None if lib is None else functools.partial(native.write, lib, slot_mapping=slot_mapping, checked=True)

    def prepare_attend(self, query, key, kv_cache, metadata: AttentionMetadata, params: AttentionParams):
        # a decode-only step (every sequence one new token) where the native kernel runs it: one kernel call a
        # layer, its plan made once for the step
        if self._overridden("attend"):
            return None
        split = _plan(metadata.query_start_loc, metadata.seq_lens, key is not None)
        if split.fresh or split.rest or not split.single:
            return None
        found = _native_call(query, kv_cache, metadata.block_tables, split, params)
        if found is None:
            return None
        every_row = len(split.single) == query.shape[0]  # the kernel writes every row: none left to zero
        shape = (query.shape[0], query.shape[1], kv_cache.shape[-1])

        def run(query, key, value, kv_cache):
            out = query.new_empty(shape) if every_row else query.new_zeros(shape)
            found.run(out, query, kv_cache, params)
            return out

        return run

    def warm_step_sizes(self, max_num_tokens: int, dtype: torch.dtype) -> tuple[int, ...]:
        """oneDNN builds a GEMM for each new number of rows: a compiled step's bfloat16 and float16 linears of more
        than 64 rows reach it padded to ``cpu_linear.onednn_rows``' sizes, each built once here (llama16m bf16 on a
        2-vCPU Xeon with AMX: 32 sizes up to 1024 tokens in ~0.8-0.9 s; its prefill and mixed steps ~30 % faster)."""
        from pagedattn.backends import cpu_linear  # it imports the native ops, which import this module's package

        packs = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}.get(dtype)
        # Inductor packs such linears for oneDNN only where the CPU has its GEMMs (else they run as float32 matmuls)
        if packs is None or not torch.backends.mkldnn.is_available() or not getattr(torch.ops.mkldnn, packs)():
            return ()
        return tuple(sorted({cpu_linear.onednn_rows(m) for m in range(65, max_num_tokens + 1)}))

    def argmax_rows(self, logits: Tensor) -> list[int]:
        # the native kernel's: ATen's CPU argmax costs ~8x its max (~40 us a decode step's [32, 4096] logits)
        lib = native.library()
        found = native.argmax_rows(lib, logits) if lib is not None else None
        return found if found is not None else super().argmax_rows(logits)

    def argmax_writer(self, out: Tensor):
        # the kernel bound once: right after a step, the call with its checks took ~3x the kernel (52 against ~18 us,
        # llama16m bf16 on a 2-core EPYC), each piece of Python slow with the interpreter's data out of cache; logits
        # it cannot read go to torch's argmax
        lib = native.library()
        fallback = super().argmax_writer(out)
        return native.ArgmaxWriter(lib, out, fallback) if lib is not None and native.ArgmaxWriter.takes(out) \
            else fallback

    # --- attention

    def attend(self, query, key, value, kv_cache, metadata: AttentionMetadata, params: AttentionParams):
        split = _plan(metadata.query_start_loc, metadata.seq_lens, key is not None)
        out = query.new_zeros((query.shape[0], query.shape[1], kv_cache.shape[-1]))
        # a position program's prefills take the native kernel where it reads positions through their distance alone
        # (its term by distance), else the reference's math, one sequence at a time (rows it hides entirely give
        # zeros, as the reference defines); its decodes the native kernel with its term per score
        if split.single:
            self._decode(out, query, kv_cache, metadata.block_tables, split, params, fixed=key is None)
        fresh, rest = split.fresh, split.rest
        # a mask-only program's masks, the same at every layer of the step (_mask_runs)
        masks = _step_plans(metadata.block_tables) if params.position_mod and (fresh or rest) else None
        lib = _native_prefill_lib(query, kv_cache, params) if fresh or rest else None
        if lib is not None and fresh and native.prefill_usable(query, key, value, params.num_kv_heads):
            by_sdpa = tuple(s for s in fresh if sdpa_prefill_pays(query.dtype, s.q_len, params))
            items = split.fresh_items
            if by_sdpa:  # long prompts below, through SDPA's kernel; the others in one native call
                fresh = tuple(s for s in fresh if s not in by_sdpa)
                items = _fresh_items(fresh)
            if fresh:
                _prefill(lib, out, query, key, value, items, params)
            fresh = by_sdpa
        for s in fresh:
            k = key[s.start:s.start + s.q_len].transpose(0, 1)  # [Hkv, L, D]
            v = value[s.start:s.start + s.q_len].transpose(0, 1)
            self._one(out, query, s, k, v, 0, params, masks)
        if rest and lib is not None:
            rest = _rest_native(lib, out, query, kv_cache, metadata.block_tables, rest, params)
        for s in rest:
            k0, k, v = self._gather_one(kv_cache, metadata.block_tables[s.index], s, params)
            k, v = k.transpose(0, 1), v.transpose(0, 1)  # [L, Hkv, D]
            if lib is not None and native.prefill_usable(query, k, v, params.num_kv_heads):
                if k0 == 0 and s.context_len and params.causal and sdpa_chunk_pays(query.dtype, s.q_len, s.kv_len,
                                                                                   params):
                    _chunk_by_sdpa(out, query, s, k, v, params.scale)
                    continue
                _prefill(lib, out, query, k, v, torch.tensor([(s.start, s.q_len, s.context_len, 0, len(k), k0)]),
                         params)
            else:
                self._one(out, query, s, k.transpose(0, 1), v.transpose(0, 1), k0, params, masks)
        return out

    @staticmethod
    def _gather_one(kv_cache: Tensor, table: Tensor, s: _Seq,
                    params: AttentionParams) -> tuple[int, Tensor, Tensor]:
        """The sequence's keys from the block holding the first one its first query can see (a window's
        or chunk's start; block 0 otherwise) to its end: ``(position of the first, K, V [Hkv, L, D])``."""
        bs = kv_cache.shape[2]
        first = reference.earliest_visible_key(s.context_len, params) // bs
        blocks = _cache_blocks(table[first:-(-s.kv_len // bs)].long(), kv_cache.shape[1])
        k0 = first * bs
        k = kv_cache[0].index_select(0, blocks).flatten(0, 1)[:s.kv_len - k0]  # [L, Hkv, D]
        v = kv_cache[1].index_select(0, blocks).flatten(0, 1)[:s.kv_len - k0]
        return k0, k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, L, D]

    def _one(self, out, query, s: _Seq, k, v, k0: int, params: AttentionParams, masks: Optional[dict] = None):
        """One sequence's queries over its keys ``[Hkv, L, D]`` (positions ``k0`` on), one run of queries
        within a chunk at a time (the whole sequence without chunks): each run reads only the keys from
        the first one its first query can see (``reference.chunk_runs``, ``earliest_visible_key``).
        ``masks``: the step's memo of mask-only programs' masks (``_mask_runs``)."""
        for a, b in reference.chunk_runs(s.context_len, s.kv_len, params):
            lo = reference.earliest_visible_key(a, params)  # >= k0: the gather started at or before it
            rows = slice(s.start + a - s.context_len, s.start + b - s.context_len)
            self._run(out, query, rows, a, k[:, lo - k0:b - k0], v[:, lo - k0:b - k0], lo, params,
                      _seq_values(params, [s.index]), masks, s.kv_len)

    @staticmethod
    def _run(out, query, rows: slice, q0: int, k, v, k_first: int, params: AttentionParams,
             values: Optional[Tensor] = None, masks: Optional[dict] = None, seq_len: Optional[int] = None):
        """Queries ``rows`` (positions ``q0`` on) over keys ``[Hkv, L, D]`` (positions ``k_first`` on);
        ``values [1, count]``: the sequence's per-request values, for a program that reads some; ``masks``: the
        step's memo of a mask-only program's masks and their runs of keys, which every layer shares; ``seq_len``:
        the sequence's length, what a program reads as such (None: the keys end with it; a run of queries within a
        chunk reads keys up to its own end only)."""
        q = query[rows].transpose(0, 1)[None]  # [1, Hq, Q, D]
        k, v = k[None], v[None]  # [1, Hkv, L, D]
        num_heads = q.shape[1]
        group = num_heads // params.num_kv_heads
        plain = params.alibi_slopes is None and params.softcap <= 0 and params.sinks is None and not params.position_mod
        q_pos = torch.arange(q0, q0 + q.shape[2], device=q.device)
        k_pos = torch.arange(k_first, k_first + k.shape[2], device=q.device)
        # every query's visible keys run from the first key up to itself, and the keys start at the first
        # query: SDPA's own (top-left) causal mask is the reference's
        last = q0 + q.shape[2] - 1
        top_left_causal = k_first == q0 and reference.earliest_visible_key(last, params) == k_first
        if plain and (not params.causal or top_left_causal):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=params.causal, scale=params.scale,
                                               enable_gqa=group > 1)  # [1, Hq, Q, Dv]
        elif params.position_mod and reference.mask_only(params):
            # a program's mask alone: the native kernel where each query sees one run of keys, else SDPA's with it
            allowed, runs = _mask_runs(q_pos, k_pos, params, num_heads, values, masks, seq_len)
            if runs is not None and _runs_by_native(out, query, rows, q_pos, k_pos, k[0], v[0], params, *runs):
                return
            if allowed is not None:
                allowed = allowed.expand(-1, q.shape[2], k.shape[2])
            o = reference.masked_sdpa(q, k, v, allowed, params.scale, group)
        elif params.softcap > 0 or params.position_mod:  # no SDPA kernel caps scores: the reference's exact math
            o = reference.dense_attention(q, k, v, params, q_pos[None], k_pos[None], values=values, seq_len=seq_len)
        else:
            mask = _folded_mask(q_pos, k_pos, params, group)
            qf = _fold_gqa(q, params.num_kv_heads)
            if params.sinks is None:
                if mask is not None and mask.dtype != torch.bool:
                    mask = mask.to(q.dtype)
                o = _unfold_gqa(F.scaled_dot_product_attention(qf, k, v, attn_mask=mask, scale=params.scale),
                                num_heads)
            else:
                o = _with_sinks(qf, k, v, mask, params.scale, params.sinks, num_heads)
        out[rows] = o[0].transpose(0, 1)

    def _decode(self, out, query, kv_cache, block_tables, split: _Split, params: AttentionParams,
                fixed: bool = False):
        # Flash-decoding on CPU. Each sequence's visible keys are cut into near-equal chunks;
        # chunks, longest first, form groups whose padded K+V fit _GATHER_BUDGET_BYTES. A group is
        # gathered by one index_select (K and V blocks together) into a reused workspace that stays
        # in cache, attended by one flash call (without a mask when every gathered key is visible),
        # and the chunks of a sequence are merged by their log-sum-exp. Index and mask tensors are
        # built once per step (the plan is memoised across the step's layers); a group only slices them.
        #
        # A chunk is one thread's share of a group: index_select and the flash kernel both split
        # their work into contiguous per-thread ranges (of blocks, and of (chunk, head) pairs), so
        # with equal chunks each thread attends to the keys it gathered itself, still in its own
        # cache. With one chunk per group the two splits cross and half of every read is remote
        # (up to ~40% slower at 1024-token contexts on a 2-core EPYC VM).
        #
        # ``fixed``: the call writes no K/V (cross-attention over blocks filled once per request). Between
        # admissions an encoder-decoder's decode steps read the same blocks of the same unchanged cache with
        # the same plan, so the gathered groups are kept (``_gathered``) instead of gathered again each step.
        #
        # Where the native kernel runs (``native``: it reads the blocks in place, one call per layer), every decode
        # goes to it instead (a position program's keys as an additive term: its bias, -inf where it hides a key).
        native_call = _native_call(query, kv_cache, block_tables, split, params)
        if native_call is not None:
            native_call.run(out, query, kv_cache, params)
            return
        plan = _decode_plan(kv_cache, block_tables, split, params, query.shape[1], query.dtype)
        if plan is None:
            return
        kept = _gathered(kv_cache, plan) if fixed else None
        _, nb, bs, _, d = kv_cache.shape
        dev = query.device
        num_heads, num_kv_heads = query.shape[1], params.num_kv_heads
        group = num_heads // num_kv_heads
        scale, softcap, sinks = params.scale, params.softcap, params.sinks
        bounds, masked, index, flat_cache, rows = plan.bounds, plan.masked, plan.index, plan.flat_cache, plan.rows
        rows_t, bias, num_items = plan.rows_t, plan.bias, len(plan.rows)
        kv_blocks = kv_cache.view(2 * nb, *kv_cache.shape[2:]) if flat_cache else None
        q_all = query.index_select(0, rows_t).view(num_items, num_kv_heads, group, d)  # [I, Hkv, G, D]
        outs, lses, off = [], [], 0
        for i, ((a, b, n), needs_mask) in enumerate(zip(bounds, masked)):
            g, span = b - a, n * bs
            fresh = kept is None or i >= len(kept.groups)
            if not fresh:
                ws = kept.groups[i]
            elif kept is not None:  # gathered once into a buffer of its own, read again by later steps
                with torch.inference_mode(False):  # an ordinary tensor: later calls may run outside inference mode
                    ws = kv_cache.new_empty((2 * g * n, *kv_cache.shape[2:]))
                kept.groups.append(ws)
            else:
                ws = _workspace(kv_cache, 2 * g * n)
            if flat_cache:
                if fresh:
                    torch.index_select(kv_blocks, 0, index[off:off + 2 * g * n], out=ws)
                off += 2 * g * n
                k, v = _kv_views(ws, g, span, 2 * span, 0, span)
            else:
                idx = index[off:off + g * n]
                off += g * n
                if fresh:
                    torch.index_select(kv_cache[0], 0, idx, out=ws[:g * n])
                    torch.index_select(kv_cache[1], 0, idx, out=ws[g * n:])
                k, v = _kv_views(ws, g, span, span, 0, g * span)
            mask = bias[a:b, ..., :span] if bias is not None and (needs_mask or plan.biased) else None
            o, lse = _partial_attention(q_all[a:b], k, v, mask, scale, softcap)  # [g, Hkv, G, Dv], [g, Hkv, G]
            if params.position_mod:  # a program may hide every key of a chunk: it adds nothing, not NaN
                o = o.masked_fill(~torch.isfinite(lse)[..., None], 0.0)
            outs.append(o)
            lses.append(lse)
        o = (torch.cat(outs) if len(outs) > 1 else outs[0]).reshape(num_items, num_heads, -1)  # [I, Hq, Dv]
        if num_items == len(set(rows)) and sinks is None:  # one chunk per sequence: nothing to merge
            out.index_copy_(0, rows_t, o.to(out.dtype))
            return
        lse = torch.cat(lses).reshape(num_items, num_heads)  # [I, Hq]
        m = torch.full((out.shape[0], num_heads), float("-inf"), device=dev).scatter_reduce_(
            0, rows_t[:, None].expand_as(lse), lse, "amax")
        if sinks is not None:  # the sink is one more chunk: its score, and no value
            m = torch.maximum(m, sinks.float()[None])
        w = torch.exp(lse - m[rows_t])  # [I, Hq]
        if params.position_mod:  # a query that sees no key at all gets zeros
            w = torch.nan_to_num(w, nan=0.0)
        num = torch.zeros(out.shape, dtype=torch.float32, device=dev).index_add_(0, rows_t, o.float() * w[..., None])
        den = torch.zeros(m.shape, device=dev).index_add_(0, rows_t, w)
        if sinks is not None:
            den += torch.exp(sinks.float()[None] - m)
        uniq = plan.uniq
        out.index_copy_(0, uniq, (num[uniq] / den[uniq, :, None].clamp_min(1e-30)).to(out.dtype))


def _build_decode_plan(kv_cache: Tensor, block_tables: Tensor, seqs: tuple[_Seq, ...], params: AttentionParams,
                       num_heads: int, dtype: torch.dtype) -> Optional["_DecodePlan"]:
    """What a decode call gathers and how it groups it (see ``SdpaCpuBackend._decode``); None: no keys."""
    _, nb, bs, _, d = kv_cache.shape
    dev = kv_cache.device
    num_kv_heads = params.num_kv_heads
    alibi_slopes = params.alibi_slopes
    block_bytes = 2 * bs * num_kv_heads * d * kv_cache.element_size()  # K and V
    budget = max(1, _GATHER_BUDGET_BYTES // block_bytes)  # blocks gathered per group
    chunk = max(1, budget // max(1, torch.get_num_threads()))  # blocks per chunk, at most
    spans = []  # (blocks, seq, first block, first visible key): a sequence's keys in equal chunks
    for s in seqs:
        lo = reference.earliest_visible_key(s.kv_len - 1, params)
        first = lo // bs
        total = -(-s.kv_len // bs) - first
        parts = -(-total // chunk)
        for j in range(parts):
            n = total // parts + (j < total % parts)
            spans.append((n, s, first, max(first * bs, lo)))
            first += n
    # longest first, so that chunks grouped together need little padding
    spans.sort(key=lambda t: -t[0])
    los, his, ends, firsts, sizes, seq_rows, rows = [], [], [], [], [], [], []
    for n, s, first, lo in spans:
        los.append(lo)  # visible keys [lo, hi) of blocks first .. first + n
        his.append(min((first + n) * bs, s.kv_len))
        ends.append(s.kv_len - 1)  # the query's position
        firsts.append(first)
        sizes.append(n)
        seq_rows.append(s.index)
        rows.append(s.start)
    if not los:
        return None
    bounds = _groups(tuple(sizes), budget, max(1, _GROUP_OVERHEAD_BYTES // block_bytes))
    padded = [n for a, b, n in bounds for _ in range(a, b)]
    # a group needs no mask when every key it gathers is visible to its query
    masked = [any(los[i] > firsts[i] * bs or his[i] < (firsts[i] + n) * bs for i in range(a, b))
              for a, b, n in bounds]

    n_max = max(padded)
    first_t = torch.tensor(firsts, device=dev)
    steps = torch.arange(n_max, device=dev)
    cols = (first_t[:, None] + steps).clamp_(max=block_tables.shape[1] - 1)
    blocks = block_tables[torch.tensor(seq_rows, device=dev)[:, None], cols].long()  # [I, n_max]
    keep = steps < torch.tensor(padded, device=dev)[:, None]  # [I, n_max]
    _cache_blocks(blocks[keep], nb)
    # one index per group, in [chunk, K|V, block] order, over the cache seen as 2 * nb blocks
    flat_cache = kv_cache.stride(0) == nb * kv_cache.stride(1)
    if flat_cache:
        index = torch.stack((blocks, blocks + nb), 1)[keep[:, None].expand(-1, 2, -1)]
    else:  # K and V are gathered separately: [K of every chunk, V of every chunk]
        index = blocks[keep]
    rows_t = torch.tensor(rows, device=dev)
    terms = present = None
    if alibi_slopes is not None or any(masked) or params.position_mod:
        k_pos = first_t[:, None] * bs + torch.arange(n_max * bs, device=dev)  # [I, Lp] absolute
        q_pos = torch.tensor(ends, device=dev)[:, None]  # [I, 1]
        present = k_pos < torch.tensor(his, device=dev)[:, None]  # gathered keys of this chunk that exist
        # the query's sequence holds ``ends + 1`` keys (what a position program reads as its length)
        terms = reference.position_terms(q_pos, k_pos, params, num_heads, q_pos[:, 0] + 1,
                                         _seq_values(params, seq_rows))  # [I, 1, Lp]
    plan = _DecodePlan(tuple(bounds), tuple(masked), index, flat_cache, tuple(rows), rows_t, None,
                       torch.tensor(sorted(set(rows)), device=dev),
                       alibi_slopes is not None or bool(params.position_mod), terms, present)
    if not _tensor_fields(params):  # the bias depends on nothing a layer holds: one for the whole step
        plan = dataclasses.replace(plan, bias=_plan_bias(plan, params, num_heads, dtype))
    return plan


@functools.lru_cache(maxsize=64)  # pure; a decode step's sizes change only when a sequence starts a block
def _groups(sizes: tuple[int, ...], budget: int, overhead: int) -> tuple[tuple[int, int, int], ...]:
    """Chunks of ``sizes`` blocks (longest first) grouped as ``(first chunk, end, blocks per chunk)``: a
    group gathers every chunk padded to its first (longest) one and holds at most ``budget`` blocks.

    Grouping minimises the blocks gathered plus ``overhead`` blocks per group (what one more gather and
    flash call cost, as bytes moved): one group for every chunk pads short sequences to the longest, a
    group per length pays the calls. Candidate groups start where the sizes change (a run of equal sizes is
    split only where the budget forces it, greedily); the choice over runs is ``O(runs^2)``, with at most
    ``_MAX_RUNS_BACK`` runs per candidate, and never costs more than the greedy grouping of all chunks.
    """
    runs = [i for i in range(len(sizes)) if i == 0 or sizes[i] != sizes[i - 1]] + [len(sizes)]
    m = len(runs) - 1

    def pieces(lo: int, hi: int) -> list[tuple[int, int, int]]:  # chunks lo..hi-1, split where the budget forces
        out = []
        while lo < hi:
            end = min(hi, lo + max(1, budget // sizes[lo]))
            out.append((lo, end, sizes[lo]))
            lo = end
        return out

    def cost(groups) -> int:
        return sum(overhead + (b - a) * n for a, b, n in groups)

    best, back = [0] + [None] * m, [0] * (m + 1)
    for b in range(1, m + 1):
        for a in range(max(0, b - _MAX_RUNS_BACK), b):
            c = best[a] + cost(pieces(runs[a], runs[b]))
            if best[b] is None or c < best[b]:
                best[b], back[b] = c, a
    cuts, b = [], m
    while b:
        cuts.append((runs[back[b]], runs[b]))
        b = back[b]
    bounds = [g for lo, hi in reversed(cuts) for g in pieces(lo, hi)]
    greedy = pieces(0, len(sizes))
    return tuple(bounds if cost(bounds) <= cost(greedy) else greedy)


def _plan_bias(plan: "_DecodePlan", params: AttentionParams, num_heads: int, dtype: torch.dtype) -> Optional[Tensor]:
    """The additive mask / bias ``[chunks, Hkv or 1, G or 1, keys]`` of a plan's chunks for one site."""
    if plan.terms is None:
        return None
    num_items, width = plan.present.shape
    vis, terms = reference.finish_terms(plan.terms, params)
    ok = plan.present if vis is None else plan.present & vis[:, 0]
    if terms is not None:  # [I, Hq|1, 1, Lp]
        heads, kv = terms.shape[1], params.num_kv_heads
        bias = terms.reshape(num_items, kv if heads > 1 else 1, num_heads // kv if heads > 1 else 1, width)
    else:
        bias = torch.zeros((num_items, 1, 1, width), device=ok.device)
    bias = bias.float().masked_fill(~ok[:, None, None, :], float("-inf"))
    return bias.to(dtype) if params.softcap <= 0 else bias


def _tensor_fields(params: AttentionParams) -> tuple:
    """The site's tensor parameters (ALiBi slopes, sinks, a program's tables): they differ per layer. A
    program's per-request values (``position_data``) are the step's, the same for every layer."""
    return tuple(f.name for f in dataclasses.fields(params)
                 if f.name != "position_data" and isinstance(getattr(params, f.name), Tensor))


def _seq_values(params: AttentionParams, seqs) -> Optional[Tensor]:
    """The per-request values ``[len(seqs), count]`` of some of the step's sequences (None: the program
    reads none)."""
    data = params.position_data
    if data is None:
        return None
    return data[list(seqs)] if len(seqs) != 1 else data[seqs[0]:seqs[0] + 1]


@dataclass(frozen=True)
class _DecodePlan:
    """A decode call's gathers and groups: fixed by the step's metadata, so the same for every layer."""

    bounds: tuple  # per group: (first chunk, end, blocks gathered per chunk)
    masked: tuple  # per group: whether it needs its mask
    index: Tensor  # blocks to gather, group after group
    flat_cache: bool  # K and V gathered by one index over the cache seen as 2 * num_blocks blocks
    rows: tuple  # each chunk's query row
    rows_t: Tensor
    bias: Optional[Tensor]  # [chunks, Hkv or 1, G or 1, keys] additive mask / bias (None: per site)
    uniq: Tensor  # the query rows, each once, sorted
    biased: bool = False  # the bias adds values (ALiBi, a position program): every group applies it
    terms: Optional[reference.PositionTerms] = None  # what positions decide, for the bias
    present: Optional[Tensor] = None  # [chunks, keys]: the gathered keys that exist


def _decode_plan(kv_cache: Tensor, block_tables: Tensor, split: _Split, params: AttentionParams,
                 num_heads: int, dtype: torch.dtype) -> Optional[_DecodePlan]:
    """``_build_decode_plan``, memoised for one step: every layer of a step passes the same block table
    tensor (unchanged) and sequences, and at decode sizes building the plan (Python and a dozen small
    index ops, a position program's arithmetic) costs about what the attention does. A site's tensor
    parameters (ALiBi slopes, a program's tables: they differ per layer) are applied per call, in
    :func:`_plan_bias`; the memo keys on which of them are set."""
    # the fields in declaration order (a frozen dataclass's __dict__ keeps it); dataclasses.fields() alone
    # cost ~40 us a call
    key = (split.single_key, _params_key(params), tuple(kv_cache.shape),
           kv_cache.stride()[:2], kv_cache.dtype, kv_cache.device, num_heads, dtype, torch.get_num_threads(),
           block_tables._version)
    plans = _step_plans(block_tables)
    plan = plans.get(key)
    if plan is None and key not in plans:
        plan = plans[key] = _build_decode_plan(kv_cache, block_tables, split.single, params, num_heads, dtype)
    if plan is not None and plan.bias is None and plan.terms is not None:
        plan = dataclasses.replace(plan, bias=_plan_bias(plan, params, num_heads, dtype))
    return plan


def _params_key(params: AttentionParams, values: bool = True) -> tuple:
    """What a step's memo keys on for a site's parameters: its fields in declaration order (a frozen dataclass's
    ``__dict__`` keeps it; ``dataclasses.fields()`` alone cost ~40 us a call), tensors only as set or not (they differ
    per layer, applied per call), and (``values``) the step's per-request values, which decide a program's mask."""
    fields = tuple(v is None if isinstance(v, Tensor) or v is None else v for v in vars(params).values())
    if values and params.position_data is not None:
        fields += (tuple(params.position_data.reshape(-1).tolist()),)
    return fields


class _NativeDecode(NamedTuple):
    """A step's decodes as one native kernel call a layer: the call, the int32 block tables it reads, and a position
    program's additive term ``[items, Hq or 1, keys]`` for this site (None without a program)."""

    call: native.DecodeCall
    tables: Tensor
    bias: Optional[Tensor]

    def run(self, out: Tensor, query: Tensor, kv_cache: Tensor, params: AttentionParams) -> None:
        # a program's term already holds ALiBi's (reference.finish_terms adds it)
        slopes = params.alibi_slopes if self.bias is None else None
        self.call(out, query, kv_cache, self.tables, params.scale, params.softcap, slopes, params.sinks, self.bias)


@dataclass(frozen=True)
class _NativeTerms:
    """What positions decide about a program's scores at a native call's items (the same for every layer): its
    position-only part pair by pair, or (a program read by distance) once over the distances the items span."""

    terms: Optional[reference.PositionTerms] = None  # pair by pair: [I, 1, W]
    present: Optional[Tensor] = None  # with terms, [items, keys]: the item's keys from its first visible one that exist
    by_distance: Optional[position_mod.Prepared] = None  # at k - q = -(G - 1) .. 0
    index: Optional[Tensor] = None  # [I, W]: where each item's key t lies among those distances


def _native_terms(rows: list, params: AttentionParams, num_heads: int, dev) -> _NativeTerms:
    """The program's position-only part at each item's keys ``[first, keys)``; ``rows`` as the call's items. A
    program that reads positions only through their distance (and not the sequence's length, which differs between
    items) is evaluated once at the distances the items span, and each item reads its keys' from there."""
    first = torch.tensor([r[2] for r in rows], device=dev)
    keys = torch.tensor([r[3] for r in rows], device=dev)
    width = max(1, max(r[3] - r[2] for r in rows))
    steps = torch.arange(width, device=dev)
    k_pos = first[:, None] + steps  # [I, W] absolute
    if _by_distance(params.position_mod) and not position_mod.reads_length(params.position_mod) \
            and params.alibi_slopes is None and dev.type == "cpu":
        # every key lies at or before its query, the sequence's last: entry t of a grid of G distances is
        # k - q = t - (G - 1); the grid's width rounded up, so that a run of steps shares one
        grid = -(-width // _DISTANCE_GRID) * _DISTANCE_GRID
        index = (k_pos - keys[:, None] + grid).clamp_(0, grid - 1)  # keys past an item's: never read by the kernel
        return _NativeTerms(by_distance=_distance_grid(params.position_mod, grid, num_heads), index=index)
    q_pos = (keys - 1)[:, None]  # [I, 1]: the query is the sequence's last key
    terms = reference.position_terms(q_pos, k_pos, params, num_heads, keys, _seq_values(params, [r[1] for r in rows]))
    return _NativeTerms(terms, k_pos < keys[:, None])


_DISTANCE_GRID = 256  # the distance grids' widths are multiples of this


@functools.lru_cache(maxsize=16)
def _distance_grid(text: str, width: int, num_heads: int) -> position_mod.Prepared:
    """A by-distance program's position-only part at distances ``-(width - 1) .. 0`` (a pure function of its
    arguments: the steps of a run share it; never changed by its readers)."""
    return position_mod.prepare_by_distance(text, torch.arange(1 - width, 1)[None], 1, num_heads)


def _additive(allowed: Optional[Tensor], bias: Optional[Tensor], rows: int, width: int) -> Tensor:
    """A kernel's additive term ``[rows, Hq or 1, width]`` float32: ``bias`` (zeros where None), ``-inf`` where
    ``allowed [rows, width]`` (None: everywhere) hides a key."""
    bias = torch.zeros((rows, 1, width)) if bias is None else bias.float()
    return bias if allowed is None else bias.masked_fill(~allowed[:, None], float("-inf"))


def _native_bias(found: _NativeTerms, params: AttentionParams) -> Tensor:
    """A site's additive term ``[items, Hq or 1, keys]`` float32 from the step's :class:`_NativeTerms`: the program's
    bias (and ALiBi's), ``-inf`` where the program, causality or the sequence's end hides a key."""
    if found.by_distance is not None:
        # a decode's keys are all visible but for a window's or chunk's, which its items' first keys leave out
        # already; the kernel reads no key past an item's last
        allowed, bias = position_mod.finish_by_distance(found.by_distance, params.position_tables)  # [1, G], [1, H|1, G]
        grid = _additive(allowed, bias, 1, found.by_distance.shape[3])
        return grid[0][:, found.index].transpose(0, 1).contiguous()  # [I, Hq|1, W]
    vis, bias = reference.finish_terms(found.terms, params)  # [I, 1, W] or None; [I, Hq|1, 1, W] or None
    ok = found.present if vis is None else found.present & vis[:, 0]
    return _additive(ok, None if bias is None else bias[:, :, 0], *ok.shape).contiguous()


def _native_call(query: Tensor, kv_cache: Tensor, block_tables: Tensor, split: _Split,
                 params: AttentionParams) -> Optional[_NativeDecode]:
    """The step's decodes as a native kernel call (memoised for the step, like the plan; a program's term per site,
    its position-only part memoised), or None where the kernel does not run them: not built here, turned off, or
    tensors it does not read as they are."""
    lib = native.library()
    if lib is None or not native.usable(query, kv_cache, params.num_kv_heads):
        return None
    threads = torch.get_num_threads()
    key = ("native", split.single_key, params.window, params.chunk, kv_cache.shape[2], threads,
           block_tables._version)
    plans = _step_plans(block_tables)
    found = plans.get(key)
    if found is None:
        if params.window or params.chunk:
            rows = [(s.start, s.index, reference.earliest_visible_key(s.kv_len - 1, params), s.kv_len)
                    for s in split.single]
        else:  # every key visible: the step's first call makes one row per sequence, at decode sizes its cost shows
            rows = [(s.start, s.index, 0, s.kv_len) for s in split.single]
        total = sum(keys - first for _, _, first, keys in rows)
        call = native.DecodeCall(lib, rows, native.part_keys(total, threads, kv_cache.shape[2]), threads)
        found = plans[key] = (call, block_tables.to(torch.int32).contiguous(), rows)
    call, tables, rows = found
    if not params.position_mod:
        return _NativeDecode(call, tables, None)
    bias_key = (key, _params_key(params), query.shape[1])
    bias = plans.get(bias_key)
    if bias is None:
        bias = plans[bias_key] = _native_terms(rows, params, query.shape[1], query.device)
    if isinstance(bias, _NativeTerms):
        bias = _native_bias(bias, params)
        if not _tensor_fields(params):  # the same term for every layer of the step
            plans[bias_key] = bias
    return _NativeDecode(call, tables, bias)


# Fresh prompts from this many tokens on go to SDPA's flash kernel rather than the native prefill kernel, in bfloat16
# where the CPU has AMX tiles: ATen's kernel then multiplies by tiles, the native one by AVX-512 pair products. On a
# Xeon with AMX (2 cores, llama16m's 6/2 heads of 64), whole prefill steps of one prompt against the native kernel:
# 1 x 700 tokens 33.1 -> 29.6 ms, 1 x 1000 48.5 -> 40.3, 2 x 512 38.0 -> 35.1; at 128-340 tokens SDPA was no faster
# or slower (its call per sequence, and the native kernel's one call for all) (benchmarks/RESULTS.md)
SDPA_PREFILL_TOKENS = 512
# Causal chunks after cached keys, each one native call or two SDPA calls (over the cached keys, over its own): one
# layer's write and attention, bf16, same Xeon: 64 queries after 2,048 keys 2.69 -> 1.87 ms, 128 after 3,000 5.90 ->
# 3.39, 256 after 1,024 4.33 -> 3.04; 128 after 512 1.48 -> 1.31 (left native), 200 after 300 1.69 -> 2.06
SDPA_CHUNK_TOKENS = 64
SDPA_CHUNK_WORK = 1 << 17  # query-key pairs


@functools.cache  # a fact about this machine
def _amx_tiles() -> bool:
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe is not None and probe())


def sdpa_prefill_pays(dtype: torch.dtype, tokens: int, params: AttentionParams) -> bool:
    """Whether a fresh prompt of ``tokens`` (every key its own, visible from the first: no window; no position program,
    which SDPA's kernel does not take) runs faster through SDPA's kernel than through the step's one native prefill
    call on this machine (:data:`SDPA_PREFILL_TOKENS`)."""
    return (dtype == torch.bfloat16 and tokens >= SDPA_PREFILL_TOKENS and not params.window and not params.position_mod
            and _amx_tiles())


def sdpa_chunk_bounds() -> tuple[int, int]:
    """``(queries, query-key pairs)``: the least a causal chunk after cached keys needs for :func:`sdpa_chunk_pays` to
    send it to SDPA's kernel on this machine (with a bfloat16 cache, no window, from the first key); ``(0, 0)`` where it
    sends none (the C++ stand-ins leave such steps to the Python op)."""
    return (SDPA_CHUNK_TOKENS, SDPA_CHUNK_WORK) if _amx_tiles() else (0, 0)


def sdpa_prefill_tokens() -> int:
    """The fewest tokens of a fresh bfloat16 prompt without a window that :func:`sdpa_prefill_pays` sends to SDPA's
    kernel on this machine; 0 where it sends none (the C++ stand-ins leave such steps to the Python op)."""
    return SDPA_PREFILL_TOKENS if _amx_tiles() else 0


def sdpa_chunk_pays(dtype: torch.dtype, tokens: int, keys: int, params: AttentionParams) -> bool:
    """Whether a chunk of ``tokens`` queries after cached keys, ``keys`` in all (visible from the first: no window; no
    position program), runs faster through SDPA's kernel than through the native prefill kernel on this machine. Each
    takes one call per chunk, so the work decides: at least :data:`SDPA_CHUNK_TOKENS` queries and
    :data:`SDPA_CHUNK_WORK` query-key pairs."""
    return (dtype == torch.bfloat16 and tokens >= SDPA_CHUNK_TOKENS and tokens * keys >= SDPA_CHUNK_WORK
            and not params.window and not params.position_mod and _amx_tiles())


def _chunk_by_sdpa(out: Tensor, query: Tensor, s: _Seq, k: Tensor, v: Tensor, scale: float) -> None:
    """A causal chunk after cached keys through SDPA's flash kernel: its queries over the cached keys (each sees all
    of them) and over its own keys (causal from the chunk's first, SDPA's own mask), merged by their log-sum-exps.
    ``k``, ``v`` ``[L, Hkv, D]``: the sequence's keys from the first."""
    c, n = s.context_len, s.q_len
    q = query[s.start:s.start + n].transpose(0, 1)[None]  # [1, Hq, n, D]
    k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, Hkv, L, D]
    o1, l1 = _partial_attention(q, k[:, :, :c], v[:, :, :c], None, scale, 0.0)  # [1, Hq, n, D], [1, Hq, n]
    o2, l2 = _partial_attention(q, k[:, :, c:], v[:, :, c:], None, scale, 0.0, causal=True)
    m = torch.maximum(l1, l2)
    w1, w2 = torch.exp(l1 - m)[..., None], torch.exp(l2 - m)[..., None]
    o = (o1.float() * w1 + o2.float() * w2) / (w1 + w2)  # [1, Hq, n, D]
    out[s.start:s.start + n] = o[0].transpose(0, 1).to(out.dtype)


@dataclass(frozen=True)
class _RestBatch:
    """Chunks over cached keys attended by one native prefill call: their blocks gathered by one index into rows
    ``[sum of blocks * block size, Hkv, D]``, each chunk's keys one run of them (``items``: ``native.prefill``'s)."""

    index: Tensor  # [blocks]: the chunks' blocks, chunk after chunk, from the block of each one's first visible key
    items: Tensor  # [n, 6] int64


# the K and V a batch of chunks over cached keys gathers at most (the C++ stand-ins are bound to it, native_ops)
REST_BATCH_BYTES = 32 << 20


def _rest_plan(block_tables: Tensor, rest: tuple, block_size: int, num_blocks: int, row_bytes: int,
               dtype: torch.dtype, params: AttentionParams) -> tuple[tuple, tuple]:
    """``(batches, others)``: the chunks the native prefill takes in batches (:class:`_RestBatch`, at most
    :data:`REST_BATCH_BYTES` of K and V gathered each, a longer chunk alone) and those left to the per-chunk path
    (SDPA's where it pays). Fixed by the step's metadata and the site's window, so memoised for the step's layers."""
    plans = _step_plans(block_tables)
    key = ("rest", block_tables._version, rest, block_size, num_blocks, row_bytes, dtype, params.window, params.causal)
    if key in plans:
        return plans[key]
    batches, others, blocks, items, rows = [], [], [], [], 0
    tables = None
    for s in rest:
        first = reference.earliest_visible_key(s.context_len, params) // block_size
        k0 = first * block_size
        if k0 == 0 and s.context_len and params.causal and sdpa_chunk_pays(dtype, s.q_len, s.kv_len, params):
            others.append(s)
            continue
        n = -(-s.kv_len // block_size) - first
        if items and (rows + n * block_size) * row_bytes > REST_BATCH_BYTES:
            batches.append(_RestBatch(torch.cat(blocks), torch.tensor(items, dtype=torch.int64)))
            blocks, items, rows = [], [], 0
        if tables is None:
            tables = block_tables.long()
        blocks.append(tables[s.index, first:first + n])
        items.append((s.start, s.q_len, s.context_len, rows, s.kv_len - k0, k0))
        rows += n * block_size
    if items:
        batches.append(_RestBatch(torch.cat(blocks), torch.tensor(items, dtype=torch.int64)))
    for b in batches:
        _cache_blocks(b.index, num_blocks)
    plans[key] = (tuple(batches), tuple(others))
    return plans[key]


def _cache_blocks(blocks: Tensor, num_blocks: int) -> Tensor:
    """``blocks``, a gather's block ids, once each is a block of the cache; else the ValueError that says so."""
    if len(blocks) and (int(blocks.min()) < 0 or int(blocks.max()) >= num_blocks):
        bad = blocks[(blocks < 0) | (blocks >= num_blocks)][0]
        raise ValueError(f"paged_attention: a block table entry is not a block of the cache: {int(bad)}, the cache "
                         f"holds blocks 0-{num_blocks - 1}; check the block tables the step was given")
    return blocks


def _rest_native(lib, out: Tensor, query: Tensor, kv_cache: Tensor, block_tables: Tensor, rest: tuple,
                 params: AttentionParams) -> tuple:
    """Attend the chunks over cached keys that the native prefill takes, a batch of them a call (one gather and one
    call where the per-chunk path makes one of each a chunk); returns the chunks left to the per-chunk path."""
    nb, bs, hkv, d = kv_cache.shape[1:]
    row_bytes = 2 * hkv * d * kv_cache.element_size()
    batches, others = _rest_plan(block_tables, rest, bs, nb, row_bytes, query.dtype, params)
    for b in batches:
        k = kv_cache[0].index_select(0, b.index).flatten(0, 1)  # [rows, Hkv, D]
        v = kv_cache[1].index_select(0, b.index).flatten(0, 1)
        if not native.prefill_usable(query, k, v, params.num_kv_heads):
            return rest  # the same for every batch (layouts and dtypes): the first one is asked, before any call
        _prefill(lib, out, query, k, v, b.items, params)
    return others


def _native_prefill_lib(query: Tensor, kv_cache: Tensor, params: AttentionParams):
    """The native kernel's library where it attends this call's prefills (every query's visible keys one run from
    the first key or a window's start; no ALiBi, cap or sinks; a position program only where it reads positions
    through their distance alone and no per-request values: its term by distance), else None."""
    plain = (params.alibi_slopes is None and params.softcap <= 0 and params.sinks is None
             and (not params.position_mod or _by_distance(params.position_mod))
             and not params.chunk)
    if not plain or params.head_size_v != query.shape[-1] or kv_cache.device.type != "cpu":
        return None
    return native.library()


@functools.lru_cache(maxsize=64)
def _by_distance(text: str) -> bool:
    """Whether the native prefill takes the program as a term by distance (a pure function of the text)."""
    return position_mod.by_distance(text) and position_mod.value_spec(text) is None


def _mask_runs(q_pos: Tensor, k_pos: Tensor, params: AttentionParams, num_heads: int, values: Optional[Tensor],
               masks: Optional[dict], seq_len: Optional[int] = None) -> tuple[Optional[Tensor],
                                                                             Optional[tuple[Tensor, Tensor]]]:
    """A mask-only program's mask for queries ``q_pos`` over keys ``k_pos`` (``[1, Q|1, L]``, None: every key) and,
    where every query sees one run of keys (checked on this mask itself), each query's run ``(lo, hi)`` (``[Q]``
    each, indices into the keys; ``lo == hi`` for a query that sees none), else None. Memoised in ``masks`` (the
    step's, for its layers) where the site holds no tensor parameters: it is then a function of the positions (two
    runs of consecutive ones), the sequence's length ``seq_len`` (None: the keys end with it), the site's other
    parameters and the sequence's values, and the key holds all of them, so that no other sequence's mask is served
    whatever the step's layout (the memo's block table may be updated in place from one step to the next)."""
    memo = key = None
    if masks is not None and not _tensor_fields(params):
        memo = masks.setdefault(("mask runs", _params_key(params, values=False)), {})  # the sequence's own: below
        n = int(k_pos[-1]) + 1 if seq_len is None else seq_len
        key = (int(q_pos[0]), q_pos.shape[0], int(k_pos[0]), k_pos.shape[0], n,
               None if values is None else tuple(values.reshape(-1).tolist()))
        if key in memo:
            return memo[key]
    allowed, _ = reference.score_terms(q_pos[None], k_pos[None], params, num_heads, seq_len, values)
    n = k_pos.shape[0]
    if allowed is None:  # every key seen by every query
        found = None, (torch.zeros_like(q_pos), torch.full_like(q_pos, n))
    else:
        a = allowed[0]  # [Q|1, L]
        # a row's runs: where a seen key follows an unseen one (or starts the row)
        runs = a[:, 0].long() + torch.count_nonzero(a[:, 1:] > a[:, :-1], dim=-1)
        if bool((runs <= 1).all()):
            lo = a.view(torch.uint8).argmax(-1)  # the first seen key (0 for a row that sees none)
            hi = lo + torch.count_nonzero(a, dim=-1)
            found = allowed, (lo.expand(q_pos.shape[0]), hi.expand(q_pos.shape[0]))
        else:  # some query sees more than one run
            found = allowed, None
    if memo is not None:
        memo[key] = found
    return found


def _runs_by_native(out: Tensor, query: Tensor, rows: slice, q_pos: Tensor, k_pos: Tensor, k: Tensor, v: Tensor,
                    params: AttentionParams, lo: Tensor, hi: Tensor) -> bool:
    """A site's queries ``rows`` (positions ``q_pos``) over keys ``[Hkv, L, D]`` (positions ``k_pos``) through the
    native prefill kernel, query ``i`` over keys ``[lo[i], hi[i])`` (a mask-only program's one run of keys a query,
    :func:`_mask_runs`; a row that sees none is left at zero). False, with nothing written, where the kernel does not
    take the call."""
    lib = native.library()
    keys, vals = k.transpose(0, 1), v.transpose(0, 1)  # [L, Hkv, D]
    if lib is None or params.head_size_v != query.shape[-1] or query.device.type != "cpu" \
            or not native.prefill_usable(query, keys, vals, params.num_kv_heads):
        return False
    n = k_pos.shape[0]
    bounds = torch.zeros((query.shape[0], 2), dtype=torch.int64, device=query.device)
    bounds[rows, 0], bounds[rows, 1] = lo, hi
    item = torch.tensor([(rows.start, q_pos.shape[0], int(q_pos[0]), 0, n, int(k_pos[0]))], dtype=torch.int64)
    native.prefill(lib, out, query, keys, vals, item, scale=params.scale, causal=params.causal, window=params.window,
                   num_threads=torch.get_num_threads(), bounds=bounds)
    return True


def _prefill(lib, out: Tensor, query: Tensor, key: Tensor, value: Tensor, items: Tensor,
             params: AttentionParams) -> None:
    rel = _prefill_term(items, params, query.shape[1]) if params.position_mod else None
    native.prefill(lib, out, query, key, value, items, scale=params.scale, causal=params.causal,
                   window=params.window, num_threads=torch.get_num_threads(), rel=rel)


def _prefill_term(items: Tensor, params: AttentionParams, num_heads: int) -> Tensor:
    """A by-distance program's term for ``native.prefill``'s items: ``[n, Hq or 1, W]`` float32, entry ``t`` of item
    ``i`` the program's bias at its query ``r`` and key ``j`` with ``j - r + queries - 1 == t`` (``-inf`` where it
    hides the key). Each item's keys run to its sequence's end, the length the program reads."""
    items = items.to(torch.int64)
    queries, q0, keys, k0 = items[:, 1], items[:, 2], items[:, 4], items[:, 5]
    width = int((queries + keys).max()) - 1 + native.REL_PAD
    # k - q at entry t: (k0 + j) - (q0 + r) = k0 - q0 - (queries - 1) + t
    distances = (k0 - q0 - (queries - 1))[:, None] + torch.arange(width)  # [n, W]
    allowed, bias = position_mod.evaluate_by_distance(params.position_mod, params.position_tables, distances,
                                                      k0 + keys, num_heads)
    return _additive(allowed, bias, len(items), width).contiguous()  # [n, Hq|1, W]


def _step_plans(block_tables: Tensor) -> dict:
    """The plans memoised for one block table tensor (a step's; an encoder-decoder's step passes two,
    its own and the cross-attention one, alternating layer by layer). The memo holds the tensors
    themselves, so a later tensor cannot take over an id; it keeps the last few tables, and a few plans
    per table (layers may alternate between parameters, e.g. sliding and global attention)."""
    memo = _LOCAL.__dict__.setdefault("decode_plans", [])
    for i, (t, plans) in enumerate(memo):
        if t is block_tables:
            if i:
                memo.insert(0, memo.pop(i))
            if len(plans) > 8:
                plans.clear()
            return plans
    memo.insert(0, (block_tables, {}))
    del memo[_MEMO_TABLES:]
    return memo[0][1]


_MEMO_TABLES = 4


@dataclass
class _Kept:
    """A plan's gathered groups over one cache, valid while the cache is unchanged (its version)."""

    cache: "weakref.ref"  # the cache, not kept alive by the memo
    index: Tensor  # the blocks the plan gathers (a site's plan is a copy per call; its index is shared)
    version: int
    nbytes: int
    groups: list = dataclasses.field(default_factory=list)  # each group's gathered K and V blocks, in order


def _gathered(kv_cache: Tensor, plan: "_DecodePlan") -> Optional[_Kept]:
    """The gathered groups kept for this cache and plan (a new, empty entry when the cache changed or the plan
    is another one), or None when keeping them would pass ``_KEPT_BYTES``. The cache's version counter moves
    with every in-place write to it or to a view of it (a request's cross K/V, a swap-in, a block copy)."""
    memo = _LOCAL.__dict__.setdefault("kept", {})
    entry = memo.get(id(kv_cache))
    if entry is not None and entry.cache() is kv_cache and entry.index is plan.index \
            and entry.version == kv_cache._version:
        return entry
    memo.pop(id(kv_cache), None)  # entries of caches gone are dropped by their weakref's callback (_forget)
    need = sum(2 * (b - a) * n for a, b, n in plan.bounds) * kv_cache[0, 0].numel() * kv_cache.element_size()
    if sum(e.nbytes for e in memo.values()) + need > _KEPT_BYTES:
        return None
    # the entry goes with its cache (its gathered buffers are freed then, not at some later call)
    gone = functools.partial(_forget, memo, id(kv_cache))
    entry = memo[id(kv_cache)] = _Kept(weakref.ref(kv_cache, gone), plan.index, kv_cache._version, need)
    return entry


def _forget(memo: dict, key: int, ref: "weakref.ref") -> None:
    entry = memo.get(key)
    if entry is not None and entry.cache is ref:
        del memo[key]


# gathered cross-attention K/V kept across decode steps, per thread (an encoder-decoder's cross layers' reads of
# the step's requests: 25 MB for 32 requests of 128 source tokens in a 3-layer d_model-256 BART, fp32)
_KEPT_BYTES = 256 << 20


def _kv_views(ws: Tensor, g: int, span: int, chunk_stride: int, k_off: int, v_off: int) -> tuple[Tensor, Tensor]:
    """K and V ``[g, Hkv, span, D]`` read in place from gathered ``[*, block_size, Hkv, D]`` blocks.

    Offsets and strides count tokens: chunk ``c``'s keys start at token ``c * chunk_stride + k_off``.
    """
    tok = ws.shape[-2] * ws.shape[-1]
    size, stride = (g, ws.shape[-2], span, ws.shape[-1]), (chunk_stride * tok, ws.shape[-1], tok, 1)
    base = ws.storage_offset()
    return ws.as_strided(size, stride, base + k_off * tok), ws.as_strided(size, stride, base + v_off * tok)


def _partial_attention(q, k, v, bias, scale, softcap, causal: bool = False) -> tuple[Tensor, Tensor]:
    """Attention plus its log-sum-exp; ``bias`` is additive (-inf masks) or None; ``causal``: SDPA's own (top-left)
    causal mask, without a cap."""
    if softcap > 0:
        s = reference.apply_softcap(torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale, softcap)
        if bias is not None:
            s = s + bias
        return torch.matmul(torch.softmax(s, -1), v.float()), torch.logsumexp(s, -1)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)


# What one more decode group costs (an index_select, a flash call and their slicing, ~40 us), as the K+V
# bytes whose gather and attention take as long (~6 GB/s through both on a 2-core EPYC).
_GROUP_OVERHEAD_BYTES = 256 << 10
_MAX_RUNS_BACK = 32
# Gathered K+V per decode group (split evenly between the intra-op threads); sized to stay
# resident in cache. Measured on a 2-core EPYC (benchmarks/RESULTS.md): 8 MiB beats 2, 4 and 16.
_GATHER_BUDGET_BYTES = 8 << 20
_LOCAL = threading.local()  # per-thread workspaces: concurrent calls must not share a buffer


def _workspace(kv_cache: Tensor, num_blocks: int) -> Tensor:
    """A reused ``[num_blocks, block_size, Hkv, D]`` gather buffer: fresh large allocations cost
    page faults on every call.

    It is an ordinary tensor even when made under ``torch.inference_mode`` (the engine's CPU step): an
    inference tensor could not be written by a later call outside that mode on the same thread."""
    spaces = _LOCAL.__dict__.setdefault("spaces", {})
    key = (kv_cache.dtype, kv_cache.device, tuple(kv_cache.shape[2:]))
    ws = spaces.get(key)
    if ws is None or ws.shape[0] < num_blocks:
        size = max(num_blocks, 2 * ws.shape[0] if ws is not None else 0)
        with torch.inference_mode(False):
            ws = spaces[key] = torch.empty((size, *key[2]), dtype=kv_cache.dtype, device=kv_cache.device)
    return ws[:num_blocks]


BACKEND = register_backend(SdpaCpuBackend())
