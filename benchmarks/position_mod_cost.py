"""What the generic position-program path costs a decode step, against the fast causal path.

Two models with the same weights: a stack of T5-style decoder layers (bucketed relative bias, causal:
no fast kind, so served by its position program, evaluated once a step at the keys the step reads and
handed to the native decode kernel as a term per score) and the same stack with a plain causal mask (the
same kernel without the term). Each engine prefills ``--batch``
prompts of ``--context`` tokens, then decode steps of the two engines are timed alternately (so that
both see the same machine load), median and fastest of ``--steps``. Then the prefill of one prompt of
``--context`` tokens (and of a quarter of it), the engines alternating, median of ``--prefills``: a
program that reads positions only through their distance (T5's) is evaluated once per distance and
handed to the native prefill kernel as a term by distance.

Then the rewrite time against the number of layers, most of it the proof that the bias depends on
positions only: causal, T5 buckets with each layer's own bucket program and table (a proof per layer:
the programs differ in their tables), and T5 buckets computed once and shared by every layer (as Hugging
Face's T5 passes layer 0's ``position_bias`` on: one distinct mask program, one proof).

    python benchmarks/position_mod_cost.py [--context 2048] [--batch 1,8] [--layers 4] [--prefills 5] [--sweep 1,2,4,8]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import paged_cases  # benchmarks/paged_cases.py, beside this script
import torch
from torch import nn

import pagedattn
from pagedattn import PagedEngine, SamplingParams

C, H, VOCAB = 256, 4, 512
D = C // H


class Layer(nn.Module):
    def __init__(self, t5: bool, buckets: int = 32, max_distance: int = 128):
        super().__init__()
        self.t5, self.buckets, self.max_distance = t5, buckets, max_distance
        self.qkv, self.o = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.rel = nn.Embedding(buckets, H)
        self.mlp = nn.Sequential(nn.Linear(C, 4 * C), nn.GELU(), nn.Linear(4 * C, C))
        self.n1, self.n2 = nn.LayerNorm(C), nn.LayerNorm(C)

    def bucket(self, rel):  # rel = key - query (T5's unidirectional buckets)
        n = -torch.min(rel, torch.zeros_like(rel))
        exact = self.buckets // 2
        large = exact + (torch.log(n.float().clamp(min=1) / exact) / math.log(self.max_distance / exact)
                         * (self.buckets - exact)).to(torch.long)
        return torch.where(n < exact, n, torch.min(large, torch.full_like(large, self.buckets - 1)))

    def forward(self, x, bias=None):
        B, T, _ = x.shape
        q, k, v = self.qkv(self.n1(x)).view(B, T, 3, H, D).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-1, -2) * D ** -0.5
        rel = torch.arange(T)[None, :] - torch.arange(T)[:, None]
        if self.t5:
            s = s + self.rel(self.bucket(rel)).permute(2, 0, 1)
        if bias is None:
            s = s.masked_fill(rel > 0, float("-inf"))
        else:  # the bias and the causal mask computed once for every layer, as Hugging Face's T5 does
            s = s + bias
        x = x + self.o((s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.n2(x))


class LM(nn.Module):
    def __init__(self, layers: int, t5: bool, shared: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.shared = shared
        self.emb, self.head = nn.Embedding(VOCAB, C), nn.Linear(C, VOCAB)
        self.layers = nn.ModuleList(Layer(t5 and not shared) for _ in range(layers))
        self.bias = Layer(True) if shared else None  # its bucket function and table only

    def forward(self, input_ids):
        x = self.emb(input_ids)
        if self.shared:
            T = x.shape[1]
            rel = torch.arange(T)[None, :] - torch.arange(T)[:, None]
            bias = self.bias.rel(self.bias.bucket(rel)).permute(2, 0, 1)  # [H, T, T], once for every layer
            bias = bias.masked_fill(rel > 0, float("-inf"))
            for layer in self.layers:
                x = layer(x, bias)
        else:
            for layer in self.layers:
                x = layer(x)
        return self.head(x)


def engine_at_context(model: nn.Module, context: int, batch: int, steps: int) -> PagedEngine:
    """An engine whose ``batch`` requests have prefilled ``context`` tokens and have ``steps`` decodes left."""
    # each step() computes its own step (burst_ms=0): the steps are timed one by one
    engine = PagedEngine(model, block_size=16, max_num_tokens=2048, compile=False, progress=False, burst_ms=0)
    g = torch.Generator().manual_seed(0)
    for _ in range(batch):
        engine.add_request(torch.randint(0, VOCAB, (context,), generator=g).tolist(),
                           SamplingParams(max_new_tokens=steps + 8))
    while engine.scheduler.waiting or any(r.num_pending > 1 for r in engine.scheduler.running):
        engine.step()  # prefill (and the first decodes)
    return engine


def decode_steps(engines: list, steps: int) -> list[list[float]]:
    """Seconds per decode step of each engine, the engines stepped in turn."""
    times = [[] for _ in engines]
    for _ in range(steps):
        for e, t in zip(engines, times):
            t0 = time.perf_counter()
            e.step()
            t.append(time.perf_counter() - t0)
    return times


def prefill_ms(engines: list, tokens: int, rounds: int) -> list[float]:
    """Median milliseconds of each engine's step prefilling one fresh prompt of ``tokens``, the engines in turn."""
    g = torch.Generator().manual_seed(1)
    times = [[] for _ in engines]
    for _ in range(rounds):
        prompt = torch.randint(0, VOCAB, (tokens,), generator=g).tolist()
        for e, t in zip(engines, times):
            e.add_request(prompt, SamplingParams(max_new_tokens=1))
            t0 = time.perf_counter()
            e.step()
            t.append(time.perf_counter() - t0)
            while e.has_unfinished():
                e.step()
    return [statistics.median(t) * 1e3 for t in times]


# position programs written out for the op-level timings (backends/position_mod.py's format): a prefix-LM over one
# span per sequence (a query sees its causal keys and its span's: one run of keys a query), and four sink keys beside
# a causal window of 64 (two runs a query)
PREFIX_LM = json.dumps({"version": 1, "float": "float32", "allowed": 12, "bias": None,
                        "values": {"input": "token_type_ids", "kind": "runs", "inside": 1, "outside": 0, "runs": 1},
                        "nodes": [["q"], ["k"], ["le", 1, 0], ["val", 0], ["val", 1], ["ge", 0, 3], ["lt", 0, 4],
                                  ["ge", 1, 3], ["lt", 1, 4], ["and", 5, 6], ["and", 7, 8], ["and", 9, 10],
                                  ["or", 2, 11]]})
SINKS_WINDOW = json.dumps({"version": 1, "float": "float32", "allowed": 10, "bias": None, "nodes": [
    ["q"], ["k"], ["sub", 0, 1], ["int", 64], ["lt", 2, 3], ["int", 4], ["lt", 1, 5], ["or", 4, 6], ["int", 0],
    ["ge", 2, 8], ["and", 7, 9]]})


def op_prefill_ms(tokens: int, rounds: int) -> dict[str, float]:
    """Median milliseconds of one layer's prefill of a ``tokens``-token prompt through the paged op (bf16, 8 query
    heads over 4 KV heads of 64), alternating: causal, the prefix-LM (a span over the prompt's second quarter) and
    the sink keys beside a window. Every call repeats one step's metadata, as a step's layers do: after the first,
    a mask-only program's mask comes from the step's memo, so the figures are a step's later layers'."""
    _, step, _ = paged_cases.prefill_case(1, tokens, 8, 4, 64, torch.bfloat16, 16)
    cases = {"causal": {}, "prefix-LM (one run a query)": dict(causal=False, position_mod=PREFIX_LM,
                                                                position_data=torch.tensor([[tokens // 4, tokens // 2]])),
             "sink keys + window (two runs a query)": dict(causal=False, position_mod=SINKS_WINDOW)}
    times = {name: [] for name in cases}
    for _ in range(rounds):
        for name, kw in cases.items():
            t0 = time.perf_counter()
            step(**kw)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def rewrite_s(model: nn.Module) -> float:
    t0 = time.perf_counter()
    pagedattn.rewrite(model.eval(), (torch.randint(0, VOCAB, (1, 8)),))
    return time.perf_counter() - t0


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prefills", type=int, default=5, help="prefills timed per prompt length (0 to skip)")
    p.add_argument("--sweep", default="1,2,4,8", help="layer counts for the rewrite times ('' to skip)")
    a = p.parse_args(argv)
    print(f"hidden {C}, {H} heads, {a.layers} layers, context {a.context}, {torch.get_num_threads()} threads")
    with torch.no_grad():
        for batch in (int(b) for b in a.batch.split(",")):
            engines = [engine_at_context(LM(a.layers, t5=t5).eval(), a.context, batch, a.steps) for t5 in (False, True)]
            causal, t5 = decode_steps(engines, a.steps)
            mc, mt = statistics.median(causal), statistics.median(t5)
            print(f"batch {batch}: decode step causal (fast path) median {mc * 1e3:.2f} ms / fastest "
                  f"{min(causal) * 1e3:.2f} ms; T5 buckets (position program) {mt * 1e3:.2f} / {min(t5) * 1e3:.2f} ms; "
                  f"ratio {mt / mc:.2f}x median, {min(t5) / min(causal):.2f}x fastest (target <= 1.5x)")
            del engines
        if a.prefills:
            engines = [PagedEngine(LM(a.layers, t5=t5).eval(), block_size=16, max_num_tokens=max(2048, a.context),
                                   compile=False, progress=False, burst_ms=0) for t5 in (False, True)]
            for tokens in (a.context // 4, a.context):
                causal, t5 = prefill_ms(engines, tokens, a.prefills)
                print(f"prefill of {tokens} tokens: causal {causal:.1f} ms, T5 buckets {t5:.1f} ms, ratio "
                      f"{t5 / causal:.2f}x (median of {a.prefills})")
            del engines
            for tokens in (a.context // 4, a.context):
                ms = op_prefill_ms(tokens, a.prefills)
                base = ms["causal"]
                print(f"one layer's prefill of {tokens} tokens through the op: " + ", ".join(
                    f"{name} {t:.1f} ms ({t / base:.2f}x)" for name, t in ms.items()))
    for n in (int(x) for x in a.sweep.split(",") if x):
        times = [rewrite_s(LM(n, t5=t5, shared=shared)) for t5, shared in ((False, False), (True, False), (True, True))]
        print(f"rewrite, {n} layers: causal {times[0]:.2f} s, T5 per-layer programs {times[1]:.2f} s, "
              f"T5 shared program {times[2]:.2f} s")


if __name__ == "__main__":
    main()
