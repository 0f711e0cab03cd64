"""Paged attention on an NVIDIA GPU (xFormers backend) against contiguous SDPA, and PagedEngine
generation against Hugging Face ``generate``, all in this process.

Decode: a batch of sequences with one new token each over contexts of 512-8192 tokens. The paged
side is ``torch.ops.pagedattn.paged_attention`` as a model calls it (plan lookup, bias, operator,
kernels). Each side is timed twice: wall time per call (host work included) and GPU time per call
(the profiler's kernel durations). The baseline holds the same K/V contiguously (``[B, Hkv, L, D]``)
and calls
``F.scaled_dot_product_attention`` with ``enable_gqa`` (plus a key-padding mask when lengths
differ). GB/s counts the K/V bytes the step must read per second of GPU time, against a
device-to-device copy measured here.

Generation: a random-weight Llama (~160 M parameters, bfloat16), prompts of 64-512 tokens, greedy.

    python benchmarks/attention_cuda.py            # the figures in benchmarks/RESULTS.md
    python benchmarks/attention_cuda.py --compile  # also PagedEngine's default (compiled), not only compile=False
    python benchmarks/attention_cuda.py --quick    # a smoke run

Also: the attention a captured decode step runs (``StaticPagedBackend``), its portable gather-and-mask path
against the Triton kernel (``backends/triton_paged.py``) on the same decode cases, GPU time only.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import logging
import math
import statistics
import time

import paged_cases  # benchmarks/paged_cases.py, beside this script
import roofline  # benchmarks/roofline.py, beside this script
import torch

from pagedattn.backends import get_backend


def _time_pair(fa, fb, repeats: int) -> tuple[float, float]:
    """Median seconds of two GPU functions, run alternately, each timed with CUDA events."""
    for _ in range(3):
        fa(), fb()
    torch.cuda.synchronize()
    ta, tb = [], []
    for _ in range(repeats):
        for fn, acc in ((fa, ta), (fb, tb)):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            acc.append(start.elapsed_time(end) / 1e3)
    return statistics.median(ta), statistics.median(tb)


def gpu_seconds(fn, repeats: int) -> float:
    """GPU time per call: the summed durations of the kernels it launches (profiler), no host time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    us = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA)
    return us / repeats / 1e6


def kernel_names(fn) -> str:
    """The CUDA kernels one call launches, longest first (shortened names)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ev = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: -e.time_range.elapsed_us())
    return ", ".join(f"{e.name[:60]} {e.time_range.elapsed_us():.0f}us" for e in ev[:3])


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Bytes read plus written per second by a device-to-device copy."""
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    t, _ = _time_pair(lambda: y.copy_(x), lambda: None, 10)
    return 2 * nbytes / t


def decode_case(batch, ctx_lo, ctx_hi, hq, hkv, d, dtype, block_size, repeats, seed=0):
    backend = get_backend("cuda")
    lens, cache, paged, contiguous = paged_cases.decode_case(batch, ctx_lo, ctx_hi, hq, hkv, d, dtype, block_size,
                                                             "cuda", seed)
    t_paged, t_contig = _time_pair(paged, contiguous, repeats)
    g_paged, g_contig = gpu_seconds(paged, repeats), gpu_seconds(contiguous, repeats)
    kv_bytes = 2 * sum(lens) * hkv * d * cache.element_size()
    paths = sorted({f"{k}:{o}" for k, o in backend.paths})
    backend.paths.clear()
    return t_paged, t_contig, g_paged, g_contig, kv_bytes, paths


def captured_decode_case(batch, ctx_lo, ctx_hi, hq, hkv, d, dtype, block_size, repeats, seed=0):
    """The attention a captured decode step runs (``StaticPagedBackend``): the portable gather-and-mask path
    against the Triton kernel on the same step. GPU seconds of each, the K+V bytes, the largest difference."""
    from pagedattn.backends import AttentionParams, static_paged, triton_paged

    lens, cache, paged, _ = paged_cases.decode_case(batch, ctx_lo, ctx_hi, hq, hkv, d, dtype, block_size, "cuda", seed)
    q, meta, scale = paged.inputs
    p = AttentionParams(scale, True, 0, 0.0, None, hkv, d)
    if not triton_paged.usable(q, cache, p):
        raise SystemExit(f"the Triton kernel does not take this case: {triton_paged.unusable_reasons(q, cache, p)}")
    gather = lambda: static_paged.attend(q, cache, meta, p)  # noqa: E731
    kernel = lambda: triton_paged.attend(q, cache, meta, p)  # noqa: E731
    diff = float((gather().float() - kernel().float()).abs().max())
    kv_bytes = 2 * sum(lens) * hkv * d * cache.element_size()
    return gpu_seconds(gather, repeats), gpu_seconds(kernel, repeats), kv_bytes, diff


def sweep_triton(repeats: int) -> None:
    """The Triton decode kernel's GPU time against its tuning (keys per loop step, warps, programs the split plan
    aims at), at the generate_cuda workload's decode step (batch 64, TinyLlama's heads 32/4 x 64) and at a long
    context (16 x 8192, heads 32/8 x 128); the largest difference from the gather path beside each."""
    from pagedattn.backends import AttentionParams, static_paged, triton_paged

    bw = copy_bandwidth(1 << 30)
    print(f"{'case':>24} {'tile':>5} {'warps':>6} {'programs':>9} {'GPU ms':>8} {'GB/s':>6} {'of copy':>8} {'max diff':>9}")
    for batch, lo, hi, hq, hkv, d in ((64, 512, 1024, 32, 4, 64), (16, 8192, 8192, 32, 8, 128)):
        lens, cache, paged, _ = paged_cases.decode_case(batch, lo, hi, hq, hkv, d, torch.bfloat16, 16, "cuda", 0)
        q, meta, scale = paged.inputs
        p = AttentionParams(scale, True, 0, 0.0, None, hkv, d)
        want = static_paged.attend(q, cache, meta, p).float()
        kv_bytes = 2 * sum(lens) * hkv * d * cache.element_size()
        for tile in (32, 64, 128):
            for warps in (4, 8):
                for programs in (256, 512, 1024, 2048):  # 256: batch 64's 4 KV heads, one split each
                    call = functools.partial(triton_paged.attend, q, cache, meta, p, tile=tile, num_warps=warps,
                                             programs=programs)

                    try:
                        diff = float((call().float() - want).abs().max())
                        t = gpu_seconds(call, repeats)
                    except Exception as e:  # noqa: BLE001 - a configuration that does not compile is reported
                        print(f"{f'{batch} x {lo}-{hi}, {hq}/{hkv}x{d}':>24} {tile:5d} {warps:6d} {programs:9d}  "
                              f"failed: {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}")
                        continue
                    print(f"{f'{batch} x {lo}-{hi}, {hq}/{hkv}x{d}':>24} {tile:5d} {warps:6d} {programs:9d} "
                          f"{t * 1e3:8.3f} {kv_bytes / t / 1e9:6.0f} {kv_bytes / t / bw:8.2f} {diff:9.2g}")


def eager_case(spec, hq, hkv, d, dtype, block_size, repeats, seed=0):
    """An eager (prefill or mixed) step's attention through ``XFormersCudaBackend``, its xFormers path against the
    Triton kernels (``triton=True``), for sequences ``spec`` of ``(cached tokens, new tokens)``: wall seconds
    (host included, CUDA events) and GPU seconds of each, and their largest difference."""
    from pagedattn.backends import AttentionParams, build_metadata
    from pagedattn.backends.xformers_cuda import XFormersCudaBackend

    g = torch.Generator().manual_seed(seed)
    xf, tr = XFormersCudaBackend(), XFormersCudaBackend(triton=True)
    need = [-(-(c + n) // block_size) for c, n in spec]
    tables = [list(range(sum(need[:i]), sum(need[:i + 1]))) for i in range(len(spec))]
    cache = xf.allocate_kv_cache(sum(need), block_size, hkv, d, dtype, "cuda")
    k_all = torch.randn(sum(c + n for c, n in spec), hkv, d, generator=g).to("cuda", dtype)
    v_all = torch.randn(k_all.shape, generator=g).to("cuda", dtype)
    fill = build_metadata([(0, c + n, t) for (c, n), t in zip(spec, tables)], block_size, device="cuda")
    torch.ops.pagedattn.write_kv_cache(k_all, v_all, cache, fill.slot_mapping)
    new = torch.tensor([a + c + i for a, (c, n) in zip(itertools.accumulate([0] + [c + n for c, n in spec]), spec)
                        for i in range(n)], device="cuda")
    k, v = k_all[new], v_all[new]  # the new tokens' K/V, as the step gives them (also in the cache)
    meta = build_metadata([(c, n, t) for (c, n), t in zip(spec, tables)], block_size, device="cuda")
    q = torch.randn(len(new), hq, d, generator=g).to("cuda", dtype)
    p = AttentionParams(1 / math.sqrt(d), True, 0, 0.0, None, hkv, d)
    fa = functools.partial(xf.attend, q, k, v, cache, meta, p)
    fb = functools.partial(tr.attend, q, k, v, cache, meta, p)
    diff = float((fa().float() - fb().float()).abs().max())  # (the first Triton call of a kind checks itself)
    ta, tb = _time_pair(fa, fb, repeats)
    return ta, tb, gpu_seconds(fa, repeats), gpu_seconds(fb, repeats), diff


def prefill_case(num_seqs, seq_len, hq, hkv, d, dtype, block_size, repeats):
    T, step, contiguous = paged_cases.prefill_case(num_seqs, seq_len, hq, hkv, d, dtype, block_size, "cuda")
    t, t_c = _time_pair(step, contiguous, repeats)
    g, g_c = gpu_seconds(step, repeats), gpu_seconds(contiguous, repeats)
    print(f"  kernels: paged {kernel_names(step)}; contiguous {kernel_names(contiguous)}")
    return T / t, T / t_c, T / g, T / g_c


# ------------------------------------------------------------------------- generation


def build_llama(dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=64, max_position_embeddings=2048,
                      eos_token_id=None, bos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(device="cuda", dtype=dtype).eval()


def hf_padded_generate(model, prompts, new):
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long, device="cuda")
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, device="cuda")
        mask[i, width - len(p):] = 1
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=0)
    return [o[width:].tolist() for o in out]


def _engine_run(model, prompts, lens, new, **kw):
    from pagedattn import PagedEngine

    t0 = time.perf_counter()
    engine = PagedEngine(model, target="cuda", block_size=16, max_num_tokens=4096, max_num_seqs=len(prompts),
                         num_blocks=sum(-(-(n + new) // 16) for n in lens) + 64, **kw)
    engine.generate(prompts[:2], max_new_tokens=4)  # warm-up (Triton kernels; Inductor with compile=True)
    t_setup = time.perf_counter() - t0
    engine.stats.update(steps=0, model_s=0.0, overhead_s=0.0, tokens=0)
    rec = roofline.StepRecorder(engine)  # every step timed (it ends on the host: logits come back) and recorded
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    rids = [engine.add_request(p, max_new_tokens=new) for p in prompts]
    rec.run()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    done = {r.request_id: r.tokens for r in engine.collect()}
    engine.recorder = rec
    return [done[r] for r in rids], seconds, t_setup, engine


def _print_roofline(engine, seconds, shape, machine) -> None:
    """The engine's steps against the GPU's limit (benchmarks/roofline.py), per step kind."""
    table = roofline.summarise(engine.recorder.steps, shape, machine)
    print(roofline.COST_HEADER)
    for kind in ("decode", "mixed", "prefill", "all"):
        if kind in table:
            print(roofline.format_cost_row(kind if kind != "all" else "all steps", *table[kind]))
    print(f"workload limit {table['all'][2]:.3f} s; engine {seconds:.3f} s: {table['all'][2] / seconds:.0%} of the "
          "roofline")


def agreement(got, ref) -> tuple[int, float]:
    """(outputs identical to ``ref``, median count of leading tokens equal to ``ref``'s)."""
    first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(got, ref)]
    return sum(a == b for a, b in zip(got, ref)), statistics.median(first)


def generation(num_prompts, new, quick, compile_too):
    model = build_llama(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(64, 513, (num_prompts,), generator=g).tolist()
    prompts = [torch.randint(1, 32000, (n,), generator=g).tolist() for n in lens]
    params = sum(p.numel() for p in model.parameters())

    hf_padded_generate(model, prompts[:2], 4)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    ref = hf_padded_generate(model, prompts, new)
    torch.cuda.synchronize()
    t_hf = time.perf_counter() - t0

    got, t_eng, t_setup, engine = _engine_run(model, prompts, lens, new, compile=False)
    machine = roofline.measure_machine(torch.bfloat16, device="cuda")
    shape = roofline.ModelShape.of(model)
    hf_limit = roofline.padded_batch_cost(shape, lens, new).limit_s(machine)
    same, agree = agreement(got, ref)
    total = num_prompts * new
    print(f"model: Llama {params / 1e6:.0f} M parameters, bfloat16, {num_prompts} prompts of 64-512 tokens "
          f"(mean {statistics.mean(lens):.0f}), {new} new tokens each, greedy")
    print(f"{'runner':34} {'s':>7} {'new tok/s':>10}")
    print(f"{'HF generate, padded batch (sdpa)':34} {t_hf:7.2f} {total / t_hf:10.0f}")
    print(f"{'PagedEngine compile=False (xformers)':34} {t_eng:7.2f} {total / t_eng:10.0f}   "
          f"(rewrite {t_setup:.1f} s; {engine.stats['steps']} steps, the engine's own work around the model call "
          f"{100 * engine.overhead_share():.0f}% of step time)")
    print(f"engine/HF speed-up {t_hf / t_eng:.2f}x; identical outputs {same}/{num_prompts}; "
          f"tokens agreeing before the first difference: median {agree:.0f} of {new}")
    print(f"roofline ({machine.describe()}); HF padded batch: {hf_limit / t_hf:.0%} of its own limit "
          f"({hf_limit:.3f} s: one prefill step, then decode steps of the batch, padding not counted)")
    print("eager engine:")
    _print_roofline(engine, t_eng, shape, machine)
    if compile_too:
        got_c, t_c, setup_c, eng_c = _engine_run(model, prompts, lens, new, compile=True)
        print(f"{'PagedEngine compile=True (Inductor)':34} {t_c:7.2f} {total / t_c:10.0f}   "
              f"(rewrite + compile {setup_c:.1f} s; {eng_c.stats['steps']} steps); engine/HF {t_hf / t_c:.2f}x; "
              f"identical to eager engine {agreement(got_c, got)[0]}/{num_prompts}, to HF {agreement(got_c, ref)[0]}"
              f"/{num_prompts}; tokens agreeing with HF before the first difference: median "
              f"{agreement(got_c, ref)[1]:.0f} of {new}")
        print("compiled engine:")
        _print_roofline(eng_c, t_c, shape, machine)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--skip-generation", action="store_true")
    p.add_argument("--compile", action="store_true", help="also time PagedEngine compiled (its default)")
    p.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    p.add_argument("--sweep", action="store_true", help="only: the Triton decode kernel's tuning sweep")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    import xformers

    props = torch.cuda.get_device_properties(0)
    bw = copy_bandwidth(256 << 20 if a.quick else 2 << 30)
    print(f"{props.name}, torch {torch.__version__}, xformers {xformers.__version__}, "
          f"device copy {bw / 1e9:.0f} GB/s (read + write)")
    if a.sweep:
        sweep_triton(a.repeats)
        return
    print(f"heads {a.heads}/{a.kv_heads}, head size {a.head_size}, bfloat16; decode: one new token per sequence")
    cases = [(16, 512, 512), (16, 2048, 2048), (16, 8192, 8192), (16, 512, 8192),
             (64, 2048, 2048), (64, 512, 8192)]
    block_sizes = [16, 64]
    if a.quick:
        cases, block_sizes, a.repeats = [(4, 128, 512)], [16], 3
    print("wall: median time per call (host included); GPU: kernel time per call (profiler); "
          "GB/s: K+V bytes the step reads per second of GPU time")
    print(f"{'batch':>5} {'context':>10} {'block':>5} {'paged ms':>9} {'contig ms':>10} {'paged GPU ms':>13} "
          f"{'contig GPU ms':>14} {'GPU ratio':>10} {'paged GB/s':>11} {'contig GB/s':>12} {'paged/copy':>11}  path")
    for bs in block_sizes:
        for batch, lo, hi in cases:
            tp, tc, gp, gc, nbytes, paths = decode_case(batch, lo, hi, a.heads, a.kv_heads, a.head_size,
                                                        torch.bfloat16, bs, a.repeats)
            ctx = f"{lo}" if lo == hi else f"{lo}-{hi}"
            print(f"{batch:5d} {ctx:>10} {bs:5d} {tp * 1e3:9.3f} {tc * 1e3:10.3f} {gp * 1e3:13.3f} {gc * 1e3:14.3f} "
                  f"{gp / gc:10.2f} {nbytes / gp / 1e9:11.0f} {nbytes / gc / 1e9:12.0f} {nbytes / gp / bw:11.2f}  "
                  f"{','.join(paths)}")
    print()
    print("captured decode step's attention (StaticPagedBackend): the gather path against the Triton kernel, GPU time")
    print(f"{'batch':>5} {'context':>10} {'gather ms':>10} {'Triton ms':>10} {'speed-up':>9} {'Triton GB/s':>12} "
          f"{'of copy':>8} {'max diff':>9}")
    for batch, lo, hi in cases:
        tg, tt, nbytes, diff = captured_decode_case(batch, lo, hi, a.heads, a.kv_heads, a.head_size, torch.bfloat16,
                                                    16, a.repeats)
        ctx = f"{lo}" if lo == hi else f"{lo}-{hi}"
        print(f"{batch:5d} {ctx:>10} {tg * 1e3:10.3f} {tt * 1e3:10.3f} {tg / tt:9.2f} {nbytes / tt / 1e9:12.0f} "
              f"{nbytes / tt / bw:8.2f} {diff:9.2g}")
    print()
    print("eager steps' attention (XFormersCudaBackend): xFormers against the Triton kernels (triton=True), "
          "heads 32/4 x 64 (generate_cuda's model)")
    print(f"{'step':>34} {'xF wall ms':>11} {'Tr wall ms':>11} {'xF GPU ms':>10} {'Tr GPU ms':>10} {'max diff':>9}")
    eager = [("prefill 4 x 2048", [(0, 2048)] * 4), ("prefill 1 x 1024", [(0, 1024)]),
             ("16 decodes (2048) + 256-token prompt", [(2048, 1)] * 16 + [(0, 256)]),
             ("64 continuations of 9 (600 cached)", [(600, 9)] * 64)]
    for name, spec in eager[:1] if a.quick else eager:
        ta, tb, ga, gb, diff = eager_case(spec, 32, 4, 64, torch.bfloat16, 16, a.repeats)
        print(f"{name:>34} {ta * 1e3:11.3f} {tb * 1e3:11.3f} {ga * 1e3:10.3f} {gb * 1e3:10.3f} {diff:9.2g}")
    print()
    print(f"{'prefill':>14} {'paged tok/s':>12} {'contig tok/s':>13} {'paged GPU tok/s':>16} {'contig GPU tok/s':>17}")
    n, L = (2, 256) if a.quick else (4, 2048)
    tps, tpc, gps, gpc = prefill_case(n, L, a.heads, a.kv_heads, a.head_size, torch.bfloat16, 16,
                                      max(3, a.repeats // 3))
    print(f"{f'{n} x {L}':>14} {tps:12.0f} {tpc:13.0f} {gps:16.0f} {gpc:17.0f}")
    if not a.skip_generation:
        print()
        generation(4 if a.quick else a.prompts, 8 if a.quick else a.new, a.quick, a.compile)


if __name__ == "__main__":
    main()
