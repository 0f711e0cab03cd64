"""Tracing helpers: recurrent layers made opaque so that a forward looping over the tokens in Python still
traces for every length (what ``adapter.mask_hints`` establishes a single-token step's masks from)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagedattn import tracing
from pagedattn.tracing import (
    FAKE_TENSOR_CACHE_MIN_REPEATS,
    export_model,
    recurrent_layers_opaque,
    repeated_blocks,
    static_sizes,
)


class Mixer(nn.Module):
    """A recurrent layer that loops over the tokens in Python, as Mamba-1's reference scan does."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, hidden_states, cache_params=None, attention_mask=None):
        state, out = torch.zeros_like(hidden_states[:, 0]), []
        for i in range(hidden_states.shape[1]):
            state = 0.5 * state + self.proj(hidden_states[:, i])
            out.append(state)
        return torch.stack(out, 1)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.mixer = Mixer()

    def forward(self, hidden_states, cache_params=None):  # takes the state too, but holds a mixer that does
        return hidden_states + self.mixer(hidden_states, cache_params=cache_params)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer, self.other = Layer(), nn.Linear(8, 8)

    def forward(self, hidden_states, cache_params=None):
        causal = torch.ones(hidden_states.shape[1], hidden_states.shape[1], dtype=torch.bool).tril()
        return self.other(self.layer(hidden_states)), causal


def test_only_the_innermost_recurrent_layers_are_opaque_and_restored_after():
    model = Model()
    x = torch.randn(2, 5, 8)
    with recurrent_layers_opaque(model) as n:
        assert n == 1 and "forward" in vars(model.layer.mixer) and "forward" not in vars(model.layer)
        opaque, _ = model(x)
        torch.testing.assert_close(opaque, model.other(x + x))  # eagerly the layer passes its input on
    assert "forward" not in vars(model.layer.mixer)
    assert not torch.allclose(model(x)[0], opaque)


def test_with_recurrent_layers_opaque_the_length_stays_dynamic():
    model = Model().eval()
    x = torch.randn(2, 5, 8)
    fixed = export_model(model, (x,))
    assert 1 in static_sizes(fixed, [x]).get(0, {})  # the loop fixes the length (the hidden size is fixed anyway)
    with recurrent_layers_opaque(model):
        free = export_model(model, (x,))
    assert 1 not in static_sizes(free, [x]).get(0, {})
    ops = {str(n.target) for n in free.graph.nodes if n.op == "call_function"}
    assert "pagedattn_trace.opaque_layer.default" in ops  # what reads the layer's output still shows reading it


def test_repeated_blocks_counts_the_most_repeated_block_not_its_leaves_or_containers():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, vocab_size=64)
    assert repeated_blocks(LlamaForCausalLM(LlamaConfig(num_hidden_layers=3, **cfg))) == 3
    assert repeated_blocks(nn.Sequential(*[nn.Linear(4, 4) for _ in range(9)])) == 1  # leaves and a container only
    assert repeated_blocks(nn.Sequential(*[Layer() for _ in range(7)])) == 7


def _tiny_lm(arch: str, layers: int):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if arch == "gpt2":
        return GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=32, n_head=4, vocab_size=64)).eval()
    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, hidden_size=32, intermediate_size=64,
                                        num_attention_heads=4, vocab_size=64)).eval()


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_exports_take_the_fake_tensor_cache_by_depth_and_give_the_same_program(arch, monkeypatch):
    # a choice of speed (the cache costs a shallow all-dynamic export more than it saves), held inside the export only:
    # a shallow model's programs (the model's, and the rewritten one's that a save exports) are the ones the cache
    # gives, and a deep model keeps the cache
    import pagedattn
    from pagedattn.serialization import export_paged

    seen, real = [], torch.export.export

    def export(*args, **kwargs):
        seen.append(torch._dynamo.config.fake_tensor_cache_enabled)
        return real(*args, **kwargs)

    kw = {"input_ids": torch.zeros(2, 5, dtype=torch.long), "use_cache": False}
    shallow, deep = _tiny_lm(arch, 2), _tiny_lm(arch, FAKE_TENSOR_CACHE_MIN_REPEATS)
    rm = pagedattn.rewrite(shallow, (), kw)
    before = torch._dynamo.config.fake_tensor_cache_enabled
    monkeypatch.setattr(torch.export, "export", export)
    programs = [export_model(shallow, (), kw), export_paged(rm)]
    export_model(deep, (), kw)
    assert seen == [False, False, True] and torch._dynamo.config.fake_tensor_cache_enabled == before
    monkeypatch.setattr(tracing, "FAKE_TENSOR_CACHE_MIN_REPEATS", 1)  # the shallow model with the cache
    cached = [export_model(shallow, (), kw), export_paged(rm)]
    assert seen[-2:] == [True, True]
    for ep, with_cache in zip(programs, cached):
        # the same ops on the same operands (a few intermediate nodes are numbered differently: their names only)
        assert _structure(ep) == _structure(with_cache)
        assert str(ep.range_constraints) == str(with_cache.range_constraints)
        assert ep.graph_signature == with_cache.graph_signature


def _structure(ep) -> list[tuple]:
    """Each node's kind, target and operands, the operands by their positions in the graph."""
    nodes = list(ep.graph_module.graph.nodes)
    at = {n: i for i, n in enumerate(nodes)}
    ref = lambda x: torch.fx.node.map_arg(x, lambda n: f"%{at[n]}")  # noqa: E731
    return [(n.op, str(n.target), str(ref(n.args)), str(ref(n.kwargs))) for n in nodes]
