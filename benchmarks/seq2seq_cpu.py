"""Encoder-decoder serving on CPU (issue 18): PagedEngine against Hugging Face ``generate`` on a padded batch,
and a decoder step's cost against the encoder's length.

Workload: a random-weight BART-like model (``--d-model`` 256, 3 encoder and 3 decoder layers, 4 heads, FFN
1024, vocab 4096), 32 requests of ragged source lengths (16-128 tokens), 64 new tokens each, greedy, no
early stop (no EOS id in the generation config). The engine runs compiled (its decoder
step compiled with Inductor at start-up, as by default).

Decode-step cost: 8 requests whose sources all have ``L`` tokens, the engine's mean decode-step time
(after the first steps) for ``L`` in 16..512, split into the step's cross-attention calls (the paged op over
the filled cross blocks, once per decoder layer, timed inside the step) and the rest: a step should grow by no
more than those reads, so the rest stays flat.

    python benchmarks/seq2seq_cpu.py            # the figures in benchmarks/RESULTS.md (issue 18)
    python benchmarks/seq2seq_cpu.py --quick    # a smoke run

The two runners run ``--repeats`` times each, alternately (the machine may be shared), and the medians are
compared.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch
from transformers import BartConfig, BartForConditionalGeneration

import pagedattn
from pagedattn.backends import ops

log = logging.getLogger("seq2seq_cpu")


def build(d_model: int, layers: int, max_len: int) -> BartForConditionalGeneration:
    cfg = BartConfig(vocab_size=4096, d_model=d_model, encoder_layers=layers, decoder_layers=layers,
                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=4 * d_model,
                     decoder_ffn_dim=4 * d_model, max_position_embeddings=max_len, forced_eos_token_id=None)
    torch.manual_seed(0)
    model = BartForConditionalGeneration(cfg).eval()
    model.generation_config.eos_token_id = None  # every request generates all its tokens, in both runners
    model.generation_config.forced_eos_token_id = None
    return model


def sources(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, 4096, (k,), generator=g).tolist() for k in lens]


def hf_padded(model, srcs: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    """``generate`` on the right-padded batch (seq2seq encoders take padding on either side)."""
    longest = max(map(len, srcs))
    ids = torch.full((len(srcs), longest), model.config.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(srcs):
        ids[i, :len(s)], mask[i, :len(s)] = torch.tensor(s), 1
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, num_beams=1)
    return time.perf_counter() - t0, [r[1:].tolist() for r in out]


def engine_run(engine, srcs, new: int) -> tuple[float, list[list[int]]]:
    t0 = time.perf_counter()
    out = engine.generate(srcs, max_new_tokens=new)
    return time.perf_counter() - t0, out


def decode_step_ms(engine, length: int, batch: int, steps: int, displace: int = 0) -> tuple[float, float, float]:
    """Mean decode-step time (ms) of ``batch`` requests whose sources have ``length`` tokens, and the parts of it spent
    in the step's cross-attention calls (the paged op over the filled cross blocks) and self-attention calls, timed
    inside the step: the reads as the step makes them, after the layer's other work has passed through the caches.

    ``displace``: bytes read before each step (not counted in its time): what reading that much does to the rest of
    the step through the CPU's caches, with no work that depends on the encoder's length."""
    srcs = sources(batch, length, length, seed=length)
    encoded = engine.stats["encoder_requests"] + batch
    for s in srcs:
        engine.add_request(s, max_new_tokens=steps + 2 + batch)
    while engine.stats["encoder_requests"] < encoded:  # admissions (the encoder; long sources a few per step)
        engine.step()
    engine.step()
    backend, spent = engine.backend, [0.0, 0.0]  # cross, self
    attend = backend.attend

    def timed(query, key, *rest):
        t0 = time.perf_counter()
        out = attend(query, key, *rest)
        spent[key is not None] += time.perf_counter() - t0  # self-attention passes the step's own K/V
        return out

    # a wrapped attend is never bypassed by the ops' prepared calls (backends/ops.py): while timed, every call
    # takes the unprepared path, ~15 us of Python a call more than serving; those prepared before are dropped
    backend.attend = timed
    ops.forget_prepared_calls()
    other = torch.ones(displace // 4) if displace else None
    try:
        dt = 0.0
        for _ in range(steps):
            if other is not None:
                other.sum()
            t0 = time.perf_counter()
            engine.step()
            dt += (time.perf_counter() - t0) / steps
    finally:
        del backend.attend
        ops.forget_prepared_calls()
    while engine.has_unfinished():
        engine.step()
    engine.collect()
    return dt * 1e3, spent[0] / steps * 1e3, spent[1] / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each runner, alternating (median reported)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    n, new = (8, 8) if args.quick else (32, 64)
    model = build(args.d_model, args.layers, 1024)
    srcs = sources(n, 16, 128)
    engine = pagedattn.PagedEngine(model, block_size=16, num_blocks=4096, max_num_tokens=512, eos_token_id=[],
                                   progress=False)  # no EOS, as the padded batch
    engine.generate(srcs[:2], max_new_tokens=4)  # warm-up
    hf_padded(model, srcs[:2], 4)
    hf_times, eng_times = [], []
    for _ in range(args.repeats):  # alternately, so that both runners see the same machine load
        t_hf, ref = hf_padded(model, srcs, new)
        engine.stats.update(steps=0, model_s=0.0, overhead_s=0.0, encoder_runs=0, encoder_requests=0, encoder_s=0.0)
        t_eng, got = engine_run(engine, srcs, new)
        hf_times.append(t_hf)
        eng_times.append(t_eng)
    t_hf, t_eng = statistics.median(hf_times), statistics.median(eng_times)
    same = sum(a == b for a, b in zip(got, ref))
    tokens = n * new
    log.info("model: BART-like d_model %d, %d+%d layers, %.1f M parameters; torch threads %d",
             args.d_model, args.layers, args.layers, sum(p.numel() for p in model.parameters()) / 1e6,
             torch.get_num_threads())
    log.info("%d requests, sources 16-128 tokens, %d new tokens each", n, new)
    log.info("median of %d runs each, alternating (HF: %s s; engine: %s s)", args.repeats,
             " ".join(f"{t:.2f}" for t in hf_times), " ".join(f"{t:.2f}" for t in eng_times))
    log.info("HF generate (padded batch): %.2f s, %.0f tok/s", t_hf, tokens / t_hf)
    log.info("PagedEngine:                %.2f s, %.0f tok/s  (%.2fx; last run: encoder %.2f s in %d calls for %d "
             "requests; %d steps, model %.2f s, other %.2f s)", t_eng, tokens / t_eng, t_hf / t_eng,
             engine.stats["encoder_s"], engine.stats["encoder_runs"], engine.stats["encoder_requests"],
             engine.stats["steps"], engine.stats["model_s"], engine.stats["overhead_s"] - engine.stats["encoder_s"])
    log.info("requests with tokens equal to the padded batch's: %d of %d", same, n)
    lengths = (16, 64) if args.quick else (16, 64, 256, 512)
    batch, steps = 8, (4 if args.quick else 20)
    log.info("decode step, %d requests, by encoder length (attention: its calls' time inside the step; the rest should "
             "not grow with L):", batch)
    log.info("  L     step ms   cross-attention ms   self-attention ms   rest ms")
    for L in lengths:
        step_ms, cross_ms, self_ms = decode_step_ms(engine, L, batch, steps)
        log.info("  %-5d %7.2f   %18.3f   %17.3f   %7.2f", L, step_ms, cross_ms, self_ms, step_ms - cross_ms - self_ms)
    # the control: the shortest sources, with as many bytes read before each step as the longest ones' cross K/V
    cross_bytes = batch * lengths[-1] * 2 * model.config.d_model * 4 * args.layers
    step_ms, cross_ms, self_ms = decode_step_ms(engine, lengths[0], batch, steps, displace=cross_bytes)
    log.info("  %-5d %7.2f   %18.3f   %17.3f   %7.2f   (and %.0f MB read before each step, as L=%d's cross K/V)",
             lengths[0], step_ms, cross_ms, self_ms, step_ms - cross_ms - self_ms, cross_bytes / 1e6, lengths[-1])


if __name__ == "__main__":
    main()
