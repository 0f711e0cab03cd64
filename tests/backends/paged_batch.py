"""Builds random paged batches and a dense reference written independently of the backends."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from pagedattn.backends import build_metadata, get_backend


def dense_reference(q, k, v, context_len, scale, causal=True, window=0, softcap=0.0, alibi=None, sinks=None):
    """Plain matmul-softmax for one sequence in float64. q [Q, Hq, D]; k, v [L, Hkv, D]."""
    hq, hkv = q.shape[1], k.shape[1]
    k = k.double().repeat_interleave(hq // hkv, dim=1)
    v = v.double().repeat_interleave(hq // hkv, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    Q, L = q.shape[0], k.shape[0]
    qi = torch.arange(Q)[:, None] + context_len
    kj = torch.arange(L)[None, :]
    if alibi is not None:
        s = s + alibi.double()[:, None, None] * (kj - qi)[None]
    if causal:
        ok = kj <= qi
        if window > 0:
            ok = ok & (qi - kj < window)
        s = s.masked_fill(~ok[None], float("-inf"))
    if sinks is not None:  # one more logit per head, dropped after the softmax
        s = torch.cat([s, sinks.double()[:, None, None].expand(*s.shape[:2], 1)], -1)
        return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1)[..., :-1], v)
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)


@dataclass
class PagedBatch:
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: torch.Tensor
    meta: object
    full_k: list
    full_v: list
    contexts: list
    q_lens: list


def make_batch(
    seqs: list[tuple[int, int]],
    *,
    num_heads=4,
    num_kv_heads=2,
    head_size=64,
    block_size=16,
    dtype=torch.float32,
    shuffle_blocks=True,
    spare_blocks=3,
    pad_tokens=0,
    generator: Optional[torch.Generator] = None,
) -> PagedBatch:
    """``seqs`` is a list of (context_len, new_tokens); context K/V are already in the cache."""
    g = generator or torch.Generator().manual_seed(1234)
    backend = get_backend("cpu")
    need = [math.ceil((c + n) / block_size) for c, n in seqs]
    num_blocks = sum(need) + spare_blocks
    order = torch.randperm(num_blocks, generator=g).tolist() if shuffle_blocks else list(range(num_blocks))
    tables, pos = [], 0
    for n in need:
        tables.append(order[pos:pos + n])
        pos += n
    cache = backend.allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_size, dtype)
    cache.normal_(generator=g)  # stale garbage in unused slots must never be read
    full_k = [torch.randn(c + n, num_kv_heads, head_size, generator=g).to(dtype) for c, n in seqs]
    full_v = [torch.randn(c + n, num_kv_heads, head_size, generator=g).to(dtype) for c, n in seqs]
    # the cached context, written through the op as an earlier step would have
    ctx_specs = [(0, c, t) for (c, _), t in zip(seqs, tables) if c > 0]
    if ctx_specs:
        ctx_meta = build_metadata(ctx_specs, block_size)
        ks = torch.cat([k[:c] for k, (c, _) in zip(full_k, seqs) if c > 0])
        vs = torch.cat([v[:c] for v, (c, _) in zip(full_v, seqs) if c > 0])
        torch.ops.pagedattn.write_kv_cache(ks, vs, cache, ctx_meta.slot_mapping)
    meta = build_metadata(
        [(c, n, t) for (c, n), t in zip(seqs, tables)], block_size,
        pad_tokens_to=sum(n for _, n in seqs) + pad_tokens,
    )
    total = meta.num_tokens
    key = torch.randn(total, num_kv_heads, head_size, generator=g).to(dtype)
    value = torch.randn(total, num_kv_heads, head_size, generator=g).to(dtype)
    row = 0
    for (c, n), k, v in zip(seqs, full_k, full_v):
        key[row:row + n], value[row:row + n] = k[c:], v[c:]
        row += n
    query = torch.randn(total, num_heads, head_size, generator=g).to(dtype)
    return PagedBatch(query, key, value, cache, meta, full_k, full_v, [c for c, _ in seqs], [n for _, n in seqs])


def run_step(b: PagedBatch, scale, causal=True, window=0, softcap=0.0, alibi=None, pass_kv=True, sinks=None):
    torch.ops.pagedattn.write_kv_cache(b.key, b.value, b.kv_cache, b.meta.slot_mapping)
    return torch.ops.pagedattn.paged_attention(
        b.query, b.key if pass_kv else None, b.value if pass_kv else None, b.kv_cache,
        b.meta.block_tables, b.meta.seq_lens, b.meta.query_start_loc,
        scale, causal, window, softcap, alibi, b.key.shape[1], b.value.shape[2], sinks,
    )


def reference_step(b: PagedBatch, scale, causal=True, window=0, softcap=0.0, alibi=None, sinks=None):
    outs, row = [], 0
    for c, n, k, v in zip(b.contexts, b.q_lens, b.full_k, b.full_v):
        outs.append(dense_reference(b.query[row:row + n], k, v, c, scale, causal, window, softcap, alibi, sinks))
        row += n
    return torch.cat(outs)


def check_copy_and_swap(backend, device="cpu"):
    """copy_blocks within a cache and swap_blocks to another, in the [2, blocks, ...] layout."""
    cache = backend.allocate_kv_cache(6, 4, 2, 8, device=device)
    cache.normal_()
    orig = cache.clone()
    backend.copy_blocks(cache, torch.tensor([[0, 3], [2, 5]]))
    assert torch.equal(cache[:, 3], orig[:, 0]) and torch.equal(cache[:, 5], orig[:, 2])
    assert torch.equal(cache[:, 1], orig[:, 1])
    host = torch.zeros_like(cache)
    backend.swap_blocks(cache, host, torch.tensor([[1, 0], [4, 2]]))
    assert torch.equal(host[:, 0], cache[:, 1]) and torch.equal(host[:, 2], cache[:, 4])
    assert torch.all(host[:, 1] == 0)
