"""Triton kernels of the backends, imported on first use (``triton_paged``): only where Triton is installed.

Triton compiles them for the GPU, or runs them in its interpreter on CPU tensors when the process started with
``TRITON_INTERPRET=1`` (Triton decides that when it is imported)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["paged_split", "write_slots"]


@triton.jit
def paged_split(Q, KC, VC, TABLES, SEQ, QPOS, LO, HI, SLOPES, O_PART, M_PART, L_PART,
                stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                stride_tab, group, head_size, head_size_v, blocks_per_split, num_splits, scale, softcap,
                BS: tl.constexpr, G_PAD: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
                HAS_SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """One token's attention for one KV head (all its query heads, ``[G_PAD]`` rows) over one split of its
    block-table row: the split's unnormalised output ``O_PART[t, heads, s, :]``, maximum and sum (online softmax
    in float32). Grid ``(tokens, KV heads, splits)``; see ``triton_paged`` for the arguments' meaning."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    num_hq = tl.num_programs(1) * group
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    dv = tl.arange(0, DV_PAD)
    r = tl.arange(0, BS)
    heads = h * group + g  # [G_PAD] the KV head's query heads
    g_ok = g < group
    seq = tl.load(SEQ + t)
    q_pos = tl.load(QPOS + t)
    lo = tl.load(LO + t)  # keys [lo, hi) may be seen; hi <= lo: none
    hi = tl.load(HI + t)
    q = tl.load(Q + t * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & (d < head_size)[None, :], other=0.0).to(tl.float32)  # [G_PAD, D_PAD]
    if HAS_ALIBI:
        slope = tl.load(SLOPES + heads, mask=g_ok, other=0.0)  # [G_PAD]
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, DV_PAD], tl.float32)
    b0 = tl.maximum(s * blocks_per_split, lo // BS)
    b1 = tl.minimum((s + 1) * blocks_per_split, (hi + BS - 1) // BS)
    for b in range(b0, b1):
        blk = tl.load(TABLES + seq * stride_tab + b).to(tl.int64)
        k_pos = b * BS + r  # [BS]
        k = tl.load(KC + blk * stride_kb + r[:, None] * stride_kt + h * stride_kh + d[None, :],
                    mask=(d < head_size)[None, :], other=0.0).to(tl.float32)  # [BS, D_PAD]
        sc = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [G_PAD, BS]
        if HAS_SOFTCAP:  # softcap * tanh(sc / softcap); tanh from exp, within ~1e-7 of it
            sc = softcap * (1.0 - 2.0 / (tl.exp(2.0 * sc / softcap) + 1.0))
        if HAS_ALIBI:
            sc += slope[:, None] * (k_pos - q_pos).to(tl.float32)[None, :]
        seen = (k_pos >= lo) & (k_pos < hi)  # [BS]
        sc = tl.where(seen[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: no NaN from -inf - -inf
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(sc - m_safe[:, None])  # [G_PAD, BS]
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(VC + blk * stride_vb + r[:, None] * stride_vt + h * stride_vh + dv[None, :],
                    mask=(dv < head_size_v)[None, :], other=0.0).to(tl.float32)  # [BS, DV_PAD]
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    row = (t * num_hq + heads) * num_splits + s  # [G_PAD] rows of [T, Hq, splits]
    tl.store(M_PART + row, m_i, mask=g_ok)
    tl.store(L_PART + row, l_i, mask=g_ok)
    tl.store(O_PART + row[:, None] * head_size_v + dv[None, :], acc,
             mask=g_ok[:, None] & (dv < head_size_v)[None, :])



@triton.jit
def write_slots(K, V, KC, VC, SLOTS, stride_kt, stride_vt, stride_cb, stride_ct, stride_vcb, stride_vct, block_size,
                row_size, BLOCK: tl.constexpr):
    """Token ``t``'s K and V rows (``row_size`` contiguous elements: every KV head) into cache slot ``SLOTS[t]``;
    a slot below 0 (padding) writes nothing. Grid ``(tokens,)``."""
    t = tl.program_id(0)
    slot = tl.load(SLOTS + t).to(tl.int64)
    i = tl.arange(0, BLOCK)
    ok = i < tl.where(slot >= 0, row_size, 0)  # padding: no element
    blk = slot // block_size
    off = slot % block_size
    k = tl.load(K + t * stride_kt + i, mask=ok)
    v = tl.load(V + t * stride_vt + i, mask=ok)
    tl.store(KC + blk * stride_cb + off * stride_ct + i, k.to(KC.dtype.element_ty), mask=ok)
    tl.store(VC + blk * stride_vcb + off * stride_vct + i, v.to(VC.dtype.element_ty), mask=ok)
