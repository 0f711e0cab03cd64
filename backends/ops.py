"""The paged attention custom ops (``torch.ops.pagedattn.*``) and their fake kernels.

Schemas and shape rules live here; device kernels come from the backends, which call
:func:`register_kernels` on import. A call on a device whose backend is not loaded yet
loads it through the registry first.

Conventions shared by every backend:

- ``key``/``value``/``query`` are flattened over tokens: ``[T, heads, head_size]``.
- ``write_kv_cache`` must run before ``paged_attention`` reads the same step's tokens.
- ``sliding_window <= 0`` means no window; ``softcap <= 0`` means no soft-cap.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from pagedattn.backends.base import AttentionBackend, get_backend

__all__ = ["write_kv_cache", "write_kv_cache_functional", "paged_attention", "register_kernels"]


def _backend_for(t: Tensor) -> AttentionBackend:
    return get_backend(t.device)


@torch.library.custom_op("pagedattn::write_kv_cache", mutates_args=("kv_cache",))
def write_kv_cache(key: Tensor, value: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write the new tokens' K ``[T, Hkv, D]`` and V into ``kv_cache`` at ``slot_mapping`` (-1 skips)."""
    _backend_for(kv_cache).write(key, value, kv_cache, slot_mapping)


@write_kv_cache.register_fake
def _(key, value, kv_cache, slot_mapping):
    return None


@torch.library.custom_op("pagedattn::write_kv_cache_functional", mutates_args=())
def write_kv_cache_functional(key: Tensor, value: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> Tensor:
    """Like :func:`write_kv_cache` but returns the updated cache and leaves the input untouched."""
    out = kv_cache.clone()
    _backend_for(kv_cache).write(key, value, out, slot_mapping)
    return out


@write_kv_cache_functional.register_fake
def _(key, value, kv_cache, slot_mapping):
    return torch.empty_like(kv_cache)


@torch.library.custom_op("pagedattn::paged_attention", mutates_args=())
def paged_attention(
    query: Tensor,
    key: Optional[Tensor],
    value: Optional[Tensor],
    kv_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
    causal: bool,
    sliding_window: int,
    softcap: float,
    alibi_slopes: Optional[Tensor],
    num_kv_heads: int,
    head_size_v: int,
    sinks: Optional[Tensor] = None,
) -> Tensor:
    """Attention of every new token over its sequence's cached keys, in one call.

    ``query`` is ``[T, Hq, D]``; sequence ``i`` owns rows ``query_start_loc[i]:query_start_loc[i+1]``
    and has ``seq_lens[i]`` keys in total (its new tokens included, causal aligned bottom-right).
    ``key``/``value`` are the new tokens' K/V (``None`` when the step has none, e.g. cross-attention
    over a cache filled once); backends may read them directly instead of the cache.
    ``sinks`` (``[Hq]``, optional) are per-head attention-sink logits: one extra score per query
    that joins the softmax's normalisation and contributes no value.
    Returns ``[T, Hq, head_size_v]``; rows past ``query_start_loc[-1]`` (padding) are zero.
    """
    return _backend_for(kv_cache).attend(
        query, key, value, kv_cache, block_tables, seq_lens, query_start_loc,
        scale, causal, sliding_window, softcap, alibi_slopes, num_kv_heads, **_sink_kw(sinks),
    )


def _sink_kw(sinks: Optional[Tensor]) -> dict:
    # backends without sink support keep their signature; the rewriter never routes sinks to them
    return {} if sinks is None else {"sinks": sinks}


@paged_attention.register_fake
def _(query, key, value, kv_cache, block_tables, seq_lens, query_start_loc, scale, causal,
      sliding_window, softcap, alibi_slopes, num_kv_heads, head_size_v, sinks=None):
    return query.new_empty((query.shape[0], query.shape[1], head_size_v))


def register_kernels(backend: AttentionBackend) -> None:
    """Register ``backend``'s methods as the ops' kernels for its device type."""
    dev = backend.device_type

    def _write(key, value, kv_cache, slot_mapping):
        backend.write(key, value, kv_cache, slot_mapping)

    def _write_functional(key, value, kv_cache, slot_mapping):
        out = kv_cache.clone()
        backend.write(key, value, out, slot_mapping)
        return out

    def _attend(query, key, value, kv_cache, block_tables, seq_lens, query_start_loc, scale, causal,
                sliding_window, softcap, alibi_slopes, num_kv_heads, head_size_v, sinks=None):
        return backend.attend(query, key, value, kv_cache, block_tables, seq_lens, query_start_loc,
                              scale, causal, sliding_window, softcap, alibi_slopes, num_kv_heads, **_sink_kw(sinks))

    write_kv_cache.register_kernel(dev)(_write)
    write_kv_cache_functional.register_kernel(dev)(_write_functional)
    paged_attention.register_kernel(dev)(_attend)


# ---------------------------------------------------------------- canonical attention


@torch.library.custom_op("pagedattn::attention", mutates_args=())
def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_padding: Optional[Tensor],
    scale: float,
    causal: bool,
    sliding_window: int,
    softcap: float,
    alibi_slopes: Optional[Tensor],
    num_kv_heads: int,
    sinks: Optional[Tensor] = None,
) -> Tensor:
    """Dense attention as the rewriter proved a site computes: the drop-in form of a site.

    ``query [B, Hq, S, D]``, ``key/value [B, Hkv, L, D]``; causal masks align bottom-right (the
    ``S`` queries are the last ``S`` of ``L`` positions); ``key_padding [B, L]`` is nonzero for keys
    that may be seen; ``sinks [Hq]`` are attention-sink logits (see :func:`paged_attention`).
    Returns ``[B, Hq, S, Dv]``.
    """
    import torch.nn.functional as F

    S, L = query.shape[-2], key.shape[-2]
    group = query.shape[1] // num_kv_heads
    q_pos = torch.arange(L - S, L, device=query.device)[:, None]
    k_pos = torch.arange(L, device=query.device)[None, :]
    allowed = None
    if causal:
        allowed = k_pos <= q_pos
        if sliding_window > 0:
            allowed = allowed & (q_pos - k_pos < sliding_window)
        allowed = allowed[None, None]  # [1, 1, S, L]
    if key_padding is not None:
        pad = (key_padding != 0)[:, None, None, :]  # [B, 1, 1, L]
        allowed = pad if allowed is None else allowed & pad
    if softcap <= 0 and alibi_slopes is None and sinks is None:
        if allowed is not None and allowed.shape[0] > 1:
            # rows with no visible key (fully padded queries) would give NaN; let them see key 0
            allowed = allowed.clone()
            allowed[..., 0] |= ~allowed.any(-1)
        # contiguous, as the fake kernel promises (SDPA follows the query's strides)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scale,
                                              enable_gqa=group > 1).contiguous()
    k = key.repeat_interleave(group, 1) if group > 1 else key
    v = value.repeat_interleave(group, 1) if group > 1 else value
    s = torch.matmul(query.float(), k.float().transpose(-1, -2)) * scale  # [B, Hq, S, L]
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    if alibi_slopes is not None:
        s = s + alibi_slopes.float()[None, :, None, None] * (k_pos - q_pos).float()
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
        s = s.masked_fill(~allowed.any(-1, keepdim=True), 0.0)
    if sinks is None:
        p = torch.softmax(s, -1)
    else:  # the sink is one more score per row that takes probability but adds no value
        sink = sinks.float()[None, :, None, None].expand(*s.shape[:-1], 1)
        p = torch.softmax(torch.cat([s, sink], -1), -1)[..., :-1]
    return torch.matmul(p, v.float()).to(query.dtype).contiguous()


@attention.register_fake
def _(query, key, value, key_padding, scale, causal, sliding_window, softcap, alibi_slopes, num_kv_heads, sinks=None):
    return query.new_empty((*query.shape[:-1], value.shape[-1]))
