"""Building and reading the op-contract nodes (``passes/canonical.py``): what is built reads back, and runs."""

import dataclasses

import torch
from torch.fx import Graph, GraphModule

from pagedattn.backends import METADATA_FIELDS, AttentionParams
from pagedattn.backends.reference import dense_attention
from pagedattn.passes.canonical import (
    attention_node,
    is_attention,
    is_cache_write,
    is_paged_attention,
    paged_nodes,
    read_attention,
    read_paged,
)

from ..support import make_batch, run_step


def _placeholders(g: Graph, *names):
    return [g.placeholder(n) for n in names]


def test_attention_node_reads_back():
    g = Graph()
    q, k, v, pad, slopes, sinks = _placeholders(g, "q", "k", "v", "pad", "slopes", "sinks")
    params = AttentionParams(0.25, True, 7, 3.0, slopes, 2, 16, sinks)
    node = attention_node(g, q, k, v, pad, params)
    site = read_attention(node)
    assert (site.node, site.query, site.key, site.value, site.key_padding) == (node, q, k, v, pad)
    assert site.params == params and site.params.alibi_slopes is slopes and site.params.sinks is sinks
    assert is_attention(node) and not is_paged_attention(node) and not is_cache_write(node)


def test_keywords_and_defaults_are_read_in_schema_order():
    # a node as a tracer may leave it: some arguments as keywords, the trailing default (sinks) left out
    g = Graph()
    q, k, v, pad = _placeholders(g, "q", "k", "v", "pad")
    params = AttentionParams(0.5, False, 0, 0.0, None, 4, 8)
    kwargs = {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.name != "sinks"}
    node = g.call_function(torch.ops.pagedattn.attention.default, (q, k, v), {"key_padding": pad, **kwargs})
    site = read_attention(node)
    assert site.key_padding is pad and site.params == params and site.params.sinks is None


def test_paged_nodes_read_back():
    g = Graph()
    q, k, v, cache = _placeholders(g, "q", "k", "v", "kv_cache_0")
    meta = dict(zip(METADATA_FIELDS, _placeholders(g, *METADATA_FIELDS)))
    params = AttentionParams(0.125, True, 0, 0.0, None, 2, 8)
    node = paged_nodes(g, q, k, v, cache, meta, params)
    (write,) = [n for n in g.nodes if is_cache_write(n)]
    assert write.args == (k, v, cache, meta["slot_mapping"]) and write.next is node  # written, then read
    site = read_paged(node)
    assert (site.query, site.key, site.value, site.kv_cache) == (q, k, v, cache)
    assert (site.block_tables, site.seq_lens, site.query_start_loc) == (
        meta["block_tables"], meta["seq_lens"], meta["query_start_loc"])
    assert site.params == params and is_paged_attention(node) and not is_attention(node)


def test_built_nodes_run_as_the_ops_define_them():
    # the argument order the helpers write is the ops' schema order: the graphs compute the ops' results
    g = Graph()
    q, k, v, pad, slopes = _placeholders(g, "q", "k", "v", "pad", "slopes")
    p = AttentionParams(0.3, True, 3, 2.0, slopes, 2, 6)
    g.output(attention_node(g, q, k, v, pad, p))
    gm = GraphModule(torch.nn.Module(), g)
    x = (torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 6), torch.tensor([[1] * 5, [0, 1, 1, 1, 1]]),
         torch.tensor([0.5, 0.25, 0.125, 0.0625]))
    want = dense_attention(*x[:3], dataclasses.replace(p, alibi_slopes=x[4]), key_present=x[3] != 0)
    torch.testing.assert_close(gm(*x), want)

    g = Graph()
    q, k, v, cache = _placeholders(g, "q", "k", "v", "kv_cache_0")
    meta = dict(zip(METADATA_FIELDS, _placeholders(g, *METADATA_FIELDS)))
    g.output(paged_nodes(g, q, k, v, cache, meta, AttentionParams(0.2, True, 0, 0.0, None, 2, 16)))
    gm = GraphModule(torch.nn.Module(), g)
    b, ref = make_batch([(0, 5), (7, 1)], head_size=16, block_size=4), make_batch([(0, 5), (7, 1)], head_size=16,
                                                                                   block_size=4)
    out = gm(b.query, b.key, b.value, b.kv_cache, *b.meta.tensors())
    torch.testing.assert_close(out, run_step(ref, 0.2))
    torch.testing.assert_close(b.kv_cache, ref.kv_cache)  # the write ran
