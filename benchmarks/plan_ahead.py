"""Decode steps planned together (``PagedEngine(plan_ahead=16)``, the default) against steps planned one at a time
(``plan_ahead=1``), in one process on one engine, the two settings alternated so that a shared host's swings (1.4x
between minutes on a 2-vCPU EPYC) fall on both alike: ``generate_cpu.py``'s workload served whole, and decode steps
of ``--requests`` requests timed in runs of 16 steps. Prints each setting's median and best time and their ratio.

    python benchmarks/plan_ahead.py                          # llama16m, bf16
    python benchmarks/plan_ahead.py --dtype float32 --model llama34m --pairs 6
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import generate_cpu  # benchmarks/generate_cpu.py, beside this script
import torch

import pagedattn
from pagedattn.runtime.frames import call_with_frame_room

SETTINGS = (16, 1)


def _line(what: str, times: dict[int, list[float]], unit: float, label: str) -> str:
    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
    a, b = SETTINGS
    return (f"  {what}: plan_ahead={a} median {med[a] * unit:.3f} {label} (best {best[a] * unit:.3f}), plan_ahead={b} "
            f"median {med[b] * unit:.3f} (best {best[b] * unit:.3f}): {med[a] / med[b]:.3f}x the time "
            f"(best {best[a] / best[b]:.3f}x)")


def workload(engine, lengths, vocab: int, new: int, pairs: int, g: torch.Generator) -> dict[int, list[float]]:
    """Seconds to serve the workload with each setting, fresh prompts every time (no prefix-cache hits)."""
    times: dict[int, list[float]] = {k: [] for k in SETTINGS}
    for i in range(pairs):
        for k in SETTINGS if i % 2 == 0 else SETTINGS[::-1]:
            engine.plan_ahead = k
            prompts = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]
            t0 = time.perf_counter()
            engine.generate(prompts, max_new_tokens=new)
            times[k].append(time.perf_counter() - t0)
    return times


def decode_steps(engine, requests: int, context: int, vocab: int, pairs: int,
                 g: torch.Generator) -> dict[int, list[float]]:
    """Seconds a decode step at ``requests`` requests takes with each setting, over runs of 16 steps (a new plan at
    the first step of each). Each ``step()`` computes its own step here (``burst_ms=0``): a burst's steps computed
    ahead would fall in one window's ``step()`` calls and be timed in another's (``benchmarks/burst.py`` measures
    the bursts)."""
    burst, engine.burst_ms = engine.burst_ms, 0.0
    try:
        return _decode_steps(engine, requests, context, vocab, pairs, g)
    finally:
        engine.burst_ms = burst


def _decode_steps(engine, requests: int, context: int, vocab: int, pairs: int,
                  g: torch.Generator) -> dict[int, list[float]]:
    times: dict[int, list[float]] = {k: [] for k in SETTINGS}
    new = 2 * 17 * pairs + 8  # every step adds a token, the untimed first of each run too
    rids = [engine.add_request(torch.randint(1, vocab, (context,), generator=g).tolist(), max_new_tokens=new)
            for _ in range(requests)]
    while any(not r.output for r in engine.scheduler.running + list(engine.scheduler.waiting)):
        engine.step()

    def steps():
        with engine.bound():
            for _ in range(16):
                engine.step()

    for i in range(pairs):
        for k in SETTINGS if i % 2 == 0 else SETTINGS[::-1]:
            engine.plan_ahead = k
            engine.step()  # the first step of a run, planned (or not) with the new setting
            t0 = time.perf_counter()
            call_with_frame_room(steps)
            times[k].append((time.perf_counter() - t0) / 16)
    for rid in rids:
        engine.abort(rid)
    engine.collect()
    return times


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama16m", choices=sorted(generate_cpu.MODELS))
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--pairs", type=int, default=10, help="runs of each setting, alternated")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--context", type=int, default=176)
    a = p.parse_args(argv)
    logging.getLogger("pagedattn").setLevel(logging.ERROR)
    cfg, num_prompts, (shortest, longest), new = generate_cpu.MODELS[a.model]
    vocab = cfg["vocab_size"]
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(shortest, longest + 1, (num_prompts,), generator=g).tolist()
    model = generate_cpu.build(getattr(torch, a.dtype), "sdpa", a.model)
    blocks = max(sum(-(-(n + new) // 16) for n in lengths), a.requests * -(-(a.context + 34 * a.pairs + 8) // 16) + 16)
    engine = pagedattn.PagedEngine(model, num_blocks=blocks, block_size=16, max_num_tokens=1024, progress=False)
    engine.generate([[1] * n for n in (300, 7, 40, 2)], max_new_tokens=2)  # warm-up, as generate_cpu.py's
    print(f"{a.model} {a.dtype}, plan_ahead {SETTINGS[0]} against {SETTINGS[1]}, {a.pairs} runs of each alternated:")
    print(_line(f"workload ({num_prompts} prompts of {shortest}-{longest} tokens, {new} new)",
                workload(engine, lengths, vocab, new, a.pairs, g), 1, "s"))
    print(_line(f"decode step ({a.requests} requests, context {a.context}+)",
                decode_steps(engine, a.requests, a.context, vocab, a.pairs, g), 1e3, "ms"))


if __name__ == "__main__":
    main()
