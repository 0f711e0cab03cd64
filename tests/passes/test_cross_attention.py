"""Cross-attention in an encoder-decoder's decoder step: found, paged over caches filled once, and never
taken where the keys are not the encoder's alone or the mask hides encoder keys."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pagedattn
from pagedattn.backends import build_cross_metadata, build_metadata, cross_slot_mapping
from pagedattn.runtime.context import paged_context

from ..rewriter.seq2seq_models import tiny_seq2seq

H = 32


class Step(nn.Module):
    """A Hugging Face seq2seq model's decoder over given encoder states."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, encoder_hidden_states):
        return self.model(encoder_outputs=(encoder_hidden_states,), decoder_input_ids=input_ids, use_cache=False).logits


def _example():
    return {"input_ids": (torch.arange(16).reshape(2, 8) * 5 + 3) % 96, "encoder_hidden_states": torch.randn(2, 11, H)}


@pytest.fixture(scope="module")
def bart():
    return tiny_seq2seq("bart")


@pytest.fixture(scope="module")
def rewritten(bart):
    return pagedattn.rewrite(Step(bart), (), _example(), encoder_inputs=("encoder_hidden_states",))


def test_sites_are_self_and_cross_and_the_writer_takes_the_encoder_states_alone(rewritten):
    kinds = [r["attention_type"] for r in rewritten.report]
    assert kinds == ["self", "cross", "self", "cross"]
    assert rewritten.num_cross_sites == 2 and rewritten.num_sites == 4
    names = [n.name for n in rewritten.cross_writer.graph.nodes if n.op == "placeholder"]
    assert names == ["encoder_hidden_states", "cross_kv_cache_0", "cross_kv_cache_1", "cross_slot_mapping"]
    paged = [n for n in rewritten.graph_module.graph.nodes if n.target is torch.ops.pagedattn.paged_attention.default]
    cross = [n for n in paged if n.args[1] is None]
    assert len(cross) == 2 and all(n.args[4].name == "cross_block_tables" and n.args[5].name == "cross_seq_lens"
                                   and n.args[6].name == "query_start_loc" and n.args[8] is False for n in cross)
    # the encoder states feed nothing in the decoder step: the K/V projections moved to the writer
    enc = next(n for n in rewritten.graph_module.graph.nodes if n.name == "encoder_hidden_states")
    assert all(u.op == "call_module" for u in enc.users)  # export's input guards alone


def test_a_packed_step_over_cross_blocks_equals_the_decoder(bart, rewritten):
    g = torch.Generator().manual_seed(0)
    srcs = [torch.randint(3, 96, (1, n), generator=g) for n in (5, 9)]
    with torch.no_grad():
        encs = [bart.get_encoder()(input_ids=s).last_hidden_state for s in srcs]
    caches = rewritten.allocate_kv_caches(16)
    padded = torch.zeros(2, 9, H)
    padded[0, :5], padded[1] = encs[0][0], encs[1][0]
    tables, lens = [[10], [12]], [5, 9]
    rewritten.write_cross_kv({"encoder_hidden_states": padded}, caches, cross_slot_mapping(tables, lens, 9, 16))
    dec = [[2, 5, 7], [2, 9, 11, 13]]
    meta = build_metadata([(0, 3, [0]), (0, 4, [1])], 16)
    with torch.no_grad(), paged_context(caches, meta, cross=build_cross_metadata(tables, lens, 16)):
        out = rewritten(input_ids=torch.tensor([dec[0] + dec[1]]), encoder_hidden_states=torch.zeros(1, 2, H))
    with torch.no_grad():
        for i, rows in enumerate((slice(0, 3), slice(3, 7))):
            ref = bart(encoder_outputs=(encs[i],), decoder_input_ids=torch.tensor([dec[i]]), use_cache=False).logits
            torch.testing.assert_close(out[0, rows], ref[0], atol=1e-5, rtol=1e-5)


def test_a_step_without_cross_metadata_is_refused(rewritten):
    caches = rewritten.allocate_kv_caches(4)
    meta = build_metadata([(0, 2, [0])], 16)
    with pytest.raises(ValueError, match="no cross metadata"), torch.no_grad(), paged_context(caches, meta):
        rewritten(input_ids=torch.tensor([[2, 5]]), encoder_hidden_states=torch.zeros(1, 2, H))


# ------------------------------------------------------------------------------- counter-examples


class Toy(nn.Module):
    """One self-attention and one attention over ``encoder_hidden_states`` whose keys/mask vary by ``kind``."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(96, H)
        self.q, self.k, self.v, self.o = (nn.Linear(H, H) for _ in range(4))
        self.head = nn.Linear(H, 96)

    def _heads(self, x):
        return x.view(x.shape[0], x.shape[1], 4, 8).transpose(1, 2)  # [B, 4, L, 8]

    def forward(self, input_ids, encoder_hidden_states):
        x = self.emb(input_ids)
        q, k, v = self._heads(self.q(x)), self._heads(self.k(x)), self._heads(self.v(x))
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2))
        mem = encoder_hidden_states
        if self.kind == "keys_read_decoder":  # keys mix in the decoder tokens: not the encoder's alone
            mem = mem + x.mean(1, keepdim=True)
        q = self._heads(self.q(x))
        k, v = self._heads(self.k(mem)), self._heads(self.v(mem))
        causal = self.kind == "causal_over_encoder"  # decoder token i sees encoder tokens up to its own position
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal, attn_mask=self._cross_mask(x.shape[1],
                                                                                                  mem.shape[1]))
        return self.head(x + self.o(y.transpose(1, 2).flatten(2)))


    def _cross_mask(self, dec_len: int, enc_len: int):
        """Masks that read decoder positions yet hide nothing while the decoder is no longer than the encoder
        (the only case the mask's proof covers, its queries being the last key positions)."""
        i, j = torch.arange(dec_len)[:, None], torch.arange(enc_len)[None, :]
        if self.kind == "rows_below_encoder_len":
            return (i < enc_len) | (j < 0)  # decoder tokens past the encoder's length see nothing
        if self.kind == "row_minus_key_within_encoder_len":
            return (i - j) <= enc_len  # a decoder token 2 past the encoder's length no longer sees key 0
        if self.kind == "zeros_bias":  # T5's cross-attention bias without a mask: constant, served as cross
            return torch.zeros(dec_len, enc_len)
        return None


@pytest.mark.parametrize("kind", ["keys_read_decoder", "causal_over_encoder", "rows_below_encoder_len",
                                  "row_minus_key_within_encoder_len"])
def test_attention_over_the_encoder_that_is_not_plain_cross_attention_is_not_paged_as_such(kind):
    rm = pagedattn.rewrite(Toy(kind).eval(), (), _example(), encoder_inputs=("encoder_hidden_states",))
    assert rm.num_cross_sites == 0 and rm.cross_writer is None
    assert [r["attention_type"] for r in rm.report] == ["self", ""]


@pytest.mark.parametrize("kind", ["plain", "zeros_bias"])
def test_plain_cross_attention_of_the_toy_is_paged(kind):
    rm = pagedattn.rewrite(Toy(kind).eval(), (), _example(), encoder_inputs=("encoder_hidden_states",))
    assert [r["attention_type"] for r in rm.report] == ["self", "cross"]


@pytest.mark.parametrize("kind", ["rows_below_encoder_len", "row_minus_key_within_encoder_len"])
def test_masks_reading_decoder_positions_differ_once_the_decoder_outgrows_the_encoder(kind):
    """Why those masks are refused: proven "every key visible" for a decoder no longer than the encoder (the
    example's 8 tokens over 11), they hide keys from a 12-token decoder over 3 encoder tokens, which a paged
    cross-attention (every encoder key for every decoder token) would not."""
    torch.manual_seed(0)
    toy, plain = Toy(kind).eval(), Toy("plain").eval()
    plain.load_state_dict(toy.state_dict())
    ids, enc = torch.randint(0, 96, (1, 12)), torch.randn(1, 3, H)
    with torch.no_grad():
        assert not torch.allclose(toy(ids, enc).nan_to_num(), plain(ids, enc))
        short = _example()
        torch.testing.assert_close(toy(**short), plain(**short))  # within the proof's lengths: the same


def test_without_encoder_inputs_cross_attention_stays_dense(bart):
    rm = pagedattn.rewrite(Step(bart), (), _example())
    assert rm.num_cross_sites == 0 and [r["attention_type"] for r in rm.report] == ["self", "", "self", ""]


def test_encoder_inputs_must_be_inputs_of_the_example(bart):
    with pytest.raises(ValueError, match="not keyword inputs"):
        pagedattn.rewrite(Step(bart), (), _example(), encoder_inputs=("memory",))
