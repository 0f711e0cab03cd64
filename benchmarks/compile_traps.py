"""The two torch.compile traps, measured: recompiles over decode steps, and cache copies.

(a) 100 paged decode steps with batch sizes 2-8 and context lengths 1-200: graphs compiled.
(b) Decode step time with 8x more cache blocks: a functionalized cache write that clones the
    whole cache per layer would make the step grow with the cache.

    python benchmarks/compile_traps.py [--inner inductor|eager]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import torch
import torch._dynamo

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pagedattn  # noqa: E402
from pagedattn.backends import build_metadata  # noqa: E402
from tests.rewriter import zoo  # noqa: E402


def decode_step(c, caches, lengths, block_size=16):
    seqs, nxt = [], 0
    for L in lengths:
        n = -(-(L + 1) // block_size)
        seqs.append((L, 1, list(range(nxt, nxt + n))))
        nxt += n
    meta = build_metadata(seqs, block_size)
    with torch.no_grad(), pagedattn.paged_context(caches, meta):
        return c(torch.randn(1, len(lengths), zoo.C))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--inner", default="inductor", choices=["inductor", "eager"])
    a = p.parse_args(argv)
    logging.getLogger("pagedattn").setLevel(logging.ERROR)
    m = zoo.GQAExpand().eval()
    c = torch.compile(m, backend="pagedattn", options={"inner": a.inner})
    torch._dynamo.utils.counters.clear()
    caches = [torch.zeros(2, 256, 16, 2, zoo.D)]
    g = torch.Generator().manual_seed(0)
    graphs = []
    for _step in range(100):
        batch = int(torch.randint(2, 9, (1,), generator=g))
        decode_step(c, caches, torch.randint(1, 200, (batch,), generator=g).tolist())
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    print(f"(a) inner={a.inner}: Dynamo graphs compiled after step 1, 2, 10, 100: "
          f"{graphs[0]}, {graphs[1]}, {graphs[9]}, {graphs[99]} (recompiles after warm-up: {graphs[99] - graphs[0]})")
    lengths = [40, 75, 12, 130]
    for blocks in (32768, 262144):
        cs = [torch.zeros(2, blocks, 16, 2, zoo.D)]
        for _ in range(3):
            decode_step(c, cs, lengths)
        t = []
        for _ in range(30):
            t0 = time.perf_counter()
            decode_step(c, cs, lengths)
            t.append(time.perf_counter() - t0)
        t.sort()
        size = cs[0].numel() * cs[0].element_size() / 2**20
        print(f"(b) cache of {blocks:5} blocks ({size:5.0f} MiB): median decode step {t[len(t) // 2] * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
