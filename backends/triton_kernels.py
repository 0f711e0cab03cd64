"""Triton kernels of the backends, imported on first use (``triton_paged``): only where Triton is installed.

Triton compiles them for the GPU, or runs them in its interpreter on CPU tensors when the process started with
``TRITON_INTERPRET=1`` (Triton decides that when it is imported)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["visible_keys", "token_run", "attend_keys", "paged_split", "paged_tiles", "merge_splits", "write_slots"]


@triton.jit
def visible_keys(q_pos, kv_len, seen, window, chunk, CAUSAL: tl.constexpr):
    """The keys ``[lo, hi)`` a query at ``q_pos`` of a sequence of ``kv_len`` keys may see (the reference's
    visibility: causal with a window or chunk, or every key of the sequence); none (``hi == lo``) where ``seen``
    is false, the sequence is empty or the query comes before its first position. Elementwise."""
    lo = tl.zeros_like(q_pos)
    if CAUSAL:
        if window > 0:
            lo = tl.maximum(lo, q_pos - window + 1)
        if chunk > 0:
            lo = tl.maximum(lo, q_pos - q_pos % chunk)
        hi = q_pos + 1
    else:
        hi = lo + kv_len
    hi = tl.where(seen & (kv_len > 0) & (q_pos >= 0), tl.minimum(hi, kv_len), lo)
    return lo, hi


@triton.jit
def token_run(QSL, SEQ_LENS, t, num_seqs, window, chunk, S_PAD: tl.constexpr, CAUSAL: tl.constexpr):
    """Token ``t``'s sequence, position and the keys ``[lo, hi)`` it may see (:func:`visible_keys`). A padding
    token (past the last sequence's rows) sees none."""
    i = tl.arange(0, S_PAD)
    ends = tl.load(QSL + 1 + i, mask=i < num_seqs, other=2147483647)  # [S_PAD] each sequence's end row
    seq = tl.sum((ends <= t).to(tl.int32), 0)  # sequences that end at or before t
    real = seq < num_seqs
    seq = tl.minimum(seq, num_seqs - 1)
    kv_len = tl.load(SEQ_LENS + seq).to(tl.int64)
    end = tl.load(QSL + 1 + seq).to(tl.int64)
    q_pos = kv_len - (end - t)
    lo, hi = visible_keys(q_pos, kv_len, real, window, chunk, CAUSAL)
    return seq, q_pos, lo, hi


@triton.jit
def attend_keys(q, q_pos, lo, hi, slope, row_tab, KC, VC, h, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt,
                stride_vh, head_size, head_size_v, scale, softcap, k0, k1, R: tl.constexpr, BS: tl.constexpr,
                KT: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                HAS_ALIBI: tl.constexpr, TF32: tl.constexpr):
    """``R`` query rows ``q`` ``[R, D_PAD]`` (float32; one sequence, KV head ``h``) over the keys ``[k0, k1)``
    of the sequence's block-table row ``row_tab``, row ``r`` seeing keys ``[lo[r], hi[r])``: the unnormalised
    output ``[R, DV_PAD]``, maximum and sum (online softmax in float32). Keys go in tiles of ``KT`` (several
    blocks, or part of one), each key's block looked up in the table, so a program has a tile's loads in flight
    at once. ``TF32``: query and cache hold 16-bit values, which TF32 holds exactly, so the tensor cores' TF32
    products of scores are exact (float32 sums), and the probabilities times V round only the probabilities (to
    11 bits, under a 16-bit output's rounding); else both products in IEEE float32."""
    d = tl.arange(0, D_PAD)
    dv = tl.arange(0, DV_PAD)
    kk = tl.arange(0, KT)
    m_i = tl.full([R], float("-inf"), tl.float32)
    l_i = tl.zeros([R], tl.float32)
    acc = tl.zeros([R, DV_PAD], tl.float32)
    for start in range(k0, k1, KT):
        k_pos = start + kk  # [KT]
        in_run = k_pos < k1
        blk = tl.load(row_tab + k_pos // BS, mask=in_run, other=0).to(tl.int64)  # [KT] each key's block
        slot = k_pos % BS
        k = tl.load(KC + blk[:, None] * stride_kb + slot[:, None] * stride_kt + h * stride_kh + d[None, :],
                    mask=in_run[:, None] & (d < head_size)[None, :], other=0.0).to(tl.float32)  # [KT, D_PAD]
        if TF32:
            sc = tl.dot(q, tl.trans(k), input_precision="tf32") * scale  # [R, KT]
        else:
            sc = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        if HAS_SOFTCAP:  # softcap * tanh(sc / softcap); tanh from exp, within ~1e-7 of it
            sc = softcap * (1.0 - 2.0 / (tl.exp(2.0 * sc / softcap) + 1.0))
        if HAS_ALIBI:
            sc += slope[:, None] * (k_pos[None, :] - q_pos[:, None]).to(tl.float32)
        seen = in_run[None, :] & (k_pos[None, :] >= lo[:, None]) & (k_pos[None, :] < hi[:, None])  # [R, KT]
        sc = tl.where(seen, sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: no NaN from -inf - -inf
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(sc - m_safe[:, None])  # [R, KT]
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(VC + blk[:, None] * stride_vb + slot[:, None] * stride_vt + h * stride_vh + dv[None, :],
                    mask=in_run[:, None] & (dv < head_size_v)[None, :], other=0.0).to(tl.float32)  # [KT, DV_PAD]
        if TF32:
            pv = tl.dot(p, v, input_precision="tf32")
        else:
            pv = tl.dot(p, v, input_precision="ieee")
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def paged_split(Q, KC, VC, TABLES, QSL, SEQ_LENS, SLOPES, O_PART, M_PART, L_PART,
                stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                stride_tab, num_seqs, group, head_size, head_size_v, keys_per_split, num_splits, scale, softcap,
                window, chunk, BS: tl.constexpr, KT: tl.constexpr, G_PAD: tl.constexpr, D_PAD: tl.constexpr,
                DV_PAD: tl.constexpr, S_PAD: tl.constexpr, CAUSAL: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                HAS_ALIBI: tl.constexpr, TF32: tl.constexpr):
    """One token's attention for one KV head (all its query heads, ``[G_PAD]`` rows) over one split of its
    keys (:func:`attend_keys`): the split's unnormalised output ``O_PART[t, heads, s, :]``, maximum and sum.
    Grid ``(tokens, KV heads, splits)``: the decode kernel; see ``triton_paged`` for the arguments' meaning."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    num_hq = tl.num_programs(1) * group
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    dv = tl.arange(0, DV_PAD)
    heads = h * group + g  # [G_PAD] the KV head's query heads
    g_ok = g < group
    seq, q_pos, lo, hi = token_run(QSL, SEQ_LENS, t, num_seqs, window, chunk, S_PAD, CAUSAL)
    t64 = t.to(tl.int64)  # offsets in 64 bits: tokens x heads x splits x head size may pass 2**31
    q = tl.load(Q + t64 * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & (d < head_size)[None, :], other=0.0).to(tl.float32)  # [G_PAD, D_PAD]
    if HAS_ALIBI:
        slope = tl.load(SLOPES + heads, mask=g_ok, other=0.0)  # [G_PAD]
    else:
        slope = tl.zeros([G_PAD], tl.float32)
    rows0 = tl.zeros([G_PAD], tl.int64)  # the token's values, one per row
    m_i, l_i, acc = attend_keys(q, rows0 + q_pos, rows0 + lo, rows0 + hi, slope, TABLES + seq * stride_tab, KC, VC,
                                h, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, head_size,
                                head_size_v, scale, softcap, tl.maximum(s * keys_per_split, lo),
                                tl.minimum((s + 1) * keys_per_split, hi), G_PAD, BS, KT, D_PAD, DV_PAD, HAS_SOFTCAP,
                                HAS_ALIBI, TF32)
    row = (t64 * num_hq + heads) * num_splits + s  # [G_PAD] rows of [T, Hq, splits]
    tl.store(M_PART + row, m_i, mask=g_ok)
    tl.store(L_PART + row, l_i, mask=g_ok)
    tl.store(O_PART + row[:, None] * head_size_v + dv[None, :], acc,
             mask=g_ok[:, None] & (dv < head_size_v)[None, :])


@triton.jit
def paged_tiles(Q, KC, VC, TABLES, QSL, SEQ_LENS, SLOPES, O_PART, M_PART, L_PART,
                stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                stride_tab, num_seqs, group, head_size, head_size_v, keys_per_split, num_splits, scale, softcap,
                window, chunk, BQ: tl.constexpr, R: tl.constexpr, BS: tl.constexpr, KT: tl.constexpr,
                D_PAD: tl.constexpr, DV_PAD: tl.constexpr, S_PAD: tl.constexpr, CAUSAL: tl.constexpr,
                HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, TF32: tl.constexpr):
    """``BQ`` consecutive query tokens of one sequence with all the query heads of one KV head (``BQ x group``
    rows of ``R``) over one split of the sequence's keys (:func:`attend_keys`), so that a tile of K/V serves every
    row: prefills and mixed steps. Sequence ``i``'s tiles are programs ``QSL[i] // BQ + i`` on (one more than its
    queries need at most); a program past its sequence's queries does nothing. Grid
    ``(tokens // BQ + sequences, KV heads, splits)``; padding tokens (past the last sequence) belong to no tile
    (``merge_splits`` gives them zeros)."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    num_hq = tl.num_programs(1) * group
    i = tl.arange(0, S_PAD)
    first_tile = tl.load(QSL + i, mask=i < num_seqs, other=0) // BQ + i  # [S_PAD]
    seq = tl.sum(((first_tile <= pid) & (i >= 1) & (i < num_seqs)).to(tl.int32), 0)
    q_start = tl.load(QSL + seq).to(tl.int64)
    q_end = tl.load(QSL + seq + 1).to(tl.int64)
    kv_len = tl.load(SEQ_LENS + seq).to(tl.int64)
    first = q_start + (pid - (q_start // BQ + seq)) * BQ  # the tile's first token
    r = tl.arange(0, R)
    t = first + r // group  # [R] each row's token and query head
    heads = h * group + r % group
    ok = (r < BQ * group) & (t < q_end)
    q_pos = kv_len - (q_end - t)
    lo, hi = visible_keys(q_pos, kv_len, ok, window, chunk, CAUSAL)
    d = tl.arange(0, D_PAD)
    dv = tl.arange(0, DV_PAD)
    q = tl.load(Q + t[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=ok[:, None] & (d < head_size)[None, :], other=0.0).to(tl.float32)  # [R, D_PAD]
    if HAS_ALIBI:
        slope = tl.load(SLOPES + heads, mask=ok, other=0.0)  # [R]
    else:
        slope = tl.zeros([R], tl.float32)
    k0 = tl.maximum(s * keys_per_split, tl.min(tl.where(ok, lo, 2**62), 0))  # the rows' keys in this split
    k1 = tl.minimum((s + 1) * keys_per_split, tl.max(tl.where(ok, hi, 0), 0))
    m_i, l_i, acc = attend_keys(q, q_pos, lo, hi, slope, TABLES + seq * stride_tab, KC, VC, h, stride_kb, stride_kt,
                                stride_kh, stride_vb, stride_vt, stride_vh, head_size, head_size_v, scale, softcap,
                                k0, k1, R, BS, KT, D_PAD, DV_PAD, HAS_SOFTCAP, HAS_ALIBI, TF32)
    row = (t * num_hq + heads) * num_splits + s  # [R] rows of [T, Hq, splits]
    tl.store(M_PART + row, m_i, mask=ok)
    tl.store(L_PART + row, l_i, mask=ok)
    tl.store(O_PART + row[:, None] * head_size_v + dv[None, :], acc, mask=ok[:, None] & (dv < head_size_v)[None, :])


@triton.jit
def merge_splits(O_PART, M_PART, L_PART, SINKS, OUT, QSL, num_seqs, stride_ot, stride_oh, num_splits, head_size_v,
                 NS_PAD: tl.constexpr, DV_PAD: tl.constexpr, HAS_SINKS: tl.constexpr):
    """Token ``t``, query head ``h``: the splits' partial sums weighted by their maxima, over the sum of their
    normalisers (and the head's sink logit, which takes probability and adds no value), in ``OUT``'s dtype. A
    token that saw no key, and a padding token (past ``QSL[num_seqs]``: no partial sums were written for it),
    gets zeros. Grid ``(tokens, query heads)``."""
    t = tl.program_id(0).to(tl.int64)  # 64-bit offsets, as in paged_split
    h = tl.program_id(1)
    num_hq = tl.num_programs(1)
    i = tl.arange(0, NS_PAD)
    dv = tl.arange(0, DV_PAD)
    row = (t * num_hq + h) * num_splits + i  # [NS_PAD]
    ok = i < tl.where(t < tl.load(QSL + num_seqs), num_splits, 0)  # a padding token: no split
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
