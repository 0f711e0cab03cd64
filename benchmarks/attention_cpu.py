"""Paged decode vs contiguous SDPA on CPU, and paged prefill throughput.

Decode: batch of sequences with one new token each over contexts of 512-2048 tokens. The
baseline holds the same K/V contiguously ([B, Hkv, L, D]) and calls plain SDPA with
``enable_gqa`` and a key-padding mask; both run in this process, interleaved.

    python benchmarks/attention_cpu.py            # the figures in benchmarks/RESULTS.md
    python benchmarks/attention_cpu.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.nn.functional as F

import pagedattn  # noqa: F401  (registers torch.ops.pagedattn)
from pagedattn.backends import build_metadata, get_backend


def _time_pair(fa, fb, repeats: int) -> tuple[float, float]:
    """Median seconds of two functions, run alternately so drift hits both alike."""
    fa(), fb()  # warm-up
    ta, tb = [], []
    for _ in range(repeats):
        for fn, acc in ((fa, ta), (fb, tb)):
            t0 = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - t0)
    return statistics.median(ta), statistics.median(tb)


def decode_case(batch, ctx_lo, ctx_hi, hq, hkv, d, dtype, block_size, repeats, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(ctx_lo, ctx_hi + 1, (batch,), generator=g).tolist()
    backend = get_backend("cpu")
    need = [math.ceil(L / block_size) for L in lens]
    num_blocks = sum(need)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, pos = [], 0
    for n in need:
        tables.append(perm[pos:pos + n])
        pos += n
    cache = backend.allocate_kv_cache(num_blocks, block_size, hkv, d, dtype)
    max_len = max(lens)
    k_dense = torch.zeros(batch, hkv, max_len, d, dtype=dtype)
    v_dense = torch.zeros(batch, hkv, max_len, d, dtype=dtype)
    for i, L in enumerate(lens):
        k = torch.randn(L, hkv, d, generator=g).to(dtype)
        v = torch.randn(L, hkv, d, generator=g).to(dtype)
        k_dense[i, :, :L], v_dense[i, :, :L] = k.transpose(0, 1), v.transpose(0, 1)
        m = build_metadata([(0, L, tables[i])], block_size)
        torch.ops.pagedattn.write_kv_cache(k, v, cache, m.slot_mapping)
    meta = build_metadata([(L - 1, 1, t) for L, t in zip(lens, tables)], block_size)
    q = torch.randn(batch, hq, d, generator=g).to(dtype)
    scale = 1 / math.sqrt(d)
    pad_mask = (torch.arange(max_len)[None, :] < torch.tensor(lens)[:, None])[:, None, None, :]

    def paged():
        return torch.ops.pagedattn.paged_attention(
            q, None, None, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            scale, True, 0, 0.0, None, hkv, d)

    def contiguous():
        return F.scaled_dot_product_attention(q[:, :, None], k_dense, v_dense, attn_mask=pad_mask,
                                              scale=scale, enable_gqa=True)

    torch.testing.assert_close(paged().float(), contiguous()[:, :, 0].float(), atol=2e-2, rtol=2e-2)
    t_paged, t_contig = _time_pair(paged, contiguous, repeats)
    kv_bytes = 2 * sum(lens) * hkv * d * cache.element_size()
    return lens, t_paged, t_contig, kv_bytes


def prefill_case(num_seqs, seq_len, hq, hkv, d, dtype, block_size, repeats):
    backend = get_backend("cpu")
    need = math.ceil(seq_len / block_size)
    cache = backend.allocate_kv_cache(num_seqs * need, block_size, hkv, d, dtype)
    meta = build_metadata([(0, seq_len, list(range(i * need, (i + 1) * need))) for i in range(num_seqs)], block_size)
    T = num_seqs * seq_len
    q = torch.randn(T, hq, d).to(dtype)
    k = torch.randn(T, hkv, d).to(dtype)
    v = torch.randn(T, hkv, d).to(dtype)

    def step():
        torch.ops.pagedattn.write_kv_cache(k, v, cache, meta.slot_mapping)
        return torch.ops.pagedattn.paged_attention(
            q, k, v, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            1 / math.sqrt(d), True, 0, 0.0, None, hkv, d)

    def contiguous():
        qb = q.view(num_seqs, seq_len, hq, d).transpose(1, 2)
        kb = k.view(num_seqs, seq_len, hkv, d).transpose(1, 2)
        vb = v.view(num_seqs, seq_len, hkv, d).transpose(1, 2)
        return F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)

    t, t_c = _time_pair(step, contiguous, repeats)
    return T / t, T / t_c


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    a = p.parse_args(argv)
    torch.manual_seed(0)
    ranges = [(512, 512), (1024, 1024), (2048, 2048), (512, 2048)]
    if a.quick:
        ranges, a.repeats = [(128, 256)], 3
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, batch {a.batch}, "
          f"heads {a.heads}/{a.kv_heads}, head size {a.head_size}, block size {a.block_size}")
    print(f"{'dtype':9} {'context':>10} {'paged ms':>9} {'contig ms':>10} {'ratio':>6} {'paged GB/s':>11} {'contig GB/s':>12}")
    for dtype in (torch.float32, torch.bfloat16):
        for lo, hi in ranges:
            lens, tp, tc, nbytes = decode_case(a.batch, lo, hi, a.heads, a.kv_heads, a.head_size, dtype,
                                               a.block_size, a.repeats)
            ctx = f"{lo}" if lo == hi else f"{lo}-{hi}"
            print(f"{str(dtype)[6:]:9} {ctx:>10} {tp * 1e3:9.2f} {tc * 1e3:10.2f} {tp / tc:6.2f} "
                  f"{nbytes / tp / 1e9:11.1f} {nbytes / tc / 1e9:12.1f}")
    print()
    print(f"{'dtype':9} {'prefill':>14} {'paged tok/s':>12} {'contig tok/s':>13} {'contig/paged':>13}")
    for dtype in (torch.float32, torch.bfloat16):
        n, L = (2, 128) if a.quick else (4, 512)
        tps, tpc = prefill_case(n, L, a.heads, a.kv_heads, a.head_size, dtype, a.block_size, max(3, a.repeats // 4))
        print(f"{str(dtype)[6:]:9} {f'{n} x {L}':>14} {tps:12.0f} {tpc:13.0f} {tpc / tps:13.2f}")


if __name__ == "__main__":
    main()
