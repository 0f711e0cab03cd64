"""Helpers for the XLA backend tests: cache layout conversion and a small bucketed serving loop.

Imported only by test modules that have already skipped when torch_xla is absent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from pagedattn.backends import build_metadata
from pagedattn.runtime.context import paged_context


def xla_layout(cpu_cache: torch.Tensor, head_align: int = 1) -> torch.Tensor:
    """``[2, nb, bs, Hkv, D]`` (CPU backend) -> ``[nb, bs, 2 * Hkv, Dp]`` with K, V interleaved."""
    x = torch.stack((cpu_cache[0], cpu_cache[1]), dim=3).flatten(2, 3)  # [nb, bs, Hkv * 2, D]
    d = x.shape[-1]
    return torch.nn.functional.pad(x, (0, -(-d // head_align) * head_align - d))


def cpu_layout(xla_cache: torch.Tensor, head_size: int) -> torch.Tensor:
    """Inverse of :func:`xla_layout` (the head padding dropped), on the CPU."""
    c = xla_cache.cpu()
    nb, bs, h2, _ = c.shape
    c = c[..., :head_size].reshape(nb, bs, h2 // 2, 2, head_size)
    return torch.stack((c[..., 0, :], c[..., 1, :]))


@dataclass
class _Req:
    prompt: list[int]
    max_new: int
    arrival: int
    eos: frozenset
    blocks: list[int] = field(default_factory=list)
    out: list[int] = field(default_factory=list)
    computed: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out

    @property
    def done(self) -> bool:
        return len(self.out) >= self.max_new or bool(self.out and self.out[-1] in self.eos)


def serve_greedy(model, prompts, max_new, *, arrivals, buckets, num_blocks, device, eos=()):
    """Greedy continuous batching over a rewritten model on XLA, every step padded to ``buckets``.

    A request joins at step ``arrivals[i]`` with its whole prompt as one chunk, then decodes one
    token a step until ``max_new`` tokens or an ``eos`` token. Each step ends in one ``torch_xla.sync()``: the model, the sampling and the cache
    updates run as one graph. Returns (tokens per prompt, the (tokens, seqs, blocks) shape of each step).
    """
    import torch_xla

    from pagedattn.backends.pallas_xla import pad_step

    block_size = model.block_size  # the caches' block size
    reqs = [_Req(list(p), n, a, frozenset(eos)) for p, n, a in zip(prompts, max_new, arrivals)]
    free = list(range(num_blocks))
    caches = model.allocate_kv_caches(num_blocks, device=device)
    shapes, step = [], 0
    while any(not r.done for r in reqs):
        batch = [r for r in reqs if r.arrival <= step and not r.done]
        step += 1
        if not batch:
            continue
        specs, ids, pos, rows = [], [], [], []
        for r in batch:
            if not r.blocks:
                need = math.ceil((len(r.prompt) + r.max_new) / block_size)
                r.blocks, free = free[:need], free[need:]
            new = r.tokens[r.computed:]
            specs.append((r.computed, len(new), r.blocks))
            ids += new
            pos += range(r.computed, r.computed + len(new))
            rows.append(len(ids) - 1)
        meta = pad_step(build_metadata(specs, block_size), buckets)
        T, S = meta.num_tokens, meta.num_seqs
        shapes.append((T, S, meta.block_tables.shape[1]))
        ids += [0] * (T - len(ids))
        pos += [0] * (T - len(pos))
        rows += [0] * (S - len(rows))
        kw = dict(input_ids=torch.tensor([ids], device=device), position_ids=torch.tensor([pos], device=device),
                  use_cache=False, logits_to_keep=torch.tensor(rows, device=device))
        with torch.no_grad(), paged_context(caches, meta.to(device)):
            logits = model(**kw).logits  # [1, S, V]
        nxt = logits[0].argmax(-1)
        torch_xla.sync()
        for r, tok in zip(batch, nxt.cpu().tolist()):
            r.computed = len(r.tokens)
            r.out.append(tok)
            if r.done:
                free += r.blocks
    return [r.out for r in reqs], shapes
