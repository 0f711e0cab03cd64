"""The native decode kernel of this checkout against the kernel of another commit, in one process.

Both libraries are built (``native.build_library``: the other one from ``git show REF:backends/csrc/...``) and
called through ``native.DecodeCall`` on the same step (``paged_cases.decode_case``: one query token per sequence over
a paged cache as the CPU backend allocates it, on huge pages, blocks in a shuffled order). The two run in alternating rounds, so that a shared host's
swings (1.4x between minutes on a 2-vCPU EPYC) fall on both; each round's figure is the median of ``--calls`` calls.
``cached``: the step's K/V read again call after call (in L2/L3 when they fit); ``from memory``: a 64 MB buffer read
between calls, so that the step's K/V come from DRAM, as in a serving step whose weights have passed through the caches
since (it empties them of the call's own state too: at a few hundred keys a sequence, ~50 us of a call's time is
that). Prints each case's medians, the ratio of the medians and the median of the rounds' ratios, nanoseconds per
(sequence, key) and the K/V bytes a second; the outputs of the two builds are compared too (they differ by float
rounding at most).

    python benchmarks/decode_kernel_ab.py --against d3c9df4           # the serving shapes, bf16 and fp32
    python benchmarks/decode_kernel_ab.py --against HEAD~1 --dtypes float16 --shapes 6/2x64
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import paged_cases  # benchmarks/paged_cases.py, beside this script
import torch

from pagedattn.backends import native

# (query heads, KV heads, head size, sequences, context): llama16m's and llama34m's decode steps
# (benchmarks/generate_cpu.py), and a Llama-3-8B-shaped one
SHAPES = {"6/2x64": (6, 2, 64, 16, 400), "8/4x64": (8, 4, 64, 32, 330), "32/8x128": (32, 8, 128, 16, 400)}


def sources_at(ref: str) -> dict[str, bytes]:
    """The C library's files as commit ``ref`` has them."""
    return {name: subprocess.run(["git", "show", f"{ref}:backends/csrc/{name}"], check=True,
                                 capture_output=True).stdout for name in native.SOURCES}


def compare(libs: dict, shape: tuple, dtype: torch.dtype, from_memory: bool, rounds: int, calls: int) -> str:
    heads, kv_heads, head_size, seqs, context = shape
    # contexts within 50 of `context`, each sequence's blocks scattered over a cache the CPU backend allocates
    lens, cache, paged, _ = paged_cases.decode_case(seqs, max(1, context - 50), context + 50, heads, kv_heads,
                                                    head_size, dtype, 16)
    query, meta, scale = paged.inputs
    tables = meta.block_tables
    items = [(i, i, 0, n) for i, n in enumerate(lens)]
    part = native.part_keys(sum(lens), torch.get_num_threads(), cache.shape[2])
    runs = {name: native.DecodeCall(lib, items, part, torch.get_num_threads()) for name, lib in libs.items()}
    outs = {name: torch.empty_like(query) for name in libs}

    def call(name):
        runs[name](outs[name], query, cache, tables, scale, 0.0, None, None)

    for name in libs:
        call(name)
    diff = (outs["this"].float() - outs["other"].float()).abs().max().item()
    flush = torch.ones(16 << 20)  # 64 MB, read between calls
    times = {name: [] for name in libs}
    for r in range(rounds):
        for name in ("this", "other") if r % 2 else ("other", "this"):
            each = []
            for _ in range(calls):
                if from_memory:
                    flush.sum()
                t0 = time.perf_counter()
                call(name)
                each.append(time.perf_counter() - t0)
            times[name].append(statistics.median(each))
    this, other = statistics.median(times["this"]), statistics.median(times["other"])
    pairs = statistics.median(a / b for a, b in zip(times["this"], times["other"]))
    keys = sum(lens)
    kv_bytes = 2 * keys * kv_heads * head_size * cache.element_size()
    where = "from memory" if from_memory else "cached"
    return (f"  {heads}/{kv_heads}x{head_size} {seqs} x {context} {str(dtype)[6:]:8} {where:11}: this "
            f"{this * 1e6:7.1f} us, other {other * 1e6:7.1f} us: {this / other:.3f}x (rounds {pairs:.3f}); this "
            f"{this / keys * 1e9:5.1f} ns a key, {kv_bytes / this / 1e9:5.1f} GB/s of K/V; outputs differ by {diff:.1e}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", required=True, help="the other commit (any git revision)")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32", "float16"])
    p.add_argument("--rounds", type=int, default=8, help="rounds of each build, alternated")
    p.add_argument("--calls", type=int, default=20, help="calls a round")
    a = p.parse_args(argv)
    this, other = native.build_library(), native.build_library(sources=sources_at(a.against))
    if this is None or other is None:
        raise SystemExit("decode_kernel_ab: the native library does not build here (a C compiler and torch's GNU "
                         "OpenMP are needed)")
    libs = {"this": this, "other": other}
    print(f"decode kernel, this checkout against {a.against}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {a.rounds} rounds of {a.calls} calls each, alternated")
    for name in a.shapes:
        for dtype in a.dtypes:
            for from_memory in (False, True):
                print(compare(libs, SHAPES[name], getattr(torch, dtype), from_memory, a.rounds, a.calls))


if __name__ == "__main__":
    main()
