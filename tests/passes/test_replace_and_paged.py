"""replace_attention, insert_paged and remove_dead_code on one graph."""

import torch

from pagedattn.passes import classify_mask, insert_paged, match_attention, remove_dead_code, replace_attention

from ..rewriter import zoo
from .graphs import aten_graph, targets

aten = torch.ops.aten


def test_replace_then_page():
    m = zoo.GQAExpand().eval()
    x = zoo.example_args("gqa_expand")
    gm = aten_graph(m, x)
    for p in (match_attention, classify_mask):
        p(gm)
    assert replace_attention(gm).changed
    remove_dead_code(gm)
    t = targets(gm)
    assert torch.ops.pagedattn.attention.default in t
    assert aten.softmax.int not in t and aten.masked_fill.Scalar not in t  # mask code is gone
    assert aten.expand.default not in t  # the repeated K/V too: GQA is native
    x2 = torch.randn(3, 12, zoo.C)
    torch.testing.assert_close(gm(x2)[0], m(x2), atol=2e-5, rtol=1e-4)

    assert insert_paged(gm).changed
    remove_dead_code(gm)
    t = targets(gm)
    assert torch.ops.pagedattn.attention.default not in t
    assert t.count(torch.ops.pagedattn.write_kv_cache.default) == 1
    assert t.count(torch.ops.pagedattn.paged_attention.default) == 1
    assert gm.meta["pagedattn_cache_inputs"] == ["kv_cache_0"]


def test_cross_attention_stays_dense_in_paged_graph():
    gm = aten_graph(zoo.CrossAttention(), zoo.example_args("cross_attention"))
    for p in (match_attention, classify_mask, replace_attention, remove_dead_code):
        p(gm)
    assert not insert_paged(gm).changed
    assert torch.ops.pagedattn.attention.default in targets(gm)


def test_dead_code_pass_reports_what_it_removed():
    gm = aten_graph(zoo.NanoGPT(), zoo.example_args("nanogpt"))
    assert not remove_dead_code(gm).changed


def test_paged_graph_drops_the_replaced_attention():
    """fx's DCE alone keeps SDPA (random: dropout) and export's dtype asserts with what they check, so an
    eager paged graph would still run the original attention beside the paged op."""
    import pagedattn

    from ..rewriter.hf_models import tiny_model

    for attn, gone in (("sdpa", aten.scaled_dot_product_attention.default), ("eager", aten.softmax.int)):
        m = tiny_model("llama", attn)
        rm = pagedattn.rewrite(m, (), {"input_ids": torch.arange(8)[None] % 100, "use_cache": False})
        t = targets(rm.graph_module)
        assert t.count(torch.ops.pagedattn.paged_attention.default) == m.config.num_hidden_layers
        assert gone not in t
