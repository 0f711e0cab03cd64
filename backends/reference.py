"""The one statement of what a pagedattn attention site computes, and an exact dense attention.

Everything that decides *which* keys a query sees, or *what* is added to its scores, is written
here once; the drop-in op, the backends' exact fallbacks and the tests call it, and the fast
paths (CPU flash-decoding, xFormers' fused kernels, XLA's static path, the ONNX translation) are
tested against it.

Semantics, for a query at absolute position ``i`` of its sequence and a key at position ``j``
(a step's new queries are the *last* positions of their sequence: causal masks align
bottom-right):

1. ``s = scale * (q · k)``, in float32 (float64 for float64 operands);
2. soft-cap: ``s = softcap * tanh(s / softcap)`` when ``softcap > 0``;
3. ALiBi: ``s += slope[h] * (j - i)`` (0 on the diagonal, negative for earlier keys); a position
   program (``position_mod``) adds its bias ``bias(h, i, j)`` here too;
4. visibility: causal attention sees ``j <= i``; with a sliding window ``w`` only ``i - j < w``;
   with chunks of ``C`` positions (chunked local attention) only keys of the query's own chunk,
   ``i // C == j // C``; a key must pass every condition the site has. Bidirectional attention
   sees every key (windows and chunks apply to causal attention only). A position program's mask
   ``allowed(i, j)`` applies on top (it carries masks none of these kinds express: sink tokens plus
   a window, dilated windows; its fast paths read every key up to the query). Keys a caller marks absent
   (padding, past the sequence's length) are never seen. So a causal query sees one run of keys,
   ``earliest_visible_key(i) <= j <= i``, whose start never moves back as ``i`` grows: the fast
   paths read only that run (and cut a step's queries where chunks begin, ``chunk_runs``);
5. softmax over the visible keys, with the per-head sink logit (if any) as one more term of the
   normalisation that contributes no value; a query that sees no key at all gets zeros;
6. ``out = p · v``, cast back to the query's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from pagedattn.backends import position_mod
from pagedattn.backends.params import AttentionParams

__all__ = ["query_positions", "visible", "earliest_visible_key", "chunk_runs", "alibi_bias", "score_terms",
           "PositionTerms", "position_terms", "finish_terms",
           "apply_softcap", "dense_attention"]


def query_positions(seq_len: int | Tensor, q_len: int, device=None) -> Tensor:
    """Absolute positions of the last ``q_len`` of ``seq_len`` tokens (bottom-right alignment)."""
    return torch.arange(q_len, device=device) + (seq_len - q_len)


def visible(q_pos: Tensor, k_pos: Tensor, params: AttentionParams) -> Optional[Tensor]:
    """Which keys each query may see: boolean ``[..., Q, L]`` from ``q_pos [..., Q]`` and ``k_pos [..., L]``.

    ``None`` when every key is visible (bidirectional attention). Keys that do not exist
    (padding, beyond a sequence's length) are the caller's to mask.
    """
    if not params.causal:
        return None
    back = q_pos[..., :, None] - k_pos[..., None, :]  # how far back from the query the key lies
    ok = back >= 0
    if params.window:
        ok = ok & (back < params.window)
    if params.chunk:  # the query's own chunk only
        ok = ok & (q_pos[..., :, None] // params.chunk == k_pos[..., None, :] // params.chunk)
    return ok


def earliest_visible_key(q_pos: int | Tensor, params: AttentionParams) -> int | Tensor:
    """The first key position a query at ``q_pos`` may see: the latest of the window's start and
    the start of the query's chunk (0 with neither). Keys before it need not be read at all; a
    causal query sees every key from it up to itself."""
    lo = 0 if isinstance(q_pos, int) else torch.zeros_like(q_pos)
    if params.window:
        start = q_pos - params.window + 1
        lo = max(lo, start) if isinstance(q_pos, int) else torch.maximum(lo, start)
    if params.chunk:
        start = q_pos - q_pos % params.chunk
        lo = max(lo, start) if isinstance(q_pos, int) else torch.maximum(lo, start)
    return lo


def chunk_runs(start: int, stop: int, params: AttentionParams) -> list[tuple[int, int]]:
    """Query positions ``[start, stop)`` cut where a chunk begins: ``[(a, b), ...]``, each run within
    one chunk (the whole range as one run without chunks). A run's queries see only keys of their
    own chunk, so each run can be attended on its own over keys ``[earliest_visible_key(a), b)``."""
    if stop <= start:
        return []
    cuts = range(start - start % params.chunk + params.chunk, stop, params.chunk) if params.chunk else ()
    edges = [start, *cuts, stop]  # cuts: the chunk starts after ``start``
    return list(zip(edges[:-1], edges[1:]))


def alibi_bias(slopes: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """ALiBi as an additive bias ``[..., Hq, Q, L]`` (float32, or the slopes' wider float dtype):
    ``slope * (key position - query position)``."""
    dtype = torch.promote_types(slopes.dtype, torch.float32)
    rel = (k_pos[..., None, :] - q_pos[..., :, None]).to(dtype)  # [..., Q, L]
    return slopes.to(rel.device, dtype).reshape(-1, 1, 1) * rel[..., None, :, :]


@dataclass(frozen=True)
class PositionTerms:
    """What a site's non-tensor parameters decide at some positions (see :func:`position_terms`)."""

    q_pos: Tensor  # [B|1, Q]
    k_pos: Tensor  # [B|1, L]
    visible: Optional[Tensor]  # [B|1, Q, L]: causal / window / chunk
    program: Optional[position_mod.Prepared]  # the position program up to its table lookups
    one_row: bool


def position_terms(q_pos: Tensor, k_pos: Tensor, params: AttentionParams, num_heads: int,
                   seq_len: Optional[Tensor | int] = None, values: Optional[Tensor] = None) -> PositionTerms:
    """The part of :func:`score_terms` that reads no tensor parameter (ALiBi slopes, a program's
    tables): the same for every layer whose parameters differ only in those, so a step computes it once.
    ``values`` are the rows' per-request values (``[B|1, count]``; ``[count]`` for one row) for a program
    that reads some (a prefix-LM mask: ``position_mod.value_spec``)."""
    one_row = q_pos.dim() == 1
    if one_row:
        q_pos, k_pos = q_pos[None], k_pos[None]
        values = None if values is None else values.reshape(1, -1)
    program = None
    if params.position_mod:
        n = k_pos[..., -1:] + 1 if seq_len is None else seq_len
        program = position_mod.prepare(params.position_mod, q_pos, k_pos, n, num_heads, values)
    return PositionTerms(q_pos, k_pos, visible(q_pos, k_pos, params), program, one_row)


def finish_terms(terms: PositionTerms, params: AttentionParams) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """:func:`score_terms` from its position-only part and the site's tensor parameters."""
    allowed, bias = terms.visible, None
    if params.alibi_slopes is not None:
        bias = alibi_bias(params.alibi_slopes, terms.q_pos, terms.k_pos)
    if terms.program is not None:
        m_allowed, m_bias = position_mod.finish(terms.program, params.position_tables)
        if m_allowed is not None:
            allowed = m_allowed if allowed is None else allowed & m_allowed
        if m_bias is not None:
            bias = m_bias if bias is None else bias + m_bias
    if terms.one_row:
        allowed = None if allowed is None else allowed[0]
        bias = None if bias is None else bias[0]
    return allowed, bias


def score_terms(q_pos: Tensor, k_pos: Tensor, params: AttentionParams, num_heads: int,
                seq_len: Optional[Tensor | int] = None,
                values: Optional[Tensor] = None) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """Everything positions decide about a site's scores: ``(visible [B|1, Q, L] bool or None, bias
    [B|1, Hq, Q, L] float32 or None)`` for ``q_pos [B|1, Q]`` / ``k_pos [B|1, L]`` (1-D: one row, and
    results without the row dimension). ``seq_len`` (an int, ``[B|1]`` or ``[B|1, Q]``; default: the
    keys run up to the last one given) is what a position program reads as the sequence's length;
    ``values`` the rows' per-request values (see :func:`position_terms`)."""
    return finish_terms(position_terms(q_pos, k_pos, params, num_heads, seq_len, values), params)


def apply_softcap(scores: Tensor, softcap: float) -> Tensor:
    """``softcap * tanh(scores / softcap)`` in place (float scores); unchanged when ``softcap <= 0``."""
    if softcap > 0:
        scores.div_(softcap).tanh_().mul_(softcap)
    return scores


def mask_only(params: AttentionParams) -> bool:
    """Nothing but a mask: SDPA computes it with the same semantics (:func:`masked_sdpa`)."""
    return (params.softcap <= 0 and params.alibi_slopes is None and params.sinks is None
            and not (params.position_mod and position_mod.has_bias(params.position_mod)))


def dense_attention(query: Tensor, key: Tensor, value: Tensor, params: AttentionParams,
                    q_pos: Optional[Tensor] = None, k_pos: Optional[Tensor] = None,
                    key_present: Optional[Tensor] = None, exact: bool = False,
                    values: Optional[Tensor] = None, seq_len: Optional[Tensor | int] = None) -> Tensor:
    """Attention as the module doc defines it, over dense operands.

    ``query [B, Hq, Q, D]``, ``key [B, Hkv, L, D]``, ``value [B, Hkv, L, Dv]`` with ``Hq`` a multiple
    of ``Hkv`` (grouped-query attention: K/V are never repeated per query head). ``q_pos`` /
    ``k_pos`` (``[B or 1, Q]`` / ``[B or 1, L]``, default: the queries are the last ``Q`` of ``L``
    positions) place them in their sequence; ``key_present [B or 1, L]`` (or ``[B or 1, Q, L]``)
    marks the keys that exist; ``values [B or 1, count]`` are the rows' per-request values, for a
    position program that reads some; ``seq_len`` (an int or ``[B|1]``) what such a program reads as the
    sequence's length (default: up to the last key present, else the last key given: a caller that hands in
    only the keys up to a run of queries passes the sequence's own). Returns ``[B, Hq, Q, Dv]`` in the query's
    dtype, contiguous.

    Without soft-cap, ALiBi or sinks this runs SDPA in the operands' dtype (unless ``exact``);
    otherwise float32 math (float64 for float64 operands), updated in place to bound memory unless
    autograd records it (the drop-in op's backward differentiates this function).
    """
    B, hq, Q, D = query.shape
    hkv, L = key.shape[1], key.shape[2]
    group = hq // hkv
    dev = query.device
    if q_pos is None:
        q_pos = query_positions(L, Q, dev)[None]
    if k_pos is None:
        k_pos = torch.arange(L, device=dev)[None]
    if seq_len is None and params.position_mod and key_present is not None and key_present.dim() == 2:
        # static paths hand in padded keys with the real ones marked: the sequence ends after its last real key
        seq_len = torch.where(key_present, k_pos, -1).amax(-1) + 1  # [B|1]
    q_pos, k_pos = (q_pos if q_pos.dim() == 2 else q_pos[None]), (k_pos if k_pos.dim() == 2 else k_pos[None])
    if isinstance(seq_len, Tensor) and seq_len.dim() and seq_len.shape[0] > max(q_pos.shape[0], k_pos.shape[0]):
        # lengths per row (its keys present) over positions shared by the rows: the positions for each row
        q_pos, k_pos = q_pos.expand(seq_len.shape[0], -1), k_pos.expand(seq_len.shape[0], -1)
    allowed, bias = score_terms(q_pos, k_pos, params, hq, seq_len, values)  # [B|1, Q, L] or None; [B|1, Hq|1, Q, L]
    if key_present is not None:
        present = key_present if key_present.dim() == 3 else key_present[:, None, :]
        allowed = present if allowed is None else allowed & present
    if allowed is not None:
        allowed = allowed.expand(-1, Q, L)
    if mask_only(params) and not exact:
        return masked_sdpa(query, key, value, allowed, params.scale, group)
    acc = torch.promote_types(query.dtype, torch.float32)  # float32, or float64 for a float64 reference
    # in place (bounded memory) unless autograd records the computation
    inplace = not (torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (query, key, value, params.alibi_slopes, params.sinks,
                                                    params.position_tables)))
    # [B, Hkv, G*Q, L]: a KV head's query heads stacked, so K/V are read once per KV head
    s = torch.matmul(query.reshape(B, hkv, group * Q, D).to(acc), key.to(acc).transpose(-1, -2))
    s = _apply(s.view(B, hkv, group, Q, L), "mul", inplace, params.scale)
    if params.softcap > 0:
        s = _apply(_apply(_apply(s, "div", inplace, params.softcap), "tanh", inplace), "mul", inplace,
                   params.softcap)
    if bias is not None:
        bias = bias.to(acc).expand(-1, hq, Q, L).reshape(-1, hkv, group, Q, L)
        s = _apply(s, "add", inplace, bias)
    if allowed is not None:
        s = _apply(s, "masked_fill", inplace, ~allowed[:, None, None], float("-inf"))
    sink = None if params.sinks is None else params.sinks.to(acc).view(1, hkv, group, 1, 1)
    p = _softmax(s, sink, inplace).view(B, hkv, group * Q, L)
    out = torch.matmul(p, value.to(acc)).view(B, hq, Q, value.shape[-1])
    return out.to(query.dtype)


def _apply(t: Tensor, op: str, inplace: bool, *args) -> Tensor:
    """``t.op(*args)``, in place when ``inplace``."""
    return getattr(t, op + "_" if inplace else op)(*args)


def _softmax(s: Tensor, sink: Optional[Tensor], inplace: bool) -> Tensor:
    """Softmax over the last dimension; ``sink`` is one more logit per row that takes probability and
    adds no value. Rows with no finite score give zeros."""
    m = s.amax(-1, keepdim=True).detach()  # any row constant gives the same softmax
    if sink is not None:
        m = torch.maximum(m, sink.detach())
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # a row that sees nothing
    e = _apply(_apply(s, "sub", inplace, m), "exp", inplace)
    denom = e.sum(-1, keepdim=True)
    if sink is not None:
        denom = denom + (sink - m).exp()
    return _apply(e, "div", inplace, torch.where(denom > 0, denom, torch.ones_like(denom)))


def masked_sdpa(query: Tensor, key: Tensor, value: Tensor, allowed: Optional[Tensor], scale: float,
                group: int) -> Tensor:
    """The plain case through SDPA: ``query [B, Hq, Q, D]`` over ``key``/``value [B, Hkv, L, D]`` where ``allowed
    [B, Q, L]`` (None: everywhere); rows that see no key give zeros (SDPA would give NaN)."""
    empty = None
    if allowed is not None:
        empty = ~allowed.any(-1, keepdim=True)  # [B, Q, 1]
        first = torch.zeros_like(allowed)
        first[..., 0] = True
        allowed = (allowed | (empty & first))[:, None]  # [B, 1, Q, L]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scale, enable_gqa=group > 1)
    if empty is not None:
        out = out.masked_fill(empty[:, None], 0.0)
    return out.contiguous()  # SDPA follows the query's strides; callers rely on a contiguous result
