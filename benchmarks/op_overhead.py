"""The fixed cost of one ``paged_attention`` call: a tiny decode (1 sequence, 16 keys, 4/1 heads,
head size 16), where the kernel's own work is small and argument decoding, backend lookup and the
always-on checks show. Median of 2,000 calls.

    python benchmarks/op_overhead.py
"""

from __future__ import annotations

import statistics
import time

import paged_cases  # benchmarks/paged_cases.py, beside this script
import torch


def main() -> None:
    _, _, paged, _ = paged_cases.decode_case(1, 16, 16, 4, 1, 16, torch.float32, 16, "cpu", 0)
    for _ in range(50):
        paged()
    times = []
    for _ in range(2000):
        t0 = time.perf_counter()
        paged()
        times.append(time.perf_counter() - t0)
    print(f"paged_attention per call: {statistics.median(times) * 1e6:.1f} us")


if __name__ == "__main__":
    main()
