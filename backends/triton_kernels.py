"""Triton kernels of the backends, imported on first use (``triton_paged``): only where Triton is installed.

Triton compiles them for the GPU, or runs them in its interpreter on CPU tensors when the process started with
``TRITON_INTERPRET=1`` (Triton decides that when it is imported)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["token_run", "paged_split", "merge_splits", "write_slots"]


@triton.jit
def token_run(QSL, SEQ_LENS, t, num_seqs, window, chunk, S_PAD: tl.constexpr, CAUSAL: tl.constexpr):
    """Token ``t``'s sequence, position and the keys ``[lo, hi)`` it may see (the reference's visibility: causal
    with a window or chunk, or every key of the sequence). A padding token (past the last sequence's rows), a
    sequence of length 0 or a token before its sequence's first position sees none (``hi == lo``)."""
    i = tl.arange(0, S_PAD)
    ends = tl.load(QSL + 1 + i, mask=i < num_seqs, other=2147483647)  # [S_PAD] each sequence's end row
    seq = tl.sum((ends <= t).to(tl.int32), 0)  # sequences that end at or before t
    real = seq < num_seqs
    seq = tl.minimum(seq, num_seqs - 1)
    kv_len = tl.load(SEQ_LENS + seq).to(tl.int64)
    end = tl.load(QSL + 1 + seq).to(tl.int64)
    q_pos = kv_len - (end - t)
    if CAUSAL:
        lo = tl.zeros_like(q_pos)
        if window > 0:
            lo = tl.maximum(lo, q_pos - window + 1)
        if chunk > 0:
            lo = tl.maximum(lo, q_pos - q_pos % chunk)
        hi = q_pos + 1
    else:
        lo = tl.zeros_like(q_pos)
        hi = kv_len
    seen = real & (kv_len > 0) & (q_pos >= 0)
    hi = tl.where(seen, tl.minimum(hi, kv_len), lo)
    return seq, q_pos, lo, hi


@triton.jit
def paged_split(Q, KC, VC, TABLES, QSL, SEQ_LENS, SLOPES, O_PART, M_PART, L_PART,
                stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                stride_tab, num_seqs, group, head_size, head_size_v, keys_per_split, num_splits, scale, softcap,
                window, chunk, BS: tl.constexpr, KT: tl.constexpr, G_PAD: tl.constexpr, D_PAD: tl.constexpr,
                DV_PAD: tl.constexpr, S_PAD: tl.constexpr, CAUSAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                HAS_ALIBI: tl.constexpr, TF32: tl.constexpr):
    """One token's attention for one KV head (all its query heads, ``[G_PAD]`` rows) over one split of its
    keys: the split's unnormalised output ``O_PART[t, heads, s, :]``, maximum and sum (online softmax in float32).
    Keys go in tiles of ``KT`` (several blocks, or part of one), each key's block looked up in the table, so a
    program has a tile's loads in flight at once. ``TF32``: query and cache hold 16-bit values, which TF32 holds
    exactly, so the tensor cores' TF32 products of scores are exact (float32 sums), and the probabilities times V
    round only the probabilities (to 11 bits, under a 16-bit output's rounding); else both products in IEEE
    float32. Grid ``(tokens, KV heads, splits)``;
    see ``triton_paged`` for the arguments' meaning."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    num_hq = tl.num_programs(1) * group
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    dv = tl.arange(0, DV_PAD)
    kk = tl.arange(0, KT)
    heads = h * group + g  # [G_PAD] the KV head's query heads
    g_ok = g < group
    seq, q_pos, lo, hi = token_run(QSL, SEQ_LENS, t, num_seqs, window, chunk, S_PAD, CAUSAL)
    t64 = t.to(tl.int64)  # offsets in 64 bits: tokens x heads x splits x head size may pass 2**31
    q = tl.load(Q + t64 * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & (d < head_size)[None, :], other=0.0).to(tl.float32)  # [G_PAD, D_PAD]
    if HAS_ALIBI:
        slope = tl.load(SLOPES + heads, mask=g_ok, other=0.0)  # [G_PAD]
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, DV_PAD], tl.float32)
    k0 = tl.maximum(s * keys_per_split, lo)  # the split's visible keys [k0, k1)
    k1 = tl.minimum((s + 1) * keys_per_split, hi)
    row_tab = TABLES + seq * stride_tab
    for start in range(k0, k1, KT):
        k_pos = start + kk  # [KT]
        seen = k_pos < k1
        blk = tl.load(row_tab + k_pos // BS, mask=seen, other=0).to(tl.int64)  # [KT] each key's block
        slot = k_pos % BS
        k = tl.load(KC + blk[:, None] * stride_kb + slot[:, None] * stride_kt + h * stride_kh + d[None, :],
                    mask=seen[:, None] & (d < head_size)[None, :], other=0.0).to(tl.float32)  # [KT, D_PAD]
        if TF32:
            sc = tl.dot(q, tl.trans(k), input_precision="tf32") * scale  # [G_PAD, KT]
        else:
            sc = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        if HAS_SOFTCAP:  # softcap * tanh(sc / softcap); tanh from exp, within ~1e-7 of it
            sc = softcap * (1.0 - 2.0 / (tl.exp(2.0 * sc / softcap) + 1.0))
        if HAS_ALIBI:
            sc += slope[:, None] * (k_pos - q_pos).to(tl.float32)[None, :]
        sc = tl.where(seen[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: no NaN from -inf - -inf
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(sc - m_safe[:, None])  # [G_PAD, KT]
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(VC + blk[:, None] * stride_vb + slot[:, None] * stride_vt + h * stride_vh + dv[None, :],
                    mask=seen[:, None] & (dv < head_size_v)[None, :], other=0.0).to(tl.float32)  # [KT, DV_PAD]
        if TF32:
            pv = tl.dot(p, v, input_precision="tf32")
        else:
            pv = tl.dot(p, v, input_precision="ieee")
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    row = (t64 * num_hq + heads) * num_splits + s  # [G_PAD] rows of [T, Hq, splits]
    tl.store(M_PART + row, m_i, mask=g_ok)
    tl.store(L_PART + row, l_i, mask=g_ok)
    tl.store(O_PART + row[:, None] * head_size_v + dv[None, :], acc,
             mask=g_ok[:, None] & (dv < head_size_v)[None, :])


@triton.jit
def merge_splits(O_PART, M_PART, L_PART, SINKS, OUT, stride_ot, stride_oh, num_splits, head_size_v,
                 NS_PAD: tl.constexpr, DV_PAD: tl.constexpr, HAS_SINKS: tl.constexpr):
    """Token ``t``, query head ``h``: the splits' partial sums weighted by their maxima, over the sum of their
    normalisers (and the head's sink logit, which takes probability and adds no value), in ``OUT``'s dtype. A
    token that saw no key gets zeros. Grid ``(tokens, query heads)``."""
    t = tl.program_id(0).to(tl.int64)  # 64-bit offsets, as in paged_split
    h = tl.program_id(1)
    num_hq = tl.num_programs(1)
    i = tl.arange(0, NS_PAD)
    dv = tl.arange(0, DV_PAD)
    row = (t * num_hq + h) * num_splits + i  # [NS_PAD]
    ok = i < num_splits
    m = tl.load(M_PART + row, mask=ok, other=float("-inf"))
    l_s = tl.load(L_PART + row, mask=ok, other=0.0)
    top = tl.max(m, 0)
    if HAS_SINKS:
        sink = tl.load(SINKS + h).to(tl.float32)
        top = tl.maximum(top, sink)
    top = tl.where(top == float("-inf"), 0.0, top)  # a token that sees nothing
    w = tl.exp(m - top)  # [NS_PAD]; 0 for splits that saw nothing
    denom = tl.sum(l_s * w, 0)
    if HAS_SINKS:
        denom += tl.exp(sink - top)
    o = tl.load(O_PART + row[:, None] * head_size_v + dv[None, :], mask=ok[:, None] & (dv < head_size_v)[None, :],
                other=0.0)  # [NS_PAD, DV_PAD]
    out = tl.sum(o * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(OUT + t * stride_ot + h * stride_oh + dv, out.to(OUT.dtype.element_ty), mask=dv < head_size_v)


@triton.jit
def write_slots(K, V, KC, VC, SLOTS, stride_kt, stride_vt, stride_cb, stride_ct, stride_vcb, stride_vct, block_size,
                row_size, BLOCK: tl.constexpr):
    """Token ``t``'s K and V rows (``row_size`` contiguous elements: every KV head) into cache slot ``SLOTS[t]``;
    a slot below 0 (padding) writes nothing. Grid ``(tokens,)``."""
    t = tl.program_id(0).to(tl.int64)  # 64-bit offsets: tokens x row size may pass 2**31
    slot = tl.load(SLOTS + t).to(tl.int64)
    i = tl.arange(0, BLOCK)
    ok = i < tl.where(slot >= 0, row_size, 0)  # padding: no element
    blk = slot // block_size
    off = slot % block_size
    k = tl.load(K + t * stride_kt + i, mask=ok)
    v = tl.load(V + t * stride_vt + i, mask=ok)
    tl.store(KC + blk * stride_cb + off * stride_ct + i, k.to(KC.dtype.element_ty), mask=ok)
    tl.store(VC + blk * stride_vcb + off * stride_vct + i, v.to(VC.dtype.element_ty), mask=ok)
