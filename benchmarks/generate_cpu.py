"""Generation throughput on CPU: PagedEngine against Hugging Face baselines, same process.

One random-weight Llama-style model (~34 M parameters), 32 prompts of 16-512 tokens, 128 new
tokens each, greedy. Baselines: (a) `generate` on the left-padded batch (DynamicCache, sdpa),
(b) `generate` one request at a time, (c) transformers' continuous batching `generate_batch`
(`attn_implementation="paged|sdpa"`, needs psutil on CPU). Also KV bytes allocated per cached
token against the padded cache, and the engine's per-step Python overhead share.

    python benchmarks/generate_cpu.py                 # the figures in benchmarks/RESULTS.md
    python benchmarks/generate_cpu.py --quick         # a smoke run (4 prompts, 8 tokens)
"""

from __future__ import annotations

import argparse
import logging
import time

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

import pagedattn


def build(dtype: torch.dtype, attn: str) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=16000, hidden_size=512, intermediate_size=1408, num_hidden_layers=6,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                      eos_token_id=None, bos_token_id=None, pad_token_id=0)
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
    # the same cache size and token budget as the engine (its default sizes the cache from free memory)
    cb = ContinuousBatchingConfig(page_size=block_size, num_blocks=num_blocks, max_batch_tokens=max_tokens)
    with torch.no_grad():
        res = model.generate_batch(inputs=prompts, generation_config=cfg, continuous_batching_config=cb,
                                   progress_bar=False)
    return [r.generated_tokens for r in res.values()]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--skip", nargs="*", default=[], choices=["padded", "serial", "hf_cb"])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--eager", action="store_true", help="run the engine's paged graph without Inductor")
    a = p.parse_args(argv)
    if a.quick:
        a.prompts, a.new = 4, 8
    logging.getLogger("pagedattn").setLevel(logging.ERROR)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(16, 513, (a.prompts,), generator=g).tolist()
    prompts = [torch.randint(1, 16000, (n,), generator=g).tolist() for n in lengths]
    total_new = a.prompts * a.new
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}; {a.prompts} prompts of {min(lengths)}-"
          f"{max(lengths)} tokens (sum {sum(lengths)}), {a.new} new tokens each")
    for dname in a.dtypes:
        dtype = getattr(torch, dname)
        model = build(dtype, "sdpa")
        n_params = sum(x.numel() for x in model.parameters())
        print(f"\n{dname}: Llama-style, {n_params / 1e6:.1f} M parameters")
        rows = []

        # pagedattn: cache sized for the batch (blocks are what the requests can use)
        block = 16
        need = sum(-(-(n + a.new) // block) for n in lengths)
        t0 = time.perf_counter()
        engine = pagedattn.PagedEngine(model, num_blocks=need, block_size=block, max_num_tokens=1024,
                                       compile=not a.eager)
        # warm-up on other prompts (no prefix-cache hits later): Inductor compiles the paged graph once
        engine.generate([[1] * n for n in (300, 7, 40, 2)], max_new_tokens=2)
        engine.stats.update(steps=0, model_s=0.0, overhead_s=0.0, tokens=0)
        t_setup = time.perf_counter() - t0
        t0 = time.perf_counter()
        ours = engine.generate(prompts, max_new_tokens=a.new)
        t_ours = time.perf_counter() - t0
        rows.append((f"pagedattn PagedEngine{' (eager)' if a.eager else ''}", t_ours))
        cached_tokens = sum(lengths) + total_new - a.prompts  # K/V written (the last token is never attended)
        paged_per_token = engine.kv_bytes / cached_tokens

        if "padded" not in a.skip:
            t0 = time.perf_counter()
            padded, padded_bytes = padded_generate(model, prompts, a.new)
            rows.append(("HF generate, padded batch", time.perf_counter() - t0))
            same = sum(x == y for x, y in zip(ours, padded))
        if "serial" not in a.skip:
            t0 = time.perf_counter()
            serial = one_at_a_time(model, prompts, a.new)
            rows.append(("HF generate, one at a time", time.perf_counter() - t0))
            same_serial = sum(x == y for x, y in zip(ours, serial))
        if "hf_cb" not in a.skip:
            cb_model = build(dtype, "paged|sdpa")
            try:
                t0 = time.perf_counter()
                hf_continuous(cb_model, prompts, a.new, need, block, 1024)
                rows.append(("HF generate_batch (paged|sdpa)", time.perf_counter() - t0))
            except Exception as e:  # e.g. psutil missing
                print(f"  generate_batch failed: {type(e).__name__}: {str(e)[:200]}")
        print(f"  {'method':32} {'seconds':>8} {'new tok/s':>10} {'pagedattn x':>12}")
        for name, t in rows:
            print(f"  {name:32} {t:8.2f} {total_new / t:10.1f} {t / t_ours:12.2f}")
        print(f"  engine setup (rewrite, cache, {'eager' if a.eager else 'Inductor compile'} warm-up): {t_setup:.2f} s; "
              f"steps {engine.stats['steps']}, "
              f"Python overhead {100 * engine.overhead_share():.1f}% of step time")
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
            print(f"  greedy tokens equal to padded-batch HF generate: {same}/{a.prompts} prompts")


if __name__ == "__main__":
    main()
