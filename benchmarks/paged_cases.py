"""The paged-vs-contiguous cases the attention benchmarks time, for any device.

Each builder returns the two functions to time: the paged op over a block-paged cache and
contiguous ``F.scaled_dot_product_attention`` over the same K/V laid out densely.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

import pagedattn  # noqa: F401  (registers torch.ops.pagedattn)
from pagedattn.backends import AttentionParams, build_metadata, get_backend


def decode_case(batch, ctx_lo, ctx_hi, hq, hkv, d, dtype, block_size, device="cpu", seed=0,
                mask_always=False) -> tuple[list[int], torch.Tensor, Callable, Callable]:
    """One new token per sequence over contexts of ``ctx_lo..ctx_hi`` keys (blocks shuffled).

    The contiguous baseline pads to the longest context with a key-padding mask (always, with
    ``mask_always``; otherwise only when lengths differ). Returns (lengths, cache, paged, contiguous).
    """
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(ctx_lo, ctx_hi + 1, (batch,), generator=g).tolist()
    backend = get_backend(device)
    need = [math.ceil(L / block_size) for L in lens]
    perm = torch.randperm(sum(need), generator=g).tolist()
    tables, pos = [], 0
    for n in need:
        tables.append(perm[pos:pos + n])
        pos += n
    cache = backend.allocate_kv_cache(sum(need), block_size, hkv, d, dtype, device)
    k_all = torch.randn(sum(lens), hkv, d, generator=g).to(device, dtype)  # [sum L, Hkv, D]
    v_all = torch.randn(sum(lens), hkv, d, generator=g).to(device, dtype)
    fill = build_metadata([(0, L, t) for L, t in zip(lens, tables)], block_size, device=device)
    torch.ops.pagedattn.write_kv_cache(k_all, v_all, cache, fill.slot_mapping)
    max_len = max(lens)
    k_dense = torch.zeros(batch, hkv, max_len, d, dtype=dtype, device=device)  # [B, Hkv, L, D]
    v_dense = torch.zeros_like(k_dense)
    row = 0
    for i, L in enumerate(lens):
        k_dense[i, :, :L], v_dense[i, :, :L] = k_all[row:row + L].transpose(0, 1), v_all[row:row + L].transpose(0, 1)
        row += L
    meta = build_metadata([(L - 1, 1, t) for L, t in zip(lens, tables)], block_size, device=device)
    q = torch.randn(batch, hq, d, generator=g).to(device, dtype)
    scale = 1 / math.sqrt(d)
    pad_mask = None
    if mask_always or ctx_lo != ctx_hi:
        pad_mask = (torch.arange(max_len, device=device)[None, :] < torch.tensor(lens, device=device)[:, None])
        pad_mask = pad_mask[:, None, None, :]  # [B, 1, 1, L]

    def paged():
        return torch.ops.pagedattn.paged_attention(
            q, None, None, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            scale, True, 0, 0.0, None, hkv, d)

    def contiguous():
        return F.scaled_dot_product_attention(q[:, :, None], k_dense, v_dense, attn_mask=pad_mask,
                                              scale=scale, enable_gqa=True)

    torch.testing.assert_close(paged().float(), contiguous()[:, :, 0].float(), atol=2e-2, rtol=2e-2)
    paged.inputs = (q, meta, scale)  # for callers that time other kernels on the same step
    return lens, cache, paged, contiguous


def prefill_case(num_seqs, seq_len, hq, hkv, d, dtype, block_size, device="cpu") -> tuple[int, Callable, Callable]:
    """Fresh prompts of ``seq_len`` tokens: the paged write + attention against causal SDPA.

    Returns (tokens, paged step, contiguous).
    """
    backend = get_backend(device)
    need = math.ceil(seq_len / block_size)
    cache = backend.allocate_kv_cache(num_seqs * need, block_size, hkv, d, dtype, device)
    meta = build_metadata([(0, seq_len, list(range(i * need, (i + 1) * need))) for i in range(num_seqs)],
                          block_size, device=device)
    T = num_seqs * seq_len
    q = torch.randn(T, hq, d, device=device, dtype=dtype)
    k = torch.randn(T, hkv, d, device=device, dtype=dtype)
    v = torch.randn(T, hkv, d, device=device, dtype=dtype)

    def step(causal: bool = True, **fields):
        """The step; ``fields``: more of the site's ``AttentionParams`` (a position program, its values)."""
        torch.ops.pagedattn.write_kv_cache(k, v, cache, meta.slot_mapping)
        params = AttentionParams(1 / math.sqrt(d), causal, 0, 0.0, None, hkv, d, **fields)
        return torch.ops.pagedattn.paged_attention(
            q, k, v, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, *params.args())

    def contiguous():
        qb = q.view(num_seqs, seq_len, hq, d).transpose(1, 2)  # [B, Hq, S, D]
        kb = k.view(num_seqs, seq_len, hkv, d).transpose(1, 2)
        vb = v.view(num_seqs, seq_len, hkv, d).transpose(1, 2)
        return F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)

    return T, step, contiguous
