"""Between models and the engine: ``prepare_model`` turns a model into a :class:`ServableModel`.

Preparing a model means discovering its inputs (``position_ids`` taken directly or through
``**kwargs``, ``use_cache``, ``logits_to_keep``), its EOS ids and vocabulary, and its recurrent state;
tracing the step(s) the engine runs (a packed ``[1, T]`` step, or ``[B, T]`` rows carrying state);
and checking that packed, chunked and batched steps reproduce the model before anything is served.
``PagedEngine`` takes the result and only schedules, moves blocks, steps and samples.
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import inspect
import itertools
import logging
import math
import operator
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch import nn
from torch.fx import GraphModule

from pagedattn.aot_step import AotStep
from pagedattn.backends import (
    AttentionBackend,
    CacheSpec,
    build_cross_metadata,
    build_metadata,
    get_backend,
    position_mod,
)
from pagedattn.hf_state import StatefulStep, StateLayout, find_recurrent_state
from pagedattn.passes import FunctionalCacheWrites, PassContext, run_pipeline
from pagedattn.passes.classify_mask import FIXED_LENGTH
from pagedattn.program import ModelInfo, PagedCall, RewrittenModel
from pagedattn.runtime.context import (
    later_keys_reason,
    mixes_tokens_reason,
    paged_context,
    sites_seeing_later_keys,
    step_mode,
)
from pagedattn.runtime.shapes import first_rows, no_duck_sizing, pad_cross, pad_packed_step
from pagedattn.runtime.state import StatePool
from pagedattn.seq2seq import Seq2SeqServing, is_seq2seq, prepare_seq2seq
from pagedattn.tracing import uncompiled, without_hf_cache

log = logging.getLogger("pagedattn")

__all__ = ["ServableModel", "Stages", "prepare_model", "accepted_inputs", "example_inputs", "is_compiled", "warm_steps",
           "step_is_compiled"]

# an item of a row step: (request id, first position, tokens, block table)
RowItem = tuple[int, int, Sequence[int], Sequence[int]]


@dataclass(frozen=True)
class ServableModel:
    """A model ready for ``PagedEngine``: how to run one step, and what its caches and outputs are.

    Without recurrent state, every scheduled chunk runs in one packed ``[1, T]`` row
    (:meth:`run_packed`). With it (``state`` set), sequences run as rows of ``[B, T]`` steps
    (:meth:`run_rows`): single decode tokens batched, longer chunks one row each; ``fresh_step`` runs
    a sequence's first step where its state does not start from zeros; ``token_steps`` advances
    every sequence one token per step; ``one_row`` runs each row in a call of its own.
    ``min_step`` pads packed steps so that their sizes are at least that (``runtime.shapes``: a
    compiled step then stays one graph); 0 runs every step at its own size. An encoder-decoder has
    ``seq2seq`` (its encoder, the cross-attention writer, its decoder start and forced tokens): its packed
    steps are decoder steps and also take each sequence's cross-attention blocks. ``values`` says how
    the masks read per-request values (a prefix-LM mask from token types: ``position_mod.ValueSpec``):
    packed steps then take each sequence's values and their tokens' types. ``unserved_inputs`` names
    request inputs the model takes but is served without (token types whose masks were not established),
    with the reason.
    """

    step: nn.Module
    backend: AttentionBackend
    block_size: int
    cache_specs: tuple[CacheSpec, ...]
    cache_dtype: torch.dtype
    input_names: frozenset[str]
    vocab_size: Optional[int]
    eos_ids: frozenset[int]
    state: Optional[StateLayout] = None
    fresh_step: Optional[nn.Module] = None
    token_steps: bool = False
    one_row: bool = False
    min_step: int = 0
    pad_single_token: bool = False  # min_step applies to single-token steps too (an eager exported program)
    seq2seq: Optional[Seq2SeqServing] = None
    values: Optional[position_mod.ValueSpec] = None
    unserved_inputs: dict = dataclasses.field(default_factory=dict)  # input -> why requests may not carry it

    @property
    def device(self) -> torch.device:
        return torch.device(self.backend.device_type)

    def allocate_kv_caches(self, num_blocks: int, device=None) -> list[torch.Tensor]:
        return self.backend.allocate_kv_caches(self.cache_specs, num_blocks, self.block_size, self.cache_dtype,
                                               device or self.device)

    def bytes_per_block(self) -> int:
        return sum(s.bytes_per_block(self.block_size, self.cache_dtype) for s in self.cache_specs)

    # --- packed steps

    def packed_inputs(self, ids: Sequence[int], pos: Sequence[int], rows: Sequence[int],
                      token_types: Optional[Sequence[int]] = None) -> dict:
        """Keyword inputs of a packed ``[1, T]`` step; ``rows`` are the token rows whose logits are needed,
        ``token_types`` the tokens' types for a model that takes them (``values``; default: none inside a span)."""
        dev = self.device
        kwargs = {"input_ids": _long_tensor(ids, dev).view(1, -1)}
        if "position_ids" in self.input_names:
            kwargs["position_ids"] = _long_tensor(pos, dev).view(1, -1)
        if "use_cache" in self.input_names:
            kwargs["use_cache"] = False
        if "logits_to_keep" in self.input_names:
            kwargs["logits_to_keep"] = _long_tensor(rows, dev)
        # last, as example_inputs orders them: the traced program takes keyword inputs in that order
        spec = self.values
        if spec is not None and spec.kind == "runs" and spec.input in self.input_names:
            types = list(token_types or ())
            types += [spec.outside] * (len(ids) - len(types))
            kwargs[spec.input] = torch.tensor([types], device=dev)
        elif spec is not None and spec.kind == "scalar" and spec.input in self.input_names:
            kwargs[spec.input] = torch.zeros(1, dtype=torch.long, device=dev)  # unused: the masks read the values
        return kwargs

    def packed_call(self, caches: Sequence[torch.Tensor]) -> Optional[PagedCall]:
        """The packed step bound to ``caches``, for :meth:`run_packed`'s ``call``: its logits alone, with what does not
        change between steps checked once (:meth:`RewrittenModel.paged_call`). None where steps take more than
        caches and metadata (an encoder-decoder, per-request mask values) or the step is no rewritten program."""
        if self.seq2seq is not None or self.values is not None or not isinstance(self.step, RewrittenModel):
            return None
        return self.step.paged_call(caches, self.backend, output="logits")

    def run_packed(self, caches: Sequence[torch.Tensor], meta, ids: Sequence[int], pos: Sequence[int],
                   rows: Sequence[int], cross=None, values: Optional[torch.Tensor] = None,
                   token_types: Optional[Sequence[int]] = None, writable: bool = True,
                   call: Optional[PagedCall] = None) -> torch.Tensor:
        """One packed step; ``[len(rows), V]`` logits of the given token rows (``cross``: an encoder-decoder's
        ``CrossMetadata``, one row per sequence of ``meta``). A model whose masks read per-request values
        (``self.values``) takes each sequence's, ``values [S, count]`` (default: no span), and the tokens'
        types (``token_types``, default: none inside a span). ``writable=False``: the logits may be an inference
        tensor (the CPU step runs in inference mode), which a caller that only reads them takes without a copy.
        ``call``: :meth:`packed_call`'s for these ``caches``, which a serving loop makes once."""
        num_rows = len(rows)
        if self.min_step > 1:
            meta, ids, pos, rows = pad_packed_step(meta, ids, pos, rows, self.min_step,
                                                   single_token=not self.pad_single_token)
            if cross is not None:
                cross = pad_cross(cross, meta.num_seqs, self.min_step)
        if self.seq2seq is not None:
            kwargs = self.seq2seq.step_inputs(ids, pos, self.device)
        else:
            kwargs = self.packed_inputs(ids, pos, rows, token_types)
        if call is not None and cross is None and len(caches) == len(call.caches) and \
                all(map(operator.is_, caches, call.caches)):
            with step_mode(self.device):
                out = call(kwargs, meta)  # the logits alone
        else:
            if self.values is not None:
                values = step_values(self.values, values, meta.num_seqs, self.device)
            at = getattr(self.step, "output_index", None)
            at = at("logits") if at is not None else None
            with step_mode(self.device), paged_context(caches, meta, self.backend, cross=cross,
                                                       position_values=values):
                out = self.step(**kwargs) if at is None else self.step.forward_flat(**kwargs)[at]  # the logits alone
        logits = first_rows(_row_logits(out, "logits_to_keep" in kwargs, rows), num_rows)
        return logits.clone() if writable and logits.is_inference() else logits  # callers may update it in place

    def decode_steps(self, call: Optional[PagedCall], metas: Sequence, starts: Sequence[int],
                     ids: Sequence[int]) -> Optional["DecodeSteps"]:
        """Decode steps of the same sequences (``build_decode_metadata``'s ``metas``: step ``j`` computes sequence
        ``i``'s token at ``starts[i] + j``) prepared to run back to back through ``call`` (:meth:`packed_call`'s):
        step ``j`` reads its input ids from ``DecodeSteps.ids[j]``, step 0's are ``ids`` and the caller writes each
        step's tokens into the next row. None where steps do not run so: no packed call, steps padded per shape,
        per-request mask values, an encoder-decoder, or a compiled step that would not take these inputs."""
        if call is None or self.min_step > 1 or self.seq2seq is not None or self.values is not None:
            return None
        n, k, dev = len(starts), len(metas), self.device
        rows = range(n)
        first = self.packed_inputs(ids, starts, rows)  # the inputs' names and the ones every step shares
        buf = torch.empty((k + 1, n), dtype=torch.long, device=dev)  # [k + 1, n]: row j, step j's input ids
        buf[0] = first["input_ids"][0]
        positions = (torch.tensor(list(starts), dtype=torch.long, device=dev)[None, :] +
                     torch.arange(k, device=dev)[:, None]).contiguous()  # [k, n]
        steps = []
        for j, meta in enumerate(metas):
            inputs = dict(first, input_ids=buf[j].view(1, n))
            if "position_ids" in inputs:
                inputs["position_ids"] = positions[j].view(1, n)
            steps.append((inputs, meta))
        prepared = call.prepare(steps)
        if prepared is None:
            return None
        return DecodeSteps(prepared, buf, "logits_to_keep" in first, rows, self.backend.argmax_writer(buf))

    # --- row steps (recurrent state)

    def run_rows(self, caches: Sequence[torch.Tensor], pool: StatePool, items: Sequence[RowItem]) -> list:
        """Run items as rows: single tokens batched, longer chunks one row each (the recurrence runs along
        a row); first steps through ``fresh_step`` where there is one. Each item's last-token logits."""
        groups = []
        for first in (True, False) if self.fresh_step is not None else (None,):
            idx = [i for i, it in enumerate(items) if first is None or (it[1] == 0) == first]
            single = [i for i in idx if len(items[i][2]) == 1]
            batched = [[i] for i in single] if self.one_row else [single] if single else []
            groups += [(first, g) for g in batched + [[i] for i in idx if len(items[i][2]) > 1]]
        out: list = [None] * len(items)
        dev = self.device
        for first, group in groups:
            rows = [items[i] for i in group]
            rids = [r[0] for r in rows]
            meta = build_metadata([(start, len(toks), table) for _, start, toks, table in rows], self.block_size,
                                  device=dev)
            kwargs = {"input_ids": torch.tensor([list(r[2]) for r in rows], device=dev),
                      "position_ids": torch.tensor([list(range(r[1], r[1] + len(r[2]))) for r in rows], device=dev),
                      "states": [] if first else pool.gather(rids)}
            with torch.no_grad(), paged_context(caches, meta, self.backend):
                logits, *states = (self.fresh_step if first else self.step)(**kwargs)  # [B, V], states [B, ...]
            pool.scatter(rids, states)
            for i, row in zip(group, logits):
                out[i] = row
        return out


class DecodeSteps:
    """A run's decode steps prepared to run back to back (:meth:`ServableModel.decode_steps`): ``greedy(j)`` runs
    step ``j`` (inside ``bound()``) and writes its greedy tokens into row ``j + 1`` of ``ids`` ``[k + 1, n]``, the
    next step's input ids, through ``write`` (the backend's ``argmax_writer``, bound to ``ids`` once)."""

    __slots__ = ("prepared", "ids", "kept", "rows", "write")

    def __init__(self, prepared, ids: torch.Tensor, kept: bool, rows: Sequence[int],
                 write: Callable[[torch.Tensor, int], list[int]]):
        self.prepared, self.ids, self.kept, self.rows, self.write = prepared, ids, kept, rows, write

    @contextlib.contextmanager
    def bound(self):
        """The context the steps run in: the call's (:meth:`PagedCall.bound`) and the grad mode a single step runs in
        (:func:`~pagedattn.runtime.context.step_mode`: on the CPU inference mode, which spares every op of the step
        the autograd layer, and which a ``torch.compile``'d step's guards check)."""
        with step_mode(self.ids.device), self.prepared.call.bound():
            yield

    def greedy(self, j: int) -> list[int]:
        """Step ``j``'s greedy tokens, one per sequence, also written into ``ids[j + 1]``."""
        return self.write(_row_logits(self.prepared.run(j), self.kept, self.rows), j + 1)


def _long_tensor(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``: through an array's buffer on the CPU (``torch.tensor`` on a list
    costs ~0.1 us an element, ~0.23 ms for a 1,000-token step's ids and positions, against ~0.03 ms)."""
    if not len(values) or device.type != "cpu":  # frombuffer takes no empty buffer
        return torch.tensor(list(values), dtype=torch.long, device=device)
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)  # the tensor keeps the array alive


def step_values(spec: position_mod.ValueSpec, values: Optional[torch.Tensor], num_seqs: int,
                device) -> torch.Tensor:
    """A step's per-sequence values ``[num_seqs, count]``: those given, then sequences without a span (padding
    sequences of a padded step, or all of them when none are given)."""
    have = 0 if values is None else int(values.shape[0])
    rest = position_mod.default_values(spec, num_seqs - have)
    out = rest if values is None else torch.cat((values.to("cpu", torch.long), rest))
    return out.to(device)


def _row_logits(out, kept: bool, rows: Sequence[int]) -> torch.Tensor:
    """``[R, V]`` logits of the rows that complete a sequence."""
    logits = out.logits if hasattr(out, "logits") else out[0] if isinstance(out, (tuple, list)) else out
    if kept:  # the model kept only those rows (logits_to_keep)
        return logits[0]
    if rows and list(rows) == list(range(rows[0], rows[0] + len(rows))):
        return logits[0, rows[0]:rows[0] + len(rows)]  # a decode step's rows are every row: a view, not a copy
    return logits[0, torch.tensor(list(rows), dtype=torch.long, device=logits.device)]


# ---------------------------------------------------------------------- preparing


def prepare_model(model: nn.Module, *, target: "str | AttentionBackend" = "auto", block_size: int = 16,
                  dtype: Optional[torch.dtype] = None, eos_token_id: Optional[int | Sequence[int]] = None,
                  compile: Optional[bool] = False, progress: bool = False, token_type_runs: int = 4,
                  ahead_of_time: Optional[bool] = None) -> ServableModel:
    """Turn a model into a :class:`ServableModel`, or raise ``ValueError`` saying why it cannot be served.

    ``model`` is a Hugging Face causal LM or any module taking ``input_ids`` (rewritten here), a
    ``RewrittenModel``, or a module compiled with ``torch.compile(backend="pagedattn")``.
    ``compile=True`` compiles the paged graph with Inductor (dynamic shapes) and runs its first step
    here, so that serving starts compiled; ``None`` (``PagedEngine``'s default) does so where it applies: a packed
    step (no recurrent state) that is not compiled already, on a backend without padded step shapes
    of its own (CPU, CUDA). Compiled packed steps are padded to sizes of at least 2
    (``ServableModel.min_step``), which keeps a serving loop in one graph. ``progress`` prints each
    start-up stage (rewriting, compiling, checking) and its time on stderr. ``token_type_runs``: image blocks per
    request a mask built from token types is established for (``pagedattn.rewrite``). ``ahead_of_time``: a CPU step is
    compiled with AOTInductor into a package kept on disk where it can (``RewrittenModel.compile_paged``).
    """
    stages = Stages(progress)
    backend = get_backend(target)
    device = torch.device(backend.device_type)
    if is_seq2seq(model):
        with stages.stage(f"rewriting the decoder step of {type(model).__name__} (self-attention paged, "
                          "cross-attention over blocks filled once per request) and checking it"):
            servable = _seq2seq_servable(model, backend, block_size, dtype, eos_token_id)
        if compile or (compile is None and backend.step_padder(512, 256, 1) is None):
            with stages.stage("compiling the encoder and the decoder step with Inductor"):
                servable = _compile(servable, ahead_of_time)
        return servable
    model_device = _module_device(model)
    if model_device is not None and model_device.type != device.type:
        raise ValueError(f"the model's parameters are on {model_device} but target {target!r} runs on "
                         f"{device.type}: move the model first (model.to('{device.type}'))")
    info = model.info if isinstance(model, RewrittenModel) else ModelInfo.of(model)
    eos = frozenset(ModelInfo(eos_token_id=eos_token_id).eos_ids() if eos_token_id is not None else info.eos_ids())
    common = dict(backend=backend, block_size=block_size, vocab_size=info.vocab_size, eos_ids=eos)
    if isinstance(model, RewrittenModel):
        servable = _servable(model, model.input_names, dtype, **common)
    elif is_compiled(model):
        names = accepted_inputs(uncompiled(model))
        servable = _servable(model, names, dtype, specs=_compiled_cache_specs(model, names, info), **common)
    else:
        with stages.stage(f"rewriting {type(model).__name__} (tracing, finding attention, checking)"):
            names = accepted_inputs(model)
            layout = find_recurrent_state(model)
            if layout is None:
                unserved: dict[str, str] = {}
                step = _rewrite_plain(model, names, backend, block_size, unserved, token_type_runs)
                servable = _servable(step, names, dtype, unserved=unserved, **common)
            else:
                names.discard("token_type_ids")  # rows carrying state take tokens and positions only
                servable = _stateful(model, layout, names, dtype, common)
    if servable.state is not None and backend.step_padder(512, 256, 1) is not None:
        raise ValueError(f"PagedEngine cannot serve a model with recurrent state on target {backend.device_type!r}: "
                         "its steps run one row per sequence, which the padded step shapes of this backend "
                         "do not cover; use the CPU or CUDA target")
    if servable.state is None and not servable.cache_specs:
        raise ValueError("the model has no rewritten attention sites: nothing to page (see its report)")
    later = sites_seeing_later_keys(getattr(servable.step, "report", None) or ())
    if later:
        raise ValueError(f"PagedEngine cannot serve this model: {later_keys_reason(later)}")
    mixes = getattr(servable.step, "paged_refusal", None)
    if mixes:
        raise ValueError(f"PagedEngine cannot serve this model: {mixes_tokens_reason(mixes)}")
    unproven = getattr(servable.step, "locality_unproven", None)
    if unproven:
        log.info("tokens not shown to be computed apart outside attention (%s): the packing check decides", unproven)
    if compile is None:
        compile = servable.state is None and isinstance(servable.step, RewrittenModel) and \
            backend.step_padder(512, 256, 1) is None
    if compile:
        with stages.stage("compiling the paged step with Inductor (a first start takes a while; later starts "
                          "reuse what it left on disk)"):
            servable = _compile(servable, ahead_of_time)
    elif isinstance(servable.step, RewrittenModel):
        servable = _padded_to_min_sizes(servable)
    if servable.state is None:
        with stages.stage("checking packed and chunked steps against each other"):
            check_packing(servable)
    return servable


def _seq2seq_servable(model, backend: AttentionBackend, block_size: int, dtype,
                      eos_token_id) -> ServableModel:
    """An encoder-decoder's servable: its rewritten decoder step, with the encoder and cross-attention writer."""
    serving = prepare_seq2seq(model, backend, block_size)
    spec = serving.spec
    eos = eos_token_id if eos_token_id is not None else spec.eos_token_id
    specs = tuple(serving.step.cache_specs)
    return ServableModel(step=serving.step, backend=backend, block_size=block_size, cache_specs=specs,
                         cache_dtype=dtype or _cache_dtype(specs, None), input_names=frozenset({"input_ids"}),
                         vocab_size=spec.vocab_size, eos_ids=frozenset(ModelInfo(eos_token_id=eos).eos_ids()),
                         seq2seq=serving)


def _servable(step: nn.Module, names, dtype, specs=None, unserved: Optional[dict] = None,
              **common) -> ServableModel:
    values = None
    if isinstance(step, RewrittenModel):
        _eager_writes_for(step, common["backend"])
        values = step.value_spec
        if values is not None:
            _check_value_input(step, values, names)
    specs = tuple(step.cache_specs if specs is None else specs)
    return ServableModel(step=step, cache_specs=specs, cache_dtype=dtype or _cache_dtype(specs, None),
                         input_names=frozenset(names), values=values, unserved_inputs=dict(unserved or {}),
                         **common)


def _check_value_input(step: RewrittenModel, spec: position_mod.ValueSpec, names) -> None:
    """A prefix length read by the masks (one value per request) must not feed anything else: a packed step
    has one row for all its sequences, and a per-request value cannot be one input there."""
    if spec.kind != "scalar" or spec.input not in names or not isinstance(step.graph_module, GraphModule):
        return
    used = [n for n in step.graph_module.graph.nodes if n.op == "placeholder" and n.name == spec.input and n.users]
    if used:
        raise ValueError(f"PagedEngine cannot serve this model: its input {spec.input!r} (one value per request, "
                         "read by its masks as a prefix length) also feeds computation outside attention, which a "
                         "packed step of several requests cannot give one value")


def _eager_writes_for(step: RewrittenModel, backend: AttentionBackend) -> None:
    """A paged graph run op by op on a device that cannot keep the in-place cache write gets functional
    writes (idempotent: a graph already converted has no in-place write left)."""
    if backend.functional_cache_writes and isinstance(step.graph_module, GraphModule):
        run_pipeline(step.graph_module, PassContext(), (FunctionalCacheWrites("copy_back"),))


def _padded_to_min_sizes(servable: ServableModel) -> ServableModel:
    """A program that checks its inputs' sizes as exported (``RewrittenModel.min_sizes``, a file saved before programs
    took sizes of 1) gets every step padded up to them, single-token ones too; other servables as they are."""
    least = servable.step.min_sizes
    return dataclasses.replace(servable, min_step=least, pad_single_token=True) if least > 1 else servable


def _compile(servable: ServableModel, ahead_of_time: Optional[bool] = None) -> ServableModel:
    """Compile the servable's step(s) and run a first step (Inductor compiles lazily, on first call)."""
    if not isinstance(servable.step, RewrittenModel):
        raise ValueError("compile=True applies to models the engine rewrites or a RewrittenModel; "
                         "a torch.compile'd model is compiled already")
    # fresh_step: the first steps of sequences whose state the model starts. A RewrittenModel compiles
    # in place: one served (or compiled) before keeps its compiled graph
    for step in (servable.step, servable.fresh_step):
        if step is not None and not is_compiled(step.graph_module):
            step.compile_paged(ahead_of_time=ahead_of_time)
    if servable.seq2seq is not None and servable.seq2seq.compiled_encoder is None:
        try:
            with no_duck_sizing():
                servable = dataclasses.replace(servable, seq2seq=servable.seq2seq.compile_encoder(servable.device))
        except Exception as e:  # an encoder Inductor cannot compile runs as it is: slower, the same states
            log.info("the encoder runs eagerly: compiling it failed (%s: %s)", type(e).__name__,
                     str(e).splitlines()[0] if str(e) else "")
    if servable.state is not None:
        return servable
    if not isinstance(servable.step.graph_module, AotStep):
        # Dynamo specialises sizes of 1: padded to at least 2, every step runs one of two graphs. A step compiled
        # ahead of time takes every size its program takes (a file saved before programs took sizes of 1 does not)
        servable = dataclasses.replace(servable, min_step=2)
    else:
        servable = _padded_to_min_sizes(servable)
    with no_duck_sizing():
        first_step(servable)
    return servable


def first_step(servable: ServableModel) -> torch.Tensor:
    """Run small packed steps on caches of their own: a 3-token prompt beside a decode token, then a
    decode token alone. Padded (``min_step``), every step has one of these two shape classes
    (``runtime.shapes``), so a compiled step compiles both here. The first step's logits."""
    vocab, bs = servable.vocab_size or 2, servable.block_size
    prompt = list(range(-(-3 // bs)))
    decode = list(range(len(prompt), len(prompt) + -(-2 // bs)))  # one cached token, one new
    n = len(prompt) + len(decode)
    caches = servable.allocate_kv_caches(n + 2)  # an encoder-decoder's cross blocks: one per sequence
    cross = cross_alone = None
    if servable.seq2seq is not None:
        cross = build_cross_metadata([[n], [n + 1]], [1, min(bs, 2)], bs, device=servable.device)
        cross_alone = build_cross_metadata([[n + 1]], [min(bs, 2)], bs, device=servable.device)
    meta = build_metadata([(0, 3, prompt), (1, 1, decode)], bs, device=servable.device)
    out = servable.run_packed(caches, meta, [t % vocab for t in (3, 8, 13, 18)], [0, 1, 2, 1], [2, 3], cross=cross)
    alone = build_metadata([(1, 1, decode)], bs, device=servable.device)
    servable.run_packed(caches, alone, [18 % vocab], [1], [0], cross=cross_alone)
    return out


def warm_steps(servable: ServableModel, sizes: Sequence[int], progress: bool = False, chunk: int = 32) -> None:
    """Run one packed step of each size in ``sizes`` (tokens, ``AttentionBackend.warm_step_sizes``) on caches of its
    own, so that what a compiled step builds on first meeting a size is built at start-up rather than in the first
    serving steps of that size. A step is prompts of at most ``chunk`` tokens (positions a model with few of them
    has). Steps with recurrent state, an encoder or per-request values are not warmed."""
    if not sizes or servable.state is not None or servable.seq2seq is not None or servable.values is not None:
        return
    bs, vocab = servable.block_size, servable.vocab_size or 2
    per = -(-chunk // bs)  # blocks a prompt holds
    caches = servable.allocate_kv_caches(-(-max(sizes) // chunk) * per)
    with Stages(progress).stage(f"building oneDNN's GEMMs for {len(sizes)} step sizes"):
        for size in sizes:
            prompts, ids, pos, rows = [], [], [], []
            for i, start in enumerate(range(0, size, chunk)):
                n = min(chunk, size - start)
                prompts.append((0, n, list(range(i * per, (i + 1) * per))))
                ids += [(start + t) % vocab for t in range(n)]
                pos += range(n)
                rows.append(len(ids) - 1)
            servable.run_packed(caches, build_metadata(prompts, bs, device=servable.device), ids, pos, rows)


def step_is_compiled(servable: ServableModel) -> bool:
    """Whether the servable's step is compiled (``compile=True`` or a ``torch.compile``'d model)."""
    step = servable.step
    return is_compiled(getattr(step, "graph_module", step))


class Stages:
    """Start-up stages: a line on stderr as each starts and its time as it ends (``progress``), and a
    log record either way."""

    def __init__(self, progress: bool):
        self.progress = progress

    @contextlib.contextmanager
    def stage(self, what: str):
        if self.progress:
            print(f"pagedattn: {what} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        yield
        dt = time.perf_counter() - t0
        log.info("%s: %.1f s", what, dt)
        if self.progress:
            print(f"pagedattn:   done in {dt:.1f} s", file=sys.stderr, flush=True)


def is_compiled(model) -> bool:
    """A module (or a module whose forward is) compiled with ``torch.compile``."""
    return hasattr(model, "_orig_mod") or (hasattr(model, "forward") and
                                           hasattr(model.forward, "_torchdynamo_orig_callable"))


def accepted_inputs(model: nn.Module) -> set[str]:
    """The step inputs the model's forward takes: ``input_ids`` and which of ``position_ids``,
    ``use_cache``, ``logits_to_keep`` (``position_ids`` also when ``**kwargs`` honours them), and
    ``token_type_ids`` where they act as a prefix-LM's token types (``_token_types_mask``)."""
    model = uncompiled(model)
    params = inspect.signature(model.forward).parameters
    names = {n for n in ("input_ids", "position_ids", "use_cache", "logits_to_keep") if n in params}
    if "position_ids" not in names and any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()) \
            and _honours_positions(model, names):
        names.add("position_ids")  # taken through **kwargs (e.g. Hugging Face's decoder-only wrappers)
    if "token_type_ids" in params and _token_types_mask(model, names):
        names.add("token_type_ids")
    return names


def _token_types_mask(model: nn.Module, names: set[str]) -> bool:
    """Whether ``token_type_ids`` act as a prefix-LM's token types (PaliGemma's prefix, Gemma-3's image
    blocks): all of one type computes what the model computes without them, a span of one token (plain causal
    attention) changes nothing, and a mix of types changes the output. Token types that change a token's
    output by its own type (segment embeddings: BERT-style causal LMs) are left out, untraced."""
    vocab = ModelInfo.of(model).vocab_size or 2
    device = _module_device(model) or "cpu"
    ids = (torch.arange(6, device=device)[None] * 5 + 3) % vocab
    kw = {"use_cache": False} if "use_cache" in names else {}

    def run(tt):
        out = model(input_ids=ids, **kw) if tt is None else model(input_ids=ids, token_type_ids=tt, **kw)
        return getattr(out, "logits", out[0] if isinstance(out, (tuple, list)) else out)

    try:
        with torch.no_grad():
            plain = run(None)
            same = any(torch.equal(run(torch.full_like(ids, t)), plain) for t in (0, 1))
            # a span of one token is plain causal attention: types that only shape masks leave the output as it
            # was; segment embeddings (BERT's token types) change that token's own output whichever type it is
            last = torch.zeros_like(ids)
            last[0, -1] = 1
            mask_only = torch.equal(run(last), run(1 - torch.ones_like(ids))) or \
                torch.equal(run(1 - last), run(torch.ones_like(ids)))
            mixed = torch.tensor([[0, 1, 1, 1, 0, 0]], device=device)
            return same and mask_only and not (torch.equal(run(mixed), plain) and torch.equal(run(1 - mixed), plain))
    except Exception:  # a forward that refuses them alone (pixels required, say) is served without them
        return False


def _honours_positions(model: nn.Module, names: set[str]) -> bool:
    """Whether ``position_ids`` passed through ``**kwargs`` reach the model: shifted positions change its output."""
    vocab = ModelInfo.of(model).vocab_size or 2
    device = _module_device(model) or "cpu"
    ids = (torch.arange(6, device=device)[None] * 5 + 3) % vocab
    kw = {"use_cache": False} if "use_cache" in names else {}
    try:
        with torch.no_grad():
            a = model(input_ids=ids, position_ids=torch.arange(6, device=device)[None], **kw)
            b = model(input_ids=ids, position_ids=torch.arange(6, device=device)[None] + 7, **kw)
        a, b = (getattr(o, "logits", o[0] if isinstance(o, (tuple, list)) else o) for o in (a, b))
        return isinstance(a, torch.Tensor) and not torch.equal(a, b)
    except Exception:  # a forward that refuses the keyword does not take it
        return False


def example_inputs(names: set[str], vocab: Optional[int], device: torch.device | str = "cpu") -> dict:
    """An 8-token example call of a model's step with the inputs it takes (``accepted_inputs``)."""
    T = 8
    # token ids that do not count up by one: the mask classifier must not take them for positions
    kw = {"input_ids": (torch.arange(T, device=device)[None] * 5 + 3) % (vocab or 2)}
    if "position_ids" in names:
        kw["position_ids"] = torch.arange(T, device=device)[None]
    if "use_cache" in names:
        kw["use_cache"] = False
    if "logits_to_keep" in names:
        kw["logits_to_keep"] = torch.tensor([T - 1, 3], device=device)
    if "token_type_ids" in names:  # one type throughout: a shape every reading of token types covers
        kw["token_type_ids"] = torch.zeros((1, T), dtype=torch.long, device=device)
    return kw


def _module_device(model) -> Optional[torch.device]:
    """Where the model's parameters (or else buffers) live; None when it has neither."""
    module = uncompiled(model)
    for t in itertools.chain(module.parameters(), module.buffers()):
        return t.device
    return None


def _cache_dtype(specs: Sequence[CacheSpec], layout: Optional[StateLayout]) -> torch.dtype:
    # no specs and no state: a model with nothing to page, which prepare_model refuses after this
    dtypes = {s.dtype for s in specs} or ({s.dtype for s in layout.slots} if layout is not None else {torch.float32})
    return sorted(dtypes, key=str)[0]


def _rewrite_plain(model: nn.Module, names: set[str], backend: AttentionBackend, block_size: int,
                   unserved: Optional[dict] = None, token_type_runs: int = 4) -> RewrittenModel:
    """The model rewritten on an example of its inputs. With token types (a prefix-LM), every attention site
    must be rewritten with its mask over them established; otherwise the model is rewritten and served
    without token types (``names`` loses them, ``unserved`` says why: requests carrying them are refused)."""
    from pagedattn.api import rewrite

    example = example_inputs(names, ModelInfo.of(model).vocab_size, _module_device(model) or "cpu")
    rm = rewrite(model, (), example, target=backend, block_size=block_size, token_type_runs=token_type_runs)
    if "token_type_ids" not in names:
        return rm
    left = [f"{r['name']}: {r['reason']}" for r in rm.report if r["status"] != "rewritten" and r.get("attention", True)]
    if rm.value_spec is not None and not left:
        return rm
    why = "; ".join(left) or "no mask reads them as token types"
    log.warning("serving %s without token types (requests carrying them are refused): %s", type(model).__name__, why)
    names.discard("token_type_ids")
    if unserved is not None:
        unserved["token_type_ids"] = why
    return rewrite(model, (), {k: v for k, v in example.items() if k != "token_type_ids"}, target=backend,
                   block_size=block_size)


def _compiled_cache_specs(model, names: set[str], info: ModelInfo) -> list[CacheSpec]:
    """Run the compiled model once in drop-in mode to learn its rewritten sites' cache layout."""
    from pagedattn.compile import compiled_graphs

    with torch.no_grad(), compiled_graphs() as graphs:
        model(**example_inputs(names, info.vocab_size, _module_device(model) or "cpu"))
    paged = [g for g in graphs if g.cache_specs]
    if len(paged) > 1:
        raise ValueError(f"the compiled model runs its attention in {len(paged)} graphs (graph breaks between "
                         "them); PagedEngine serves one paged graph per step: pass the model itself, or a "
                         "RewrittenModel from pagedattn.rewrite()")
    return paged[0].cache_specs if paged else []


# ------------------------------------------------------------------------- checks


def check_packing(servable: ServableModel) -> None:
    """Refuse models whose tokens influence each other outside attention.

    Steps pack several sequences into one row and split prompts into chunks across steps; only
    attention knows where a sequence starts and what its cache holds. A model that numbers tokens
    by their index in the step (no ``position_ids``), or that carries state along the row outside
    attention (recurrent, convolution or linear-attention layers), would silently mix sequences.
    Checked by running a sequence alone, after another one in the same step, and in two chunks.
    """
    vocab = servable.vocab_size or 2
    first = [(3 + 5 * i) % vocab for i in range(7)]
    second = [(11 + 3 * i) % vocab for i in range(5)]
    bs = servable.block_size
    n0, n1 = -(-len(first) // bs), -(-len(second) // bs)
    tables = {0: list(range(n0)), 1: list(range(n0, n0 + n1))}  # each sequence its own blocks

    def run(steps):
        """steps: per step, the (sequence index, tokens) chunks; returns the last row's logits."""
        caches = servable.allocate_kv_caches(n0 + n1)
        done, out = {}, None
        for step in steps:
            specs, ids, pos = [], [], []
            for seq, toks in step:
                start = done.get(seq, 0)
                specs.append((start, len(toks), tables[seq]))
                ids += toks
                pos += list(range(start, start + len(toks)))
                done[seq] = start + len(toks)
            meta = build_metadata(specs, bs, device=servable.device)
            out = servable.run_packed(caches, meta, ids, pos, [len(ids) - 1])[-1].float()
        return out

    try:
        alone = run([[(1, second)]])
        checks = {
            "after another sequence in the same step": run([[(0, first), (1, second)]]),
            "in two chunks": run([[(1, second[:3])], [(1, second[3:])]]),
        }
    except Exception as e:  # e.g. a guard of the traced program on the step's token count
        msg = str(e).splitlines()[0] if str(e) else ""
        raise ValueError(f"PagedEngine cannot serve this model: a packed step (2 to 12 tokens) failed "
                         f"({type(e).__name__}: {msg}); its traced forward does not accept every step size") from e
    # GEMMs sum in an order that depends on the step's rows; a bf16/fp16 result shows that as a few ulps
    rtol = max(1e-3, 4 * torch.finfo(servable.cache_dtype).eps)
    atol = 1e-4 if rtol == 1e-3 else rtol * float(alone.abs().max())
    for how, got in checks.items():
        if not torch.allclose(alone, got, atol=atol, rtol=rtol):
            why = ("it takes no position_ids and numbers tokens by their index in the step; it needs a forward "
                   "that accepts position_ids, or no absolute positions (ALiBi)"
                   if "position_ids" not in servable.input_names else
                   "tokens influence each other outside attention (recurrent, convolution or linear-attention "
                   "layers, whose state the paged KV cache does not hold); if that state is in the model's "
                   "Hugging Face cache, pass the model itself, not a RewrittenModel, and the engine carries it")
            raise ValueError(f"PagedEngine cannot serve this model: a sequence's logits change when run {how} "
                             f"(max difference {float((alone - got).abs().max()):.3g}): {why}")


# ----------------------------------------------------------------- recurrent state


def _stateful(model: nn.Module, layout: StateLayout, names: set[str], dtype, common: dict) -> ServableModel:
    """Trace the stateful step for chunks of tokens, or else for one token per sequence and step.

    Some layers read their carried state only on single-token steps (Mamba-1's selective scan
    starts every longer chunk from zeros): their prompts then advance a token per step, in
    batches of rows. A single-token trace shows no mask extent: its sites take their masks from
    a multi-token trace of the model itself. A state that does not start from zeros gets a
    second trace for the first step of each sequence, in which the model starts it itself.
    """
    backend, block_size = common["backend"], common["block_size"]
    errors, hints = [], None
    log.info("recurrent state per sequence: %s (%d bytes)", ", ".join(s.name for s in layout.slots),
             layout.bytes_per_sequence)
    # (tokens per row, rows): chunks in batched rows; one token per row; one token in one row per
    # call, for models whose single-token path mixes the rows of a batch (RWKV's broadcasts them)
    for tokens, rows in ((8, 2), (1, 2), (1, 1)):
        try:
            if tokens == 1 and hints is None:
                hints = _mask_hints(model, names, backend, block_size)
            step = _rewrite_stateful(model, layout, names, backend, block_size, tokens, rows, hints)
            fresh = None if layout.starts_from_zeros else \
                _rewrite_stateful(model, layout, names, backend, block_size, tokens, rows, hints, fresh=True)
            servable = ServableModel(
                step=step, cache_specs=tuple(step.cache_specs), cache_dtype=dtype or _cache_dtype(step.cache_specs,
                                                                                               layout),
                input_names=frozenset(names), state=layout, fresh_step=fresh, token_steps=tokens == 1,
                one_row=rows == 1, **common)
            check_state(servable, model)
            if errors:
                log.info("the model's state advances %s (%s)", "one token per step" if rows > 1 else
                         "one token per step and call", "; ".join(errors))
            return servable
        except (ValueError, RuntimeError) as e:
            errors.append(f"{tokens}-token steps in {rows} rows: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    raise ValueError("PagedEngine cannot serve this model with its recurrent state: " + "; ".join(errors))


def _mask_hints(model: nn.Module, names: set[str], backend: AttentionBackend, block_size: int) -> list[dict]:
    """The report of a multi-token trace of the model, whose masks its single-token steps take (``mask_hints``).

    A forward that fixes the trace's length (a recurrent layer looping over the tokens in Python) establishes
    masks up to that length only. The model is then traced again with its recurrent layers opaque
    (:func:`pagedattn.tracing.recurrent_layers_opaque`): the code around them, which builds the masks, traces
    for every length. That trace's masks are taken where every site's agrees with the first trace's in
    status, kind and parameters (its established length aside); otherwise the first trace's."""
    from pagedattn.tracing import recurrent_layers_opaque

    first = _rewrite_plain(model, names, backend, block_size)
    if not first.static_sizes:
        return first.report
    fixed = [_how(r, FIXED_LENGTH) for r in first.report]
    try:
        with recurrent_layers_opaque(model) as opaque:
            second = _rewrite_plain(model, set(names), backend, block_size) if opaque else None
    except (ValueError, RuntimeError) as e:
        log.debug("tracing with recurrent layers opaque failed: %s", e)
        return fixed
    if second is None or second.static_sizes or not _same_masks(first.report, second.report):
        return fixed
    return [_how(r, "recurrent layers opaque") for r in second.report]


def _how(entry: dict, note: str) -> dict:
    return dict(entry, mask_established=f"{entry['mask_established']}, {note}") if entry.get("mask_established") \
        else entry


_MASK_FIELDS = ("name", "status", "mask", "window", "chunk", "softcap", "alibi", "sinks", "key_padding",
                "key_padding_ignores_true", "key_padding_runs", "positions_from_first_key", "position_program",
                "position_values")


def _same_masks(a: list[dict], b: list[dict]) -> bool:
    """Two reports whose sites match one for one, with the same masks, ``b``'s established at least as far."""
    def reach(r: dict) -> float:  # no mask_up_to: every length
        return math.inf if r.get("mask_up_to") is None else r["mask_up_to"]

    return len(a) == len(b) and all(all(x.get(f) == y.get(f) for f in _MASK_FIELDS) and reach(y) >= reach(x)
                                    for x, y in zip(a, b))


def _rewrite_stateful(model: nn.Module, layout: StateLayout, names: set[str], backend: AttentionBackend,
                      block_size: int, tokens: int = 8, rows: int = 2, mask_hints: Optional[list[dict]] = None,
                      fresh: bool = False) -> RewrittenModel:
    """Rewrite the model's step with its recurrent state as inputs and outputs (see StatefulStep)."""
    from pagedattn.api import rewrite

    device = _module_device(model) or "cpu"
    B, T = rows, tokens  # two rows: the batch dimension stays dynamic
    ids = (torch.arange(B * T, device=device).reshape(B, T) * 5 + 3) % (ModelInfo.of(model).vocab_size or 2)
    example = {"input_ids": ids, "position_ids": torch.arange(T, device=device).expand(B, T).contiguous(),
               "states": [] if fresh else [torch.zeros((B, *s.shape), dtype=s.dtype, device=device)
                                           for s in layout.slots]}
    rm = rewrite(StatefulStep(model, layout, "position_ids" in names, fresh).eval(), (), example,
                 target=backend, block_size=block_size, mask_hints=mask_hints)
    rm.retrace = None  # a step whose program fixed its sizes refuses others: the next mode is tried instead
    # its steps run a sequence per row (the recurrence runs along a row, its state carried per sequence, and
    # check_state compares the steps with the model's own forward): what combines a row's tokens is its to combine
    rm.paged_refusal = rm.locality_unproven = None
    return rm


def _token_by_token(steps: list) -> list:
    """The same chunks split into steps of one token per sequence."""
    out = []
    for step in steps:
        for i in range(max(len(toks) for _, toks in step)):
            out.append([(rid, toks[i:i + 1]) for rid, toks in step if i < len(toks)])
    return out


def check_state(servable: ServableModel, model: nn.Module) -> None:
    """Refuse a stateful model whose steps do not reproduce its own forward.

    A sequence runs as one prefill row, and again as a chunk batched beside another sequence, then
    single tokens batched with it, then a last chunk: each time its last logits must equal the
    model's forward over the whole sequence. This catches state the Hugging Face cache does not hold.
    """
    vocab = servable.vocab_size or 2
    seq = [(11 + 3 * i) % vocab for i in range(9)]
    other = [(3 + 5 * i) % vocab for i in range(6)]
    bs = servable.block_size
    n0 = -(-len(seq) // bs)
    tables = {0: list(range(n0)), 1: list(range(n0, n0 + -(-len(other) // bs)))}
    blocks = n0 + len(tables[1])
    dev = servable.device

    def run(steps):
        caches = servable.allocate_kv_caches(blocks)
        pool, done, last = StatePool(servable.state.slots, dev, capacity=2), {}, None
        for step in steps:
            items = []
            for rid, toks in step:
                start = done.get(rid, 0)
                if start == 0:
                    pool.start(rid)
                items.append((rid, start, toks, tables[rid]))
                done[rid] = start + len(toks)
            out = servable.run_rows(caches, pool, items)
            last = next((o for (rid, *_), o in zip(items, out) if rid == 0), last)
        return last.float()

    kw = {"input_ids": torch.tensor([seq], device=dev)}
    if "position_ids" in servable.input_names:
        kw["position_ids"] = torch.arange(len(seq), device=dev)[None]
    if "use_cache" in servable.input_names:
        kw["use_cache"] = False
    try:
        with torch.no_grad(), without_hf_cache(model):
            ref = _row_logits(model(**kw), False, [len(seq) - 1])[-1].float()
        chunked = [[(0, seq[:4]), (1, other[:3])], [(0, seq[4:5]), (1, other[3:4])],
                   [(0, seq[5:6]), (1, other[4:6])], [(0, seq[6:])]]
        if servable.token_steps:
            checks = {"a token per step, batched with another sequence": run(_token_by_token(chunked))}
        else:
            checks = {"as one prefill row": run([[(0, seq)]]),
                      "in chunks and single tokens batched with another sequence": run(chunked)}
    except Exception as e:
        msg = str(e).splitlines()[0] if str(e) else ""
        raise ValueError(f"PagedEngine cannot serve this model with its recurrent state: a step failed "
                         f"({type(e).__name__}: {msg})") from e
    # relative to the logits' scale: a lost state can move random-weight logits by as little as 1e-5
    tol = max(2e-5, 8 * torch.finfo(servable.cache_dtype).eps) * float(ref.abs().max())
    for how, got in checks.items():
        if float((ref - got).abs().max()) > tol:
            raise ValueError(
                f"PagedEngine cannot serve this model: run {how}, a sequence's logits differ from the model's "
                f"own forward (max difference {float((ref - got).abs().max()):.3g}); its state lives outside "
                "the Hugging Face cache layers the engine carries")
