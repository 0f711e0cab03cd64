"""Decode steps as CUDA graphs: capture sizes, persistent step buffers, capture and replay (issue 17).

A decode step of a small model on a GPU is bound by the host: a launch per op, Python around every attention
call, metadata built per step. vLLM captures its decode-only steps as CUDA graphs at a small set of batch sizes
and pads each step up to the next one; the same here:

- **capture sizes** (:func:`capture_sizes`): 1, 2, 4, then multiples of 8, up to the first size that holds the
  engine's ``max_num_seqs`` (at most 256); a decode step of ``n`` sequences runs in the graph of the smallest
  size ``N >= n`` (:func:`bucket`), larger ones eagerly; block tables are cut to a power-of-two number of
  columns that holds the step's longest sequence (:func:`width_buckets`), so a graph's attention reads about
  the keys its sequences have, not the most any could (the static attention reads every column it is given);
- **persistent buffers** (:class:`DecodeBuffers`): token ids, positions, slots, block tables (a fixed number of
  columns, the most a sequence can hold), sequence lengths, query starts and logits rows live in device tensors
  allocated once; a size-``N`` graph reads their first ``N`` rows. A step writes its values in one host-to-device
  copy (``load``), padded as ``runtime.shapes`` pads steps: padding tokens have slot -1 (written nowhere) and
  belong to no sequence, padding sequences have no token and length 0; an asynchronous step's token ids are
  gathered on the device from the previous step's sampled tokens instead (:class:`DeviceTokens`);
- **capture and replay** (:class:`DecodeGraphs`): the first step at a size runs eagerly (it compiles and warms
  up), then the same call is captured into a graph sharing one memory pool and replayed once against that
  step's own logits (a graph that does not reproduce them is dropped: :class:`CaptureFailed`, and the engine
  goes on without graphs); later steps load the buffers and replay. What runs inside must read no tensor value on the host: the step binds
  :class:`~pagedattn.backends.static_paged.StaticPagedBackend` (the model's backend with the static write and
  attention, for its warm-up run too, so that the graph replays what ran eagerly), and the metadata's value
  checks are ``torch._assert_async`` on CUDA, captured with the step and replayed with it. With full validation
  on (``PAGEDATTN_VALIDATE``, which reads metadata on the host) steps run eagerly.

Off CUDA (tests), :class:`DecodeGraphs` runs the same buffers eagerly (``capture=False``), which checks
everything but the capture itself; :func:`no_host_reads` makes a host read inside a step raise, as capture would.
An encoder-decoder's decode steps take their cross-attention blocks and encoder lengths from buffers too
(``DecodeBuffers.cross_metadata``: a power-of-two number of cross columns, padding sequences with no encoder keys);
its encoder runs eagerly at admission. Prefill and mixed steps, and models with recurrent state or per-request
mask values, run eagerly.
"""

from __future__ import annotations

import array
import bisect
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import torch
from torch import Tensor

from pagedattn.backends import AttentionMetadata, CrossMetadata, validation_enabled
from pagedattn.backends.static_paged import StaticPagedBackend
from pagedattn.runtime.context import paged_context, step_mode

log = logging.getLogger("pagedattn")

__all__ = ["capture_sizes", "width_buckets", "bucket", "DeviceTokens", "DecodeBuffers", "packed_rows", "DecodeGraphs",
           "CaptureFailed", "no_host_reads", "HostRead", "reproduces"]

_LARGEST = 256  # capture sizes stop here: a larger decode batch is compute-bound enough to run eagerly


def capture_sizes(max_num_seqs: int, largest: int = _LARGEST) -> tuple[int, ...]:
    """1, 2, 4, then multiples of 8, up to the first one that holds ``max_num_seqs`` (or ``largest``)."""
    top = min(max_num_seqs, largest)
    sizes = []
    for n in (1, 2, 4, *range(8, largest + 8, 8)):
        sizes.append(n)
        if n >= top:
            break
    return tuple(sizes)


def width_buckets(max_width: int) -> tuple[int, ...]:
    """Block-table widths a graph is captured at: powers of two from 2 below ``max_width``, then ``max_width``
    (2 at least). Never 1: a compiled step specialises a size of 1, and the engine compiles its steps at 2 columns
    or more (``runtime.shapes``), so a graph of 1 column would compile again."""
    widths, w = [], 2
    while w < max_width:
        widths.append(w)
        w *= 2
    return (*widths, max(2, max_width))


def bucket(n: int, sizes: Sequence[int]) -> Optional[int]:
    """The smallest capture size that holds ``n`` sequences; None above the largest."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


@dataclass(frozen=True)
class DeviceTokens:
    """A decode step's input tokens read on the device: sequence ``i``'s token is ``tokens[rows[i]]``, a row of an
    earlier step's sampled tokens (an asynchronous step's, not read back yet)."""

    tokens: Tensor  # [R] long, on the step's device
    rows: Sequence[int]

    def __len__(self) -> int:
        return len(self.rows)


@dataclass
class DecodeBuffers:
    """The inputs of a captured decode step, allocated once for ``size`` sequences of up to ``width``
    blocks each; a step of ``N <= size`` sequences uses the first ``N`` rows (:meth:`metadata`)."""

    ids: Tensor  # [size] token ids
    positions: Tensor  # [size]
    slots: Tensor  # [size] cache slot of each token (-1: padding)
    tables: Tensor  # [size, width] block tables (padding: block 0, never read past a length of 0)
    seq_lens: Tensor  # [size] (padding: 0)
    starts: Tensor  # [size + 1] query_start_loc: one token per real sequence, none per padding one
    rows: Tensor  # [size] logits rows, constant
    block_size: int
    # two pinned host copies of a step's values (see ``load``), used in turn: one transfer a step, and a step's
    # values written while the previous step's transfer may still wait behind a step running on the device
    staging: tuple[Tensor, Tensor]
    copied: list = field(default_factory=lambda: [None, None])  # an event recorded after each one's transfer
    turn: int = 0
    # an encoder-decoder's cross-attention blocks and encoder lengths (padding: no blocks, length 0)
    cross_tables: Optional[Tensor] = None  # [size, width] int32
    cross_lens: Optional[Tensor] = None  # [size] int32

    @classmethod
    def allocate(cls, size: int, width: int, block_size: int, device: torch.device | str,
                 cross: bool = False) -> "DecodeBuffers":
        """Buffers for steps of up to ``size`` sequences of up to ``width`` blocks (``cross``: and as many cross
        blocks each)."""
        def zeros(*shape, dtype=torch.long):
            return torch.zeros(shape, dtype=dtype, device=device)

        pin = torch.device(device).type == "cuda"
        staging = tuple(torch.zeros(size * (5 + width) + 1 + (size * (1 + width) if cross else 0),
                                    dtype=torch.long, pin_memory=pin) for _ in range(2))
        cross_tables, cross_lens = (zeros(size, width, dtype=torch.int32), zeros(size, dtype=torch.int32)) if cross \
            else (None, None)
        return cls(zeros(size), zeros(size), zeros(size), zeros(size, width, dtype=torch.int32),
                   zeros(size, dtype=torch.int32), torch.arange(size + 1, dtype=torch.int32, device=device),
                   torch.arange(size, device=device), block_size, staging, cross_tables=cross_tables,
                   cross_lens=cross_lens)

    @property
    def size(self) -> int:
        return self.ids.shape[0]

    @property
    def width(self) -> int:
        return self.tables.shape[1]

    def load(self, ids: "Sequence[int] | DeviceTokens", positions: Sequence[int], slots: Sequence[int],
             tables: Sequence[Sequence[int]], seq_lens: Sequence[int], n_rows: int, width: Optional[int] = None,
             cross_tables: Optional[Sequence[Sequence[int]]] = None, cross_lens: Optional[Sequence[int]] = None,
             cross_width: Optional[int] = None) -> None:
        """Write a decode step of ``len(ids)`` sequences into the first ``n_rows`` rows and ``width`` block-table
        columns (default: all), the rest padding; an encoder-decoder's step also its cross blocks and encoder
        lengths (``cross_width`` columns). A longer block table is a ValueError (the step must run eagerly).
        ``ids`` as :class:`DeviceTokens`: each sequence's token read on the device from an earlier step's sampled
        tokens (nothing waits for them on the host)."""
        on_device = isinstance(ids, DeviceTokens)
        n, W = len(ids), self.width if width is None else width
        if not n <= n_rows <= self.size or W > self.width:
            raise ValueError(f"a decode step of {n} sequences does not fit {n_rows} of {self.size} rows")
        if (cross_tables is None) != (self.cross_tables is None):
            raise ValueError("an encoder-decoder's decode step loads its cross blocks, a decoder-only step none")
        # one flat list of rows [token, position, slot, length, table padded to W], grown by list extends (a list
        # per row flattened element by element took 2.8x as long at 64 sequences of 64 columns, and this runs while
        # the GPU waits)
        flat: list[int] = []
        for tok, pos, slot, table, length in zip(ids.rows if on_device else ids, positions, slots, tables,
                                                 seq_lens):
            if len(table) > W:
                raise ValueError(f"a block table of {len(table)} blocks is wider than the captured {W}")
            flat += (tok, pos, slot, length)
            flat += table
            flat += [0] * (W - len(table))
        # padding, as runtime.shapes pads a step: tokens with slot -1 that belong to no sequence, and sequences
        # with no token and length 0
        flat += [0, 0, -1, 0, *[0] * W] * (n_rows - n)  # (with DeviceTokens, row 0's token: any token will do)
        flat += range(n + 1)  # query starts: one token per real sequence, none per padding one
        flat += [n] * (n_rows - n)
        CW = 0
        if cross_tables is not None:
            CW = self.width if cross_width is None else cross_width
            if CW > self.width or any(len(t) > CW for t in cross_tables):
                raise ValueError(f"a cross block table is wider than the captured {CW}")
            for table, length in zip(cross_tables, cross_lens):
                flat.append(length)
                flat += table
                flat += [0] * (CW - len(table))
            flat += [0] * ((n_rows - n) * (1 + CW))  # padding sequences: no encoder keys
        turn = self.turn
        self.turn ^= 1
        copied = self.copied[turn]
        if copied is not None and not copied.query():  # the copy out of this staging buffer two steps ago must
            copied.synchronize()  # be done before it is overwritten; it long is, so no wait
        host = self.staging[turn][:len(flat)]
        host.copy_(torch.frombuffer(array.array("q", flat), dtype=torch.long))  # ~4x faster than torch.tensor(flat)
        dev = self.ids.device
        on_dev = host.to(dev, non_blocking=True) if dev.type == "cuda" else host
        table = on_dev[:n_rows * (4 + W)].view(n_rows, 4 + W)
        if on_device:
            self.ids[:n_rows].copy_(ids.tokens.index_select(0, table[:, 0]))
        else:
            self.ids[:n_rows].copy_(table[:, 0])
        self.positions[:n_rows].copy_(table[:, 1])
        self.slots[:n_rows].copy_(table[:, 2])
        self.seq_lens[:n_rows].copy_(table[:, 3])
        packed_rows(self.tables, n_rows, W).copy_(table[:, 4:])
        at = n_rows * (4 + W)
        self.starts[:n_rows + 1].copy_(on_dev[at:at + n_rows + 1])
        if CW:
            cross = on_dev[at + n_rows + 1:at + n_rows + 1 + n_rows * (1 + CW)].view(n_rows, 1 + CW)
            self.cross_lens[:n_rows].copy_(cross[:, 0])
            packed_rows(self.cross_tables, n_rows, CW).copy_(cross[:, 1:])
        if dev.type == "cuda":
            self.copied[turn] = torch.cuda.Event()
            self.copied[turn].record()

    def metadata(self, n_rows: int, width: Optional[int] = None) -> AttentionMetadata:
        """The step's metadata over the first ``n_rows`` rows and ``width`` block-table columns (views of the
        buffers: the same storage each step, as a replayed graph reads it; the tables contiguous, as the engine's
        steps give theirs, or a compiled step compiles again for the stride)."""
        return AttentionMetadata(self.slots[:n_rows], packed_rows(self.tables, n_rows, width), self.seq_lens[:n_rows],
                                 self.starts[:n_rows + 1], self.block_size)

    def cross_metadata(self, n_rows: int, width: Optional[int] = None) -> CrossMetadata:
        """An encoder-decoder step's cross metadata over the first ``n_rows`` rows and ``width`` columns."""
        return CrossMetadata(packed_rows(self.cross_tables, n_rows, width), self.cross_lens[:n_rows])


def packed_rows(buffer: Tensor, n_rows: int, width: Optional[int]) -> Tensor:
    """``[n_rows, width]`` (default: all columns) over the start of a contiguous ``[size, W]`` buffer's storage:
    a contiguous view, the same one for every step of that shape."""
    width = buffer.shape[1] if width is None else width
    return buffer.view(-1)[:n_rows * width].view(n_rows, width)


class DecodeGraphs:
    """A servable model's decode-only steps run at capture sizes over persistent buffers: captured as CUDA
    graphs (``capture=True``, CUDA only) or run eagerly on the same buffers (``capture=False``)."""

    def __init__(self, servable, kv_caches: Sequence[Tensor], max_num_seqs: int, width: int,
                 capture: Optional[bool] = None):
        if servable.state is not None or servable.values is not None:
            raise ValueError("decode graphs serve packed steps (no recurrent state, no per-request mask values)")
        self.servable, self.kv_caches = servable, list(kv_caches)
        self.backend = StaticPagedBackend(servable.backend)  # the write and attention a capture can take
        self.sizes = capture_sizes(max_num_seqs)
        device = servable.device
        self.capture = device.type == "cuda" if capture is None else capture
        if self.capture and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.widths = width_buckets(width)
        width = self.widths[-1]
        # an encoder-decoder's step reads the cross blocks filled at admission; its encoder-states input is a
        # placeholder (the paged graph reads the caches), one tensor for every step
        self.seq2seq_inputs = None if servable.seq2seq is None else \
            servable.seq2seq.step_inputs([0], [0], device)
        self.buffers = DecodeBuffers.allocate(self.sizes[-1], width, servable.block_size, device,
                                              cross=servable.seq2seq is not None)
        # (size, width, cross width) ->
        self.graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.stats = {"replays": 0, "captures": 0, "eager": 0}

    def fits(self, num_seqs: int, widest: int, widest_cross: int = 0) -> bool:
        """Whether a decode step of ``num_seqs`` sequences, the longest holding ``widest`` blocks (and
        ``widest_cross`` cross-attention blocks), runs here."""
        return bucket(num_seqs, self.sizes) is not None and max(widest, widest_cross) <= self.buffers.width

    def run(self, ids: Sequence[int] | DeviceTokens, positions: Sequence[int], slots: Sequence[int],
            tables: Sequence[Sequence[int]], seq_lens: Sequence[int],
            cross_tables: Optional[Sequence[Sequence[int]]] = None,
            cross_lens: Optional[Sequence[int]] = None, copy: bool = True) -> Tensor:
        """One decode step (a token per sequence): ``[n, V]`` logits of its ``n`` sequences. An
        encoder-decoder's step gives each sequence's cross-attention blocks and encoder length. ``ids`` as
        :class:`DeviceTokens`: the tokens read on the device. ``copy=False``: a replay's logits are its graph's
        own output, which the next replay overwrites (read them in the same stream before it)."""
        n = len(ids)
        size = bucket(n, self.sizes)
        if size is None:
            raise ValueError(f"a decode step of {n} sequences is above the largest capture size {self.sizes[-1]}")
        width = self._width(tables)
        cross_width = 0 if cross_tables is None else self._width(cross_tables)
        self.buffers.load(ids, positions, slots, tables, seq_lens, size, width, cross_tables, cross_lens,
                          cross_width or None)
        shape = (size, width, cross_width)
        if not self.capture or validation_enabled():  # full validation reads metadata on the host: eager
            self.stats["eager"] += 1
            return self._step(shape)[:n]
        entry = self.graphs.get(shape)
        if entry is None:
            out = self._step(shape)  # compiles and warms up at this size; this step's result
            self._capture(shape, out)
            return out[:n].clone()
        graph, out = entry
        graph.replay()
        self.stats["replays"] += 1
        return out[:n].clone() if copy else out[:n]  # the next replay overwrites ``out``

    def _width(self, tables: Sequence[Sequence[int]]) -> int:
        width = bucket(max(map(len, tables)), self.widths)
        if width is None:
            raise ValueError(f"a block table of {max(map(len, tables))} blocks is wider than the captured "
                             f"{self.widths[-1]}")
        return width

    def _step(self, shape: tuple[int, int, int]) -> Tensor:
        """The model's packed step over the first ``size`` rows and ``width`` block-table columns of the
        buffers (and ``cross_width`` cross-attention columns): ``[size, V]`` logits."""
        size, width, cross_width = shape
        b, sv = self.buffers, self.servable
        kwargs = {"input_ids": b.ids[:size][None]}
        cross = None
        if self.seq2seq_inputs is not None:  # the decoder step's inputs, as Seq2SeqServing.step_inputs gives them
            kwargs = {**self.seq2seq_inputs, **kwargs}
            if "position_ids" in kwargs:
                kwargs["position_ids"] = b.positions[:size][None]
            cross = b.cross_metadata(size, cross_width)
        else:
            if "position_ids" in sv.input_names:
                kwargs["position_ids"] = b.positions[:size][None]
            if "use_cache" in sv.input_names:
                kwargs["use_cache"] = False
            if "logits_to_keep" in sv.input_names:
                kwargs["logits_to_keep"] = b.rows[:size]
        # the engine's packed steps' grad mode: a compiled step's guards check it (a step in another mode compiles
        # again)
        with step_mode(b.ids.device), paged_context(self.kv_caches, b.metadata(size, width), self.backend,
                                                    cross=cross):
            out = sv.step(**kwargs)
        logits = out.logits if hasattr(out, "logits") else out[0] if isinstance(out, (tuple, list)) else out
        return logits[0]  # [size, V]: every row completes its sequence

    def _capture(self, shape: tuple[int, int, int], eager: Tensor) -> None:
        """Capture the step at this shape, then replay it once on the same buffers (its cache writes repeat the
        same K/V into the same slots) and compare with ``eager``, the step's own logits: a graph that does not
        reproduce them is never used (:class:`CaptureFailed`)."""
        size, width, cross_width = shape
        try:
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = self._step(shape)
            graph.replay()
            ok = reproduces(out, eager)
        except Exception as e:  # noqa: BLE001 -- whatever capture trips on, the engine goes on without graphs
            raise CaptureFailed(f"capturing the decode step at {size} sequences failed: {type(e).__name__}: "
                                f"{str(e).splitlines()[0] if str(e) else ''}") from e
        if not ok:
            raise CaptureFailed(f"the decode step captured at {size} sequences gave other logits than the step "
                                "itself (max difference "
                                f"{(out.float() - eager.float()).abs().max().item():.3g})")
        self.graphs[shape] = (graph, out)
        self.stats["captures"] += 1
        log.info("captured the decode step at %d sequences of up to %d blocks%s as a CUDA graph", size, width,
                 f" (and {cross_width} cross-attention blocks)" if cross_width else "")


def reproduces(replayed: Tensor, eager: Tensor, ulps: int = 8) -> bool:
    """Whether a graph's logits are the eager step's up to rounding: within ``ulps`` units in the last place of
    the largest logit (in the logits' dtype). Kernels chosen under capture (cuBLAS picks its algorithms per
    stream state) may round bf16 logits differently by an ulp or two; a graph that replays stale inputs or a
    value baked in at capture differs by far more."""
    a, b = replayed.float(), eager.float()
    if a.shape != b.shape or not torch.isfinite(a).all():
        return False
    if b.numel() == 0:
        return True
    eps = torch.finfo(eager.dtype).eps if eager.is_floating_point() else 0.0
    return bool((a - b).abs().max() <= 1e-3 + ulps * eps * float(b.abs().max()))


class CaptureFailed(RuntimeError):
    """A decode step could not be captured, or its graph did not reproduce the step: run steps eagerly."""


class HostRead(RuntimeError):
    """A step read a tensor's value on the host where it must not (inside a captured step)."""


_READS = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def no_host_reads() -> Iterator[None]:
    """Make reading a tensor's value on the host raise :class:`HostRead`: ``.item()``, ``.tolist()``,
    ``.numpy()``, ``bool()``/``int()``/``float()``/``index`` of a tensor, and the aten ops whose output size
    depends on values (``nonzero``, ``masked_select``, ``unique``, boolean-mask indexing). What a CUDA graph
    cannot capture, checked on any device. Not thread-safe (it patches ``torch.Tensor`` while active)."""
    saved = {name: getattr(torch.Tensor, name) for name in _READS}

    def refuse(name):
        def method(self, *args, **kwargs):
            raise HostRead(f"Tensor.{name} read a tensor's value on the host inside a step that must not")
        return method

    try:
        for name in _READS:
            setattr(torch.Tensor, name, refuse(name))
        with _DataDependentOps():
            yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


class _DataDependentOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Refuses aten ops whose output shape depends on tensor values (called at the top level: ops inside a
    custom op's own kernel are not seen here, which the patched methods of :func:`no_host_reads` cover)."""

    _REFUSED = ("nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive",
                "unique_dim", "repeat_interleave", "_local_scalar_dense")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)
        if name in self._REFUSED and not (name == "repeat_interleave" and kwargs.get("output_size") is not None):
            raise HostRead(f"aten.{name} needs tensor values on the host (its output size depends on them)")
        if name == "index" and any(isinstance(i, Tensor) and i.dtype == torch.bool for i in (args[1] or ())
                                   if i is not None):
            raise HostRead("boolean-mask indexing needs tensor values on the host (its output size depends on them)")
        return func(*args, **kwargs)
