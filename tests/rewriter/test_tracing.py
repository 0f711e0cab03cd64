"""Tracing helpers: recurrent layers made opaque so that a forward looping over the tokens in Python still
traces for every length (what ``adapter.mask_hints`` establishes a single-token step's masks from)."""

from __future__ import annotations

import torch
from torch import nn

from pagedattn.tracing import export_model, recurrent_layers_opaque, static_sizes


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
