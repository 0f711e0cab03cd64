"""The ONNX translations of the paged ops, run in onnxruntime against the reference semantics in float64."""

from __future__ import annotations

import math

import pytest
import torch

from ..support import Step, make_batch, onnx_step_session, reference_step

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from pagedattn.backends import AttentionParams  # noqa: E402

# (context, new tokens): fresh prefills, a chunked prefill over cached context, decodes
MIXED = [(0, 9), (20, 1), (17, 6), (0, 1), (40, 1)]


@pytest.mark.parametrize("case", [
    dict(),
    dict(window=7),
    dict(softcap=5.0),
    dict(alibi=True),
    dict(causal=False),
    dict(num_kv_heads=1),
    dict(sinks=True),
    dict(sinks=True, window=5),
])
def test_translation_matches_reference(case, tmp_path):
    hkv = case.get("num_kv_heads", 2)
    b = make_batch(MIXED, num_heads=4, num_kv_heads=hkv, head_size=16, block_size=8, pad_tokens=3)
    scale = 1 / math.sqrt(16)
    causal = case.get("causal", True)
    alibi = torch.tensor([0.5, 0.25, 0.125, 0.0625]) if case.get("alibi") else None
    sinks = torch.tensor([-1.0, 0.5, 2.0, 3.0]) if case.get("sinks") else None
    step = Step(AttentionParams(scale, causal, case.get("window", 0), case.get("softcap", 0.0), alibi, hkv, 16, sinks))
    m = b.meta
    inputs = (b.query, b.key, b.value, b.kv_cache, m.slot_mapping, m.block_tables, m.seq_lens, m.query_start_loc)
    sess = onnx_step_session(step.eval(), inputs, tmp_path / "step.onnx")
    got_out, got_cache = sess.run(None, {i.name: x.numpy() for i, x in zip(sess.get_inputs(), inputs)})
    ref = reference_step(b, scale, causal, case.get("window", 0), case.get("softcap", 0.0), alibi, sinks)
    n = ref.shape[0]
    torch.testing.assert_close(torch.from_numpy(got_out[:n]).double(), ref, atol=2e-5, rtol=2e-5)
    assert (got_out[n:] == 0).all(), "padding rows must be zero"
    # the written cache equals the PyTorch op's, and the padding tokens (slot -1) wrote nowhere
    expect = b.kv_cache.clone()
    torch.ops.pagedattn.write_kv_cache(b.key, b.value, expect, m.slot_mapping)
    assert torch.equal(torch.from_numpy(got_cache), expect)
