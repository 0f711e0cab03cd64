"""What the generic position-program path costs a decode step, against the fast causal path.

Two models with the same weights: a stack of T5-style decoder layers (bucketed relative bias, causal:
no fast kind, so served by its position program, evaluated for each step's positions) and the same
stack with a plain causal mask (the CPU backend's flash-decoding). Each engine prefills ``--batch``
prompts of ``--context`` tokens, then decode steps are timed (median of ``--steps``), in this process.
Also prints the rewrite time, most of it the proof that the bias depends on positions only.

    python benchmarks/position_mod_cost.py [--context 2048] [--batch 1] [--layers 4]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
from torch import nn

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

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(self.n1(x)).view(B, T, 3, H, D).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-1, -2) * D ** -0.5
        rel = torch.arange(T)[None, :] - torch.arange(T)[:, None]
        if self.t5:
            s = s + self.rel(self.bucket(rel)).permute(2, 0, 1)
        s = s.masked_fill(rel > 0, float("-inf"))
        x = x + self.o((s.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.n2(x))


class LM(nn.Module):
    def __init__(self, layers: int, t5: bool):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(VOCAB, C), nn.Linear(C, VOCAB)
        self.layers = nn.ModuleList(Layer(t5) for _ in range(layers))

    def forward(self, input_ids):
        x = self.emb(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def decode_step_s(model: nn.Module, context: int, batch: int, steps: int) -> tuple[float, float]:
    """(rewrite seconds, median decode-step seconds)."""
    t0 = time.perf_counter()
    engine = PagedEngine(model, block_size=16, max_num_tokens=2048, compile=False)
    rewrite_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    for _ in range(batch):
        engine.add_request(torch.randint(0, VOCAB, (context,), generator=g).tolist(),
                           SamplingParams(max_new_tokens=steps + 8))
    while engine.scheduler.waiting or any(r.num_pending > 1 for r in engine.scheduler.running):
        engine.step()  # prefill (and the first decodes)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return rewrite_s, statistics.median(times)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args(argv)
    with torch.no_grad():
        r_causal, causal = decode_step_s(LM(a.layers, t5=False).eval(), a.context, a.batch, a.steps)
        r_t5, t5 = decode_step_s(LM(a.layers, t5=True).eval(), a.context, a.batch, a.steps)
    print(f"{a.layers} layers, hidden {C}, {H} heads, batch {a.batch}, context {a.context}, "
          f"{torch.get_num_threads()} threads")
    print(f"rewrite: causal {r_causal:.2f} s, T5 buckets {r_t5:.2f} s (the proof of the position program)")
    print(f"decode step: causal (fast path) {causal * 1e3:.2f} ms, T5 buckets (position program) {t5 * 1e3:.2f} ms, "
          f"ratio {t5 / causal:.2f}x (target <= 1.5x)")


if __name__ == "__main__":
    main()
