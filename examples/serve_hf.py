"""Serve a batch with a tiny Hugging Face model compiled with ``backend="pagedattn"``.

Builds a random-weight Llama from a config (no download), compiles it, serves prompts of
different lengths through the paged engine, checks the tokens against Hugging Face ``generate``
and prints them with the throughput.

    python examples/serve_hf.py
"""

import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import pagedattn


def main() -> None:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, eos_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    compiled = torch.compile(model, backend="pagedattn", options={"inner": "eager"})
    engine = pagedattn.PagedEngine(compiled, block_size=16, num_blocks=256, max_num_tokens=256)

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (7, 31, 12, 64, 3, 45)]
    t0 = time.perf_counter()
    outputs = engine.generate(prompts, max_new_tokens=16)
    elapsed = time.perf_counter() - t0

    same = 0
    for p, out in zip(prompts, outputs):
        ref = model.generate(input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             max_new_tokens=16, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
        same += out == ref
        print(f"prompt of {len(p):3} tokens -> {out}")
    new = sum(map(len, outputs))
    print(f"{new} new tokens in {elapsed:.2f} s ({new / elapsed:.0f} tokens/s, first call includes compilation); "
          f"{engine.stats['steps']} steps")
    print(f"{same}/{len(prompts)} prompts generate the same tokens as Hugging Face generate")
    raise SystemExit(0 if same == len(prompts) else 1)


if __name__ == "__main__":
    main()
