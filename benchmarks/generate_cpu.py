"""Generation throughput on CPU: PagedEngine against Hugging Face baselines and against the machine's
limit, same process.

Workloads (``--model``): ``llama34m``, a random-weight Llama-style model (~34 M parameters), 32 prompts of
16-512 tokens, 128 new tokens each; ``llama16m``, issue 17's (15.6 M parameters: 6 layers, hidden 384,
GQA 6/2, vocab 8000), 16 prompts of 16-256 tokens, 48 new tokens each. Greedy. Baselines: (a) `generate`
on the left-padded batch (DynamicCache, sdpa), (b) `generate` one request at a time, (c) transformers'
continuous batching `generate_batch` (`attn_implementation="paged|sdpa"`, needs psutil on CPU). Also KV
bytes allocated per cached token against the padded cache, and the share of step time the engine spends around
the model call; ``--breakdown`` splits a decode step at the workload's batch into its native kernels (linears,
attention, cache writes, SiLU x up, argmax: timed inside the library by its kernel clock, ``native.kernel_clock``;
``torch.profiler``'s operator times where the step calls none) and the rest (Python, the runner and dispatch,
Inductor's small kernels, the threads' start and end).

Rounds (``--rounds``, default 3): the engine, the padded batch and ``generate_batch`` run in turn that many times,
each round on fresh prompts of the same lengths (the same steps, no prefix-cache hits from the round before). The
host's speed drifts by up to 1.6x within minutes on a shared VM, so every ratio is taken within a round and the
figures reported are the rounds' medians; the one-at-a-time baseline runs once.

Roofline (``benchmarks/roofline.py``): the machine's copy bandwidth and matmul rate are measured in this
process (before and after each round's engine run, and after the baselines; the fastest is used for the tables,
and each round's own pair for that round's fraction); every engine step is timed and
recorded, and its limit is what its weights, K/V and FLOPs cost at those rates. Printed per step kind
(decode-only / mixed / prefill-only) for the workload, and with ``--step-kinds`` for synthetic steps
(decode at batch 1/8/32/64, decode beside a prefill, a long prefill). ``--startup`` times the engine's
start in fresh processes: cold (an empty Inductor cache directory) and warm (the same directory again).

    python benchmarks/generate_cpu.py                 # the figures in benchmarks/RESULTS.md
    python benchmarks/generate_cpu.py --model llama16m --step-kinds --startup
    python benchmarks/generate_cpu.py --model llama16m --skip padded serial hf_cb --breakdown   # a decode step split
    python benchmarks/generate_cpu.py --quick         # a smoke run (4 prompts, 8 tokens)

On a shared CPU, a 2-thread run's times swing by up to 10x with the other jobs' load (OpenMP threads wait
for a descheduled sibling); ``--threads 1`` measures every runner and the machine at one thread, which
other jobs disturb far less.
"""

from __future__ import annotations

import argparse
import inspect
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import roofline  # benchmarks/roofline.py, beside this script
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

import pagedattn
from pagedattn.runtime.shapes import graph_count

# name -> (config, prompts, shortest and longest prompt, new tokens)
MODELS = {
    "llama34m": (dict(vocab_size=16000, hidden_size=512, intermediate_size=1408, num_hidden_layers=6,
                      num_attention_heads=8, num_key_value_heads=4), 32, (16, 512), 128),
    "llama16m": (dict(vocab_size=8000, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                      num_attention_heads=6, num_key_value_heads=2), 16, (16, 256), 48),
}


def build(dtype: torch.dtype, attn: str, name: str = "llama34m") -> LlamaForCausalLM:
    cfg = LlamaConfig(**MODELS[name][0], max_position_embeddings=1024, eos_token_id=None, bos_token_id=None,
                      pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    model.set_attn_implementation(attn)
    return model


def padded_generate(model, prompts, new):
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=0)
    kv_bytes = 2 * model.config.num_hidden_layers * len(prompts) * (width + new) * \
        model.config.num_key_value_heads * (model.config.hidden_size // model.config.num_attention_heads) * \
        next(model.parameters()).element_size()
    return [o[width:].tolist() for o in out], kv_bytes


def one_at_a_time(model, prompts, new):
    outs = []
    for p in prompts:
        with torch.no_grad():
            o = model.generate(input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        outs.append(o[0, len(p):].tolist())
    return outs


def hf_continuous(model, prompts, new, num_blocks, block_size, max_tokens):
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    cfg = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None)
    # the same cache size and token budget as the engine (its default sizes the cache from free memory); the
    # page size's keyword is page_size in transformers 5.18, block_size before
    names = inspect.signature(ContinuousBatchingConfig).parameters
    cb = ContinuousBatchingConfig(**{"page_size" if "page_size" in names else "block_size": block_size,
                                     "num_blocks": num_blocks, "max_batch_tokens": max_tokens})
    with torch.no_grad():
        res = model.generate_batch(inputs=prompts, generation_config=cfg, continuous_batching_config=cb,
                                   progress_bar=False)
    return [r.generated_tokens for r in res.values()]


def run_engine(engine, prompts, new):
    """Every request through ``engine``, each step timed and recorded: (outputs, seconds, recorder)."""
    rec = roofline.StepRecorder(engine)
    t0 = time.perf_counter()
    rids = [engine.add_request(p, max_new_tokens=new) for p in prompts]
    rec.run()
    seconds = time.perf_counter() - t0
    done = {r.request_id: r.tokens for r in engine.collect()}
    return [done[r] for r in rids], seconds, rec


def startup_times(model: str, dtype: str) -> tuple[float, float]:
    """Seconds to construct ``PagedEngine(model)`` (defaults) in a fresh process: with an empty Inductor
    cache directory, then with the same directory again."""
    times = []
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
        for _ in range(2):
            out = subprocess.run([sys.executable, __file__, "--startup-child", "--model", model, "--dtypes", dtype],
                                 env=env, capture_output=True, text=True, check=True)
            times.append(float(out.stdout.strip().splitlines()[-1]))
    return times[0], times[1]


def startup_child(model: str, dtype: str) -> None:
    m = build(getattr(torch, dtype), "sdpa", model)
    t0 = time.perf_counter()
    pagedattn.PagedEngine(m, num_blocks=256, block_size=16, max_num_tokens=1024, progress=False)
    print(time.perf_counter() - t0)


@dataclass(frozen=True)
class Round:
    """One round: each runner's seconds, the engine's greedy tokens and recorded steps, the machine measured right
    before and after the engine's run, and how many prompts gave the engine the padded batch's tokens."""
    seconds: dict
    tokens: list
    rec: object
    machines: tuple
    limit: float
    same: int
    padded_bytes: int


def fastest(machines) -> roofline.Machine:
    """The machine at its best copy and matmul figures among ``machines`` (measurements of one machine)."""
    return roofline.Machine(max(m.copy_bytes_per_s for m in machines), max(m.matmul_flops_per_s for m in machines),
                            machines[0].device, machines[0].threads)


def run_round(engine, model, cb_model, prompts, new, num_blocks, block_size, dtype, shape) -> Round:
    """The engine, then the padded batch and ``generate_batch`` (where given), on ``prompts``."""
    before = roofline.measure_machine(dtype)
    ours, t_ours, rec = run_engine(engine, prompts, new)
    after = roofline.measure_machine(dtype)
    seconds, same, padded_bytes = {"engine": t_ours}, 0, 0
    if model is not None:
        t0 = time.perf_counter()
        padded, padded_bytes = padded_generate(model, prompts, new)
        seconds["padded"] = time.perf_counter() - t0
        same = sum(x == y for x, y in zip(ours, padded))
    if cb_model is not None:
        try:
            t0 = time.perf_counter()
            hf_continuous(cb_model, prompts, new, num_blocks, block_size, 1024)
            seconds["hf_cb"] = time.perf_counter() - t0
        except Exception as e:  # e.g. psutil missing
            print(f"  generate_batch failed: {type(e).__name__}: {str(e)[:200]}")
    limit = roofline.summarise(rec.steps, shape, fastest((before, after)))["all"][2]
    return Round(seconds, ours, rec, (before, after), limit, same, padded_bytes)


def print_rounds(rounds, names) -> None:
    """A line per round: each runner's seconds, its ratio to the engine's, and the engine's fraction of the roofline
    at the machine measured around its own run."""
    if len(rounds) < 2:
        return
    print("  rounds (fresh prompts of the same lengths; the engine's roofline at the machine measured around its run):")
    for i, r in enumerate(rounds):
        t = r.seconds["engine"]
        rest = "".join(f", {names[k].replace('HF ', '')} {r.seconds[k]:.2f} s ({r.seconds[k] / t:.2f}x)"
                       for k in names if k in r.seconds)
        print(f"    {i + 1}: engine {t:.3f} s ({r.limit / t:.0%} of the roofline){rest}")
    fractions = [r.limit / r.seconds["engine"] for r in rounds]
    print(f"    median of the rounds' roofline fractions: {statistics.median(fractions):.0%} "
          f"(range {min(fractions):.0%}-{max(fractions):.0%})")


def print_roofline(name, rec, seconds, shape, machine):
    table = roofline.summarise(rec.steps, shape, machine)
    print(f"  roofline, {name} (per step: bytes it must move, FLOPs it must do, the limit at the machine's rates, "
          "the time it took):")
    print(roofline.COST_HEADER)
    for kind in ("decode", "mixed", "prefill", "all"):
        if kind in table:
            print(roofline.format_cost_row(kind if kind != "all" else "all steps", *table[kind]))
    n, stepped, limit, _ = table["all"]
    print(f"  workload: limit {limit:.3f} s, engine {seconds:.3f} s wall ({stepped:.3f} s in steps): "
          f"{limit / seconds:.0%} of the roofline ({seconds / limit:.2f}x the limit)")
    seq = roofline.sequential_limit(rec.steps, shape, machine)
    print(f"  with each step's matmuls and attention one after the other (as the CPU step runs them, no overlap): "
          f"limit {seq:.3f} s, the engine at {seq / seconds:.0%} of it")
    return limit


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="llama34m")
    p.add_argument("--prompts", type=int, default=None, help="default: the workload's")
    p.add_argument("--new", type=int, default=None, help="default: the workload's")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--skip", nargs="*", default=[], choices=["padded", "serial", "hf_cb"])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--eager", action="store_true", help="run the engine's paged graph without Inductor")
    p.add_argument("--step-kinds", action="store_true", help="also time synthetic step kinds against the roofline")
    p.add_argument("--startup", action="store_true", help="also time cold and warm engine starts (fresh processes)")
    p.add_argument("--breakdown", action="store_true",
                   help="also split a decode step's time at the workload's batch: its kernels against the rest")
    p.add_argument("--startup-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rounds", type=int, default=3,
                   help="runs of the engine and the batch baselines in turn, on fresh prompts; figures are medians")
    p.add_argument("--threads", type=int, default=None,
                   help="intra-op threads (default: torch's); 1 keeps ratios steady while other jobs load the CPU")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    logging.getLogger("pagedattn").setLevel(logging.ERROR)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)  # generate_batch's notes on the config
    if a.startup_child:
        return startup_child(a.model, a.dtypes[0])
    _, num_prompts, (shortest, longest), new = MODELS[a.model]
    a.prompts, a.new = a.prompts or num_prompts, a.new or new
    if a.quick:
        a.prompts, a.new, a.rounds = 4, 8, 1
    if a.rounds < 1:
        p.error("--rounds must be >= 1")
    vocab = MODELS[a.model][0]["vocab_size"]
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(shortest, longest + 1, (a.prompts,), generator=g).tolist()
    prompts = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]
    total_new = a.prompts * a.new
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.2f}; "
          f"{a.prompts} prompts of {min(lengths)}-{max(lengths)} tokens (sum {sum(lengths)}), {a.new} new tokens each")
    for dname in a.dtypes:
        dtype = getattr(torch, dname)
        machines = [roofline.measure_machine(dtype)]
        model = build(dtype, "sdpa", a.model)
        shape = roofline.ModelShape.of(model)
        n_params = sum(x.numel() for x in model.parameters())
        print(f"\n{dname}: Llama-style ({a.model}), {n_params / 1e6:.1f} M parameters")
        rows = []

        # pagedattn: cache sized for the batch (blocks are what the requests can use)
        block = 16
        need = sum(-(-(n + a.new) // block) for n in lengths)
        t0 = time.perf_counter()
        engine = pagedattn.PagedEngine(model, num_blocks=need, block_size=block, max_num_tokens=1024,
                                       compile=False if a.eager else None, progress=False)
        t_start = time.perf_counter() - t0
        # warm-up on other prompts (no prefix-cache hits later): caches, allocator, first-touch pages
        engine.generate([[1] * n for n in (300, 7, 40, 2)], max_new_tokens=2)
        engine.stats.update(steps=0, model_s=0.0, overhead_s=0.0, tokens=0)
        graphs = graph_count()
        cb_model = build(dtype, "paged|sdpa", a.model) if "hf_cb" not in a.skip else None
        padded_model = model if "padded" not in a.skip else None
        rounds = [run_round(engine, padded_model, cb_model, prompts if r == 0 else
                            [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths],
                            a.new, need, block, dtype, shape) for r in range(a.rounds)]
        recompiles = graph_count() - graphs
        machines += [m for r in rounds for m in r.machines]
        mid = sorted(rounds, key=lambda r: r.seconds["engine"])[len(rounds) // 2]  # the median engine run
        t_ours, rec = mid.seconds["engine"], mid.rec
        rows.append((f"pagedattn PagedEngine{' (eager)' if a.eager else ''}", t_ours))
        cached_tokens = sum(lengths) + total_new - a.prompts  # K/V written (the last token is never attended)
        paged_per_token = engine.kv_bytes / cached_tokens
        names = {"padded": "HF generate, padded batch", "hf_cb": "HF generate_batch (paged|sdpa)"}
        for key, name in names.items():
            if all(key in r.seconds for r in rounds):
                rows.append((name, statistics.median([r.seconds[key] for r in rounds])))
        padded_bytes = rounds[0].padded_bytes
        same = sum(r.same for r in rounds)
        if "serial" not in a.skip:
            t0 = time.perf_counter()
            serial = one_at_a_time(model, prompts, a.new)
            rows.append(("HF generate, one at a time", time.perf_counter() - t0))
            same_serial = sum(x == y for x, y in zip(rounds[0].tokens, serial))
        # the machine before, right after the engine's runs and after the baselines: the fastest figures are its
        # limit (load on a shared CPU varies; a limit measured under load would flatter every runner)
        machines.append(roofline.measure_machine(dtype))
        machine = fastest(machines)
        print(f"  machine: {machine.describe()} (best of {len(machines)} measurements: copy "
              f"{', '.join(f'{m.copy_bytes_per_s / 1e9:.1f}' for m in machines)} GB/s, matmul "
              f"{', '.join(f'{m.matmul_flops_per_s / 1e9:.0f}' for m in machines)} GFLOP/s; load average "
              f"{os.getloadavg()[0]:.2f})")
        print_rounds(rounds, names)
        limit = roofline.summarise(rec.steps, shape, machine)["all"][2]
        ratios = {names[k]: statistics.median([r.seconds[k] / r.seconds["engine"] for r in rounds]) for k in names
                  if all(k in r.seconds for r in rounds)}
        print(f"  {'method':32} {'seconds':>8} {'new tok/s':>10} {'pagedattn x':>12} {'limit/time':>10}"
              + ("   (medians of the rounds; 'pagedattn x' the median of the rounds' own ratios)" if a.rounds > 1
                 else ""))
        for name, t in rows:
            x = ratios.get(name, t / t_ours)
            print(f"  {name:32} {t:8.2f} {total_new / t:10.1f} {x:12.2f} {limit / t:10.0%}")
        print_roofline("the engine's steps on this workload", rec, t_ours, shape, machine)
        hf_limit = roofline.padded_batch_cost(shape, lengths, a.new).limit_s(machine)
        print(f"  (Hugging Face's padded batch must do at least: one prefill step of the batch, then {a.new - 1} "
              f"decode steps of it: limit {hf_limit:.3f} s, padding not counted)")
        print(f"  engine start (rewrite, compile, checks): {t_start:.2f} s in this process; recompiles during the "
              f"timed run: {recompiles}; steps {engine.stats['steps']}, "
              f"the engine's own work around the model call {100 * engine.overhead_share():.1f}% of step time "
              f"(--breakdown splits a step)")
        blocks_tokens = need * block
        # padding positions run the whole model too (attention aside, each costs what a real token does)
        ours_pos, padded_pos = sum(lengths) + total_new, a.prompts * (max(lengths) + a.new)
        print(f"  token positions through the model: pagedattn {ours_pos:,}, padded batch {padded_pos:,} "
              f"({padded_pos / ours_pos:.2f}x)")
        print(f"  KV bytes per cached token: pagedattn {paged_per_token:,.0f} "
              f"(waste {100 * (1 - cached_tokens / blocks_tokens):.1f}% in partly filled blocks)"
              + (f", padded cache {padded_bytes / cached_tokens:,.0f} ({padded_bytes / engine.kv_bytes:.2f}x)"
                 if "padded" not in a.skip else ""))
        if "serial" not in a.skip:
            print(f"  greedy tokens equal to one-at-a-time HF generate: {same_serial}/{a.prompts} prompts")
        if "padded" not in a.skip:
            print(f"  greedy tokens equal to padded-batch HF generate: {same}/{a.prompts * a.rounds} prompts "
                  f"({a.rounds} round{'s' if a.rounds > 1 else ''})")
        if a.step_kinds:
            # 64 requests of 256 tokens, their timed steps, a burst's edge at each end and a run's blocks reserved ahead
            kinds = pagedattn.PagedEngine(model, num_blocks=64 * -(-(256 + 64) // 16) + 128, block_size=16,
                                          max_num_tokens=1024, max_num_seqs=64, progress=False,
                                          compile=False if a.eager else None)
            print("  step kinds (synthetic steps through a fresh engine, per step):")
            with kinds.bound():  # the backend bound once for the steps, as generate's loop binds it
                for row in roofline.step_kinds(kinds, shape, machine, vocab=vocab):
                    print(row)
        if a.breakdown:
            with engine.bound():
                print(roofline.decode_breakdown(engine, vocab=vocab, batch=a.prompts))
        if a.startup:
            cold, warm = startup_times(a.model, dname)
            print(f"  engine start in a fresh process (defaults): cold {cold:.1f} s (empty Inductor cache), "
                  f"warm {warm:.1f} s (its on-disk cache from the cold start)")


if __name__ == "__main__":
    main()
