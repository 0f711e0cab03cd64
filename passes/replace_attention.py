"""Replace each classified site with one canonical ``pagedattn::attention`` node."""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch.fx import GraphModule, Node

from pagedattn.passes.canonical import attention_node
from pagedattn.passes.context import PassContext, PassReport
from pagedattn.passes.site import AttentionSite, aten, val

log = logging.getLogger("pagedattn.passes")


def replace_attention(gm: GraphModule, ctx: PassContext) -> PassReport:
    done = 0
    for i, site in enumerate(ctx.sites):
        if site.status != "matched" or site.mask_kind is None:
            continue
        reason = _dtype_problem(site)
        if reason:
            site.skip(reason)
            continue
        _replace(gm, site, i)
        site.status = "rewritten"
        done += 1
    return PassReport("replace_attention", done > 0, f"{done} sites replaced")


def _dtype_problem(site: AttentionSite) -> str:
    dts = {val(n).dtype for n in (site.query, site.key, site.value)}
    if len(dts) > 1:
        return f"query/key/value dtypes differ ({', '.join(str(d) for d in dts)})"
    return ""


def _beside(constant: torch.Tensor, like) -> torch.Tensor:
    """A copy of a constant the classifier established (on the CPU) on the device of the site's tensors, so
    that the graph's buffer sits where the model runs; traced on the meta device, it stays where it is."""
    device = getattr(like, "device", None)
    if device is None or device.type == "meta":
        return constant.clone()
    return constant.to(device, copy=True)


def _pad_last(g, node: Node, size: int) -> Node:
    v = val(node)
    if v.shape[-1] == size:
        return node
    n = g.call_function(aten.constant_pad_nd.default, (node, [0, size - v.shape[-1]]))
    n.meta["val"] = v.new_empty((*v.shape[:-1], size))
    return n


def _replace(gm: GraphModule, site: AttentionSite, index: int) -> None:
    g = gm.graph
    out = site.output
    dv = val(site.value).shape[-1]
    with g.inserting_before(out):
        # query/key and value head sizes differ (multi-head latent attention): zero-pad the smaller to the
        # larger, so one cache holds both; zeros add nothing to the scores, and the padded output columns
        # are sliced off
        size = max(val(site.query).shape[-1], dv)
        site.query, site.key, site.value = (_pad_last(g, n, size) for n in (site.query, site.key, site.value))
        site.head_dim = size
        alibi = None
        if site.alibi_slopes is not None:
            name = f"_pagedattn_alibi_{index}"
            gm.register_buffer(name, _beside(site.alibi_slopes, val(site.query)))
            alibi = g.get_attr(name)
            alibi.meta["val"] = site.alibi_slopes
        sinks = None
        if site.sinks is not None:  # [Hq]: the state's elements are in head order (checked when matched)
            sinks = g.call_function(aten.reshape.default, (site.sinks, [-1]))
            sinks.meta["val"] = val(site.sinks).reshape(-1)
        tables = None
        if site.position_tables is not None:  # constant tables a position program reads
            name = f"_pagedattn_position_tables_{index}"
            gm.register_buffer(name, _beside(site.position_tables, val(site.query)))
            tables = g.get_attr(name)
            tables.meta["val"] = site.position_tables
        params = dataclasses.replace(site.params(), alibi_slopes=alibi, sinks=sinks, head_size_v=int(size),
                                     position_tables=tables, position_data=site.position_data)
        key_padding = site.key_padding
        if key_padding is not None and not site.key_padding_keeps_true:  # True marked keys to ignore
            key_padding = g.call_function(aten.logical_not.default, (key_padding,))
            key_padding.meta["val"] = val(site.key_padding).logical_not()
        node = attention_node(g, site.query, site.key, site.value, key_padding, params)
        qv, vv = val(site.query), val(site.value)
        node.meta["val"] = qv.new_empty((*qv.shape[:-1], vv.shape[-1]))
        node.meta["pagedattn_site"] = site.name
        if dv != size:
            sliced = g.call_function(aten.slice.Tensor, (node, -1, 0, dv))
            sliced.meta["val"] = qv.new_empty((*qv.shape[:-1], dv))
            node = sliced
        result = _to_layout(g, node, site.output_layout)
        result = _same_memory_order(g, result, val(out))
        want = val(out).dtype if val(out) is not None else None
        if want is not None and want != qv.dtype:
            result = g.call_function(aten._to_copy.default, (result,), {"dtype": want})
    out.replace_all_uses_with(result)
    site.output = result


def _same_memory_order(g, node: Node, like) -> Node:
    """Lay the result out in memory like the replaced value: code after it may ``view`` it in that order
    (SDPA returns ``[B, H, S, D]`` stored as ``[B, S, H, D]``; its ``transpose(1, 2).contiguous()`` traces to nothing)."""
    if not isinstance(like, torch.Tensor) or like.dim() < 2:
        return node
    try:
        strides = [int(s.node.hint) if isinstance(s, torch.SymInt) else int(s) for s in like.stride()]
        sizes = [int(s.node.hint) if isinstance(s, torch.SymInt) else int(s) for s in like.shape]
    except Exception:
        return node
    big = [i for i in range(like.dim()) if sizes[i] > 1]  # size-1 dims do not constrain a view
    want = sorted(big, key=lambda i: (-strides[i], i))
    if want == big:
        return node
    order = [i for i in range(like.dim()) if sizes[i] <= 1] + want
    inverse = [order.index(i) for i in range(len(order))]
    p = g.call_function(aten.permute.default, (node, order))
    c = g.call_function(aten.clone.default, (p,), {"memory_format": torch.contiguous_format})
    return g.call_function(aten.permute.default, (c, inverse))


def _to_layout(g, node: Node, layout) -> Node:
    """Map the canonical ``[B, Hq, S, Dv]`` result onto the replaced node's layout."""
    if layout is None:
        return node
    if layout[0] == "flatten":
        return g.call_function(aten.flatten.using_ints, (node, 0, 1))
    if layout[0] == "permute":
        return g.call_function(aten.permute.default, (node, list(layout[1])))
    raise ValueError(f"unknown output layout {layout}")
