"""Paged attention on CPU through ``scaled_dot_product_attention``.

Cache layout: ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (K then V). A gather of
whole blocks is a run of contiguous copies, and ``[B, L, Hkv, D]`` transposed to ``[B, Hkv, L, D]``
is a strided view SDPA reads directly.

GQA never repeats K/V: the ``G = Hq / Hkv`` query heads that share a KV head are folded into the
query-length dimension (``[Hkv, G * Q, D]``) and the mask is tiled to match.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedattn.backends import ops
from pagedattn.backends.base import (
    AttentionBackend,
    AttentionConfig,
    register_backend,
    validate_attend,
    validate_write,
    validation_enabled,
)

_SDPA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class _Seq:
    index: int
    start: int  # first query row
    q_len: int
    kv_len: int

    @property
    def context_len(self) -> int:
        return self.kv_len - self.q_len


def _plan(query_start_loc: Tensor, seq_lens: Tensor) -> list[_Seq]:
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    return [_Seq(i, qsl[i], qsl[i + 1] - qsl[i], lens[i]) for i in range(len(lens))]


# ------------------------------------------------------------------------- masks


def _allowed(q_pos: Tensor, k_pos: Tensor, causal: bool, window: int) -> Optional[Tensor]:
    """Boolean ``[Q, L]`` of keys each query may see, or None when it sees them all."""
    if not causal:
        return None
    diff = q_pos[:, None] - k_pos[None, :]  # [Q, L] distance back from the query
    ok = diff >= 0
    if window > 0:
        ok = ok & (diff < window)
    return ok


def _alibi_bias(slopes: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    # [H, Q, L]; (j - i) * slope is <= 0 in the causal region
    return slopes.float()[:, None, None] * (k_pos[None, None, :] - q_pos[None, :, None]).float()


def _fold_gqa(q: Tensor, num_kv_heads: int) -> Tensor:
    # [..., Hq, Q, D] -> [..., Hkv, G * Q, D]
    *lead, hq, qlen, d = q.shape
    return q.reshape(*lead, num_kv_heads, (hq // num_kv_heads) * qlen, d)


def _unfold_gqa(o: Tensor, num_heads: int) -> Tensor:
    # [..., Hkv, G * Q, Dv] -> [..., Hq, Q, Dv]
    *lead, hkv, gq, dv = o.shape
    return o.reshape(*lead, num_heads, gq // (num_heads // hkv), dv)


def _scores_bias(
    allowed: Optional[Tensor], alibi: Optional[Tensor], num_kv_heads: int, group: int
) -> Optional[Tensor]:
    """The additive or boolean mask for folded queries: ``[..., Hkv or 1, G * Q, L]``."""
    if alibi is None:
        if allowed is None:
            return None
        return allowed.tile(group, 1) if group > 1 else allowed  # [G*Q, L]
    # alibi: [..., Hq, Q, L] float
    *lead, hq, qlen, L = alibi.shape
    bias = alibi
    if allowed is not None:
        bias = bias.masked_fill(~allowed, float("-inf"))
    return bias.reshape(*lead, num_kv_heads, group * qlen, L)


def _attend_folded(
    q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: float, softcap: float
) -> Tensor:
    """q ``[..., Hkv, G*Q, D]``, k/v ``[..., Hkv, L, D]`` -> ``[..., Hkv, G*Q, Dv]``."""
    if softcap > 0:
        return _math_attention(q, k, v, mask, scale, softcap)
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _math_attention(q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: float, softcap: float) -> Tensor:
    # exact path for what SDPA cannot express (soft-cap): fp32 scores, tanh cap, then the mask
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    p = torch.softmax(s, dim=-1)
    return torch.matmul(p, v.float()).to(q.dtype)


# ------------------------------------------------------------------------ backend


class SdpaCpuBackend(AttentionBackend):
    name = "sdpa_cpu"
    device_type = "cpu"

    def kv_cache_shape(self, num_blocks, block_size, num_kv_heads, head_size):
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def cache_geometry(self, kv_cache):
        if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
            raise ValueError(
                f"sdpa_cpu: kv_cache must be [2, num_blocks, block_size, kv_heads, head_size], got {tuple(kv_cache.shape)}"
            )
        _, nb, bs, hkv, d = kv_cache.shape
        return nb, bs, hkv, d

    def supports(self, config: AttentionConfig) -> list[str]:
        reasons = []
        if config.dtype not in _SDPA_DTYPES:
            reasons.append(f"dtype {config.dtype} is not supported (float32, bfloat16, float16)")
        if config.num_heads % config.num_kv_heads:
            reasons.append(f"{config.num_heads} query heads are not a multiple of {config.num_kv_heads} kv heads")
        if config.sliding_window and not config.causal:
            reasons.append("a sliding window needs causal attention")
        if config.head_size_v not in (None, config.head_size):
            reasons.append("value head size differs from key head size (the cache stores one head size)")
        return reasons

    # --- cache maintenance

    def write(self, key, value, kv_cache, slot_mapping):
        nb, bs, hkv, d = self.cache_geometry(kv_cache)
        if validation_enabled():
            validate_write(key, value, nb * bs, hkv, d, kv_cache.dtype, kv_cache.device, slot_mapping)
        slots = slot_mapping.long()
        if slots.numel() and bool((slots < 0).any()):
            keep = slots >= 0
            key, value, slots = key[keep], value[keep], slots[keep]
        kv_cache[0].view(nb * bs, hkv, d).index_copy_(0, slots, key)
        kv_cache[1].view(nb * bs, hkv, d).index_copy_(0, slots, value)

    def copy_blocks(self, kv_cache, src_to_dst):
        src, dst = src_to_dst[:, 0].long(), src_to_dst[:, 1].long()
        kv_cache[:, dst] = kv_cache[:, src]

    def swap_blocks(self, src_cache, dst_cache, src_to_dst):
        src = src_to_dst[:, 0].to(src_cache.device, torch.long)
        dst = src_to_dst[:, 1].to(dst_cache.device, torch.long)
        dst_cache[:, dst] = src_cache[:, src].to(dst_cache.device)

    # --- attention

    def attend(self, query, key, value, kv_cache, block_tables, seq_lens, query_start_loc,
               scale, causal, sliding_window, softcap, alibi_slopes, num_kv_heads):
        nb, bs, hkv, d = self.cache_geometry(kv_cache)
        if validation_enabled():
            validate_attend(query, nb, hkv, d, kv_cache.dtype, kv_cache.device, block_tables,
                            seq_lens, query_start_loc, bs, num_kv_heads)
            if causal and bool((seq_lens < query_start_loc.diff()).any()):
                raise ValueError("paged_attention: a causal sequence has seq_len shorter than its new tokens")
        seqs = _plan(query_start_loc, seq_lens)
        num_heads = query.shape[1]
        out = query.new_zeros((query.shape[0], num_heads, kv_cache.shape[-1]))
        fresh = [s for s in seqs if key is not None and s.q_len > 1 and s.kv_len == s.q_len]
        single = [s for s in seqs if s.q_len == 1]
        fresh_ids = {s.index for s in fresh}
        rest = [s for s in seqs if s.q_len > 1 and s.index not in fresh_ids]
        if single:
            self._decode(out, query, kv_cache, block_tables, single, scale, causal, sliding_window,
                         softcap, alibi_slopes, num_kv_heads)
        for s in fresh:
            k = key[s.start:s.start + s.q_len].transpose(0, 1)  # [Hkv, Q, D]
            v = value[s.start:s.start + s.q_len].transpose(0, 1)
            self._one(out, query, s, k, v, scale, causal, sliding_window, softcap, alibi_slopes, num_kv_heads)
        for s in rest:
            k, v = self._gather_one(kv_cache, block_tables[s.index], s.kv_len)
            self._one(out, query, s, k, v, scale, causal, sliding_window, softcap, alibi_slopes, num_kv_heads)
        return out

    @staticmethod
    def _gather_one(kv_cache: Tensor, table: Tensor, kv_len: int) -> tuple[Tensor, Tensor]:
        bs = kv_cache.shape[2]
        n = -(-kv_len // bs)
        blocks = table[:n].long()
        k = kv_cache[0].index_select(0, blocks).flatten(0, 1)[:kv_len]  # [L, Hkv, D]
        v = kv_cache[1].index_select(0, blocks).flatten(0, 1)[:kv_len]
        return k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, L, D]

    def _one(self, out, query, s: _Seq, k, v, scale, causal, window, softcap, alibi_slopes, num_kv_heads):
        q = query[s.start:s.start + s.q_len].transpose(0, 1)[None]  # [1, Hq, Q, D]
        k, v = k[None], v[None]
        num_heads = q.shape[1]
        group = num_heads // num_kv_heads
        plain = alibi_slopes is None and softcap <= 0 and window <= 0
        if plain and (not causal or s.context_len == 0):
            # top-left causal equals bottom-right when there is no context: SDPA's own mask
            o = F.scaled_dot_product_attention(
                q, k, v, is_causal=causal, scale=scale, enable_gqa=group > 1
            )  # [Hq, Q, Dv]
        else:
            q_pos = torch.arange(s.context_len, s.kv_len, device=q.device)
            k_pos = torch.arange(s.kv_len, device=q.device)
            allowed = _allowed(q_pos, k_pos, causal, window)
            alibi = _alibi_bias(alibi_slopes, q_pos, k_pos) if alibi_slopes is not None else None
            mask = _scores_bias(allowed, alibi, num_kv_heads, group)
            o = _unfold_gqa(_attend_folded(_fold_gqa(q, num_kv_heads), k, v, mask, scale, softcap), num_heads)
        out[s.start:s.start + s.q_len] = o[0].transpose(0, 1)

    def _decode(self, out, query, kv_cache, block_tables, seqs: list[_Seq], scale, causal, window,
                softcap, alibi_slopes, num_kv_heads):
        # Flash-decoding on CPU: each sequence's keys are cut into chunks that, gathered, stay in the
        # last-level cache; chunks are batched into padded groups, and partial results merged by
        # their log-sum-exp. Per-chunk tensors are built once; groups only slice them.
        bs, d = kv_cache.shape[2], kv_cache.shape[-1]
        dev = query.device
        kv_token_bytes = 2 * num_kv_heads * d * kv_cache.element_size()
        chunk = max(bs, (_GATHER_BUDGET_BYTES // kv_token_bytes) // bs * bs)
        items: list[_Chunk] = []
        for s in seqs:
            lo = max(0, s.kv_len - window) if causal and window > 0 else 0
            for a in range(lo - lo % bs, s.kv_len, chunk):
                items.append(_Chunk(s, max(a, lo), min(a + chunk, s.kv_len)))
        bounds, start, longest = [], 0, 0  # groups are runs of consecutive chunks
        for i, it in enumerate(items):
            longest_with = max(longest, it.num_blocks(bs))
            if i > start and (i - start + 1) * longest_with * bs * kv_token_bytes > _GATHER_BUDGET_BYTES:
                bounds.append((start, i, longest))
                start, longest_with = i, it.num_blocks(bs)
            longest = longest_with
        bounds.append((start, len(items), longest))

        n_max = max(n for _, _, n in bounds)
        first = torch.tensor([it.lo // bs for it in items], device=dev)
        cols = (first[:, None] + torch.arange(n_max, device=dev)[None, :]).clamp_(max=block_tables.shape[1] - 1)
        seq_rows = torch.tensor([it.seq.index for it in items], device=dev)
        blocks = block_tables[seq_rows[:, None], cols].long()  # [I, n_max]
        rows = torch.tensor([it.seq.start for it in items], device=dev)
        num_heads = query.shape[1]
        group = num_heads // num_kv_heads
        q_all = query.index_select(0, rows).view(len(items), num_kv_heads, group, -1)  # [I, Hkv, G, D]
        k_pos = first[:, None] * bs + torch.arange(n_max * bs, device=dev)[None, :]  # [I, Lp] absolute
        lo = torch.tensor([it.lo for it in items], device=dev)[:, None]
        hi = torch.tensor([it.hi for it in items], device=dev)[:, None]
        ok = ((k_pos >= lo) & (k_pos < hi))[:, None, None, :]  # [I, 1, 1, Lp]
        if alibi_slopes is not None:
            rel = (k_pos - torch.tensor([it.seq.kv_len - 1 for it in items], device=dev)[:, None]).float()
            bias = alibi_slopes.float().view(1, num_kv_heads, group, 1) * rel[:, None, None, :]
        else:
            bias = torch.zeros(ok.shape, device=dev)
        bias = bias.masked_fill(~ok, float("-inf"))
        if softcap <= 0:
            bias = bias.to(query.dtype)

        outs, lses = [], []
        for a, b, n in bounds:
            k_ws, v_ws = _workspace(kv_cache, (b - a) * n)
            flat = blocks[a:b, :n].reshape(-1)
            torch.index_select(kv_cache[0], 0, flat, out=k_ws)
            torch.index_select(kv_cache[1], 0, flat, out=v_ws)
            k = k_ws.view(b - a, n * bs, num_kv_heads, -1).transpose(1, 2)  # [g, Hkv, Lp, D]
            v = v_ws.view(b - a, n * bs, num_kv_heads, -1).transpose(1, 2)
            o, lse = _partial_attention(q_all[a:b], k, v, bias[a:b, ..., : n * bs], scale, softcap)
            outs.append(o.reshape(b - a, num_heads, -1))
            lses.append(lse.reshape(b - a, num_heads))
        o = torch.cat(outs)  # [I, Hq, Dv]
        if len(items) == len(seqs):
            out.index_copy_(0, rows, o.to(out.dtype))
            return
        lse = torch.cat(lses)  # [I, Hq]
        m = torch.full((out.shape[0], num_heads), float("-inf"), device=dev).scatter_reduce_(
            0, rows[:, None].expand_as(lse), lse, "amax")
        w = torch.exp(lse - m[rows])  # [I, Hq]
        num = torch.zeros(out.shape, dtype=torch.float32, device=dev).index_add_(0, rows, o.float() * w[..., None])
        den = torch.zeros(m.shape, device=dev).index_add_(0, rows, w)
        uniq = torch.tensor([s.start for s in seqs], device=dev)
        out.index_copy_(0, uniq, (num[uniq] / den[uniq, :, None]).to(out.dtype))


def _partial_attention(q, k, v, bias, scale, softcap) -> tuple[Tensor, Tensor]:
    """Attention plus its log-sum-exp; ``bias`` is additive (-inf masks)."""
    if softcap > 0:
        s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
        s = torch.tanh(s / softcap) * softcap + bias
        return torch.matmul(torch.softmax(s, -1), v.float()), torch.logsumexp(s, -1)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=bias, scale=scale)


@dataclass(frozen=True)
class _Chunk:
    seq: _Seq
    lo: int  # first key position
    hi: int  # one past the last key position

    def num_blocks(self, block_size: int) -> int:
        return -(-self.hi // block_size) - self.lo // block_size


# Gathered K+V per decode group; sized to stay resident in a typical last-level cache.
_GATHER_BUDGET_BYTES = 8 << 20
_WORKSPACES: dict[tuple, tuple[Tensor, Tensor]] = {}


def _workspace(kv_cache: Tensor, num_blocks: int) -> tuple[Tensor, Tensor]:
    """Reused gather buffers: fresh large allocations cost page faults on every call."""
    block_shape = tuple(kv_cache.shape[2:])
    key = (kv_cache.dtype, kv_cache.device, block_shape)
    ws = _WORKSPACES.get(key)
    if ws is None or ws[0].shape[0] < num_blocks:
        size = max(num_blocks, 2 * ws[0].shape[0] if ws is not None else 0)
        ws = tuple(torch.empty((size, *block_shape), dtype=kv_cache.dtype, device=kv_cache.device) for _ in range(2))
        _WORKSPACES[key] = ws
    return ws[0][:num_blocks], ws[1][:num_blocks]


BACKEND = register_backend(SdpaCpuBackend())
ops.register_kernels(BACKEND)
