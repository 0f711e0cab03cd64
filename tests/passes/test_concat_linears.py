"""Linears that read the same input, run as one (``ConcatLinears``, ``RewrittenModel.compile_paged(concat_linears=True)``):
the same logits, one copy of the weights, and the groups it must leave alone."""

import pytest
import torch

import pagedattn
from pagedattn import PagedEngine
from pagedattn.adapter import prepare_model
from pagedattn.backends import build_metadata
from pagedattn.passes import ConcatLinears, PassContext, run_pipeline
from pagedattn.runtime import paged_context
from pagedattn.tracing import copy_graph_module, uncompiled

from ..support import hf_generate, prompts, tiny_model

LINEAR = torch.ops.aten.linear.default


def _rewritten(dtype=torch.float32):
    m = tiny_model("llama", "eager").to(dtype)
    ids = torch.arange(8)[None] % 100
    rm = pagedattn.rewrite(m, (), {"input_ids": ids, "position_ids": torch.arange(8)[None], "use_cache": False})
    return m, rm


def _paged_logits(gm, rm, tokens):
    caches = rm.allocate_kv_caches(4)
    meta = build_metadata([(0, len(tokens), [0, 1, 2, 3])], rm.block_size)
    kwargs = {"input_ids": torch.tensor([tokens]), "position_ids": torch.arange(len(tokens))[None], "use_cache": False}
    with torch.no_grad(), paged_context(caches, meta) as ctx:
        return gm(*rm.flatten_inputs((), kwargs), *ctx.graph_inputs(rm.num_sites))[0]


def _weight_bytes(module) -> int:
    """Bytes of the distinct storages behind ``module``'s parameters."""
    return sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in module.parameters()}.values())


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
def test_q_k_v_and_gate_up_run_as_one_linear_each_with_the_same_logits_and_one_copy_of_the_weights(dtype, tol):
    model, rm = _rewritten(dtype)
    tokens = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46]  # longer than the 8 tokens it was rewritten at
    before = _paged_logits(rm.graph_module, rm, tokens)
    with torch.no_grad():
        eager = model(torch.tensor([tokens])).logits[0]
    layers = model.config.num_hidden_layers
    gm = copy_graph_module(rm.graph_module)
    assert sum(n.target is LINEAR for n in gm.graph.nodes) == 7 * layers + 1
    weight_bytes = _weight_bytes(model)
    (report,) = run_pipeline(gm, PassContext(), (ConcatLinears(),))
    assert report.changed and f"{2 * layers} groups" in report.detail
    assert sum(n.target is LINEAR for n in gm.graph.nodes) == 4 * layers + 1  # qkv, o, gate-up, down; lm_head
    torch.testing.assert_close(_paged_logits(gm, rm, tokens), before, atol=tol, rtol=tol)
    # the model's own parameters now view the concatenated weights: the same values, no second copy
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.untyped_storage().data_ptr() == attn.v_proj.weight.untyped_storage().data_ptr()
    assert _weight_bytes(model) == weight_bytes
    with torch.no_grad():
        torch.testing.assert_close(model(torch.tensor([tokens])).logits[0], eager, atol=0, rtol=0)


class _Mixed(torch.nn.Module):
    """Linears of one input that must stay apart (a tied weight, a bias on one only, another dtype), beside a
    pair that may be joined and one linear of another input."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 4, bias=False), torch.nn.Linear(8, 6, bias=False)
        self.tied, self.other = torch.nn.Linear(8, 5, bias=False), torch.nn.Linear(8, 5, bias=False)
        self.other.weight = self.tied.weight
        self.biased = torch.nn.Linear(8, 3)
        self.wide = torch.nn.Linear(8, 2, bias=False).to(torch.float64)
        self.elsewhere = torch.nn.Linear(8, 7, bias=False)

    def forward(self, x, y):
        return (self.a(x), self.b(x), self.tied(x), self.other(y), self.biased(x), self.wide(x.double()),
                self.elsewhere(y))


def test_only_linears_of_one_input_whose_weights_can_be_joined_are():
    torch.manual_seed(0)
    module = _Mixed()
    x, y = torch.randn(2, 8), torch.randn(2, 8)
    want = module(x, y)
    gm = torch.export.export(module, (x, y)).module()
    (report,) = run_pipeline(gm, PassContext(), (ConcatLinears(),))
    assert report.changed and "1 groups of linears concatenated (2 linears)" in report.detail
    joined = [n for n in gm.graph.nodes if n.target is LINEAR and n.args[1].op == "get_attr"
              and n.args[1].target.startswith("_concat_linear")]
    assert len(joined) == 1 and tuple(getattr(gm, joined[0].args[1].target).shape) == (10, 8)
    assert module.tied.weight is module.other.weight and module.tied.weight.untyped_storage().nbytes() == 5 * 8 * 4
    for got, w in zip(gm(x, y), want):
        torch.testing.assert_close(got, w, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_an_engine_over_a_step_with_joined_linears_generates_hfs_tokens(compiled):
    model = tiny_model("llama", "eager")
    ps = prompts()
    want = hf_generate(model, ps, 8)
    step = prepare_model(model, target="cpu", compile=False).step
    step.compile_paged("inductor" if compiled else "eager", concat_linears=True, freeze=False)
    engine = PagedEngine(step, block_size=4, num_blocks=96, max_num_tokens=64, progress=False)
    assert engine.generate(ps, max_new_tokens=8) == want


@pytest.mark.parametrize("target, given, joined", [("cuda", None, True), ("cuda", False, False), ("cpu", None, False),
                                                   ("cpu", True, True)])
def test_compile_paged_joins_linears_by_default_for_cuda_steps_only(target, given, joined):
    # a CUDA program is built and compiled (lazily) on any machine: no kernel runs here
    m = tiny_model("llama", "eager")
    ids = torch.arange(8)[None] % 100
    rm = pagedattn.rewrite(m, (), {"input_ids": ids, "position_ids": torch.arange(8)[None], "use_cache": False},
                           target=target)
    rm.compile_paged(concat_linears=given, freeze=False)
    gm = uncompiled(rm.graph_module)
    names = [n.target for n in gm.graph.nodes if n.op == "get_attr" and n.target.startswith("_concat_linear")]
    assert len(names) == (4 if joined else 0)  # 2 layers: q/k/v and gate/up each


@pytest.mark.parametrize("joined", [False, True], ids=["as_traced", "joined"])
def test_a_compiled_program_saves_the_graph_it_compiled_and_loads_with_the_models_logits(joined, tmp_path):
    m, rm = _rewritten()
    rm.compile_paged(concat_linears=joined)
    path = str(tmp_path / "step.pt2")
    rm.save(path)
    loaded = pagedattn.load(path)
    saved = [p for p in loaded.exported_program.graph_signature.parameters if p.startswith("_concat_linear")]
    assert len(saved) == (4 if joined else 0)
    for tokens in ([5, 17, 3, 99, 42, 7], [(7 * t) % 100 for t in range(29)]):  # lengths apart from the export's
        want = m(input_ids=torch.tensor([tokens]), use_cache=False).logits
        torch.testing.assert_close(_paged_logits(loaded.graph_module, loaded, tokens), want, atol=1e-5, rtol=1e-5)
