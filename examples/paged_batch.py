"""Run one mixed serving step through the paged ops and check it against dense attention.

The batch holds what a serving engine produces in one step: two fresh prompts, a chunked
prefill continuing a cached prompt and three decodes, with GQA (8 query heads over 2 KV heads).

    python examples/paged_batch.py
"""

import math

import torch

import pagedattn
from pagedattn.backends import AttentionParams, build_metadata, get_backend, reference


def dense(q, k, v, scale):
    """Causal attention for one sequence (its queries the last of its keys), as
    ``pagedattn.backends.reference`` defines it. q [Q, Hq, D]; k, v [L, Hkv, D]."""
    params = AttentionParams(scale=scale, causal=True, sliding_window=0, softcap=0.0, alibi_slopes=None,
                             num_kv_heads=k.shape[1], head_size_v=v.shape[2])
    out = reference.dense_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                    params, exact=True)  # [1, Hq, Q, D]
    return out[0].transpose(0, 1)


def main() -> None:
    torch.manual_seed(0)
    heads, kv_heads, head_size, block_size = 8, 2, 64, 16
    scale = 1 / math.sqrt(head_size)
    backend = get_backend("cpu")
    # (tokens already cached, new tokens this step)
    seqs = [(0, 37), (0, 5), (48, 20), (70, 1), (15, 1), (129, 1)]
    total = [c + n for c, n in seqs]
    num_blocks = sum(math.ceil(t / block_size) for t in total) + 4
    free = torch.randperm(num_blocks).tolist()  # blocks handed out in no particular order
    tables = [[free.pop() for _ in range(math.ceil(t / block_size))] for t in total]
    cache = backend.allocate_kv_cache(num_blocks, block_size, kv_heads, head_size)
    ks = [torch.randn(t, kv_heads, head_size) for t in total]
    vs = [torch.randn(t, kv_heads, head_size) for t in total]

    # an earlier step cached the contexts
    earlier = [(i, c) for i, (c, _) in enumerate(seqs) if c]
    m0 = build_metadata([(0, c, tables[i]) for i, c in earlier], block_size)
    torch.ops.pagedattn.write_kv_cache(torch.cat([ks[i][:c] for i, c in earlier]),
                                       torch.cat([vs[i][:c] for i, c in earlier]), cache, m0.slot_mapping)

    # this step: write the new tokens, then attend
    meta = build_metadata([(c, n, t) for (c, n), t in zip(seqs, tables)], block_size)
    key = torch.cat([k[c:] for k, (c, _) in zip(ks, seqs)])
    value = torch.cat([v[c:] for v, (c, _) in zip(vs, seqs)])
    query = torch.randn(meta.num_tokens, heads, head_size)
    torch.ops.pagedattn.write_kv_cache(key, value, cache, meta.slot_mapping)
    out = torch.ops.pagedattn.paged_attention(
        query, key, value, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
        scale, True, 0, 0.0, None, kv_heads, head_size)

    starts = meta.query_start_loc.tolist()
    print(f"pagedattn {pagedattn.__version__}: one step, {meta.num_tokens} tokens, {len(seqs)} sequences, "
          f"backend {backend.name}, cache {tuple(cache.shape)}")
    print(f"{'seq':>3} {'cached':>6} {'new':>4} {'kind':>14} {'blocks':>6} {'max |paged - dense|':>20}")
    worst = 0.0
    for i, ((c, n), t) in enumerate(zip(seqs, tables)):
        ref = dense(query[starts[i]:starts[i + 1]], ks[i], vs[i], scale)
        err = (out[starts[i]:starts[i + 1]] - ref).abs().max().item()
        worst = max(worst, err)
        kind = "decode" if n == 1 and c else ("chunked prefill" if c else "prefill")
        print(f"{i:>3} {c:>6} {n:>4} {kind:>14} {len(t):>6} {err:>20.2e}")
    ok = worst < 1e-4
    print(f"{'OK' if ok else 'MISMATCH'}: paged attention matches dense attention (max error {worst:.2e})")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
