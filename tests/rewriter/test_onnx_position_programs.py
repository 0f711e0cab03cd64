"""The ONNX translation of ``paged_attention`` for sites served by a position program (their own mask and bias
as a function of positions, head and per-request values), run in onnxruntime against the reference semantics
in float64; programs that call float functions are refused before export."""

from __future__ import annotations

import math

import pytest
import torch

from pagedattn.backends import position_mod

from ..support import (
    BUCKET_BIAS_MOD,
    BUCKET_TABLE,
    PREFIX_LEN_MOD,
    SINKS_WINDOW_MOD,
    Step,
    batch_params,
    make_batch,
    onnx_step_session,
    prefix_lm_mod,
    reference_step,
    span_values,
)

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from pagedattn.onnx_export import export_onnx, verify_onnx  # noqa: E402

# (context, new tokens): fresh prefills, chunked prefills over cached context, decodes; past the window of 7
SEQS = [(0, 9), (20, 1), (17, 6), (0, 1), (40, 1), (5, 14)]

# a capped distance bias in reals with integer and float division and a floor (no float function): ALiBi whose
# distance stops growing at 12 (divided by the head's number plus one), and a dilated window: every other key,
# back to a distance of 20, and of at most twice half the capped distance (so 12)
CAPPED_MOD = __import__("json").dumps({"version": 1, "float": "float32", "nodes": [
    ["q"], ["k"], ["sub", 0, 1], ["int", 12], ["lt", 2, 3], ["ite", 4, 2, 3], ["to_real", 5], ["h"],
    ["int", 1], ["add", 7, 8], ["div", 6, 9], ["neg", 10], ["int", 2], ["mod", 2, 12], ["int", 0], ["eq", 13, 14],
    ["int", 20], ["lt", 2, 16], ["and", 15, 17], ["ge", 2, 14], ["and", 18, 19], ["idiv", 2, 12],
    ["real", 0.5], ["mul", 22, 6], ["to_int", 23], ["le", 21, 24], ["and", 20, 25]],
    "allowed": 26, "bias": 11})


# causal, with a bias of 0.5 on the keys in the second half of the sequence (reads its length, ``n``)
LENGTH_MOD = __import__("json").dumps({"version": 1, "float": "float32", "nodes": [
    ["q"], ["k"], ["n"], ["le", 1, 0], ["int", 2], ["idiv", 2, 4], ["ge", 1, 5], ["real", 0.5], ["real", 0.0],
    ["ite", 6, 7, 8]], "allowed": 3, "bias": 9})


def _programs():
    return {
        "length_bias": (LENGTH_MOD, None),
        "capped_dilated_f64": (CAPPED_MOD.replace('"float32"', '"float64"'), None),
        "sinks_window": (SINKS_WINDOW_MOD, None),
        "bucket_bias": (BUCKET_BIAS_MOD, BUCKET_TABLE),
        "capped_dilated": (CAPPED_MOD, None),
        "prefix_lm_runs": (prefix_lm_mod(2), None, span_values(2, [[(0, 5)], [], [(2, 9), (12, 14)], [], [(0, 1)],
                                                                   [(3, 12)]])),
        "prefix_len": (PREFIX_LEN_MOD, None, torch.tensor([[4], [0], [20], [0], [30], [9]])),
    }


@pytest.mark.parametrize("name", list(_programs()))
def test_position_program_translation_matches_reference(name, tmp_path):
    mod = _programs()[name]
    b = make_batch(SEQS, num_heads=4, num_kv_heads=2, head_size=16, block_size=8, pad_tokens=3)
    scale = 1 / math.sqrt(16)
    p = batch_params(b, scale, False, mod=mod)
    m = b.meta
    inputs = (b.query, b.key, b.value, b.kv_cache, m.slot_mapping, m.block_tables, m.seq_lens, m.query_start_loc)
    sess = onnx_step_session(Step(p).eval(), inputs, tmp_path / "step.onnx")
    got, _ = sess.run(None, {i.name: x.numpy() for i, x in zip(sess.get_inputs(), inputs)})
    ref = reference_step(b, scale, False, mod=mod)
    n = ref.shape[0]
    torch.testing.assert_close(torch.from_numpy(got[:n]).double(), ref, atol=2e-5, rtol=2e-5)
    assert (got[n:] == 0).all(), "padding rows must be zero"
    # the check can fail: without the program, causal attention computes something else
    assert not torch.allclose(torch.from_numpy(got[:n]).double(), reference_step(b, scale, True), atol=1e-3)


def test_the_capped_program_masks_and_biases():
    # the hand-written program above does what its comment says (so the test above exercises its operations)
    q, k = torch.tensor([[40]]), torch.arange(41)[None]
    allowed, bias = position_mod.evaluate(CAPPED_MOD, None, q, k, 41, 4)
    seen = allowed[0, 0].nonzero().flatten().tolist()
    assert seen == sorted(40 - d for d in range(0, 13, 2))
    assert bias[0, 1, 0, 40 - 30].item() == pytest.approx(-12 / 2) and bias[0, 3, 0, 38].item() == -0.5


def test_whole_models_export_with_their_program_and_a_float_function_is_refused(tmp_path):
    # a learned bias by distance bucket, read from the model (integer arithmetic and a lookup), exports and runs
    # in onnxruntime as PyTorch does; T5's buckets take a logarithm, which onnxruntime may round otherwise
    import pagedattn

    from .zoo import ATTENTION, example_args

    cls, _ = ATTENTION["learned_relative_bias"]
    rm = pagedattn.rewrite(_LM(cls()).eval(), (example_args("learned_relative_bias")[0].new_zeros(2, 12).long(),))
    assert any(r["position_program"] for r in rm.report)
    export_onnx(rm, str(tmp_path / "m.onnx"))
    errors = verify_onnx(rm, str(tmp_path / "m.onnx"))
    assert max(errors.values()) < 1e-4, errors
    cls, _ = ATTENTION["t5_relative_bias"]
    t5 = pagedattn.rewrite(_LM(cls()).eval(), (torch.zeros(2, 12, dtype=torch.long),))
    with pytest.raises(ValueError, match="calls float functions"):
        export_onnx(t5, str(tmp_path / "t5.onnx"))


def test_a_prefix_lm_exports_with_the_steps_values_as_an_input(tmp_path):
    # masks read from token types: the exported graph takes the step's per-request values (span boundaries)
    # as its last input, as the paged graph does, and onnxruntime computes what PyTorch does with them
    import pagedattn

    from ..runtime.test_engine_prefix_lm import PrefixLM

    types = torch.tensor([[0, 1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0]] * 2)
    rm = pagedattn.rewrite(PrefixLM().eval(), (), {"input_ids": torch.zeros(2, 12, dtype=torch.long),
                                                   "token_type_ids": types,
                                                   "position_ids": torch.arange(12)[None].repeat(2, 1)})
    assert rm.value_spec is not None
    names = export_onnx(rm, str(tmp_path / "p.onnx"))
    assert names[-1] == "position_values"
    errors = verify_onnx(rm, str(tmp_path / "p.onnx"))
    assert max(errors.values()) < 1e-4, errors


class _LM(torch.nn.Module):
    """A one-layer token model around a zoo attention block."""

    def __init__(self, block: torch.nn.Module):
        super().__init__()
        from .zoo import C

        torch.manual_seed(0)
        self.emb, self.block, self.head = torch.nn.Embedding(50, C), block, torch.nn.Linear(C, 50)

    def forward(self, input_ids):
        return self.head(self.block(self.emb(input_ids)))
