"""Paged decode vs contiguous SDPA on CPU, and paged prefill throughput (native kernel, SDPA path, contiguous SDPA).

Decode: batch of sequences with one new token each over contexts of 512-2048 tokens. The
baseline holds the same K/V contiguously ([B, Hkv, L, D]) and calls plain SDPA with
``enable_gqa`` and a key-padding mask. The paged op runs twice: through the native kernel (the default) and
through the SDPA path (``PAGEDATTN_NATIVE=0``: blocks gathered, then SDPA's flash kernel); all three run in this
process, interleaved. ``of copy`` is the native path's K/V read rate against the machine's copy rate (read + write,
``roofline.measure_machine``): a decode must read its K/V once.

    python benchmarks/attention_cpu.py            # the figures in benchmarks/RESULTS.md
    python benchmarks/attention_cpu.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import paged_cases  # benchmarks/paged_cases.py, beside this script
import roofline
import torch


def _time_all(fns, repeats: int) -> list[float]:
    """Median seconds of each function, run in turn so drift hits all alike."""
    for fn in fns:  # warm-up
        fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, acc in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def _sdpa_path(fn):
    """``fn`` with the paged op's decodes on the SDPA path (gathered blocks, SDPA's flash kernel)."""
    def run():
        before = os.environ.get("PAGEDATTN_NATIVE")
        os.environ["PAGEDATTN_NATIVE"] = "0"
        try:
            return fn()
        finally:
            if before is None:
                del os.environ["PAGEDATTN_NATIVE"]
            else:
                os.environ["PAGEDATTN_NATIVE"] = before
    return run


def decode_case(batch, ctx_lo, ctx_hi, hq, hkv, d, dtype, block_size, repeats, seed=0):
    lens, cache, paged, contiguous = paged_cases.decode_case(batch, ctx_lo, ctx_hi, hq, hkv, d, dtype, block_size,
                                                             "cpu", seed, mask_always=True)
    t_paged, t_sdpa, t_contig = _time_all((paged, _sdpa_path(paged), contiguous), repeats)
    kv_bytes = 2 * sum(lens) * hkv * d * cache.element_size()
    return lens, t_paged, t_sdpa, t_contig, kv_bytes


def prefill_case(num_seqs, seq_len, hq, hkv, d, dtype, block_size, repeats):
    """Tokens per second of a paged prefill step (write + attend) through the native kernel and through SDPA
    (``PAGEDATTN_NATIVE=0``), and of contiguous SDPA on the same tensors."""
    T, step, contiguous = paged_cases.prefill_case(num_seqs, seq_len, hq, hkv, d, dtype, block_size, "cpu")
    t, t_s, t_c = _time_all((step, _sdpa_path(step), contiguous), repeats)
    return T / t, T / t_s, T / t_c


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
    copy = roofline.measure_machine().copy_bytes_per_s
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, batch {a.batch}, "
          f"heads {a.heads}/{a.kv_heads}, head size {a.head_size}, block size {a.block_size}; "
          f"machine copy rate {copy / 1e9:.1f} GB/s (read + write)")
    print(f"{'dtype':9} {'context':>10} {'paged ms':>9} {'sdpa-path ms':>13} {'contig ms':>10} {'ratio':>6} "
          f"{'paged GB/s':>11} {'of copy':>8} {'contig GB/s':>12}")
    for dtype in (torch.float32, torch.bfloat16):
        for lo, hi in ranges:
            lens, tp, ts, tc, nbytes = decode_case(a.batch, lo, hi, a.heads, a.kv_heads, a.head_size, dtype,
                                                   a.block_size, a.repeats)
            ctx = f"{lo}" if lo == hi else f"{lo}-{hi}"
            print(f"{str(dtype)[6:]:9} {ctx:>10} {tp * 1e3:9.2f} {ts * 1e3:13.2f} {tc * 1e3:10.2f} {tp / tc:6.2f} "
                  f"{nbytes / tp / 1e9:11.1f} {nbytes / tp / copy:8.0%} {nbytes / tc / 1e9:12.1f}")
    print()
    print("prefill steps (causal, every sequence fresh): tokens per second")
    print(f"{'dtype':9} {'heads':>9} {'prefill':>14} {'paged tok/s':>12} {'sdpa-path tok/s':>16} "
          f"{'contig tok/s':>13} {'paged/sdpa-path':>16} {'paged/contig':>13}")
    shapes = [(a.heads, a.kv_heads, a.head_size), (6, 2, 64)]  # the default, and llama16m's (benchmarks/generate_cpu)
    sizes = [(2, 128)] if a.quick else [(16, 64), (8, 256), (4, 512), (1, 1024)]
    for dtype in (torch.float32, torch.bfloat16):
        for hq, hkv, d in shapes:
            for n, L in sizes:
                tp, ts, tc = prefill_case(n, L, hq, hkv, d, dtype, a.block_size, max(3, a.repeats // 4))
                print(f"{str(dtype)[6:]:9} {f'{hq}/{hkv}x{d}':>9} {f'{n} x {L}':>14} {tp:12.0f} {ts:16.0f} "
                      f"{tc:13.0f} {tp / ts:16.2f} {tp / tc:13.2f}")

if __name__ == "__main__":
    main()
