"""replace_attention, insert_paged and remove_dead_code on one graph."""

import torch

import pagedattn
from pagedattn.passes import (
    PagedSite,
    classify_mask,
    insert_paged,
    match_attention,
    remove_dead_code,
    replace_attention,
)

from ..rewriter import zoo
from ..support import aten_graph, engine_example, targets, tiny_model

aten = torch.ops.aten


def test_replace_then_page():
    m = zoo.GQAExpand().eval()
    x = zoo.example_args("gqa_expand")
    gm, ctx = aten_graph(m, x)
    for p in (match_attention, classify_mask):
        p(gm, ctx)
    assert replace_attention(gm, ctx).changed
    remove_dead_code(gm, ctx)
    gm.recompile()
    t = targets(gm)
    assert torch.ops.pagedattn.attention.default in t
    assert aten.softmax.int not in t and aten.masked_fill.Scalar not in t  # mask code is gone
    assert aten.expand.default not in t  # the repeated K/V too: GQA is native
    x2 = torch.randn(3, 12, zoo.C)
    torch.testing.assert_close(gm(x2)[0], m(x2), atol=2e-5, rtol=1e-4)

    assert insert_paged(gm, ctx).changed
    remove_dead_code(gm, ctx)
    t = targets(gm)
    assert torch.ops.pagedattn.attention.default not in t
    assert t.count(torch.ops.pagedattn.write_kv_cache.default) == 1
    assert t.count(torch.ops.pagedattn.paged_attention.default) == 1
    (site,) = ctx.sites
    assert ctx.paged_sites == [PagedSite("kv_cache_0", site.name)]
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    assert names[-5:] == ["kv_cache_0", "slot_mapping", "block_tables", "seq_lens", "query_start_loc"]


def test_cross_attention_stays_dense_in_paged_graph():
    gm, ctx = aten_graph(zoo.CrossAttention(), zoo.example_args("cross_attention"))
    for p in (match_attention, classify_mask, replace_attention, remove_dead_code):
        p(gm, ctx)
    assert not insert_paged(gm, ctx).changed and ctx.paged_sites == []
    assert torch.ops.pagedattn.attention.default in targets(gm)


def test_dead_code_pass_reports_what_it_removed():
    gm, ctx = aten_graph(zoo.NanoGPT(), zoo.example_args("nanogpt"))
    assert not remove_dead_code(gm, ctx).changed
    x = next(n for n in gm.graph.nodes if n.op == "placeholder")
    with gm.graph.inserting_after(x):
        gm.graph.call_function(aten.neg.default, (x,))  # computed, never used
    assert remove_dead_code(gm, ctx).changed
    assert aten.neg.default not in targets(gm)


def test_paged_graph_drops_the_replaced_attention(llama):
    """fx's DCE alone keeps SDPA (random: dropout) and export's dtype asserts with what they check, so an
    eager paged graph would still run the original attention beside the paged op."""
    sdpa = tiny_model("llama", "sdpa")
    for rm, gone in ((pagedattn.rewrite(sdpa, (), engine_example(sdpa)), aten.scaled_dot_product_attention.default),
                     (llama[2], aten.softmax.int)):  # the eager model, rewritten as the engine does
        t = targets(rm.graph_module)
        assert t.count(torch.ops.pagedattn.paged_attention.default) == sdpa.config.num_hidden_layers
        assert gone not in t
