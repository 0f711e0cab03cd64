"""Step shapes for compiled steps: pad a packed step so that a serving loop compiles one graph.

Dynamo compiles a dynamic-shape graph once, but specialises every size that is 0 or 1 (and, by
default, sizes that happen to be equal: "duck sizing"). A packed step has four sizes: tokens ``T``,
sequences ``S``, block-table columns ``W`` and logits rows ``R``; a decode step at batch 1 has
``T = S = R = 1``, a step that only continues a long prompt has ``R = 0``. Padding each of them up to
a floor of 2 (and compiling without duck sizing, see :func:`no_duck_sizing`) leaves one graph for
every step a serving loop runs, except single-token steps (a decode at batch 1): those keep ``T = S =
R = 1`` (only ``W`` is padded) and run a second graph, compiled at start-up beside the first, because
padding them would double the work of every matmul (MKL's GEMM at 2 rows takes 2-2.3x its time at 1
row on a 2-core EPYC, for the layer and LM-head shapes of a 15 M-parameter Llama).

Padding follows the XLA backend's ``pad_step``: padding tokens get slot -1 (never written) and belong
to no sequence; padding sequences have no tokens and length 0; padding block-table columns point at
block 0 and are never read; padding logits rows repeat row 0 and are dropped after the step.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F

from pagedattn.backends import AttentionMetadata, CrossMetadata

__all__ = ["pad_packed_step", "pad_cross", "first_rows", "no_duck_sizing", "graph_count"]


def first_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x[:n]``, or ``x`` itself where it has ``n`` rows (a view costs ~1.5 us, several a decode step's Python)."""
    return x if x.shape[0] == n else x[:n]


def pad_packed_step(meta: AttentionMetadata, ids: Sequence[int], pos: Sequence[int], rows: Sequence[int],
                    floor: int, single_token: bool = True) -> tuple[AttentionMetadata, list[int], list[int], list[int]]:
    """The step padded so that ``T``, ``S``, ``W`` and ``R`` are at least ``floor``, or for a single-token
    step ``W`` alone (``R`` to 1 when the token needs no logits) (see the module). ``single_token=False``
    pads single-token steps too (a graph that has no single-token variant: an exported program).

    Reads no tensor on the host: the real token count is ``len(ids)``, so the metadata may live on
    the device.
    """
    T, S, W, R = len(ids), meta.num_seqs, int(meta.block_tables.shape[1]), len(rows)
    dT, dS, dW, dR = (max(0, floor - n) for n in (T, S, W, R))
    if T == 1 and single_token:  # the single-token graph: T = S = R = 1
        dT, dS, dR = 0, 0, 1 - R
    if not (dT or dS or dW or dR):
        return meta, list(ids), list(pos), list(rows)
    meta = dataclasses.replace(
        meta,
        slot_mapping=F.pad(meta.slot_mapping, (0, dT), value=-1),
        block_tables=F.pad(meta.block_tables, (0, dW, 0, dS), value=0),
        seq_lens=F.pad(meta.seq_lens, (0, dS), value=0),
        query_start_loc=F.pad(meta.query_start_loc, (0, dS), value=T),
    )
    return meta, list(ids) + [0] * dT, list(pos) + [0] * dT, list(rows) + [rows[0] if rows else 0] * dR


def pad_cross(cross: CrossMetadata, num_seqs: int, floor: int) -> CrossMetadata:
    """An encoder-decoder step's cross metadata padded like its step (``pad_packed_step``): one row per
    sequence, padding sequences with no encoder tokens, at least ``floor`` block-table columns."""
    S, W = int(cross.seq_lens.shape[0]), int(cross.block_tables.shape[1])
    dS, dW = max(0, num_seqs - S), max(0, floor - W)
    if not (dS or dW):
        return cross
    return CrossMetadata(F.pad(cross.block_tables, (0, dW, 0, dS), value=0), F.pad(cross.seq_lens, (0, dS), value=0))


@contextlib.contextmanager
def no_duck_sizing() -> Iterator[None]:
    """Dynamo without duck sizing while compiling: inputs whose sizes happen to be equal (a decode
    step's tokens, sequences and logits rows) get symbols of their own, so the graph does not
    assume they always are."""
    from torch.fx.experimental import _config as fx_config

    with fx_config.patch(use_duck_shape=False):
        yield


def graph_count() -> int:
    """Graphs Dynamo compiled in this process so far (its ``unique_graphs`` counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])

