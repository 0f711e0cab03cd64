import logging
import subprocess
import sys
import textwrap

import pytest
import torch

import pagedattn
from pagedattn.backends import CacheSpec, build_metadata
from pagedattn.passes.canonical import is_attention, read_attention

from . import zoo

ATOL = 2e-5


@pytest.fixture(scope="module")
def rewritten():
    cache = {}

    def get(name):
        if name not in cache:
            cls, _ = {**zoo.ATTENTION, **zoo.NOT_ATTENTION}[name]
            m = cls().eval()
            cache[name] = (m, pagedattn.rewrite(m, zoo.example_args(name)))
        return cache[name]

    return get


@pytest.mark.parametrize("name", sorted(zoo.ATTENTION))
def test_zoo_report_and_dropin_equality(name, rewritten):
    m, rm = rewritten(name)
    expect = zoo.ATTENTION[name][1]
    (site,) = rm.report
    assert site["status"] == "rewritten", site["reason"]
    assert site["mask"] == expect["mask"]
    assert site["num_heads"] == zoo.H and site["head_dim"] == zoo.D
    assert site["num_kv_heads"] == expect.get("num_kv_heads", zoo.H)
    assert site["scale"] == pytest.approx(expect.get("scale", zoo.D**-0.5), rel=1e-6)
    assert site["window"] == expect.get("window")
    assert site["softcap"] == expect.get("softcap")
    assert site["alibi"] == expect.get("alibi", False)
    # other batch sizes and lengths than the example's, longer than any window probe would guess
    assert site["mask_up_to"] == expect.get("up_to", site["mask_up_to"])
    longest = expect.get("up_to") or (128 if name == "nanogpt" else None)  # a buffer the mask reads bounds it
    for B, T in [(3, 19), (1, 5), (2, 130) if longest is None else (2, longest - 8)]:
        args = zoo.example_args(name, B, T, seed=B + T)
        with torch.no_grad():
            torch.testing.assert_close(rm(*args), m(*args), atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("name", sorted(zoo.NOT_ATTENTION))
def test_counter_examples_are_left_alone(name, rewritten):
    m, rm = rewritten(name)
    expect = zoo.NOT_ATTENTION[name][1]
    assert rm.report, "the softmax must be found as a site, to be left alone"
    for site in rm.report:
        assert site["status"] == "skipped"
        if expect:
            assert expect in site["reason"]
        else:  # the router: a softmax that is no attention
            assert not site["attention"]
    assert rm.cache_specs == []
    assert not any(n.target is torch.ops.pagedattn.attention.default for n in rm.dropin_module.graph.nodes)
    args = zoo.example_args(name, 3, 11)
    with torch.no_grad():
        torch.testing.assert_close(rm(*args), m(*args))


def test_zero_matches_warns(caplog):
    m = zoo.Router().eval()
    with caplog.at_level(logging.WARNING, logger="pagedattn"):
        pagedattn.rewrite(m, zoo.example_args("router"))
    assert any("rewrote none" in r.message for r in caplog.records)


def test_sliding_window_wider_than_example_is_found(rewritten):
    # traced at T=8, the window of 100 looks causal there; probing beyond it must recover it
    _, rm = rewritten("sliding_window")
    assert rm.report[0]["mask"] == "sliding_window" and rm.report[0]["window"] == 100


def test_alibi_slopes_recovered(rewritten):
    _, rm = rewritten("alibi")
    (node,) = [n for n in rm.dropin_module.graph.nodes if is_attention(n)]
    slopes = read_attention(node).params.alibi_slopes  # a get_attr of the buffer holding them
    torch.testing.assert_close(getattr(rm.dropin_module, slopes.target), zoo.alibi_slopes(zoo.H))


SELF_ATTENTION = sorted(n for n in zoo.ATTENTION if n != "cross_attention")


@pytest.mark.parametrize("name", SELF_ATTENTION)
def test_paged_mode_prefill_then_decode(name, rewritten):
    """Two sequences flattened into one [1, T] step, then one decode token each."""
    m, rm = rewritten(name)
    g = torch.Generator().manual_seed(3)
    xa, xb = torch.randn(1, 9, zoo.C, generator=g), torch.randn(1, 21, zoo.C, generator=g)
    caches = rm.allocate_kv_caches(num_blocks=8)
    meta = build_metadata([(0, 9, [5]), (0, 21, [2, 0])], block_size=16)
    with torch.no_grad(), pagedattn.paged_context(caches, meta):
        out = rm(torch.cat([xa, xb], 1))
    with torch.no_grad():
        torch.testing.assert_close(out[:, :9], m(xa), atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(out[:, 9:], m(xb), atol=ATOL, rtol=1e-4)
    da, db = torch.randn(1, 1, zoo.C, generator=g), torch.randn(1, 1, zoo.C, generator=g)
    meta = build_metadata([(9, 1, [5]), (21, 1, [2, 0])], block_size=16)
    with torch.no_grad(), pagedattn.paged_context(caches, meta):
        out = rm(torch.cat([da, db], 1))
    with torch.no_grad():
        torch.testing.assert_close(out[:, :1], m(torch.cat([xa, da], 1))[:, -1:], atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(out[:, 1:], m(torch.cat([xb, db], 1))[:, -1:], atol=ATOL, rtol=1e-4)


def test_paged_graph_has_cache_and_metadata_inputs(rewritten):
    _, rm = rewritten("gqa_expand")
    names = [n.name for n in rm.graph_module.graph.nodes if n.op == "placeholder"]
    assert names[-5:] == ["kv_cache_0", "slot_mapping", "block_tables", "seq_lens", "query_start_loc"]
    targets = [n.target for n in rm.graph_module.graph.nodes if n.op == "call_function"]
    assert torch.ops.pagedattn.write_kv_cache.default in targets
    assert torch.ops.pagedattn.paged_attention.default in targets
    assert torch.ops.aten.softmax.int not in targets
    assert rm.cache_specs == [CacheSpec(rm.report[0]["name"], 2, zoo.D, torch.float32)]


def test_wrong_argument_structure_is_a_clear_error(rewritten):
    _, rm = rewritten("nanogpt")
    with pytest.raises(TypeError, match="argument structure"):
        rm(torch.randn(2, 8, zoo.C), torch.randn(1))


def test_context_with_wrong_cache_count(rewritten):
    _, rm = rewritten("nanogpt")
    meta = build_metadata([(0, 4, [0])], block_size=16)
    with pytest.raises(ValueError, match="one cache per site"), pagedattn.paged_context([], meta):
        rm(torch.randn(1, 4, zoo.C))


def test_save_and_load_in_a_fresh_process(rewritten, tmp_path):
    m, rm = rewritten("gqa_expand")
    path = tmp_path / "model.pt2"
    rm.save(str(path))
    x = torch.randn(1, 7, zoo.C, generator=torch.Generator().manual_seed(9))
    torch.save({"x": x, "ref": m(x).detach()}, tmp_path / "io.pt")
    script = textwrap.dedent(f"""
        import torch, pagedattn
        from pagedattn.backends import build_metadata
        rm = pagedattn.load({str(path)!r})
        io = torch.load({str(tmp_path / 'io.pt')!r})
        caches = rm.allocate_kv_caches(4)
        with torch.no_grad(), pagedattn.paged_context(caches, build_metadata([(0, 7, [1])], 16)):
            out = rm(io["x"])
        out = out[0] if isinstance(out, (tuple, list)) else out
        torch.testing.assert_close(out, io["ref"], atol=2e-5, rtol=1e-4)
        assert rm.report[0]["status"] == "rewritten"
        print("LOADED-OK")
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert "LOADED-OK" in r.stdout, r.stderr[-3000:]


class TokenLoop(zoo.NanoGPT):
    """A forward that loops over the tokens in Python (Mamba-1's scan): torch.export fixes the length."""

    def forward(self, x):
        acc, outs = torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            acc = 0.5 * acc + x[:, t]
            outs.append(acc)
        return super().forward(torch.stack(outs, 1))


def test_sizes_the_trace_fixed_are_traced_again():
    m = TokenLoop().eval()
    rm = pagedattn.rewrite(m, zoo.example_args("nanogpt"))  # [2, 8, C]
    assert rm.static_sizes == {0: {1: 8, 2: zoo.C}}  # the length, and the width the weights fix
    variants, retrace = [], rm.retrace
    rm.retrace = lambda args, kwargs: variants.append(retrace(args, kwargs)) or variants[-1]
    x = zoo.example_args("nanogpt", T=5)[0]
    with torch.no_grad():
        torch.testing.assert_close(rm(x), m(x), atol=ATOL, rtol=0)
        rm(zoo.example_args("nanogpt", T=5, seed=1)[0])  # the same sizes: the same variant
    assert len(variants) == 1
    (variant,) = variants
    assert variant.report[0]["status"] == "rewritten" and variant.static_sizes == {0: {1: 5, 2: zoo.C}}
    rm.retrace = None  # a loaded program has no model to trace again
    with pytest.raises(ValueError, match="traced for fixed input sizes"):
        rm(zoo.example_args("nanogpt", T=6)[0])


def test_a_multimodal_gemma3_runs_its_own_example():
    # pixels and token_type_ids: Hugging Face builds the prefix-LM mask with vmap, whose level changes
    # export keeps as calls; dead-code removal must keep them
    pytest.importorskip("transformers")
    from .hf_zoo import tiny_model

    m0 = tiny_model("gemma3", "eager")
    cfg = m0.config
    cfg.mm_tokens_per_image, cfg.image_token_id = 4, 5
    cfg.vision_config.image_size, cfg.vision_config.patch_size = 32, 8
    torch.manual_seed(0)
    m = type(m0)(cfg).eval()
    ids = torch.randint(6, 50, (1, 10))
    ids[0, 2:6] = 5
    tt = (ids == 5).long()
    kw = {"input_ids": ids, "pixel_values": torch.randn(1, 3, 32, 32), "token_type_ids": tt, "use_cache": False}
    rm = pagedattn.rewrite(m, (), kw)
    with torch.no_grad():
        torch.testing.assert_close(rm(**kw).logits, m(**kw).logits, atol=2e-5, rtol=1e-4)
    # the language model's sliding and global masks over its image blocks are proven and served, the
    # sliding one read through vmap's levels (Hugging Face's or/and mask overlays)
    text = [r for r in rm.report if r["num_kv_heads"] == cfg.text_config.num_key_value_heads]
    assert [(r["status"], r["mask"], r["position_values"]) for r in text] == \
        [("rewritten", "positional", "token_type_ids")] * 2, text
    assert (rm.value_spec.inside, rm.value_spec.outside, rm.value_spec.runs) == (1, 0, 4)
    # the image elsewhere in a longer prompt (the trace fixed one image): still the model's logits
    ids2 = torch.randint(6, 50, (1, 16))
    ids2[0, 10:14] = 5
    kw2 = {"input_ids": ids2, "pixel_values": torch.randn(1, 3, 32, 32), "token_type_ids": (ids2 == 5).long(),
           "use_cache": False}
    with torch.no_grad():
        torch.testing.assert_close(rm(**kw2).logits, m(**kw2).logits, atol=2e-5, rtol=1e-4)


def test_keyword_calls_skip_pytree_and_flat_outputs_give_the_logits():
    # a call with the traced keywords in their order, each a tensor or scalar, flattens to its values as pytree would;
    # any other call takes pytree's path and its checks; forward_flat's entry at output_index("logits") is forward's
    from ..support import engine_example, tiny_model

    model = tiny_model("llama")
    example = engine_example(model)
    rm = pagedattn.rewrite(model, kwargs=example)
    names = list(example)
    assert rm._keyword_leaves() == tuple(names)
    flat = rm.flatten_inputs((), example)
    assert all(a is b for a, b in zip(flat, torch.utils._pytree.tree_flatten(((), example))[0]))
    with pytest.raises(TypeError, match="argument structure"):
        rm.flatten_inputs((), dict(reversed(list(example.items()))))  # the same keywords in another order
    with pytest.raises(TypeError, match="argument structure"):
        rm.flatten_inputs((), {**example, names[0]: [example[names[0]]]})  # a list where a tensor was traced
    at = rm.output_index("logits")
    assert at is not None and rm.output_index("past_key_values") is None and rm.output_index("no_such") is None
    with torch.no_grad():
        assert torch.equal(rm.forward_flat(**example)[at], rm(**example).logits)
    spec, rm.out_spec = rm.out_spec, None  # what it answers follows the program's output structure
    assert rm.output_index("logits") is None
    rm.out_spec = spec
    assert rm.output_index("logits") == at
