"""What the always-on metadata checks cost a decode step, against the paged attention they guard.

Every ``paged_attention`` call checks shapes, dtypes and devices; the value checks (slots inside the
cache, sequence lengths inside their block tables) run once per step: later layers find the same
metadata tensors (same objects, same versions) and skip them. A step of ``L`` layers therefore pays
one full cheap check and ``L - 1`` memo hits, against ``L`` attention calls. All three are timed here,
in this process, on a decode batch (one new token per sequence over 1-2k keys).

    python benchmarks/check_cost.py [--layers 32] [--batch 16]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import paged_cases  # benchmarks/paged_cases.py, beside this script
import torch

from pagedattn.backends import AttentionParams, build_metadata, get_backend


def _median(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--repeats", type=int, default=50)
    a = p.parse_args(argv)
    hq, hkv, d, bs = 32, 8, 128, 16
    lens, cache, paged, _ = paged_cases.decode_case(a.batch, 1024, 2048, hq, hkv, d, torch.float32, bs, "cpu")
    backend = get_backend("cpu")
    tables = [list(range(i * 128, i * 128 + (L + bs - 1) // bs)) for i, L in enumerate(lens)]
    meta = build_metadata([(L - 1, 1, t) for L, t in zip(lens, tables)], bs)
    query = torch.randn(a.batch, hq, d)

    def fresh():  # a new step: new metadata tensors, so the value checks run
        m = dataclasses.replace(meta, block_tables=meta.block_tables.clone(), seq_lens=meta.seq_lens.clone(),
                                query_start_loc=meta.query_start_loc.clone())
        backend.check_attend(query, cache, m, _params(hkv, d))

    params = _params(hkv, d)

    def memo_hit():  # a later layer of the same step
        backend.check_attend(query, cache, meta, params)

    t_attend = _median(paged, a.repeats)
    t_full = _median(fresh, a.repeats)
    t_hit = _median(memo_hit, a.repeats * 4)
    step_checks = t_full + (a.layers - 1) * t_hit
    step_attn = a.layers * t_attend
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, batch {a.batch}, heads {hq}/{hkv}, "
          f"head size {d}, contexts {min(lens)}-{max(lens)}")
    print(f"paged attention call      {t_attend * 1e3:8.3f} ms")
    print(f"cheap checks, new step    {t_full * 1e6:8.1f} us")
    print(f"cheap checks, memo hit    {t_hit * 1e6:8.1f} us")
    print(f"per {a.layers}-layer step: checks {step_checks * 1e3:.3f} ms vs attention {step_attn * 1e3:.2f} ms "
          f"= {100 * step_checks / step_attn:.2f}%")


def _params(hkv, d) -> AttentionParams:
    return AttentionParams(scale=d ** -0.5, causal=True, sliding_window=0, softcap=0.0, alibi_slopes=None,
                           num_kv_heads=hkv, head_size_v=d)


if __name__ == "__main__":
    main()
