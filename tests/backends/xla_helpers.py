"""Helpers for the XLA backend tests: random paged batches, the references they are checked against,
cache layout conversion, tiny Hugging Face models and a small bucketed serving loop.

Batches come from ``tests/support.py`` like the CPU suite's; the XLA tests run in their own environment
(``.ci/xla-tests``). Imported only by test modules that have already skipped when torch_xla is absent.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from pagedattn.backends import AttentionParams, build_metadata, reference
from pagedattn.runtime.context import paged_context

from ..support import PagedBatch, make_batch  # noqa: F401  (make_batch re-exported for the XLA tests)

# ------------------------------------------------------------------ paged batches


# the CPU suite's paged step: one definition of how a test batch is laid out
Batch = PagedBatch


def params_for(b: Batch, scale=None, causal=True, window=0, softcap=0.0, alibi=None, sinks=None,
               mod=None) -> AttentionParams:
    """The site parameters of a test call on ``b`` (scale ``1/sqrt(D)`` unless given; ``mod``: a position
    program and its tables, and the sequences' per-request values for a program that reads some)."""
    d = b.query.shape[-1]
    extra = {} if mod is None else {"position_mod": mod[0], "position_tables": mod[1]}
    if mod is not None and len(mod) > 2:
        extra["position_data"] = mod[2]
    return AttentionParams(scale=1 / math.sqrt(d) if scale is None else scale, causal=causal, sliding_window=window,
                           softcap=softcap, alibi_slopes=alibi, num_kv_heads=b.key.shape[1], head_size_v=d,
                           sinks=sinks, **extra)


def on(params: AttentionParams, device) -> AttentionParams:
    """``params`` with its tensors (ALiBi slopes, sinks) on ``device``."""
    move = {f: getattr(params, f).to(device) for f in ("alibi_slopes", "sinks", "position_tables", "position_data")
            if getattr(params, f) is not None}
    return dataclasses.replace(params, **move)


def cpu_step(b: Batch, params: AttentionParams) -> torch.Tensor:
    """The step through the ops on the CPU (the CPU backend, itself tested against ``reference``);
    writes ``b.kv_cache``."""
    m = b.meta
    torch.ops.pagedattn.write_kv_cache(b.key, b.value, b.kv_cache, m.slot_mapping)
    return torch.ops.pagedattn.paged_attention(b.query, b.key, b.value, b.kv_cache, m.block_tables, m.seq_lens,
                                               m.query_start_loc, *params.args())


def reference_step(b: Batch, params: AttentionParams) -> torch.Tensor:
    """The real tokens' rows by ``pagedattn.backends.reference.dense_attention`` (exact math), one
    sequence at a time over its full K/V; ``[sum(q_lens), Hq, D]``."""
    outs, row = [], 0
    for i, (n, k, v) in enumerate(zip(b.q_lens, b.full_k, b.full_v)):
        q = b.query[row:row + n].transpose(0, 1)[None]  # [1, Hq, n, D]: the last n of L positions
        values = None if params.position_data is None else params.position_data[i:i + 1]
        o = reference.dense_attention(q, k.transpose(0, 1)[None], v.transpose(0, 1)[None], params, exact=True,
                                      values=values)
        outs.append(o[0].transpose(0, 1))
        row += n
    return torch.cat(outs)


def float64_step(b: Batch, params: AttentionParams) -> torch.Tensor:
    """The real tokens' rows by plain float64 matmul-softmax, written independently of the library."""
    p, outs, row = params, [], 0
    for c, n, k, v in zip(b.contexts, b.q_lens, b.full_k, b.full_v):
        q = b.query[row:row + n].double()
        row += n
        group = q.shape[1] // k.shape[1]
        k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) * p.scale
        if p.softcap > 0:
            s = p.softcap * torch.tanh(s / p.softcap)
        qi, kj = torch.arange(n)[:, None] + c, torch.arange(c + n)[None, :]
        if p.alibi_slopes is not None:
            s = s + p.alibi_slopes.double()[:, None, None] * (kj - qi)[None]
        if p.causal:
            ok = (kj <= qi) & ((qi - kj < p.sliding_window) if p.sliding_window > 0 else True)
            if p.chunk_size > 0:  # the query's own chunk only
                ok = ok & (qi // p.chunk_size == kj // p.chunk_size)
            s = s.masked_fill(~ok[None], float("-inf"))
        if p.sinks is not None:  # one more logit per head, dropped after the softmax
            s = torch.cat([s, p.sinks.double()[:, None, None].expand(*s.shape[:2], 1)], -1)
            outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1)[..., :-1], v))
        else:
            outs.append(torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v))
    return torch.cat(outs)


# ------------------------------------------------------------------ cache layouts


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


# ------------------------------------------------------------------ tiny models

VOCAB = 128
TINY = {
    "llama": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2),
    "mistral": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, sliding_window=6),
}


def tiny_model(arch: str, seed: int = 0):
    """A tiny random-weight Hugging Face causal LM (eager attention), built from a config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(arch, vocab_size=VOCAB, max_position_embeddings=256, **TINY[arch])
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()


def example(model) -> dict:
    """The example call ``pagedattn.rewrite`` traces with: the step inputs the model takes."""
    from pagedattn.adapter import accepted_inputs, example_inputs

    return example_inputs(accepted_inputs(model), VOCAB)


def eos_ids(model) -> list[int]:
    eos = model.generation_config.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos or [])


def hf_greedy(model, prompts, new) -> list[list[int]]:
    """Hugging Face greedy ``generate``: ``new[i]`` tokens after each prompt."""
    out = []
    for p, n in zip(prompts, new):
        ids = torch.tensor([p])
        with torch.no_grad():
            g = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                               do_sample=False, pad_token_id=0)
        out.append(g[0, len(p):].tolist())
    return out


# ------------------------------------------------------------------ a serving loop


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


def serve_greedy(model, prompts, max_new, *, arrivals, buckets, num_blocks, device, eos=(),
                 backend=None):
    """Greedy continuous batching over a rewritten model on XLA, every step padded to ``buckets``.

    A request joins at step ``arrivals[i]`` with its whole prompt as one chunk, then decodes one
    token a step until ``max_new`` tokens or an ``eos`` token. Each step ends in one ``torch_xla.sync()``:
    the model, the sampling and the cache updates run as one graph. ``backend`` is bound to the steps
    (``paged_context(..., backend=)``; default: the model's own). Returns (tokens per prompt, the
    (tokens, seqs, blocks) shape of each step).
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
        with torch.no_grad(), paged_context(caches, meta.to(device), backend):
            logits = model(**kw).logits  # [1, S, V]
        nxt = logits[0].argmax(-1)
        torch_xla.sync()
        for r, tok in zip(batch, nxt.cpu().tolist()):
            r.computed = len(r.tokens)
            r.out.append(tok)
            if r.done:
                free += r.blocks
    return [r.out for r in reqs], shapes
