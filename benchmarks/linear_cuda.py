"""A decode step's linear layers on an NVIDIA GPU against the copy rate: how near cuBLAS reads the weights at
decode row counts, and whether another GEMM does better (issue 17: a batch-64 decode step's GEMMs read their
weights at ~0.42 of the copy rate on an H200, the largest share of the step's distance from its limit).

Shapes: TinyLlama-1.1B's linears as the engine's CUDA step runs them (q/k/v and gate/up joined by
ConcatLinears), 22 layers of distinct random bf16 weights (1.9 GB, far beyond L2), rows 1/8/32/64. Each
runner's 22 calls of one shape are captured in one CUDA graph and replayed (no launch cost from Python); the
figure is GPU time per call and the weights' bytes per second against a device-to-device copy measured here.

Runners:
  cublas     ``F.linear`` as Inductor's step calls it (cuBLAS's choice of kernel, split-K reduce included)
  cublaslt   the same after ``torch.backends.cuda.preferred_blas_library("cublaslt")``
  splitk     a Triton GEMM for few rows: each program one tile of output columns over one slice of K, the
             slices summed with fp32 atomics (the output zeroed and cast in the same graph); the best of a small
             grid of tiles, stages and splits per shape
  autotune   Inductor's max-autotune (Triton templates and cuBLAS benchmarked per shape), 64 rows only, with
             ``--autotune``

    python benchmarks/linear_cuda.py             # the figures in benchmarks/RESULTS.md (--autotune too)
    python benchmarks/linear_cuda.py --rows 64
"""

from __future__ import annotations

import argparse
import functools
import itertools
import time

import roofline  # benchmarks/roofline.py, beside this script
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# (name, in_features, out_features): TinyLlama's linears as the CUDA step joins them
SHAPES = (("qkv", 2048, 2560), ("o", 2048, 2048), ("gate_up", 2048, 11264), ("down", 5632, 2048))
LAYERS = 22


@triton.jit
def splitk_linear_kernel(x_ptr, w_ptr, out_ptr, M, N, K, k_blocks_per_split,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr):
    """out[M, N] (fp32, zeroed) += x[M, K] @ w[N, K]^T over one slice of K; x, w contiguous."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    k_start = pid_k * k_blocks_per_split * BK
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in tl.range(0, k_blocks_per_split, num_stages=STAGES):
        offs_k = k_start + kb * BK + tl.arange(0, BK)
        x = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :],
                    mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)  # [BM, BK]
        w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :],
                    mask=(offs_n[:, None] < N) & (offs_k[None, :] < K), other=0.0)  # [BN, BK]
        acc += tl.dot(x, tl.trans(w))
    tl.atomic_add(out_ptr + offs_m[:, None] * N + offs_n[None, :], acc,
                  mask=(offs_m[:, None] < M) & (offs_n[None, :] < N), sem="relaxed")


def splitk_linear(x: torch.Tensor, w: torch.Tensor, acc: torch.Tensor, cfg: tuple) -> torch.Tensor:
    """``x @ w.T`` through :func:`splitk_linear_kernel`; ``acc`` is an fp32 [M, N] scratch the call zeroes."""
    bn, bk, stages, warps, split = cfg
    m, k = x.shape
    n = w.shape[0]
    k_blocks = triton.cdiv(k, bk)
    per_split = triton.cdiv(k_blocks, split)
    acc.zero_()
    grid = (triton.cdiv(n, bn), triton.cdiv(k_blocks, per_split))
    splitk_linear_kernel[grid](x, w, acc, m, n, k, per_split, BM=max(16, triton.next_power_of_2(m)), BN=bn, BK=bk,
                               STAGES=stages, num_warps=warps)
    return acc.to(x.dtype)


def graph_seconds(calls, repeats: int = 20) -> float:
    """GPU seconds per call of ``calls`` (a list of thunks) captured in one CUDA graph and replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls[:2]:  # warm-up outside the capture (compiles, cuBLAS workspaces)
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return roofline.graph_replay_seconds(graph, repeats) / len(calls)


def splitk_configs(m: int, n: int, k: int, sms: int):
    """The grid searched: tiles, stages, warps, and the splits of K that give half a wave to four waves of programs
    (one split whatever the count)."""
    for bn, bk, stages, warps in itertools.product((64, 128), (64, 128), (3, 4), (4,)):
        n_tiles, k_blocks = -(-n // bn), -(-k // bk)
        for split in (1, 2, 4, 8, 16):
            if split <= k_blocks // 2 or split == 1:
                if n_tiles * split <= 4 * sms and (n_tiles * split >= sms // 2 or split == 1):
                    yield bn, bk, stages, warps, split


def runners(m: int, k: int, n: int, x: torch.Tensor, ws: list, sms: int, autotune: bool, in_time):
    """(runner, seconds per call, detail) for one shape at ``m`` rows, each runner over the 22 weights."""
    yield "cublas", graph_seconds([functools.partial(F.linear, x, w) for w in ws]), ""
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        yield "cublaslt", graph_seconds([functools.partial(F.linear, x, w) for w in ws]), ""
    finally:
        torch.backends.cuda.preferred_blas_library("default")
    ref = F.linear(x, ws[0]).float()
    if m in (8, 64) and in_time():
        acc = torch.empty(m, n, device="cuda", dtype=torch.float32)
        best = None
        for cfg in splitk_configs(m, n, k, sms):
            err = (splitk_linear(x, ws[0], acc, cfg).float() - ref).abs().max().item()
            if err > 0.05 * ref.abs().max().item():
                print(f"  splitk {cfg} wrong: max difference {err:.3g}")
                continue
            t = graph_seconds([functools.partial(splitk_linear, x, w, acc, cfg) for w in ws], repeats=10)
            if best is None or t < best[0]:
                best = (t, cfg)
        if best:
            yield "splitk", best[0], "bn, bk, stages, warps, split = " + str(best[1])
    if m == 64 and autotune and in_time():
        torch._dynamo.reset()
        fn = torch.compile(F.linear, mode="max-autotune-no-cudagraphs", dynamic=False)
        t0 = time.perf_counter()
        err = (fn(x, ws[0]).float() - ref).abs().max().item()
        built = time.perf_counter() - t0
        yield ("autotune", graph_seconds([functools.partial(fn, x, w) for w in ws]),
               f"compile {built:.0f} s, max difference {err:.3g}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="*", default=[1, 8, 32, 64])
    p.add_argument("--autotune", action="store_true", help="also Inductor's max-autotune at 64 rows (~50 s)")
    p.add_argument("--budget", type=float, default=150.0, help="seconds after which the slower parts are skipped")
    a = p.parse_args(argv)
    t_end = time.perf_counter() + a.budget
    props = torch.cuda.get_device_properties(0)
    machine = roofline.measure_machine(torch.bfloat16, device="cuda", copy_bytes=1 << 30, matmul_size=8192)
    print(f"{props.name}, torch {torch.__version__}, triton {triton.__version__}; {machine.describe()}")
    torch.manual_seed(0)
    weights = {name: [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(LAYERS)]
               for name, k, n in SHAPES}
    # "x copy": the weights' bytes a second against the copy's bytes (read + write) a second, as the roofline counts
    print(f"{'shape':8} {'rows':>4} {'runner':9} {'us/call':>8} {'GB/s':>7} {'x copy':>6}  detail")
    step_us: dict[tuple[int, str], float] = {}
    for m in a.rows:
        for name, k, n in SHAPES:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            nbytes = n * k * 2
            for runner, seconds, detail in runners(m, k, n, x, weights[name], props.multi_processor_count,
                                                   a.autotune, lambda: time.perf_counter() < t_end):
                step_us[(m, runner)] = step_us.get((m, runner), 0.0) + seconds * 1e6
                print(f"{name:8} {m:4} {runner:9} {seconds * 1e6:8.1f} {nbytes / seconds / 1e9:7.0f} "
                      f"{nbytes / seconds / machine.copy_bytes_per_s:6.2f}  {detail}", flush=True)
    print(f"per decode step ({LAYERS} layers of the four shapes), GPU time of the linears, where every shape ran:")
    for (m, runner), us in sorted(step_us.items()):
        print(f"  rows {m:3} {runner:9} {us * LAYERS / 1e3:7.3f} ms")


if __name__ == "__main__":
    main()
