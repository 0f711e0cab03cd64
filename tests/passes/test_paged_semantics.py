"""A paged program computes the model's own logits, or refuses: over 300 tokens (past anything the rewriter sampled),
prefilled in chunks of 128 then a token a step (``pagedattn.paged_context``), against the model's forward.

Each spelling here was once served wrongly (``benchmarks/RESULTS.md``, thirty-seventh session): a strictly causal
mask filled with -1e4 (row 0 hides every key), a query temperature from ``arange(T)`` (it stayed each token's index
in the step), a position table cut to the token count (``pe[:, :T]``). Beside them, models that combine tokens
outside attention, which paged mode must refuse (``passes/token_locality.py``) while the drop-in serves them.

A tiny causal LM (embedding, two blocks of hand-written attention, a head; float32) is rewritten from short
examples."""

import math

import pytest
import torch
from torch import nn

import pagedattn
from pagedattn.backends import build_metadata

V, C, H = 64, 32, 4
D = C // H


class _Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(C, C) for _ in range(4))

    def qkv(self, x):
        B, T, _ = x.shape
        return [lin(x).view(B, T, H, D).transpose(1, 2) for lin in (self.q, self.k, self.v)]

    def merge(self, y):
        B, _, T, _ = y.shape
        return self.o(y.transpose(1, 2).reshape(B, T, C))

    def scores(self, q, k):
        return (q @ k.transpose(-1, -2)) * D ** -0.5


def _grid(T):
    return torch.arange(T)[:, None], torch.arange(T)[None, :]


class _SeesNextKeys(_Attn):
    """From position 16 on a query sees the next 8 keys too: no KV cache can serve it (a key's K/V are cached before
    the later tokens exist). The drop-in serves it; paged mode refuses it (it gave 14.9 off)."""

    def forward(self, x):
        q, k, v = self.qkv(x)
        i, j = _grid(x.shape[1])
        s = self.scores(q, k).masked_fill(~((j <= i) | ((i >= 16) & (j <= i + 8))), float("-inf"))
        return self.merge(s.softmax(-1) @ v)


class _FiniteStrictMask(_Attn):
    """A strictly causal mask filled with -1e4: row 0 hides every key, so the model's softmax there runs over all of
    them (future ones too); the rewriter reads -1e4 as hidden without proving that every row keeps a key."""

    def forward(self, x):
        q, k, v = self.qkv(x)
        i, j = _grid(x.shape[1])
        s = self.scores(q, k) + (j >= i).float() * -1e4
        return self.merge(s.softmax(-1) @ v)


class _QueryTemperature(_Attn):
    """Llama 4's query temperature from ``arange(T)``: the range reaches no embedding or cos/sin, so it stays each
    token's index in the step (``passes/packed_positions.py``), not its position in its sequence."""

    def forward(self, x):
        q, k, v = self.qkv(x)
        T = x.shape[1]
        pos = torch.arange(T).float()
        q = q * (1 + 0.5 * torch.log1p(torch.floor((pos + 1) / 16)))[:, None]
        i, j = _grid(T)
        s = self.scores(q, k).masked_fill(j > i, float("-inf"))
        return self.merge(s.softmax(-1) @ v)


class _Causal(_Attn):
    def forward(self, x):
        q, k, v = self.qkv(x)
        i, j = _grid(x.shape[1])
        return self.merge(self.scores(q, k).masked_fill(j > i, float("-inf")).softmax(-1) @ v)


class _LM(nn.Module):
    """``mix(x)`` (default none) is added after each block: a way to combine tokens outside attention."""

    def __init__(self, attn, sliced_table=False, offset=None, mix=None):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, C)
        self.layers = nn.ModuleList([attn() for _ in range(2)])
        self.head = nn.Linear(C, V)
        with torch.no_grad():
            for p in self.parameters():
                p.mul_(2.0)
        self.sliced_table, self.offset, self.mix = sliced_table, offset, mix
        if offset is not None:  # OPT's learned positions, numbered from an offset
            self.pos = nn.Embedding(2048 + offset, C)
        if sliced_table:  # the tutorials' sinusoidal table, sliced by the token count (no arange)
            p = torch.arange(2048).float()[:, None]
            div = torch.exp(torch.arange(0, C, 2).float() * (-math.log(10000.0) / C))
            pe = torch.zeros(2048, C)
            pe[:, 0::2], pe[:, 1::2] = torch.sin(p * div), torch.cos(p * div)
            self.register_buffer("pe", 2 * pe[None])

    def forward(self, input_ids):
        x = self.emb(input_ids)
        T = input_ids.shape[1]
        if self.sliced_table == "narrow":
            x = x + self.pe.narrow(1, 0, T)
        elif self.sliced_table:
            x = x + self.pe[:, :T]
        if self.offset is not None:  # a float start, as some code writes it: the range has the same length
            x = x + self.pos(torch.arange(float(self.offset), T + self.offset).long())
        for layer in self.layers:
            x = x + layer(x)
            if self.mix is not None:
                x = x + self.mix(x)
        return self.head(x)


def _outer_angles(x):
    """Rotary-like angles from ``outer(arange(T), freqs)``: a step index read as a number."""
    angles = torch.outer(torch.arange(x.shape[1]).float(), torch.linspace(0.01, 1.0, C))
    return 0.5 * angles.sin()


def _paged_logits(rm, ids, block_size=16):
    caches = rm.allocate_kv_caches(-(-len(ids) // block_size) + 1)
    out, pos = [], 0
    while pos < len(ids):
        n = min(128 if pos < len(ids) - 20 else 1, len(ids) - pos)
        meta = build_metadata([(pos, n, list(range(-(-(pos + n) // block_size))))], block_size)
        with torch.no_grad(), pagedattn.paged_context(caches, meta):
            out.append(rm(torch.tensor([ids[pos:pos + n]]))[0])
        pos += n
    return torch.cat(out)


@pytest.mark.parametrize("model", [
    lambda: _LM(_QueryTemperature), lambda: _LM(_Causal, sliced_table=True), lambda: _LM(_Causal, offset=2),
    lambda: _LM(_Causal, sliced_table="narrow"), lambda: _LM(_Causal, mix=_outer_angles)],
    ids=["query_temperature", "sliced_position_table", "positions_from_two", "narrowed_position_table",
         "angles_from_an_outer_product"])
def test_step_indices_become_positions_and_give_the_models_logits(model):
    m = model().eval()
    rm = pagedattn.rewrite(m, (torch.randint(0, V, (2, 8)),))
    assert rm.paged_refusal is None
    assert all(r["status"] == "rewritten" for r in rm.report if r.get("attention"))
    ids = torch.randint(0, V, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        want = m(torch.tensor([ids]))[0]
    torch.testing.assert_close(_paged_logits(rm, ids), want, atol=1e-3, rtol=1e-3)
    # packed: two sequences in the same steps, each in two chunks, the second continuing its own cache
    seqs = [ids, torch.randint(0, V, (170,), generator=torch.Generator().manual_seed(2)).tolist()]
    for seq, got in zip(seqs, _packed_logits(rm, seqs)):
        with torch.no_grad():
            torch.testing.assert_close(got, m(torch.tensor([seq]))[0], atol=1e-3, rtol=1e-3)


def _packed_logits(rm, seqs, block_size=16):
    """Every sequence of ``seqs`` prefilled in the same two steps, packed in one row: its first 40 % in the first,
    the rest (at its own offset) in the second. Each sequence's logits."""
    tables, first = [], 0
    for seq in seqs:
        tables.append(list(range(first, first + -(-len(seq) // block_size))))
        first += len(tables[-1])
    caches = rm.allocate_kv_caches(first + 1)
    outs = [[] for _ in seqs]
    for part in (0, 1):
        specs, ids = [], []
        for seq, table in zip(seqs, tables):
            cut = len(seq) * 2 // 5
            lo, hi = (0, cut) if part == 0 else (cut, len(seq))
            specs.append((lo, hi - lo, table[:-(-hi // block_size)]))
            ids += seq[lo:hi]
        with torch.no_grad(), pagedattn.paged_context(caches, build_metadata(specs, block_size)):
            out = rm(torch.tensor([ids]))[0]
        for o, chunk in zip(outs, out.split([n for _, n, _ in specs])):
            o.append(chunk)
    return [torch.cat(o) for o in outs]


def test_a_mask_that_may_hide_every_key_of_a_row_is_refused():
    m = _LM(_FiniteStrictMask).eval()
    rm = pagedattn.rewrite(m, (torch.randint(0, V, (2, 8)),))
    sites = [r for r in rm.report if r.get("attention")]
    assert sites and all(r["status"] != "rewritten" and "may hide every key" in r["reason"] for r in sites), sites


def test_the_same_harness_passes_a_causal_model():
    # the check above can pass: a plain causal model (a learned embedding, no table) gives its own logits
    m = _LM(_Causal).eval()
    rm = pagedattn.rewrite(m, (torch.randint(0, V, (2, 8)),))
    ids = torch.randint(0, V, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        want = m(torch.tensor([ids]))[0]
    torch.testing.assert_close(_paged_logits(rm, ids), want, atol=1e-3, rtol=1e-3)


def test_a_mask_that_lets_a_query_see_later_keys_is_served_by_the_drop_in_and_refused_paged():
    m = _LM(_SeesNextKeys).eval()
    rm = pagedattn.rewrite(m, (torch.randint(0, V, (2, 8)),))
    sites = [r for r in rm.report if r.get("attention")]
    assert all(r["status"] == "rewritten" and r["later_keys"] for r in sites), sites
    ids = torch.randint(0, V, (300,), generator=torch.Generator().manual_seed(1))[None]
    with torch.no_grad():
        torch.testing.assert_close(rm(ids), m(ids), atol=1e-4, rtol=1e-4)
    with pytest.raises(RuntimeError, match="may let a query see a later key"):
        _paged_logits(rm, ids[0, :40].tolist())
    with pytest.raises(ValueError, match="may let a query see a later key"):
        pagedattn.PagedEngine(m, compile=False, progress=False)
    causal = pagedattn.rewrite(_LM(_Causal).eval(), (torch.randint(0, V, (2, 8)),))
    assert not any(r.get("later_keys") for r in causal.report)  # counter-example


# ways to combine tokens outside attention (each a [B, T, C] -> [B, T, C] term added after a block)
_MIXERS = {
    "mean_over_tokens": lambda x: x.mean(1, keepdim=True),
    "running_sum": lambda x: 0.1 * x.cumsum(1),
    "token_shift": lambda x: torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], 1),
    "last_token_everywhere": lambda x: x[:, -1:].expand_as(x),
    "token_count_as_a_number": lambda x: x / x.shape[1],
    "tokens_reversed": lambda x: x[:, torch.arange(x.shape[1] - 1, -1, -1)],
    "mix_across_tokens": lambda x: 0.1 * x @ (x.transpose(1, 2) @ x).tanh(),
    "shift_by_padding": lambda x: torch.nn.functional.pad(x, (0, 0, 1, 0))[:, :-1],
    "running_count_of_ones": lambda x: 0.1 * torch.ones_like(x).cumsum(1),  # ones(T) numbers the step's tokens
    "first_token_flag_written_in_place": lambda x: x * _first_token_flag(x),
    "rolled": lambda x: x.roll(1, 1),
}


def _first_token_flag(x):
    f = torch.zeros(x.shape[0], x.shape[1], 1)
    f[:, 0] = 1.0
    return f


@pytest.mark.parametrize("mix", sorted(_MIXERS))
def test_a_model_that_combines_tokens_outside_attention_is_refused_paged_and_served_drop_in(mix, tmp_path):
    m = _LM(_Causal, mix=_MIXERS[mix]).eval()
    rm = pagedattn.rewrite(m, (torch.randint(0, V, (2, 8)),))
    assert all(r["status"] == "rewritten" for r in rm.report if r.get("attention"))
    assert rm.paged_refusal, "the rewrite must say why paged mode cannot serve it"
    ids = torch.randint(0, V, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(rm(ids), m(ids), atol=1e-3, rtol=1e-3)
    with pytest.raises(RuntimeError, match="combines tokens"):
        _paged_logits(rm, ids[0].tolist())
    with pytest.raises(ValueError, match="combines tokens"):
        pagedattn.PagedEngine(m, compile=False, progress=False)
    with pytest.raises(ValueError, match="combines tokens"):  # a saved program runs in paged mode alone
        rm.save(str(tmp_path / "m.pt2"))
    assert not (tmp_path / "m.pt2").exists()


class _PerSequence(nn.Module):
    """A vector per sequence (a speaker, a style) added to every token: a packed step has one row for several."""

    def __init__(self):
        super().__init__()
        self.lm = _LM(_Causal)

    def forward(self, input_ids, style):
        x = self.lm.emb(input_ids) + style[:, None, :]
        for layer in self.lm.layers:
            x = x + layer(x)
        return self.lm.head(x)


def test_a_per_sequence_input_spread_over_the_tokens_is_refused_paged():
    m = _PerSequence().eval()
    rm = pagedattn.rewrite(m, (torch.randint(0, V, (2, 8)), torch.randn(2, C)))
    assert rm.paged_refusal and "one value per sequence" in rm.paged_refusal


def test_a_model_that_keeps_tokens_apart_is_not_refused():
    # the counter-example: the same model without a mixer, and per-token terms of every kind the pass reads
    per_token = lambda x: torch.nn.functional.layer_norm(x, (C,)) * x.softmax(-1) + x.amax(-1, keepdim=True)  # noqa
    for m in (_LM(_Causal), _LM(_Causal, mix=per_token)):
        rm = pagedattn.rewrite(m.eval(), (torch.randint(0, V, (2, 8)),))
        assert rm.paged_refusal is None
