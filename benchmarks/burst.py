"""Decode runs computed ahead in bursts (``PagedEngine(burst_ms=20)``, the default) against one step computed per
``step()`` (``burst_ms=0``: the run's inputs still built and checked once) and against steps planned one at a time
(``plan_ahead=1``), in one process on one engine, the settings alternated so that a shared host's swings (1.4x
between minutes on a 2-vCPU EPYC) fall on all alike: ``generate_cpu.py``'s workload served whole by ``generate``,
fresh prompts each time (no prefix-cache hits). Prints each setting's median and best time, their ratios to the
last setting's, and the steps the bursts computed ahead and dropped.

    python benchmarks/burst.py                          # llama16m, bf16
    python benchmarks/burst.py --dtype float32 --model llama34m --runs 8
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import generate_cpu  # benchmarks/generate_cpu.py, beside this script
import torch

import pagedattn

SETTINGS = (("burst_ms=20", {"burst_ms": 20.0, "plan_ahead": 16}),
            ("burst_ms=0", {"burst_ms": 0.0, "plan_ahead": 16}),
            ("plan_ahead=1", {"burst_ms": 0.0, "plan_ahead": 1}))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama16m", choices=sorted(generate_cpu.MODELS))
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--runs", type=int, default=20, help="runs of each setting, alternated (after one of each)")
    a = p.parse_args(argv)
    logging.getLogger("pagedattn").setLevel(logging.ERROR)
    cfg, count, (shortest, longest), new = generate_cpu.MODELS[a.model]
    model = generate_cpu.build(getattr(torch, a.dtype), "sdpa", a.model)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(shortest, longest + 1, (count,), generator=g).tolist()
    need = sum(-(-(n + new) // 16) for n in lengths)
    engine = pagedattn.PagedEngine(model, num_blocks=need, block_size=16, max_num_tokens=1024, progress=False)
    times: dict[str, list[float]] = {name: [] for name, _ in SETTINGS}
    counts = {"ahead_steps": 0, "dropped_steps": 0, "planned_steps": 0}
    for i in range(a.runs + 1):
        for name, setting in SETTINGS if i % 2 == 0 else SETTINGS[::-1]:
            for k, v in setting.items():
                setattr(engine, k, v)
            prompts = [torch.randint(1, cfg["vocab_size"], (n,), generator=g).tolist() for n in lengths]
            before = dict(engine.stats)
            t0 = time.perf_counter()
            engine.generate(prompts, max_new_tokens=new)
            if i:  # the first of each: warm-up
                times[name].append(time.perf_counter() - t0)
                if name == SETTINGS[0][0]:
                    for k in counts:
                        counts[k] += engine.stats[k] - before[k]
    base = SETTINGS[-1][0]
    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
    print(f"{a.model} {a.dtype}, the workload served whole ({count} prompts, {new} new tokens each), {a.runs} runs of "
          f"each setting alternated:")
    for name, _ in SETTINGS:
        print(f"  {name:13s} median {med[name] * 1e3:7.1f} ms ({med[name] / med[base]:.3f}x), best "
              f"{best[name] * 1e3:7.1f} ms ({best[name] / best[base]:.3f}x)")
    print(f"  {SETTINGS[0][0]}: {counts['ahead_steps']} of {counts['planned_steps']} planned steps computed ahead, "
          f"{counts['dropped_steps']} dropped")


if __name__ == "__main__":
    main()
