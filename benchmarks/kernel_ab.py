"""A native attention kernel of this checkout against the same kernel of another commit, in one process.

Both libraries are built (``native.build_library``: the other one from ``git show REF:backends/csrc/...``) and run in
alternating rounds on the same inputs, so that a shared host's swings (1.4x between minutes on a 2-vCPU EPYC) fall on
both; each round's figure is the median of ``--calls`` calls. Prints each case's medians, the ratio of the medians and
the median of the rounds' ratios; the outputs of the two builds are compared too (they differ by float rounding at
most, or not at all).

- ``--kernel decode`` (the default): ``native.DecodeCall`` on a decode step (``paged_cases.decode_case``: one query
  token per sequence over a paged cache as the CPU backend allocates it, on huge pages, blocks in a shuffled order).
  ``cached``: the step's K/V read again call after call (in L2/L3 when they fit); ``from memory``: a 64 MB buffer read
  between calls, so that the step's K/V come from DRAM, as in a serving step whose weights have passed through the
  caches since (it empties them of the call's own state too: at a few hundred keys a sequence, ~50 us of a call's time
  is that). Also nanoseconds per (sequence, key) and the K/V bytes a second.
- ``--kernel prefill``: ``native.prefill`` over fresh causal prompts: ``mix``, the seven of a llama16m prefill step of
  the generate_cpu workload (96-235 tokens, 1,169 in all), and ``long``, one prompt of 1,020 tokens. Also GFLOP/s
  (4 * heads * head size per (query, visible key) pair).

    python benchmarks/kernel_ab.py --against d3c9df4           # decode, the serving shapes, bf16 and fp32
    python benchmarks/kernel_ab.py --against HEAD~1 --dtypes float16 --shapes 6/2x64
    python benchmarks/kernel_ab.py --against HEAD~1 --shapes 6/2x64 --contexts 60 200   # shorter sequences
    python benchmarks/kernel_ab.py --kernel prefill --against HEAD~1
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from typing import Callable

import paged_cases  # benchmarks/paged_cases.py, beside this script
import torch

from pagedattn.backends import native

# (query heads, KV heads, head size, sequences, context): llama16m's and llama34m's decode steps
# (benchmarks/generate_cpu.py), and a Llama-3-8B-shaped one
SHAPES = {"6/2x64": (6, 2, 64, 16, 400), "8/4x64": (8, 4, 64, 32, 330), "32/8x128": (32, 8, 128, 16, 400)}
# prompt lengths of a prefill call
PROMPTS = {"mix": [96, 235, 125, 224, 195, 103, 191], "long": [1020]}


def sources_at(ref: str) -> dict[str, bytes]:
    """The C library's files as commit ``ref`` has them."""
    return {name: subprocess.run(["git", "show", f"{ref}:backends/csrc/{name}"], check=True,
                                 capture_output=True).stdout for name in native.SOURCES}


def alternate(call: Callable[[str], None], rounds: int, calls: int, between: Callable[[], object] = lambda: None):
    """Each build's per-round median seconds, the builds taking turns round by round."""
    times = {"this": [], "other": []}
    for r in range(rounds):
        for name in ("this", "other") if r % 2 else ("other", "this"):
            each = []
            for _ in range(calls):
                between()
                t0 = time.perf_counter()
                call(name)
                each.append(time.perf_counter() - t0)
            times[name].append(statistics.median(each))
    this, other = statistics.median(times["this"]), statistics.median(times["other"])
    return this, other, statistics.median(a / b for a, b in zip(times["this"], times["other"]))


def compare_decode(libs: dict, shape: tuple, dtype: torch.dtype, from_memory: bool, rounds: int, calls: int) -> str:
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
    this, other, pairs = alternate(call, rounds, calls, flush.sum if from_memory else lambda: None)
    keys = sum(lens)
    kv_bytes = 2 * keys * kv_heads * head_size * cache.element_size()
    where = "from memory" if from_memory else "cached"
    return (f"  {heads}/{kv_heads}x{head_size} {seqs} x {context} {str(dtype)[6:]:8} {where:11}: this "
            f"{this * 1e6:7.1f} us, other {other * 1e6:7.1f} us: {this / other:.3f}x (rounds {pairs:.3f}); this "
            f"{this / keys * 1e9:5.1f} ns a key, {kv_bytes / this / 1e9:5.1f} GB/s of K/V; outputs differ by {diff:.1e}")


def compare_prefill(libs: dict, shape: tuple, dtype: torch.dtype, prompts: str, rounds: int, calls: int) -> str:
    heads, kv_heads, head_size = shape[:3]
    lens = PROMPTS[prompts]
    g = torch.Generator().manual_seed(0)
    tokens = sum(lens)
    query = torch.randn(tokens, heads, head_size, generator=g).to(dtype)  # [T, Hq, D]
    key, value = (torch.randn(tokens, kv_heads, head_size, generator=g).to(dtype) for _ in range(2))  # [T, Hkv, D]
    starts = [sum(lens[:i]) for i in range(len(lens))]
    items = torch.tensor([(s, n, 0, s, n, 0) for s, n in zip(starts, lens)])
    outs = {name: torch.empty_like(query) for name in libs}
    threads = torch.get_num_threads()

    def call(name):
        native.prefill(libs[name], outs[name], query, key, value, items, scale=head_size ** -0.5, causal=True,
                       window=0, num_threads=threads)

    for name in libs:
        call(name)
    diff = (outs["this"].float() - outs["other"].float()).abs().max().item()
    this, other, pairs = alternate(call, rounds, calls)
    flops = sum(4 * heads * head_size * n * (n + 1) // 2 for n in lens)
    return (f"  {heads}/{kv_heads}x{head_size} {prompts:4} ({len(lens)} x {min(lens)}-{max(lens)}) {str(dtype)[6:]:8}: "
            f"this {this * 1e3:6.3f} ms, other {other * 1e3:6.3f} ms: {this / other:.3f}x (rounds {pairs:.3f}); this "
            f"{flops / this / 1e9:5.1f} GFLOP/s; outputs differ by {diff:.1e}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", required=True, help="the other commit (any git revision)")
    p.add_argument("--kernel", choices=["decode", "prefill"], default="decode")
    p.add_argument("--shapes", nargs="+", default=None, choices=list(SHAPES),
                   help="default: all for decode, the two llama shapes for prefill")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32", "float16"])
    p.add_argument("--rounds", type=int, default=8, help="rounds of each build, alternated")
    p.add_argument("--calls", type=int, default=None, help="calls a round (default: 20 decode, 5 prefill)")
    p.add_argument("--contexts", nargs="+", type=int, default=None,
                   help="decode: keys a sequence (each within 50 of it), in place of each shape's own")
    a = p.parse_args(argv)
    shapes = a.shapes or (list(SHAPES) if a.kernel == "decode" else ["6/2x64", "8/4x64"])
    calls = a.calls or (20 if a.kernel == "decode" else 5)
    this, other = native.build_library(), native.build_library(sources=sources_at(a.against))
    if this is None or other is None:
        raise SystemExit("kernel_ab: the native library does not build here (a C compiler and torch's GNU OpenMP are "
                         "needed)")
    libs = {"this": this, "other": other}
    print(f"{a.kernel} kernel, this checkout against {a.against}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {a.rounds} rounds of {calls} calls each, alternated")
    # decode: cached, then from memory; prefill: each prompt set
    compare, cases = (compare_decode, (False, True)) if a.kernel == "decode" else (compare_prefill, tuple(PROMPTS))
    for name in shapes:
        for shape in [SHAPES[name]] if not a.contexts or a.kernel != "decode" else \
                [(*SHAPES[name][:4], context) for context in a.contexts]:
            for dtype in a.dtypes:
                for case in cases:
                    print(compare(libs, shape, getattr(torch, dtype), case, a.rounds, calls))


if __name__ == "__main__":
    main()
