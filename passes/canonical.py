"""Building and reading the nodes of the op contract: the one place that knows their argument order.

``attention_node`` / ``read_attention`` for the canonical (drop-in) ``pagedattn::attention``;
``paged_nodes`` / ``read_paged`` for a KV-cache write plus ``pagedattn::paged_attention``. Per-site
parameters travel as an :class:`~pagedattn.backends.params.AttentionParams` whose tensor fields
hold graph nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.fx import Graph, Node

from pagedattn.backends.ops import PARAMS_OFFSET
from pagedattn.backends.params import AttentionParams

__all__ = ["CanonicalAttention", "PagedAttention", "attention_node", "read_attention", "paged_nodes", "attend_node",
           "read_paged", "is_attention", "is_paged_attention", "is_cache_write"]

_ATTENTION = torch.ops.pagedattn.attention.default
_PAGED = torch.ops.pagedattn.paged_attention.default
_WRITES = (torch.ops.pagedattn.write_kv_cache.default, torch.ops.pagedattn.write_kv_cache_functional.default)


def _bound(node: Node) -> list:
    """The node's arguments in schema order, defaults filled in (kwargs included)."""
    schema = node.target._schema
    out = []
    for i, a in enumerate(schema.arguments):
        if i < len(node.args):
            out.append(node.args[i])
        elif a.name in node.kwargs:
            out.append(node.kwargs[a.name])
        else:
            out.append(a.default_value)
    return out


def is_attention(node: Node) -> bool:
    return node.op == "call_function" and node.target is _ATTENTION


def is_paged_attention(node: Node) -> bool:
    return node.op == "call_function" and node.target is _PAGED


def is_cache_write(node: Node) -> bool:
    return node.op == "call_function" and node.target in _WRITES


@dataclass(frozen=True)
class CanonicalAttention:
    """A ``pagedattn::attention`` node: ``query [B, Hq, S, D]``, ``key``/``value [B, Hkv, L, D]``."""

    node: Node
    query: Node
    key: Node
    value: Node
    key_padding: Optional[Node]
    params: AttentionParams


def attention_node(graph: Graph, query: Node, key: Node, value: Node, key_padding: Optional[Node],
                   params: AttentionParams) -> Node:
    return graph.call_function(_ATTENTION, (query, key, value, key_padding, *params.args()))


def read_attention(node: Node) -> CanonicalAttention:
    args = _bound(node)
    off = PARAMS_OFFSET["attention"]
    return CanonicalAttention(node, *args[:off], AttentionParams.from_args(args[off:]))


@dataclass(frozen=True)
class PagedAttention:
    """A ``pagedattn::paged_attention`` node over flattened tokens ``[T, heads, head_size]``."""

    node: Node
    query: Node
    key: Optional[Node]
    value: Optional[Node]
    kv_cache: Node
    block_tables: Node
    seq_lens: Node
    query_start_loc: Node
    params: AttentionParams


def paged_nodes(graph: Graph, query: Node, key: Node, value: Node, kv_cache: Node, metadata: dict[str, Node],
                params: AttentionParams) -> Node:
    """A cache write of the step's K/V, then the paged attention over the cache; returns the attention node."""
    graph.call_function(torch.ops.pagedattn.write_kv_cache.default, (key, value, kv_cache, metadata["slot_mapping"]))
    return attend_node(graph, query, key, value, kv_cache, metadata["block_tables"], metadata["seq_lens"],
                       metadata["query_start_loc"], params)


def attend_node(graph: Graph, query: Node, key: Optional[Node], value: Optional[Node], kv_cache: Node,
                block_tables: Node, seq_lens: Node, query_start_loc: Node, params: AttentionParams) -> Node:
    """A paged attention node alone (no write): ``key``/``value`` None over a cache filled elsewhere."""
    return graph.call_function(_PAGED, (query, key, value, kv_cache, block_tables, seq_lens, query_start_loc,
                                        *params.args()))


def read_paged(node: Node) -> PagedAttention:
    args = _bound(node)
    off = PARAMS_OFFSET["paged_attention"]
    return PagedAttention(node, *args[:off], AttentionParams.from_args(args[off:]))
