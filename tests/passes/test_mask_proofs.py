"""Masks and biases established for every length the model takes, by proof, or left with the reason.

Each case here was once classified by evaluating the mask at a few lengths and then computed something
else past them; the checks run at lengths beyond anything a probe reached.
"""

import pytest
import torch
from torch import nn

import pagedattn

from ..rewriter import zoo

C, H, D = zoo.C, zoo.H, zoo.D


class PositionMask(zoo._Base):
    """A causal mask (and optional extras) computed from explicit query and key positions."""

    def __init__(self, visible):
        super().__init__()
        self.visible = visible

    def forward(self, x):
        q, k, v = self.qkv(x)
        T = x.shape[1]
        i = torch.arange(T)[:, None]  # query positions
        j = torch.arange(T)[None, :]  # key positions
        s = (q @ k.transpose(-1, -2)) * D ** -0.5
        s = s.masked_fill(~self.visible(i, j, T), float("-inf"))
        return self.merge(torch.softmax(s, -1) @ v)


class ALiBiLike(zoo._Base):
    """Causal attention with an additive bias ``bias(distance, T)`` per head."""

    def __init__(self, bias):
        super().__init__()
        self.bias = bias

    def forward(self, x):
        q, k, v = self.qkv(x)
        T = x.shape[1]
        dist = (torch.arange(T)[None, :] - torch.arange(T)[:, None]).float()  # key - query
        slopes = torch.tensor([2.0 ** -(h + 1) for h in range(H)])[:, None, None]
        s = (q @ k.transpose(-1, -2)) * D ** -0.5 + self.bias(slopes, dist, T)
        s = s.masked_fill(dist > 0, float("-inf"))
        return self.merge(torch.softmax(s, -1) @ v)


def _rewrite(m, T=8):
    return pagedattn.rewrite(m.eval(), (torch.randn(2, T, C),))


def _site(rm):
    (site,) = [r for r in rm.report if r["attention"]]
    return site


def _dropin_matches(m, rm, T):
    x = torch.randn(1, T, C, generator=torch.Generator().manual_seed(T))
    with torch.no_grad():
        torch.testing.assert_close(rm(x), m(x), atol=2e-5, rtol=1e-4)


def test_a_window_wider_than_every_length_probed_is_found_and_proven():
    m = PositionMask(lambda i, j, T: (j <= i) & (i - j < 6000))
    rm = _rewrite(m)
    site = _site(rm)
    assert (site["status"], site["mask"], site["window"]) == ("rewritten", "sliding_window", 6000), site
    assert site["mask_established"] == "proof" and site["mask_up_to"] is None  # every length
    _dropin_matches(m, rm, 6100)


def test_sink_tokens_plus_a_window_are_not_called_causal_and_are_served_by_their_program():
    # StreamingLLM: four always-visible tokens plus a window; causal up to 5004 keys, not past it
    m = PositionMask(lambda i, j, T: (j <= i) & ((i - j < 5000) | (j < 4)))
    rm = _rewrite(m)
    site = _site(rm)
    assert (site["status"], site["mask"], site["mask_up_to"]) == ("rewritten", "positional", None), site
    assert "mask" in site["position_program"] and "bias" not in site["position_program"]
    _dropin_matches(m, rm, 5200)


def test_a_mask_that_changes_past_a_length_is_left():
    # causal up to 5000 keys, a window of 16 beyond: no probe up to 4100 sees the change
    m = PositionMask(lambda i, j, T: (j <= i) & ((T <= 5000) | (i - j < 16)))
    site = _site(_rewrite(m))
    assert site["status"] == "skipped", site


def test_alibi_capped_at_a_distance_is_not_alibi_but_a_position_program():
    m = ALiBiLike(lambda slopes, dist, T: slopes * dist.clamp(min=-280))
    rm = _rewrite(m)
    site = _site(rm)
    assert (site["status"], site["mask"], site["alibi"]) == ("rewritten", "positional", False), site
    _dropin_matches(m, rm, 700)  # past the cap: plain ALiBi would differ (by 1.19 at 700 keys)


def test_alibi_whose_slope_follows_the_length_is_left():
    # not ALiBi, and not a function of positions either: the bias of one pair changes with the length
    m = ALiBiLike(lambda slopes, dist, T: slopes * dist * (8.0 / T))
    site = _site(_rewrite(m))
    assert site["status"] == "skipped" and "not ALiBi" in site["reason"], site
    assert "depends on more than the query and key positions" in site["reason"], site


def test_plain_alibi_is_proven_with_its_slopes():
    m = ALiBiLike(lambda slopes, dist, T: slopes * dist)
    rm = _rewrite(m)
    site = _site(rm)
    assert site["status"] == "rewritten" and site["alibi"] and site["mask"] == "causal", site
    slopes = [b for n, b in rm.dropin_module.named_buffers() if "alibi" in n]
    torch.testing.assert_close(slopes[0], torch.tensor([2.0 ** -(h + 1) for h in range(H)]))
    _dropin_matches(m, rm, 700)


class WindowFromPositions(zoo._Base):
    """A window computed from ``position_ids`` the caller passes."""

    def forward(self, x, position_ids):
        q, k, v = self.qkv(x)
        p = position_ids[:, None, :, None]  # [B, 1, T, 1] query positions
        r = position_ids[:, None, None, :]  # [B, 1, 1, T] key positions
        s = (q @ k.transpose(-1, -2)) * D ** -0.5
        s = s.masked_fill((r > p) | (p - r >= 5), float("-inf"))
        return self.merge(torch.softmax(s, -1) @ v)


def test_positions_that_are_inputs_hold_for_offsets_and_are_checked_at_call_time():
    m = WindowFromPositions().eval()
    rm = pagedattn.rewrite(m, (torch.randn(2, 8, C), torch.arange(8).expand(2, 8)))
    site = _site(rm)
    assert (site["status"], site["mask"], site["window"]) == ("rewritten", "sliding_window", 5), site
    assert site["position_inputs"] == ["position_ids"]
    x = torch.randn(2, 13, C)
    offset = torch.arange(13).expand(2, 13) + torch.tensor([[100], [7]])
    with torch.no_grad():
        torch.testing.assert_close(rm(x, offset), m(x, offset), atol=2e-5, rtol=1e-4)
        packed = torch.cat([torch.arange(6), torch.arange(7)]).expand(2, 13)
        with pytest.raises(ValueError, match="count up by one"):
            rm(x, packed)


class SinksFromPositions(zoo._Base):
    """Sink keys picked by the *values* of ``position_ids``: with an offset, other keys are sinks."""

    def forward(self, x, position_ids):
        q, k, v = self.qkv(x)
        p = position_ids[:, None, :, None]
        r = position_ids[:, None, None, :]
        s = (q @ k.transpose(-1, -2)) * D ** -0.5
        s = s.masked_fill((r > p) | ((p - r >= 5) & (r >= 2)), float("-inf"))
        return self.merge(torch.softmax(s, -1) @ v)


def test_a_position_program_that_reads_position_values_is_left():
    # its mask changes with the positions' offset: no function of (query position, key position) alone
    rm = pagedattn.rewrite(SinksFromPositions().eval(), (torch.randn(2, 8, C), torch.arange(8).expand(2, 8)))
    site = _site(rm)
    assert site["status"] == "skipped" and "depends on more than the query and key positions" in site["reason"], site


def test_a_boolean_padding_mask_that_marks_keys_to_ignore():
    """``nn.TransformerEncoder``'s ``src_key_padding_mask``: True means "ignore this key"."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(C, H, dim_feedforward=64, dropout=0.0, batch_first=True)
    m = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False).eval()

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = m

        def forward(self, x, pad):
            return self.m(x, src_key_padding_mask=pad)

    enc = Encoder().eval()
    pad = torch.zeros(2, 9, dtype=torch.bool)
    pad[1, 6:] = True
    rm = pagedattn.rewrite(enc, (torch.randn(2, 9, C), pad))
    site = _site(rm)
    assert site["status"] == "rewritten" and site["key_padding"] == "pad" and site["key_padding_ignores_true"], site
    x = torch.randn(2, 11, C)
    pad = torch.zeros(2, 11, dtype=torch.bool)
    pad[0, 8:] = True
    with torch.no_grad():
        out, ref = rm(x, pad), enc(x, pad)
    keep = ~pad
    torch.testing.assert_close(out[keep], ref[keep], atol=2e-5, rtol=1e-4)


class PaddedPositional(zoo.T5RelativeBias):
    """A position program beside key padding: T5's bucketed bias or sink tokens plus a window over positions
    in the row, and a padding input (0/1 as Hugging Face's ``attention_mask``, or boolean with True =
    ignore); ``positions="present"`` counts positions over each row's present keys instead."""

    def __init__(self, program="t5", ignore_true=False, positions="row"):
        super().__init__()
        self.program, self.ignore_true, self.positions = program, ignore_true, positions

    def forward(self, x, attention_mask):
        q, k, v = self.qkv(x)
        keep = ~attention_mask if self.ignore_true else attention_mask.bool()  # [B, T]
        if self.positions == "present":
            pos = keep.long().cumsum(-1) - 1
        else:
            pos = torch.arange(x.shape[1])[None]
        i, j = pos[:, :, None], pos[:, None, :]  # [B|1, T, 1], [B|1, 1, T]
        if self.program == "t5":
            s = q @ k.transpose(-1, -2) + self.rel(self.bucket(j - i)).permute(0, 3, 1, 2)
            vis = j <= i
        else:
            s = (q @ k.transpose(-1, -2)) * D ** -0.5
            vis = (j <= i) & ((i - j < 20) | (j < 4))
        vis = vis & keep[:, None, :]
        s = s.masked_fill(~vis[:, None], float("-inf"))
        return self.merge(s.softmax(-1) @ v)


@pytest.mark.parametrize("program, ignore_true", [("t5", False), ("sinks", False), ("t5", True)],
                         ids=["t5_buckets", "sinks_window", "t5_ignore_true"])
def test_position_programs_beside_key_padding(program, ignore_true):
    # traced at 8 tokens, called at 200 with left and right padding (past the buckets' exact range and the
    # window): equal to eager on every row eager computes
    torch.manual_seed(0)
    m = PaddedPositional(program, ignore_true).eval()
    ones = torch.ones(2, 8, dtype=torch.bool) if ignore_true else torch.ones(2, 8, dtype=torch.long)
    rm = pagedattn.rewrite(m, (torch.randn(2, 8, C), ~ones if ignore_true else ones))
    site = _site(rm)
    assert (site["status"], site["mask"], site["key_padding"]) == ("rewritten", "positional", "attention_mask"), site
    assert site["key_padding_ignores_true"] == ignore_true
    x = torch.randn(2, 200, C)
    keep = torch.ones(2, 200, dtype=torch.bool)
    keep[0, :37] = False
    keep[1, 150:] = False
    mask = ~keep if ignore_true else keep.long()
    with torch.no_grad():
        out, ref = rm(x, mask), m(x, mask)
    rows = ref.isfinite().all(-1)  # left-padding queries see no key: NaN in eager
    assert rows[0, 37:].all() and rows[1].all()
    torch.testing.assert_close(out[rows], ref[rows], atol=2e-5, rtol=1e-4)


def test_position_programs_beside_padding_that_moves_them_are_left():
    # positions counted over each row's present keys: under right padding the padded queries keep the last
    # position, which the program at their place in the row would not give, so no program beside padding holds
    m = PaddedPositional("sinks", positions="present").eval()
    rm = pagedattn.rewrite(m, (torch.randn(2, 8, C), torch.ones(2, 8, dtype=torch.long)))
    site = _site(rm)
    assert site["status"] == "skipped" and "not key padding beside the position program" in site["reason"], site


def test_hugging_face_packed_positions_are_refused_in_drop_in_mode():
    """Llama called with packed ``position_ids`` (restarting at 0 in one row) builds a per-document mask:
    the rewrite must not let the second document see the first."""
    from ..support import tiny_model

    model = tiny_model("llama", "eager")
    rm = pagedattn.rewrite(model, (), {"input_ids": torch.randint(0, 100, (1, 8)),
                                       "position_ids": torch.arange(8)[None], "use_cache": False})
    assert all(r["status"] == "rewritten" for r in rm.report)
    ids = torch.randint(0, 100, (1, 12))
    with torch.no_grad():
        ok = rm(input_ids=ids, position_ids=torch.arange(12)[None] + 3, use_cache=False).logits
        torch.testing.assert_close(ok, model(input_ids=ids, position_ids=torch.arange(12)[None] + 3,
                                             use_cache=False).logits, atol=1e-5, rtol=1e-5)
        packed = torch.cat([torch.arange(5), torch.arange(7)])[None]
        with pytest.raises(ValueError, match="count up by one"):
            rm(input_ids=ids, position_ids=packed, use_cache=False)


def test_a_causal_buffer_bounds_the_lengths_established():
    # nanoGPT's `bias` buffer is causal for 128 positions: the program cannot run past them
    rm = _rewrite(zoo.NanoGPT())
    site = _site(rm)
    assert site["status"] == "rewritten" and site["mask"] == "causal" and site["mask_up_to"] == 128, site


def test_the_model_maximum_bounds_what_a_window_means():
    # a window wider than the model's longest sequence is causal attention for every input it takes
    from ..support import tiny_model

    model = tiny_model("mistral", "eager")
    model.config.sliding_window = 6000
    for layer in model.model.layers:
        layer.self_attn.sliding_window = 6000
    rm = pagedattn.rewrite(model, (), {"input_ids": torch.randint(0, 100, (1, 8)),
                                       "position_ids": torch.arange(8)[None], "use_cache": False})
    limit = model.config.max_position_embeddings
    for site in rm.report:
        assert site["status"] == "rewritten" and site["mask_up_to"] == limit, site
        assert site["mask"] == ("causal" if limit <= 6000 else "sliding_window"), site


@pytest.mark.parametrize("window", [3, 64])
def test_windows_spelled_with_tril_and_triu(window):
    m = PositionMask(lambda i, j, T: torch.ones(T, T, dtype=torch.bool).tril() &
                     torch.ones(T, T, dtype=torch.bool).triu(-(window - 1)))
    site = _site(_rewrite(m))
    assert (site["status"], site["mask"], site["window"]) == ("rewritten", "sliding_window", window), site


def test_token_value_masks_stay_refused():
    class PadTokenMask(zoo._Base):
        def forward(self, x, ids):
            q, k, v = self.qkv(x)
            s = (q @ k.transpose(-1, -2)) * D ** -0.5
            s = s.masked_fill((ids == 0)[:, None, None, :], float("-inf"))
            return self.merge(torch.softmax(s, -1) @ v)

    m = PadTokenMask().eval()
    rm = pagedattn.rewrite(m, (torch.randn(2, 8, C), torch.randint(1, 50, (2, 8))))
    site = _site(rm)
    assert site["status"] == "skipped" and "token values" in site["reason"], site


class BufferMask(zoo._Base):
    """A mask read from a square buffer sliced to the length, in either convention: ``keep`` True marks
    visible keys (nanoGPT, GPT-Neo), False marks hidden ones (``triu(1)`` filled with -inf)."""

    def __init__(self, buffer, keep=True):
        super().__init__()
        self.register_buffer("pattern", buffer, persistent=False)
        self.keep = keep

    def forward(self, x):
        q, k, v = self.qkv(x)
        T = x.shape[1]
        s = (q @ k.transpose(-1, -2)) * D ** -0.5
        m = self.pattern[:T, :T]
        if m.dtype.is_floating_point:
            s = s + m
        else:
            s = s.masked_fill(~m if self.keep else m, float("-inf"))
        return self.merge(torch.softmax(s, -1) @ v)


def _band(n, lo, hi):
    d = torch.arange(n)[:, None] - torch.arange(n)[None, :]
    return (d >= lo) & (d <= hi)


@pytest.mark.parametrize("buffer, keep, kind, window", [
    (_band(300, 0, 299), True, "causal", None),  # nanoGPT's tril
    (_band(300, 0, 5), True, "sliding_window", 6),  # GPT-Neo's local layers
    (~_band(300, 0, 299), False, "causal", None),  # triu(1): True hides
    (~_band(300, 0, 9), False, "sliding_window", 10),
    (torch.zeros(300, 300).masked_fill(~_band(300, 0, 299), float("-inf")), True, "causal", None),
])
def test_band_buffers_in_either_convention(buffer, keep, kind, window):
    m = BufferMask(buffer, keep).eval()
    rm = _rewrite(m)
    site = _site(rm)
    assert (site["status"], site["mask"], site["window"], site["mask_up_to"]) == ("rewritten", kind, window, 300)
    x = torch.randn(1, 280, C)  # far past the example's 8 tokens and past the window
    with torch.no_grad():
        torch.testing.assert_close(rm(x), m(x), atol=1e-5, rtol=1e-5)


def test_buffers_that_are_no_band_stay_dense():
    dilated = _band(300, 0, 299) & ((torch.arange(300)[:, None] - torch.arange(300)[None, :]) % 2 == 0)
    site = _site(_rewrite(BufferMask(dilated)))
    assert site["status"] == "skipped" and "band around the diagonal" in site["reason"], site
    # a learned bias per (query, key) pair: values the proof cannot know, but a function of positions only,
    # served by its program (up to the table's 300 positions)
    table = BufferMask(torch.randn(300, 300)).eval()
    rm = _rewrite(table)
    site = _site(rm)
    assert (site["status"], site["mask"], site["mask_up_to"]) == ("rewritten", "positional", 300), site
    x = torch.randn(1, 280, C)
    with torch.no_grad():
        torch.testing.assert_close(rm(x), table(x), atol=1e-5, rtol=1e-5)


class PaddingBias(zoo._Base):
    """Causal attention with a key padding mask and a bias read from the padding: ``ranks`` gives BLOOM's
    ALiBi over the running count of present keys; ``first_key`` a distance bias only rows whose first
    key is present get (with padding it changes other than by a constant per row)."""

    def __init__(self, variant):
        super().__init__()
        self.variant = variant

    def forward(self, x, mask):
        q, k, v = self.qkv(x)
        T = x.shape[1]
        s = (q @ k.transpose(-1, -2)) * D ** -0.5
        if self.variant == "ranks":
            slopes = torch.tensor([2.0 ** -(h + 1) for h in range(H)])[:, None, None]
            rank = ((mask.cumsum(-1) - 1) * mask)[:, None, None, :].float()  # [B, 1, 1, T]
            s = s + slopes * rank
        else:
            s = s + 0.5 * mask[:, :1, None, None].float() * torch.arange(T)[None, :]
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).tril().logical_not(), float("-inf"))
        s = s.masked_fill(mask[:, None, None, :] == 0, float("-inf"))
        return self.merge(torch.softmax(s, -1) @ v)


def test_alibi_over_the_running_count_of_present_keys_holds_for_one_run_per_row():
    m = PaddingBias("ranks").eval()
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :3] = 0
    rm = pagedattn.rewrite(m, (torch.randn(2, 8, C), mask))
    site = _site(rm)
    assert site["status"] == "rewritten" and site["alibi"] and site["key_padding_runs"], site
    x = torch.randn(3, 40, C)
    mask = torch.ones(3, 40, dtype=torch.long)
    mask[1, :17] = 0  # left padding
    mask[2, 30:] = 0  # right padding
    with torch.no_grad():
        out, ref = rm(x, mask), m(x, mask)
    keep = mask.bool() & ~torch.isnan(ref).any(-1)
    torch.testing.assert_close(out[keep], ref[keep], atol=2e-5, rtol=1e-4)
    gaps = mask.clone()
    gaps[0, 10:12] = 0  # present keys in two runs: the ranks are no longer positions
    with pytest.raises(ValueError, match="not one run per row"):
        rm(x, gaps)


def test_a_bias_that_changes_with_the_padding_is_refused():
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :3] = 0
    site = _site(pagedattn.rewrite(PaddingBias("first_key").eval(), (torch.randn(2, 8, C), mask)))
    assert site["status"] == "skipped" and "changes with the padding input" in site["reason"], site


class TinyLM(nn.Module):
    """One narrow attention layer (``layer()``) as a language model the engine serves."""

    def __init__(self, layer):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.attn, self.head = nn.Embedding(64, C), layer(), nn.Linear(C, 64)

    def forward(self, input_ids):
        return self.head(self.attn(self.emb(input_ids)))


def LongMaskLM(visible):  # noqa: N802 - reads as the model it builds
    """A ``TinyLM`` under a position mask."""
    return TinyLM(lambda: PositionMask(visible))


@pytest.mark.parametrize("visible, kind", [
    (lambda i, j, T: (j <= i) & (i - j < 6000), ("sliding_window", 6000, None)),
    (lambda i, j, T: (j <= i) & (i // 4500 == j // 4500), ("chunked", None, 4500)),
], ids=["window_6000", "chunk_4500"])
def test_wide_windows_and_chunks_through_the_engine_past_their_width(visible, kind):
    from pagedattn import PagedEngine

    from ..support import greedy_by_forward

    m = LongMaskLM(visible).eval()
    engine = PagedEngine(m, compile=False, block_size=64, max_num_tokens=2048)
    (site,) = [r for r in engine.servable.step.report if r["attention"]]
    assert (site["mask"], site["window"], site["chunk"]) == kind, site
    # 600 repeats of one token, out of the window (or chunk) by the end: causal attention picks another
    # next token, so serving the mask as causal cannot pass
    prompt = [4] * 600 + torch.randint(0, 64, (5500,), generator=torch.Generator().manual_seed(1)).tolist()
    want = greedy_by_forward(m, [prompt], 2)
    assert greedy_by_forward(LongMaskLM(lambda i, j, T: j <= i).eval(), [prompt], 1)[0][0] != want[0][0]
    assert engine.generate([prompt], max_new_tokens=2) == want


class LeftPaddedChunks(zoo._Base):
    """Chunked attention counted from each row's first present key (Hugging Face's chunked mask under
    left padding: ``(k - left_pad) // C == (q - left_pad) // C``)."""

    def forward(self, x, mask):
        q, k, v = self.qkv(x)
        T = x.shape[1]
        left = (mask.cumsum(-1) == 0).sum(-1)[:, None, None, None]  # [B, 1, 1, 1]
        i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
        keep = (j <= i) & ((j - left) // 4 == (i - left) // 4) & (mask[:, None, None, :] != 0)
        s = (q @ k.transpose(-1, -2)) * D ** -0.5
        return self.merge(torch.softmax(s.masked_fill(~keep, float("-inf")), -1) @ v)


def test_chunks_counted_from_the_first_present_key_under_left_padding():
    m = LeftPaddedChunks().eval()
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :3] = 0
    rm = pagedattn.rewrite(m, (torch.randn(2, 8, C), mask))
    site = _site(rm)
    assert (site["status"], site["mask"], site["chunk"]) == ("rewritten", "chunked", 4), site
    assert site["positions_from_first_key"] and site["key_padding_runs"], site
    x = torch.randn(3, 30, C)
    mask = torch.ones(3, 30, dtype=torch.long)
    mask[1, :5] = 0  # chunk boundaries shift by 5 in this row only
    mask[2, :2] = 0
    with torch.no_grad():
        out, ref = rm(x, mask), m(x, mask)
    keep = mask.bool()
    torch.testing.assert_close(out[keep], ref[keep], atol=2e-5, rtol=1e-4)


# ----------------------------------------------------------------- position programs: no fast kind


_PROGRAMS = {
    "t5_buckets": (lambda: TinyLM(zoo.T5RelativeBias), lambda: LongMaskLM(lambda i, j, T: j <= i)),
    "sinks_window": (lambda: LongMaskLM(lambda i, j, T: (j <= i) & ((i - j < 100) | (j < 4))),
                     lambda: LongMaskLM(lambda i, j, T: (j <= i) & (i - j < 100))),
    "dilated": (lambda: LongMaskLM(lambda i, j, T: (j <= i) & ((i - j) % 3 == 0)),
                lambda: LongMaskLM(lambda i, j, T: j <= i)),
    "kerple_log": (lambda: TinyLM(lambda: ALiBiLike(lambda slopes, dist, T: -2.0 * torch.log1p(0.5 * dist.abs()))),
                   lambda: LongMaskLM(lambda i, j, T: j <= i)),
}


@pytest.mark.parametrize("name", sorted(_PROGRAMS))
def test_position_programs_through_the_engine_past_every_probe(name):
    # prompts of 300 tokens past windows, buckets and the 8-token trace; chunked prefill (128 tokens a
    # step) and decode; tokens equal the model's own greedy forward, and the model without its program
    # (plain causal or a plain window) computes other logits, so the check can fail
    from pagedattn import PagedEngine

    from ..support import greedy_by_forward

    make, plain = _PROGRAMS[name]
    m = make().eval()
    engine = PagedEngine(m, block_size=16, max_num_tokens=128)
    (site,) = [r for r in engine.servable.step.report if r["attention"]]
    assert (site["status"], site["mask"]) == ("rewritten", "positional"), site
    prompts = [torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (300, 170, 45)]
    want = greedy_by_forward(m, prompts, 4)
    with torch.no_grad():
        x = torch.tensor([prompts[0]])
        assert (m(x)[0, -1] - plain().eval()(x)[0, -1]).abs().max() > 1e-2
    assert engine.generate(prompts, max_new_tokens=4) == want


def test_layers_differing_only_in_learned_tables_share_one_program():
    # two T5 layers: the same bucket arithmetic, their own learned biases (an embedding whose last row is
    # the lookup's default): one program text, so the backends run the position arithmetic once a step
    from pagedattn.passes.canonical import read_paged

    torch.manual_seed(0)
    m = nn.Sequential(zoo.T5RelativeBias(), zoo.T5RelativeBias()).eval()
    rm = _rewrite(m)
    sites = [read_paged(n).params for n in rm.graph_module.graph.nodes
             if n.target is torch.ops.pagedattn.paged_attention.default]
    assert len(sites) == 2 and sites[0].position_mod and sites[0].position_mod == sites[1].position_mod
    assert '"tval"' in sites[0].position_mod
    assert sites[0].position_tables is not sites[1].position_tables
    _dropin_matches(m, rm, 150)


class ShapeOfValues(zoo._Base):
    """A causal mask or'ed with a tensor shaped like the hidden states (GIT's, without pixels): ``zeros_like``
    reads their shape only; ``reads_values`` compares the states themselves instead (a data-dependent mask)."""

    def __init__(self, reads_values=False):
        super().__init__()
        self.reads_values = reads_values

    def forward(self, x):
        q, k, v = self.qkv(x)
        T = x.shape[1]
        extra = x[..., 0] > 100 if self.reads_values else torch.zeros_like(x[..., 0]).bool()  # [B, T]
        vis = (torch.arange(T)[None, :] <= torch.arange(T)[:, None])[None] | extra[:, None, :]
        s = (q @ k.transpose(-1, -2)) * D ** -0.5
        s = s.masked_fill(~vis[:, None], float("-inf"))
        return self.merge(torch.softmax(s, -1) @ v)


def test_a_mask_reading_only_the_shape_of_the_states_is_proven():
    m = ShapeOfValues().eval()
    rm = _rewrite(m)
    site = _site(rm)
    assert (site["status"], site["mask"]) == ("rewritten", "causal"), site
    _dropin_matches(m, rm, 40)
    site = _site(_rewrite(ShapeOfValues(reads_values=True)))
    assert site["status"] == "skipped" and "values of input" in site["reason"], site
