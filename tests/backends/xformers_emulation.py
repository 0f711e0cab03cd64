"""A CPU stand-in for xFormers' attention operators, built on xFormers' own bias definitions.

Every xFormers bias can ``materialize()`` itself as a dense additive mask on the CPU; this operator
applies that mask in float64. Running the CUDA backend with it checks, without a GPU, that the
metadata -> bias conversion, the grouped GQA layout and the row bookkeeping are right by xFormers'
definitions; the real kernels' own limits are checked on the GPU (test_xformers_cuda_gpu.py).
"""

from __future__ import annotations

import dataclasses
import math

import torch


class EmulatedOp:
    """Quacks like an xFormers forward operator; records what it was called with."""

    NAME = "emulated"
    calls: list = []

    @classmethod
    def not_supported_reasons(cls, inp) -> list[str]:
        return []

    @classmethod
    def apply(cls, inp, needs_gradient=False):
        q, k, v = inp.get_qkv_in_bmghk()  # [B, M, G, H, K]
        cls.calls.append({"bias": inp.attn_bias, "query": inp.query, "key": inp.key, "value": inp.value})
        mask = dense_mask(inp.attn_bias, q.shape[1], k.shape[1], q.shape[0])  # [B|1, G|1, H|1, Mq, Mk]
        scale = inp.scale if inp.scale is not None else 1 / math.sqrt(q.shape[-1])
        s = torch.einsum("bmghk,bnghk->bghmn", q.double(), k.double()) * scale + mask
        p = torch.softmax(s, -1).nan_to_num(0.0)  # rows that see nothing give 0
        o = torch.einsum("bghmn,bnghk->bmghk", p, v.double()).to(inp.query.dtype)
        return o.reshape(*inp.query.shape[:-1], v.shape[-1]), None


def dense_mask(bias, mq: int, mk: int, batch: int) -> torch.Tensor:
    """The bias as a float64 additive mask broadcastable to ``[B, G, H, Mq, Mk]``."""
    if bias is None:
        return torch.zeros(1, 1, 1, mq, mk, dtype=torch.float64)
    if isinstance(bias, torch.Tensor):
        b = bias.double()
        return b if b.dim() == 5 else b[:, None]
    tables = getattr(bias, "block_tables", None)
    if tables is not None:
        # paged: materialize over the logical key space; it returns the physical pages used. Table
        # entries past a sequence's last page are padding the kernels never read, but materialize
        # would paint them (-inf) over the page they name: point them at a spare page, dropped after.
        page = bias.page_size
        ends = bias.k_seqinfo.seqlen_py  # key count (padded) or end offset (gappy) per sequence
        spare = int(tables.max()) + 1
        tables = tables.clone()
        for b, end in enumerate(ends):
            tables[b, -(-end // page):] = spare
        logical = tables.shape[0] * tables.shape[1] * page
        m = dataclasses.replace(bias, block_tables=tables).materialize((mq, logical), dtype=torch.float64)
        m = m[:, :min(spare * page, mk)]
        if m.shape[-1] < mk:
            m = torch.cat([m, m.new_full((mq, mk - m.shape[-1]), -math.inf)], -1)
    else:
        m = bias.materialize((mq, mk), dtype=torch.float64)
    return m.reshape(1, 1, 1, mq, mk)


def install(monkeypatch, refuse=()):
    """Route the backend's operator choice to the emulator; ``refuse`` names bias classes it declines."""
    from pagedattn.backends import xformers_cuda

    EmulatedOp.calls = []

    def select(candidates, inp, xf):
        if type(inp.attn_bias).__name__ in refuse:
            raise xformers_cuda._NoOperator([f"emulated: {type(inp.attn_bias).__name__} refused"])
        return EmulatedOp

    monkeypatch.setattr(xformers_cuda, "_select_op", select)
    return EmulatedOp
