"""``token_locality``: which graphs keep tokens apart outside attention, which combine them, and which it cannot read.

The end-to-end checks (the paged program's logits against the model's, the refusals in paged mode and by the engine)
are in ``test_paged_semantics.py``; here, the pass's verdicts and its view grouping."""

import sympy
import torch
from torch import nn

import pagedattn
from pagedattn.passes.token_locality import _view_groups

from .test_paged_semantics import _LM, V, _Causal

T, B = sympy.Symbol("T"), sympy.Symbol("B")


def test_views_group_dimensions_holding_the_same_elements():
    assert _view_groups([B, T, 32], [B * T, 4, 8]) == [([0, 1], [0]), ([2], [1, 2])]
    assert _view_groups([B, 2, 4, T, 8], [B, 8, T, 8]) == [([0], [0]), ([1, 2], [1]), ([3], [2]), ([4], [3])]
    assert _view_groups([1, T, 6], [T, 6]) == [([0], []), ([1], [0]), ([2], [1])]
    assert _view_groups([T, 2], [2 * T]) == [([0, 1], [0])]  # tokens merged with a feature: the caller refuses
    assert _view_groups([T, 6], [4, 3]) is None


def _rewrite(m, *example):
    return pagedattn.rewrite(m.eval(), example or (torch.randint(0, V, (2, 8)),))


class _Routed(nn.Module):
    """Each token in two slots, the slots sorted by a score and put back (a mixture of experts' dispatch, in
    miniature): each token's result is its own, through a view that merges tokens with slots and a sort that the
    pass does not follow."""

    def forward(self, x):  # [B, T, C]
        flat = x.reshape(-1, x.shape[-1])  # [N, C]
        slots = torch.stack([flat, flat], 1).reshape(-1, flat.shape[-1])  # [2N, C]
        order = slots.sum(-1).argsort()
        back = torch.empty_like(slots).index_copy_(0, order, slots[order])
        return 0.5 * back.view(-1, 2, flat.shape[-1]).sum(1).reshape(x.shape)


def test_what_the_pass_cannot_follow_is_unproven_not_refused():
    rm = _rewrite(_LM(_Causal, mix=_Routed()))
    assert rm.paged_refusal is None and rm.locality_unproven
    assert _rewrite(_LM(_Causal)).locality_unproven is None  # the counter-example


def test_a_hugging_face_llama_keeps_tokens_apart_and_picks_rows_by_its_input():
    transformers = __import__("pytest").importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2)
    m = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 64, (2, 8))
    for kwargs in ({"input_ids": ids}, {"input_ids": ids, "logits_to_keep": torch.tensor([7, 3])}):
        rm = pagedattn.rewrite(m.eval(), (), kwargs)
        assert rm.paged_refusal is None and rm.locality_unproven is None, kwargs
