"""Dead-code removal: in-place writes into tensors the graph made itself go with them when nothing reads them
(a sinusoidal position table left behind by a cut graph), and stay when something does."""

from __future__ import annotations

import torch
from torch import nn

from pagedattn.passes.cleanup import remove_dead_code
from pagedattn.passes.context import PassContext


class _Table(nn.Module):
    """``out = x * w``, beside a position table filled in place (``use_table``: added to the output)."""

    def __init__(self, use_table: bool):
        super().__init__()
        self.use_table = use_table

    def forward(self, x):
        n = x.shape[1]
        table = torch.zeros(n, 4)
        pos = torch.arange(n, dtype=torch.float32)[:, None]
        table[:, :2] = torch.sin(pos)
        table[:, 2:] = torch.cos(pos)
        out = x * 2.0
        return out + table.sum(-1) if self.use_table else out


def _graph(use_table: bool):
    x = torch.randn(2, 6)
    ep = torch.export.export(_Table(use_table), (x,), dynamic_shapes=({1: torch.export.Dim("n")},), strict=False)
    return ep.module(), x


def _writes(gm) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and "copy_" in str(n.target))


def test_writes_into_a_table_nothing_reads_are_removed():
    gm, x = _graph(use_table=False)
    assert _writes(gm) == 2  # export keeps the in-place writes: fx's own DCE sees them as side effects
    want = gm(x)
    remove_dead_code(gm, PassContext())
    gm.recompile()
    assert _writes(gm) == 0
    assert not any(n.target in (torch.ops.aten.sin.default, torch.ops.aten.cos.default) for n in gm.graph.nodes)
    torch.testing.assert_close(gm(x), want)


def test_writes_into_a_table_that_is_read_stay():
    gm, x = _graph(use_table=True)
    want = gm(x)
    remove_dead_code(gm, PassContext())
    gm.recompile()
    assert _writes(gm) == 2
    torch.testing.assert_close(gm(x), want)
