"""Train the built-in demo checkpoint: a tiny byte-level Llama that has learned the Zen of Python.

The text ships with every Python (``import this``), so training needs no download. The result
(about 2 MB with its byte-level tokenizer) is what ``rewrite-model demo`` rewrites and serves; a
model that reproduces a known text makes it easy to see that paged generation is right.

    python examples/train_demo.py                      # writes rewriter/demo/zen (a few minutes on 2 cores)
    python examples/train_demo.py --out /tmp/zen --steps 300
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import io
import os
import time

import torch

EOS = "<|endoftext|>"
HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "..", "rewriter", "demo", "zen")


def zen_text() -> str:
    with contextlib.redirect_stdout(io.StringIO()):
        import this
    return codecs.decode(this.s, "rot13")


def byte_tokenizer():
    """A byte-level tokenizer (256 byte symbols and EOS) in Hugging Face's fast-tokenizer format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins GPT-2 uses for bytes
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=lambda c: _byte_of(c)))}
    vocab[EOS] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, unk_token=None)


def _byte_of(ch: str) -> int:
    # GPT-2's map: printable latin-1 bytes stand for themselves, the others are shifted past 255
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(map(chr, cs), bs))[ch]


def build_model(vocab_size: int, eos_id: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=True, bos_token_id=eos_id, eos_token_id=eos_id)
    return LlamaForCausalLM(cfg)


def train(steps: int, seed: int = 0):
    """Learn the text by heart from every line on: each step sees the rest of the text after a random
    line start, from position 0, as generation from a prompt will."""
    torch.manual_seed(seed)
    tok = byte_tokenizer()
    text = zen_text().strip().split("\n", 2)[2] + "\n"  # the aphorisms, without the title
    ids = tok(text)["input_ids"] + [tok.eos_token_id]
    starts = [0] + [i + 1 for i, t in enumerate(ids[:-2]) if t == ord("\n")]
    model = build_model(len(tok), tok.eos_token_id)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    t0 = time.perf_counter()
    for step in range(steps):
        k = starts[0] if step % 4 == 0 else starts[int(torch.randint(len(starts), ()))]
        x = torch.tensor([ids[k:]])  # [1, S]
        loss = model(input_ids=x, labels=x.clone()).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}  {time.perf_counter() - t0:.0f}s", flush=True)
    return model.eval(), tok, ids


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--steps", type=int, default=800)
    a = p.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    model, tok, ids = train(a.steps)
    prompt = tok("Beautiful is")["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=len(ids), do_sample=False)
    text = tok.decode(out[0], skip_special_tokens=True)
    print(text)
    ok = text.strip() == zen_text().strip().split("\n", 2)[2].strip()
    print("reproduces the Zen of Python:", ok)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(a.out, safe_serialization=True)
    tok.save_pretrained(a.out)
    print("saved", os.path.abspath(a.out))


if __name__ == "__main__":
    main()
