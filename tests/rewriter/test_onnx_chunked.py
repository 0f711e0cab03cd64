"""The ONNX translation of ``paged_attention`` with chunked local attention (``chunk_size``), run in
onnxruntime against the reference semantics in float64."""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest
import torch

from pagedattn.backends import AttentionParams, reference

from ..support import Step, make_batch, onnx_step_session

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from pagedattn.onnx_export import translations  # noqa: E402

# (context, new tokens): fresh prefills, chunked prefills over cached context (starting inside a chunk),
# decodes
SEQS = [(0, 9), (20, 1), (17, 6), (0, 1), (40, 1), (5, 14)]


def _expected(b, p: AttentionParams) -> torch.Tensor:
    """The real tokens' rows in float64: each sequence's new queries over its whole K/V by the reference."""
    p = dataclasses.replace(p, alibi_slopes=None if p.alibi_slopes is None else p.alibi_slopes.double(),
                            sinks=None if p.sinks is None else p.sinks.double())
    outs, row = [], 0
    for n, k, v in zip(b.q_lens, b.full_k, b.full_v):
        q = b.query[row:row + n].double().transpose(0, 1)[None]  # [1, Hq, n, D]
        k, v = k.double().transpose(0, 1)[None], v.double().transpose(0, 1)[None]  # [1, Hkv, L, D]
        o = reference.dense_attention(q, k, v, p, exact=True)
        outs.append(o[0].transpose(0, 1))
        row += n
    return torch.cat(outs)


def test_translation_signature_follows_the_op_schema():
    # torch.onnx binds the op's arguments to the translation by name and position
    names = list(inspect.signature(translations()[torch.ops.pagedattn.paged_attention.default]).parameters)
    schema = [a.name for a in torch.ops.pagedattn.paged_attention.default._schema.arguments]
    assert names == schema and names[-7:] == ["sinks", "chunk_size", "max_seq_len", "positions_from_first_key",
                                             "position_mod", "position_tables", "position_data"]


@pytest.mark.parametrize("case", [
    dict(chunk=4),
    dict(chunk=1),
    dict(chunk=7, window=3),
    dict(chunk=5, alibi=True),
    dict(chunk=6, sinks=True),
    dict(chunk=8, softcap=4.0),
    dict(chunk=3, causal=False),  # chunks apply to causal attention only: bidirectional as without
], ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_chunked_translation_matches_reference(case, tmp_path):
    b = make_batch(SEQS, num_heads=4, num_kv_heads=2, head_size=16, block_size=8, pad_tokens=3)
    alibi = torch.tensor([0.5, 0.25, 0.125, 0.0625]) if case.get("alibi") else None
    sinks = torch.tensor([-1.0, 0.5, 2.0, 3.0]) if case.get("sinks") else None
    p = AttentionParams(1 / math.sqrt(16), case.get("causal", True), case.get("window", 0),
                        case.get("softcap", 0.0), alibi, 2, 16, sinks, case["chunk"])
    m = b.meta
    inputs = (b.query, b.key, b.value, b.kv_cache, m.slot_mapping, m.block_tables, m.seq_lens,
              m.query_start_loc)
    sess = onnx_step_session(Step(p).eval(), inputs, tmp_path / "step.onnx")
    got, _ = sess.run(None, {i.name: x.numpy() for i, x in zip(sess.get_inputs(), inputs)})
    ref = _expected(b, p)
    n = ref.shape[0]
    torch.testing.assert_close(torch.from_numpy(got[:n]).double(), ref, atol=2e-5, rtol=2e-5)
    assert (got[n:] == 0).all(), "padding rows must be zero"
