"""Generation on an NVIDIA GPU against its roofline: PagedEngine (compiled, decode steps as CUDA graphs)
against Hugging Face ``generate`` on the left-padded batch and ``generate_batch`` (``paged|sdpa``), all in
this process (issue 17's GPU workload).

Workload (the defaults): a random-weight Llama-shaped model of about 1.1 B parameters (TinyLlama's shape:
22 layers, hidden 2048, GQA 32/4, vocab 32000), bfloat16, 64 prompts of 128-1024 random tokens, 256 new
tokens each, greedy. The engine serves the workload twice: the first run captures its decode graphs as it
meets each (batch, block-table width) bucket, the second is timed step by step against the roofline
(``benchmarks/roofline.py``: the bytes and FLOPs each step must move and do, against a device-to-device
copy and a bf16 matmul measured here). Then one table of synthetic step kinds (decode at batch
1/8/32/64, mixed, a long prefill), the host syncs a decode step makes (profiler), and the recompile count.

    python benchmarks/generate_cuda.py                # the figures in benchmarks/RESULTS.md
    python benchmarks/generate_cuda.py --quick        # a smoke run (small model, few tokens)
    python benchmarks/generate_cuda.py --no-graphs    # also the engine with cuda_graphs=False
    python benchmarks/generate_cuda.py --triton-eager # also the engine with every step's attention in Triton
    python benchmarks/generate_cuda.py --sync-decode  # also the engine with async_decode=False
    python benchmarks/generate_cuda.py --freeze       # also the engine with the step compiled under freezing
    python benchmarks/generate_cuda.py --no-concat    # also the engine with q/k/v and gate/up as separate linears
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import roofline  # benchmarks/roofline.py, beside this script
import torch
from attention_cuda import agreement, hf_padded_generate  # benchmarks/, beside this script
from generate_cpu import hf_continuous

from pagedattn.runtime.shapes import graph_count

_SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def build_llama(quick: bool, attn: str = "sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    if quick:
        shape = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                     num_key_value_heads=2)
    else:  # TinyLlama-1.1B's shape
        shape = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                     num_key_value_heads=4)
    cfg = LlamaConfig(vocab_size=32000, max_position_embeddings=2048, eos_token_id=None, bos_token_id=None,
                      pad_token_id=0, attn_implementation=attn, **shape)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    return model.to(torch.bfloat16).eval()


def _timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def make_engine(model, num_blocks, max_num_seqs, max_num_tokens, **kw):
    from pagedattn import PagedEngine

    kw = {"target": "cuda", **kw}
    compile_kw = {k: kw.pop(k) for k in ("freeze", "concat_linears") if k in kw}
    if compile_kw:  # the step rewritten, then compiled with these options before the engine
        from pagedattn.adapter import prepare_model

        def compiled(source=model):
            step = prepare_model(source, target=kw["target"], compile=False).step
            return step.compile_paged(**compile_kw)
        model = compiled
    else:
        given = model
        model = lambda: given  # noqa: E731
    engine, seconds = _timed(lambda: PagedEngine(model(), block_size=16, num_blocks=num_blocks,
                                                 max_num_seqs=max_num_seqs, max_num_tokens=max_num_tokens,
                                                 progress=False, **kw))
    return engine, seconds


def engine_run(engine, prompts, new):
    """Serve the workload once: (outputs, seconds, StepRecorder)."""
    engine.stats.update(steps=0, model_s=0.0, overhead_s=0.0, tokens=0, overlapped_steps=0)
    rec = roofline.StepRecorder(engine)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    rids = [engine.add_request(p, max_new_tokens=new) for p in prompts]
    rec.run()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    done = {r.request_id: r.tokens for r in engine.collect()}
    return [done[r] for r in rids], seconds, rec


def print_roofline(steps, seconds, shape, machine, batch: int) -> None:
    table = roofline.summarise(steps, shape, machine)
    print(roofline.COST_HEADER)
    for kind in ("decode", "mixed", "prefill", "all"):
        if kind in table:
            print(roofline.format_cost_row(kind if kind != "all" else "all steps", *table[kind]))
    full = [s for s in steps if roofline.step_kind(s.chunks) == "decode" and len(s.chunks) == batch]
    if full:
        print(roofline.format_cost_row(f"decode at batch {batch}", *roofline.summarise(full, shape, machine)["all"]))
    print(f"  workload limit {table['all'][2]:.3f} s; engine {seconds:.3f} s: {table['all'][2] / seconds:.0%} of "
          "the roofline")
    slow = sorted(enumerate(steps), key=lambda st: -st[1].seconds)[:3]  # one-off costs show up here
    print("  slowest steps: " + "; ".join(
        f"#{i} {roofline.step_kind(s.chunks)}, {len(s.chunks)} sequences, {sum(n for _, n, _ in s.chunks)} tokens: "
        f"{s.seconds * 1e3:.1f} ms" for i, s in slow))


def host_syncs(engine, prompts, new_tokens: int = 12, steps: int = 5) -> str:
    """Profile ``steps`` decode steps: CUDA runtime calls per step that wait for the device, D2H copies,
    graph launches and kernel launches."""
    from torch.profiler import ProfilerActivity, profile

    rids = [engine.add_request(p, max_new_tokens=new_tokens) for p in prompts]
    for _ in range(4):  # past the prefills
        engine.step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    names: dict[str, int] = {}
    for e in prof.events():
        if e.name.startswith("cuda") and not e.name.startswith("cudaGetDevice"):
            names[e.name] = names.get(e.name, 0) + 1
    while engine.has_unfinished():
        engine.step()
    engine.collect()
    del rids
    interesting = {k: v for k, v in names.items() if k in _SYNC_CALLS or k.startswith(("cudaMemcpy", "cudaGraphLaunch",
                                                                                          "cudaLaunchKernel"))}
    return ", ".join(f"{k} {v / steps:.1f}" for k, v in sorted(interesting.items())) or "none"


def profile_decode(model, batch: int, context: int, steps: int = 5, top: int = 14) -> None:
    """Where a decode step's time goes: the kernels of ``steps`` decode steps at ``batch`` sequences of
    ``context`` tokens (profiler), grouped by name, against the step's wall time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    engine, t_start = make_engine(model, batch * (-(-(context + 64) // 16) + 1) + 64, batch, 8192)
    print(f"engine start {t_start:.1f} s (in a fresh process: a warm start where an earlier run left Inductor's "
          "caches)")
    g = torch.Generator().manual_seed(2)
    for _ in range(batch):
        engine.add_request(torch.randint(1, 32000, (context,), generator=g).tolist(), max_new_tokens=48)
    while any(not r.output for r in list(engine.scheduler.running) + list(engine.scheduler.waiting)):
        engine.step()
    for _ in range(3):  # captures at this size and width
        engine.step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = step_wall(engine, steps)
    kernels: dict[str, list] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            row = kernels.setdefault(e.name, [0, 0.0])
            row[0] += 1
            row[1] += e.time_range.elapsed_us()
    busy = sum(us for _, us in kernels.values()) / steps
    print(f"decode step at batch {batch}, context {context}: wall {wall * 1e3:.2f} ms, GPU busy {busy / 1e3:.2f} ms "
          f"({sum(n for n, _ in kernels.values()) / steps:.0f} kernels); graphs: {engine.decode_graphs.stats}")
    for name, (n, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"  {us / steps:9.1f} us {n / steps:6.1f}x  {100 * us / steps / busy:5.1f}%  {name[:110]}")
    print(split_step(engine, steps=20))
    while engine.has_unfinished():
        engine.step()
    engine.collect()
    for label in ("first", "second"):
        print(prefix_hit_step(engine, batch, context, g, label))


def prefix_hit_step(engine, batch: int, context: int, g: torch.Generator, label: str, top: int = 12) -> str:
    """One step of ``batch`` requests whose prompts' full blocks are in the prefix cache (each goes on with the
    tokens after its last full block), profiled: the kind of step that took 0.4-0.6 s the first time in a process
    (benchmarks/RESULTS.md) against ~50 ms after, before the engine served one of each kind of step at start-up
    (``PagedEngine(warm_up=None)``, on CUDA): "first" says whether that warm-up took the one-off in. Its wall time,
    then its costliest host operations and kernels."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    prompts = [torch.randint(1, 32000, (context + 1 + i % 15,), generator=g).tolist() for i in range(batch)]
    for p in prompts:  # fills the prefix cache with these prompts' blocks
        engine.add_request(p, max_new_tokens=1)
    while engine.has_unfinished():
        engine.step()
    engine.collect()
    for p in prompts:
        engine.add_request(p, max_new_tokens=2)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall = step_wall(engine, 1)
    while engine.has_unfinished():
        engine.step()
    engine.collect()
    host: dict[str, float] = {}
    gpu: dict[str, float] = {}
    for e in prof.events():
        into = gpu if e.device_type == DeviceType.CUDA else host
        into[e.name] = into.get(e.name, 0.0) + (e.time_range.elapsed_us() if into is gpu else e.self_cpu_time_total)
    rows = [f"{label} prefix-hit step ({batch} sequences, {context}+ cached tokens each): {wall * 1e3:.1f} ms wall "
            f"(profiled), kernels {sum(gpu.values()) / 1e3:.1f} ms"]
    for title, table in (("host, self time", host), ("kernels", gpu)):
        rows.append(f"  {title}:")
        rows += [f"    {us / 1e3:8.2f} ms  {name[:100]}" for name, us in sorted(table.items(), key=lambda kv: -kv[1])[:top]]
    return "\n".join(rows)


def step_wall(engine, steps: int) -> float:
    """Seconds per ``engine.step()`` over ``steps`` steps, the device synchronised before and after."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def split_step(engine, steps: int) -> str:
    """A decode step's wall time split in two, without the profiler: its graph replayed alone, back to back (the
    GPU's part: kernels and the gaps between them, timed by ``torch.cuda.Event``), and the rest of an engine step
    (the host's part that the GPU waits for: scheduling, the buffers' load, the token read)."""
    dg = engine.decode_graphs
    wall = step_wall(engine, steps)
    shape = max(dg.graphs)  # the largest batch, then the widest table: the shape these steps replay
    graph, _ = dg.graphs[shape]
    replay = roofline.graph_replay_seconds(graph, steps)
    return (f"engine step {wall * 1e3:.2f} ms (no profiler); its graph {shape} replayed alone {replay * 1e3:.2f} ms "
            f"back to back; the rest, {(wall - replay) * 1e3:.2f} ms, is the host's part of a step (the GPU waits)")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--min-len", type=int, default=128)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--max-num-tokens", type=int, default=8192)
    p.add_argument("--quick", action="store_true", help="a small model and workload (smoke run)")
    p.add_argument("--no-graphs", action="store_true", help="also time the engine with cuda_graphs=False")
    p.add_argument("--freeze", action="store_true",
                   help="also time the engine with the step compiled under Inductor's freezing (on the GPU it "
                        "concatenates q/k/v and gate/up into one GEMM each)")
    p.add_argument("--sync-decode", action="store_true",
                   help="also time the engine with async_decode=False (each decode step read back before the next "
                        "starts)")
    p.add_argument("--no-concat", action="store_true",
                   help="also time the engine with compile_paged(concat_linears=False): q/k/v and gate/up as "
                        "separate linears (the default joins them)")
    p.add_argument("--triton-eager", action="store_true",
                   help="also time the engine with XFormersCudaBackend(triton=True): prefill and mixed steps' "
                        "attention through the Triton kernels too")
    p.add_argument("--skip", nargs="*", default=[], choices=["padded", "hf_cb", "kinds", "default"],
                   help="parts to leave out: HF's padded generate, HF's generate_batch, the synthetic step kinds, "
                        "the engine with its defaults (to time only the variants asked for)")
    p.add_argument("--profile", action="store_true", help="only: the kernels of a decode step at batch 64")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if a.quick:
        a.prompts, a.min_len, a.max_len, a.new = 8, 16, 64, 16
    props = torch.cuda.get_device_properties(0)
    machine = roofline.measure_machine(torch.bfloat16, device="cuda", copy_bytes=1 << 30, matmul_size=8192)
    print(f"{props.name}, torch {torch.__version__}; {machine.describe()}")

    model = build_llama(a.quick)
    if a.profile:
        profile_decode(model, min(64, a.prompts), 512)
        return
    shape = roofline.ModelShape.of(model)
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(a.min_len, a.max_len + 1, (a.prompts,), generator=g).tolist()
    prompts = [torch.randint(1, 32000, (n,), generator=g).tolist() for n in lens]
    params = sum(q.numel() for q in model.parameters())
    total = a.prompts * a.new
    block = 16
    num_blocks = sum(-(-(n + a.new) // block) for n in lens) + 64 * -(-(512 + 64) // block) + 64
    print(f"model: Llama {params / 1e9:.2f} B parameters, bfloat16; {a.prompts} prompts of {a.min_len}-{a.max_len} "
          f"tokens (mean {statistics.mean(lens):.0f}), {a.new} new tokens each, greedy")
    print(f"{'runner':44} {'s':>7} {'new tok/s':>10}")
    rows: dict[str, float] = {}
    ref = None
    if "padded" not in a.skip:
        hf_padded_generate(model, prompts, 2)  # warm-up, at the workload's shapes
        ref, rows["hf"] = _timed(lambda: hf_padded_generate(model, prompts, a.new))
        limit = roofline.padded_batch_cost(shape, lens, a.new).limit_s(machine)
        print(f"{'HF generate, padded batch (sdpa)':44} {rows['hf']:7.2f} {total / rows['hf']:10.0f}   "
              f"({limit / rows['hf']:.0%} of its own limit, padding not counted)")
    variants = [] if "default" in a.skip else [("PagedEngine (default: compiled, CUDA graphs)", {})]
    if a.no_graphs:
        variants.append(("PagedEngine cuda_graphs=False (compiled)", {"cuda_graphs": False}))
    if a.sync_decode:
        variants.append(("PagedEngine, async_decode=False", {"async_decode": False}))
    if a.freeze:
        variants.append(("PagedEngine, Inductor freezing", {"freeze": True}))
    if a.no_concat:
        variants.append(("PagedEngine, linears not concatenated", {"concat_linears": False}))
    if a.triton_eager:
        from pagedattn.backends.xformers_cuda import XFormersCudaBackend

        variants.append(("PagedEngine, Triton for eager steps too", {"target": XFormersCudaBackend(triton=True)}))
    for name, kw in variants:
        engine, t_start = make_engine(model, num_blocks, a.prompts, a.max_num_tokens, **kw)
        _, t_first, _ = engine_run(engine, prompts, a.new)  # compiles and captures as it meets each bucket
        graphs0 = graph_count()
        got, t_eng, rec = engine_run(engine, prompts, a.new)
        recompiles = graph_count() - graphs0
        dg = engine.decode_graphs
        graphs = (f"{dg.stats['captures']} graphs captured, {dg.stats['replays']} replays, "
                  f"{engine.stats['overlapped_steps']} steps started before the previous one was read"
                  if dg is not None else "no CUDA graphs")
        print(f"{name:44} {t_eng:7.2f} {total / t_eng:10.0f}   (engine start {t_start:.1f} s, first run "
              f"{t_first:.2f} s; {engine.stats['steps']} steps, host overhead {100 * engine.overhead_share():.0f}% "
              f"of step time; {graphs}; {recompiles} recompiles in the timed run)")
        rows[name] = t_eng
        if "hf" in rows:
            print(f"    engine / HF generate: {rows['hf'] / t_eng:.2f}x")
        if ref is not None:
            same, agree = agreement(got, ref)
            print(f"    identical to HF generate {same}/{a.prompts}; tokens agreeing before the first difference: "
                  f"median {agree:.0f} of {a.new} (bfloat16, random weights)")
        print_roofline(rec.steps, t_eng, shape, machine, a.prompts)
        print(f"    per decode step (profiler, 8 sequences): {host_syncs(engine, prompts[:8])}")
        if "kinds" not in a.skip and "cuda_graphs" not in kw and name == variants[0][0]:  # the first variant's
            print("  synthetic step kinds (per step, after warm-up):")
            batches = tuple(b for b in (1, 8, 32, 64) if b <= a.prompts)
            kinds = dict(vocab=32000, context=512, batches=batches, mixed_batch=min(16, a.prompts))
            roofline.step_kinds(engine, shape, machine, repeats=4, **kinds)  # warm-up: compiles and captures
            for row in roofline.step_kinds(engine, shape, machine, repeats=16, **kinds):
                print("  " + row)
        del engine
        torch.cuda.empty_cache()

    if "hf_cb" not in a.skip:
        try:
            cb_model = build_llama(a.quick, "paged|sdpa")
            cb_model.load_state_dict(model.state_dict())
            hf_continuous(cb_model, prompts[:2], 4, num_blocks, block, a.max_num_tokens)
            cb, rows["hf_cb"] = _timed(lambda: hf_continuous(cb_model, prompts, a.new, num_blocks, block,
                                                                   a.max_num_tokens))
            same = f"identical to HF generate {agreement(cb, ref)[0]}/{a.prompts}" if ref else ""
            print(f"{'HF generate_batch (paged|sdpa)':44} {rows['hf_cb']:7.2f} {total / rows['hf_cb']:10.0f}   {same}")
            del cb_model
        except Exception as e:  # noqa: BLE001 -- a baseline that fails is reported, the engine still runs
            print(f"  generate_batch failed: {type(e).__name__}: {str(e)[:200]}")
        torch.cuda.empty_cache()

    print("speed-ups (same process):")
    for name, _ in variants:
        for key, label in (("hf", "HF generate (padded batch)"), ("hf_cb", "HF generate_batch (paged|sdpa)")):
            if key in rows and name in rows:
                print(f"  {name} / {label}: {rows[key] / rows[name]:.2f}x")


if __name__ == "__main__":
    main()
