"""``RewrittenModel``: a rewritten program, callable like the model it came from."""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Callable, Iterator, Optional, Sequence

import torch
from torch import nn
from torch.fx import GraphModule
from torch.utils import _pytree as pytree

from pagedattn.aot_step import AotStep
from pagedattn.backends import (
    AttentionBackend,
    AttentionMetadata,
    CacheSpec,
    get_backend,
    native_ops,
    position_mod,
    use_backend,
    validation_enabled,
)
from pagedattn.backends.cpu_linear import SmallLinears
from pagedattn.backends.native_ops import NativePagedOps, SiluMul
from pagedattn.backends.shared_values import RealizeSharedValues
from pagedattn.inductor_cache import frozen_steps_cacheable
from pagedattn.passes import ConcatLinears, Fp32Matmuls, PassContext, run_pipeline
from pagedattn.report import first_line
from pagedattn.runtime.context import (
    cache_block_size,
    current_context,
    refuse_if_unpaged,
    sites_seeing_later_keys,
)
from pagedattn.tracing import copy_graph_module, fits_static_sizes, quiet_tracing, uncompiled

log = logging.getLogger("pagedattn")

__all__ = ["RewrittenModel", "PagedCall", "ModelInfo", "check_positions", "check_padding", "check_values",
           "paged_step_options", "ahead_of_time_default"]


class ModelInfo:
    """What serving needs besides the graph: vocabulary size, EOS ids, the model type.

    Read from a Hugging Face model's configs (generation config first for EOS, as ``generate`` does),
    or from a saved program's metadata.
    """

    def __init__(self, vocab_size: Optional[int] = None, eos_token_id=None, model_type: Optional[str] = None,
                 max_length: Optional[int] = None):
        self.vocab_size, self.eos_token_id, self.model_type = vocab_size, eos_token_id, model_type
        self.max_length = max_length  # the longest sequence the model takes (positions it has embeddings for)

    @classmethod
    def of(cls, model: Optional[nn.Module]) -> "ModelInfo":
        model = uncompiled(model)
        cfg = getattr(model, "config", None)
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        eos = None
        for c in (getattr(model, "generation_config", None), text):
            eos = getattr(c, "eos_token_id", None) if c is not None else None
            if eos is not None:
                break
        return cls(getattr(text, "vocab_size", None), eos, getattr(text, "model_type", None), _max_length(text))

    def eos_ids(self) -> set[int]:
        eos = self.eos_token_id
        if eos is None:
            return set()
        return {int(eos)} if isinstance(eos, int) else {int(e) for e in eos}

    def to_json(self) -> dict:
        d = {"vocab_size": self.vocab_size, "eos_token_id": self.eos_token_id, "model_type": self.model_type,
             "max_length": self.max_length}
        return {k: v for k, v in d.items() if v is not None}

    @classmethod
    def from_json(cls, d: dict) -> "ModelInfo":
        return cls(d.get("vocab_size"), d.get("eos_token_id"), d.get("model_type"), d.get("max_length"))


_SCALARS = (bool, int, float, str)  # leaves for pytree, as tensors are


def _spec_children(spec) -> list:
    """A pytree spec's child specs (``children()`` in newer torch, ``children_specs`` before)."""
    return list(spec.children()) if hasattr(spec, "children") else list(spec.children_specs)


def _max_length(cfg) -> Optional[int]:
    """A config's longest sequence (the first of the names transformers' configs use for it)."""
    for name in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx",
                 "max_sequence_length"):
        v = getattr(cfg, name, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def check_positions(flat: list, position_inputs: dict[int, str]) -> None:
    """Refuse a dense (drop-in) call whose positions do not count up by one along each row (packed
    documents restarting at 0, say): the masks that read them were established for positions that do."""
    for i, name in position_inputs.items():
        t = flat[i]
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[-1] < 2:
            continue
        rows = t.reshape(-1, t.shape[-1])
        if not bool((rows[:, 1:] - rows[:, :-1] == 1).all()):
            raise ValueError(
                f"input {name!r} does not count up by one along each row (e.g. packed sequences restarting at 0): "
                "the rewritten masks were established for positions that do. Serve packed sequences through "
                "paged mode (PagedEngine, or paged_context with one sequence per document), or pass one sequence "
                "per row")


def check_padding(flat: list, padding_inputs: dict[int, tuple[str, bool]]) -> None:
    """Refuse a dense (drop-in) call whose padding mask holds values other than 0 and 1, or, where the masks
    were established for left or right padding, leaves gaps inside a row (present keys in several runs)."""
    for i, (name, runs) in padding_inputs.items():
        t = flat[i]
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            continue
        if t.dtype != torch.bool and not bool(((t == 0) | (t == 1)).all()):
            raise ValueError(f"input {name!r} is a padding mask but holds values other than 0 and 1: pass 1 for "
                             "keys to attend to and 0 for padding")
        if not runs:
            continue
        nonzero = t != 0  # what the proof took as one run [start, end) per row, never empty
        starts = (nonzero[:, 1:] & ~nonzero[:, :-1]).sum(-1) + nonzero[:, 0].long()
        if bool((starts != 1).any()):
            raise ValueError(
                f"input {name!r} marks present keys that are not one run per row (padding with gaps, or a row "
                "of padding only): the "
                "rewritten masks were established for left or right padding. Pass padding at the ends of each "
                "row, or serve the sequences through paged mode (PagedEngine)")


def check_values(flat: list, value_inputs: dict[int, position_mod.ValueSpec]) -> None:
    """Refuse a dense (drop-in) call whose token types (or prefix lengths) have a shape the masks that read
    them were not established for (other values, more spans than proven), in one line naming the input."""
    for i, spec in value_inputs.items():
        t = flat[i]
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"input {spec.input!r} is read by the rewritten masks as per-request values: pass a "
                             f"tensor, got {type(t).__name__}")
        position_mod.values_from_input(spec, t)


@contextlib.contextmanager
def inductor_freezing(on: bool) -> Iterator[None]:
    """Inductor's ``freezing`` on while a compiled step may trace: Dynamo reads it when it builds the graph (it
    marks the weights static then), before ``torch.compile``'s per-compile options apply, so it must hold at
    every call that may compile (the first ones, and any recompile). With it, ``cpp.enable_concat_linear``: on the
    CPU, linears that share an input and frozen weights (q/k/v, gate/up) become one GEMM, a few fewer oneDNN
    calls per layer (each ~10 us at decode sizes)."""
    if not on:
        yield
        return
    import torch._inductor.config as inductor_config

    # set and restored directly: ``config.patch`` costs ~15 us, and this runs around every step
    saved = inductor_config.freezing, inductor_config.cpp.enable_concat_linear
    inductor_config.freezing = inductor_config.cpp.enable_concat_linear = True
    try:
        with frozen_steps_cacheable():  # a later start loads the step's code from Inductor's cache
            yield
    finally:
        inductor_config.freezing, inductor_config.cpp.enable_concat_linear = saved


def frozen_step_options(freeze: bool) -> Optional[dict]:
    """``torch.compile`` options for a paged graph compiled with Inductor's freezing. They leave out Dynamo's
    guards on the graph module's attributes (``torch.compiler.skip_guard_on_all_nn_modules_unsafe``).

    Why that is safe here: freezing makes the weights constants of the compiled step, which already ignores
    later changes to them, and the graph module is pagedattn's own, never changed after it is built. The guards
    on the step's inputs (their dtypes, devices and shapes, the shape environment) and on global state stay.
    A 6-layer Llama step keeps 69 of its 320 guards: decode steps 1.03-1.06x faster (benchmarks/RESULTS.md)."""
    return {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe} if freeze else None


def serving_step_options() -> dict:
    """Inductor options for a paged step compiled for serving: without the generated code's checks, at every call,
    that each kernel's output has the sizes, strides and alignment its fake kernel promised at compile time
    (``size_asserts``, ``alignment_asserts``: 69 calls in a 6-layer Llama decode step, ~4 % of its time on the
    CPU). Dynamo's guards still check the step's inputs. Under full validation (``set_validation(True)``, as
    pagedattn's tests run) the checks stay, so that tests hold every kernel to its fake."""
    return {} if validation_enabled() else {"size_asserts": False, "alignment_asserts": False}


def ahead_of_time_default() -> bool:
    """Whether a step compiles ahead of time where it can (``compile_paged(ahead_of_time=None)``): yes, unless the
    environment sets ``PAGEDATTN_AHEAD_OF_TIME=0``."""
    return os.environ.get("PAGEDATTN_AHEAD_OF_TIME", "1").strip().lower() not in ("0", "false", "no", "off")


def paged_step_options(backend: str, target: str, *, freeze: bool,
                       small_linears: Optional[bool] = None) -> Optional[dict]:
    """The compile options of a paged step for ``backend`` on ``target`` (see ``RewrittenModel.compile_paged`` for
    ``freeze`` and ``small_linears``): freezing's (:func:`frozen_step_options`), serving's
    (:func:`serving_step_options`) and, on the CPU, the post-grad passes (pagedattn's small linears, a step's shared
    values once, the paged ops' C++ stand-ins, a gated MLP's activation by the native kernel). None where there are
    none."""
    if freeze and backend != "inductor":
        raise ValueError(f"freeze=True needs the inductor backend, not {backend!r}")
    if small_linears and not (freeze and target == "cpu"):
        raise ValueError("small_linears=True needs a CPU step compiled with freezing (freeze=True)")
    options = frozen_step_options(freeze)
    if backend == "inductor":
        options = {**(options or {}), **serving_step_options()} or None
    passes = []
    if freeze and target == "cpu" and small_linears is not False:
        passes.append(SmallLinears())
    if backend == "inductor" and target == "cpu":
        passes.append(RealizeSharedValues())  # a rotary table's sines and cosines once a step, not per layer
        if native_ops.paged_ops() is not None:
            passes.append(NativePagedOps())  # the paged ops' C++ stand-ins: a decode's calls with no Python
        if native_ops.silu_mul_op() is not None:
            passes.append(SiluMul())  # a gated MLP's SiLU(gate) * up by the native kernel
    if passes:
        options = {**(options or {}), "post_grad_custom_pre_pass": PostGradPasses(tuple(passes))}
    return options


try:
    from torch._inductor.custom_graph_pass import CustomGraphPass
except ImportError:  # pragma: no cover - torch without Inductor's custom passes
    CustomGraphPass = object


class PostGradPasses(CustomGraphPass):
    """Inductor post-grad passes run in order as its one ``post_grad_custom_pre_pass``; its cache key is theirs."""

    def __init__(self, passes: tuple):
        self.passes = passes

    def __call__(self, graph: torch.fx.Graph) -> None:
        for p in self.passes:
            p(graph)

    def uuid(self) -> str:
        return ":".join(f"{type(p).__name__}={p.uuid()}" for p in self.passes)


class PagedCall:
    """A rewritten program's paged step bound to its KV caches (:meth:`RewrittenModel.paged_call`): called with the
    step's keyword inputs, in the order the program was traced with, and its metadata, it returns the graph's flat
    outputs, as ``forward_flat`` inside ``paged_context`` does (or the one ``output`` it was made for). A serving loop
    calls its step a few hundred times a second; this leaves out what that path does at every call and cannot change
    between calls (the context, the structure of the inputs, the number of caches and their block size): ~0.04-0.07
    ms of a small model's ~2.5 ms decode step on a 2-core CPU, where the host's work runs between the kernels."""

    __slots__ = ("program", "names", "caches", "backend", "block_size", "output")

    def __init__(self, program: "RewrittenModel", names: tuple[str, ...], caches: tuple[torch.Tensor, ...],
                 backend: AttentionBackend, block_size: Optional[int], output: Optional[int]):
        self.program, self.names, self.caches, self.backend = program, names, caches, backend
        self.block_size = block_size  # None where no backend reads the caches (the ops then say what is wrong)
        self.output = output  # the one flat output a call returns (None: all, as a list)

    def __call__(self, inputs: dict, metadata: AttentionMetadata):
        flat = self._flat(inputs, metadata)
        program = self.program
        step = program.graph_module  # read at each call: compiling the program again replaces it
        with use_backend(self.backend), inductor_freezing(program._freezing):  # in a serving loop: bound already
            out = step.run(flat) if isinstance(step, AotStep) else step(*flat)
        return self._output(out)

    def _flat(self, inputs: dict, metadata: AttentionMetadata) -> list:
        """The step's flat inputs, its keyword inputs and metadata checked."""
        if tuple(inputs) != self.names or \
                not all(isinstance(v, torch.Tensor) or type(v) in _SCALARS for v in inputs.values()):
            raise TypeError(f"the paged step takes the keyword inputs {list(self.names)} (tensors or scalars), in "
                            f"that order; got {list(inputs)}")
        if self.block_size is not None and metadata.block_size != self.block_size:
            raise ValueError(f"the KV caches have blocks of {self.block_size} tokens but the metadata was built for "
                             f"{metadata.block_size}; build it with build_metadata(..., block_size={self.block_size})")
        return [*inputs.values(), *self.caches, *metadata.tensors()]

    def _output(self, out):
        out = list(out) if isinstance(out, (list, tuple)) else [out]
        return out if self.output is None else out[self.output]

    @contextlib.contextmanager
    def bound(self) -> Iterator[None]:
        """The context a step runs in: the backend bound, Inductor's freezing as the step was compiled with."""
        with use_backend(self.backend), inductor_freezing(self.program._freezing):
            yield

    def prepare(self, steps: Sequence[tuple[dict, AttentionMetadata]]) -> Optional["PreparedSteps"]:
        """These steps (keyword inputs and metadata each) checked once, for a loop that runs them in turn inside
        :meth:`bound` (a run of decode steps whose input ids a buffer takes from the step before): what each call of
        :meth:`__call__` checks, and an ahead-of-time step's input guard, done here for all of them. The inputs'
        tensors must keep their sizes, dtypes and layouts until the steps ran; their values may change. None where
        the compiled step would not take one of them as it is (then each goes through :meth:`__call__`)."""
        step = self.program.graph_module
        calls = []
        for inputs, metadata in steps:
            flat = self._flat(inputs, metadata)
            call = step.prepared(flat) if isinstance(step, AotStep) else _called(step, flat)
            if call is None:
                return None
            calls.append(call)
        return PreparedSteps(self, tuple(calls))


def _called(step: Callable, flat: list) -> Callable[[], object]:
    return lambda: step(*flat)


class PreparedSteps:
    """Steps of a :class:`PagedCall` checked once (:meth:`PagedCall.prepare`): ``run(i)`` runs step ``i`` and returns
    what the call returns, inside ``PagedCall.bound()``."""

    __slots__ = ("call", "calls")

    def __init__(self, call: PagedCall, calls: tuple):
        self.call, self.calls = call, calls

    def run(self, i: int):
        return self.call._output(self.calls[i]())


class RewrittenModel(nn.Module):
    """A model whose attention runs through pagedattn.

    Called like the original model it runs in *drop-in* mode (same outputs); inside
    ``pagedattn.runtime.paged_context(caches, metadata)`` it runs in *paged* mode with ``backend``.
    """

    def __init__(self, dropin: Optional[GraphModule], paged: nn.Module, in_spec, out_spec, report: list[dict],
                 cache_specs: list[CacheSpec], backend: AttentionBackend, block_size: int,
                 example_inputs: Optional[list] = None, info: Optional[ModelInfo] = None):
        super().__init__()
        self.dropin_module = dropin
        self.graph_module = paged
        self.in_spec, self.out_spec = in_spec, out_spec
        self.report = report
        self.cache_specs = cache_specs
        self.backend = backend
        self.block_size = block_size
        self.example_inputs = example_inputs
        self.info = info or ModelInfo()
        self.graph_views: Optional[dict] = None  # see pagedattn.inspection.graph_views
        # input sizes torch.export fixed to the example's (a forward looping over tokens in Python):
        # {flat input index: {dim: size}}; other sizes are traced again by ``retrace``, like recompiles
        self.static_sizes: dict[int, dict[int, int]] = {}
        self.retrace: Optional[Callable[[tuple, dict], "RewrittenModel"]] = None
        self._variants: dict[tuple, "RewrittenModel"] = {}
        # flat input index -> name of inputs whose values the rewritten masks read as positions: proven for
        # positions that count up by one along each row, which drop-in calls must keep to
        self.position_inputs: dict[int, str] = {}
        # padding inputs the rewritten masks read: 0/1 masks, some established for one run of keys per row
        self.padding_inputs: dict[int, tuple[str, bool]] = {}
        # flat input index -> how rewritten masks read it as per-request values (token types, a prefix length):
        # at most one input; in paged mode the graph takes the step's values (paged_context's position_values)
        self.value_inputs: dict[int, position_mod.ValueSpec] = {}
        self._exported: Optional[torch.export.ExportedProgram] = None
        # every input size of the paged graph is at least this (a loaded program: torch.export specialises
        # sizes 0 and 1, so its graph checks that the others are >= 2); 0: any size
        self.min_sizes = 0
        self._freezing = False  # see compile_paged
        self._skipped = [f"{r['name']}: {r['reason']}" for r in report
                         if r["status"] != "rewritten" and r.get("attention", True)]
        # rewritten for the drop-in, which sees the whole sequence, but a KV cache cannot serve them
        self._sees_later_keys = sites_seeing_later_keys(report)
        # where the graph combines tokens outside attention (``token_locality``): paged mode refuses it
        self.paged_refusal: Optional[str] = None
        # where token_locality could not follow the graph (an op, an indexing it does not know): not shown either way
        self.locality_unproven: Optional[str] = None
        # an encoder-decoder's decoder step: the last num_cross_sites of cache_specs are cross-attention
        # caches, filled once per request by cross_writer (see write_cross_kv)
        self.num_cross_sites = 0
        self.cross_writer: Optional[GraphModule] = None
        self._keyword_spec: Optional[tuple] = None  # (in_spec, its keyword names): see _keyword_leaves
        self._output_index: Optional[tuple] = None  # ((out_spec, variants?, name), index): see output_index

    @property
    def target(self) -> str:
        """The device type the paged graph runs on."""
        return self.backend.device_type

    @property
    def num_sites(self) -> int:
        return len(self.cache_specs)

    @property
    def value_spec(self) -> Optional[position_mod.ValueSpec]:
        """How the rewritten masks read per-request values (a prefix-LM mask's token types), or None."""
        return next(iter(self.value_inputs.values()), None)

    @property
    def input_names(self) -> set[str]:
        """Keyword inputs the program was traced with."""
        try:
            kwargs = self.in_spec.child(1) if hasattr(self.in_spec, "child") else self.in_spec.children_specs[1]
            return set(kwargs.context)  # (args, kwargs) -> kwargs keys
        except Exception:  # no spec (a loaded program whose spec did not load), or positional inputs
            return {"input_ids"}

    # --- running

    def flatten_inputs(self, args, kwargs) -> list:
        names = self._keyword_leaves()
        if names is not None and not args and kwargs and tuple(kwargs) == names and \
                all(isinstance(v, torch.Tensor) or type(v) in _SCALARS for v in kwargs.values()):
            return list(kwargs.values())  # what pytree gives for these, without its ~25 us a call
        flat, spec = pytree.tree_flatten((args, kwargs or {}))
        if self.in_spec is not None and spec != self.in_spec:
            raise TypeError(
                "the rewritten model was traced with a different argument structure; call it with the same "
                "positional and keyword arguments as the example given to rewrite() "
                f"(expected {self.in_spec}, got {spec})")
        return flat

    def _keyword_leaves(self) -> Optional[tuple]:
        """The keyword inputs' names, in order, where the traced inputs are keyword inputs alone, each one leaf (a
        tensor or a scalar): a call passing those names in that order, with such values, flattens to its values."""
        spec = self.in_spec
        if self._keyword_spec is not None and self._keyword_spec[0] is spec:
            return self._keyword_spec[1]
        names = None
        try:
            args, kwargs = _spec_children(spec)
            if spec.type is tuple and args.num_leaves == 0 and kwargs.type is dict and \
                    all(c.is_leaf() for c in _spec_children(kwargs)):
                names = tuple(kwargs.context)
        except Exception:  # no spec, or one of another shape: the pytree path decides
            names = None
        self._keyword_spec = (spec, names)
        return names

    def _unflatten(self, out):
        out = list(out) if isinstance(out, (list, tuple)) else [out]
        return pytree.tree_unflatten(out, self.out_spec) if self.out_spec is not None else tuple(out)

    def output_index(self, name: str) -> Optional[int]:
        """Where :meth:`forward_flat`'s list holds the output field ``name`` (a ``ModelOutput``'s or a dict's key)
        when that field is one tensor; None otherwise (then read it from ``forward``'s output)."""
        key = (self.out_spec, bool(self.static_sizes), name)
        known = self._output_index
        if known is not None and known[0][0] is key[0] and known[0][1:] == key[1:]:
            return known[1]
        at = self._find_output(name)
        self._output_index = (key, at)
        return at

    def _find_output(self, name: str) -> Optional[int]:
        spec = self.out_spec
        try:
            keys = list(spec.context) if isinstance(spec.context, (list, tuple)) else []
            if name not in keys or self.static_sizes:  # a variant traced again may order its outputs otherwise
                return None
            children = _spec_children(spec)
            i = keys.index(name)
            return sum(c.num_leaves for c in children[:i]) if children[i].is_leaf() else None
        except Exception:
            return None

    def forward(self, *args, **kwargs):
        runner, out = self._run(args, kwargs)
        return runner._unflatten(out)

    def forward_flat(self, *args, **kwargs) -> list:
        """``forward``'s outputs as the graph returns them, flat (their structure is ``out_spec``), for a caller that
        reads one (:meth:`output_index`) without building the model's output object (a ``ModelOutput`` costs ~40 us,
        a few percent of a small model's decode step)."""
        out = self._run(args, kwargs)[1]
        return list(out) if isinstance(out, (list, tuple)) else [out]

    def _run(self, args, kwargs) -> tuple["RewrittenModel", object]:
        """The program that ran (this one or a variant traced for other sizes) and its flat outputs."""
        flat = self.flatten_inputs(args, kwargs)
        if self.static_sizes and not fits_static_sizes(flat, self.static_sizes):
            return self._variant(flat, args, kwargs)._run(args, kwargs)
        ctx = current_context()
        if ctx is None:
            if self.dropin_module is None:
                raise RuntimeError("this rewritten program was loaded from disk and runs in paged mode only: "
                                   "call it inside pagedattn.runtime.paged_context(...) or through PagedEngine")
            check_positions(flat, self.position_inputs)
            check_padding(flat, self.padding_inputs)
            check_values(flat, self.value_inputs)
            return self, self.dropin_module(*flat)
        refuse_if_unpaged(self._skipped, self._sees_later_keys, self.paged_refusal)
        with use_backend(ctx.backend or self.backend), inductor_freezing(self._freezing):
            if not self.num_sites:  # nothing paged (a state-space model): the graph takes no caches or metadata
                return self, self.graph_module(*flat)
            return self, self.graph_module(*flat, *ctx.graph_inputs(
                self.num_sites, cross=self.num_cross_sites > 0, values=bool(self.value_inputs)))

    def paged_call(self, kv_caches: Sequence[torch.Tensor], backend: Optional[AttentionBackend] = None,
                   output: Optional[str] = None) -> Optional["PagedCall"]:
        """This program's paged step bound to ``kv_caches`` (and ``backend``, default its own; ``output``: the name of
        the one output its calls return, as :meth:`output_index` finds it, default all of them): a
        :class:`PagedCall` runs what a call inside ``paged_context(kv_caches, metadata, backend)`` runs, with what
        does not change between steps checked here once. None where a step needs more than keyword inputs, caches
        and metadata: inputs traced as another structure, sizes traced again (``static_sizes``), cross-attention,
        per-request mask values, no paged site, attention left dense (whose refusal the context's call gives), or an
        ``output`` it cannot find."""
        names = self._keyword_leaves()
        at = None if output is None else self.output_index(output)
        if names is None or self.static_sizes or self.num_cross_sites or self.value_inputs or self._skipped or \
                self._sees_later_keys or self.paged_refusal or not self.num_sites or (output is not None and at is None):
            return None
        caches = tuple(kv_caches)
        if len(caches) != self.num_sites:
            raise ValueError(f"the rewritten model has {self.num_sites} attention sites but {len(caches)} KV caches "
                             "were given; allocate one cache per site (RewrittenModel.allocate_kv_caches)")
        backend = backend or self.backend
        return PagedCall(self, names, caches, backend, cache_block_size(caches, backend), at)

    def write_cross_kv(self, encoder_inputs: dict, kv_caches, slot_mapping: torch.Tensor) -> None:
        """Write the cross-attention K/V of a padded encoder batch into the cross-attention caches.

        ``encoder_inputs`` maps the encoder input names the program was rewritten with to ``[B, L, ...]``
        tensors; ``kv_caches`` are all of the program's caches (as ``allocate_kv_caches`` gives them);
        ``slot_mapping [B * L]`` places every encoder token (-1: padding), see ``cross_slot_mapping``.
        """
        if self.cross_writer is None:
            raise ValueError("this program has no cross-attention sites to write")
        names = [n.name for n in self.cross_writer.graph.nodes if n.op == "placeholder"]
        cross = list(kv_caches)[self.num_sites - self.num_cross_sites:self.num_sites]
        if len(list(kv_caches)) != self.num_sites:
            raise ValueError(f"write_cross_kv: {len(list(kv_caches))} caches for a program of {self.num_sites} sites")
        args = [encoder_inputs[n] for n in names[:len(names) - self.num_cross_sites - 1]]
        with torch.no_grad(), use_backend(self.backend), inductor_freezing(self._freezing):
            self.cross_writer(*args, *cross, slot_mapping)

    def _variant(self, flat: list, args, kwargs) -> "RewrittenModel":
        """The model rewritten again for these input sizes (its traced program fixed some)."""
        key = tuple(tuple(flat[i].shape) for i in sorted(self.static_sizes))
        if key not in self._variants:
            fixed = "; ".join(f"input {i} dims {sorted(d)} = {[d[k] for k in sorted(d)]}"
                              for i, d in self.static_sizes.items())
            if self.retrace is None:
                raise ValueError(f"this program was traced for fixed input sizes ({fixed}; the model's forward "
                                 "specialises them, e.g. a Python loop over the tokens) and cannot run others; "
                                 "rewrite the model with pagedattn.rewrite() to get one that traces new sizes")
            log.info("tracing again for input sizes %s: the traced program fixed %s", key, fixed)
            self._variants[key] = self.retrace(args, kwargs)
        return self._variants[key]

    def compile_paged(self, backend: str = "inductor", *, cpu_fp32_matmuls: str = "cache",
                      freeze: Optional[bool] = None, small_linears: Optional[bool] = None,
                      concat_linears: Optional[bool] = None,
                      ahead_of_time: Optional[bool] = None) -> "RewrittenModel":
        """Compile the paged graph (dynamic shapes: one compilation serves every batch shape).

        ``ahead_of_time``: compile the step with AOTInductor into a package run by its C++ runner, kept on disk
        (:mod:`pagedattn.aot_step`): the step's kernels are called without Python (a CPU decode step 7-30 % faster),
        and a later start of the same model, weights and options loads the package instead of compiling again.
        Inputs outside what the package's program takes, and a package that cannot be built, run the step compiled
        with ``torch.compile``. A program loaded from disk is compiled as saved. ``None`` (default): on where it
        applies (a CPU step compiled with Inductor's freezing, without cross-attention or sizes fixed by tracing),
        unless the environment sets ``PAGEDATTN_AHEAD_OF_TIME=0``; ``True`` where it does not apply is an error naming
        why.

        ``freeze``: Inductor's freezing (``torch._inductor.config.freezing``): the weights become constants of
        the compiled graph, which on the CPU repacks the linear layers' weights once for oneDNN
        (``mkldnn._linear_pointwise``), 1.5-2x faster than the default GEMM at decode sizes, at the cost of
        one packed copy of those weights. ``None`` (default): on for Inductor on the CPU. The compiled step
        then ignores later changes to the model's weights, and Dynamo does not guard the graph module's
        attributes (:func:`frozen_step_options`). It applies to steps run without gradients, as the
        engine runs them.

        ``small_linears``: with freezing on the CPU, linears of up to ``cpu_linear.SMALL_ROWS`` rows (decode steps)
        run by pagedattn's native kernel over oneDNN's packed weights, once their layout is proved, and larger ones
        by oneDNN on the same weights (:class:`pagedattn.backends.cpu_linear.SmallLinears`). ``None`` (default): on
        where the native library has the kernel; ``False``: oneDNN and MKL throughout.

        ``concat_linears``: linears that read the same input (q/k/v, gate/up) run as one linear of their summed
        width, their weights made views of one concatenated tensor (:class:`pagedattn.passes.ConcatLinears`): one
        GEMM launch instead of several narrow ones, for a GPU's decode steps. ``None`` (default): on for Inductor on
        CUDA (an H200's decode step at batch 64 2.35 -> 2.04 ms, benchmarks/RESULTS.md), off elsewhere (a CPU
        step's freezing and small-linear kernel take its linears as they are).

        ``cpu_fp32_matmuls``: on a CPU without native bf16/fp16 GEMMs (no AVX512/AMX), run those matmuls
        in fp32 (:class:`pagedattn.passes.Fp32Matmuls`; 3-9x faster there): ``"cache"`` converts their
        weights once and keeps the fp32 copies (4 more bytes per weight element), ``"convert"`` converts
        them on every call (no extra memory, slower at decode sizes), ``"off"`` leaves the matmuls as they are.
        """
        if cpu_fp32_matmuls not in ("cache", "convert", "off"):
            raise ValueError(f"cpu_fp32_matmuls must be 'cache', 'convert' or 'off', got {cpu_fp32_matmuls!r}")
        gm = self.graph_module
        if concat_linears is None:
            concat_linears = backend == "inductor" and self.target == "cuda"
        if concat_linears and isinstance(gm, GraphModule):
            gm = copy_graph_module(gm)
            run_pipeline(gm, PassContext(), (ConcatLinears(),))
        if cpu_fp32_matmuls != "off" and isinstance(gm, GraphModule):  # only matmuls traced on the CPU
            gm = copy_graph_module(gm)
            run_pipeline(gm, PassContext(), (Fp32Matmuls(cache_weights=cpu_fp32_matmuls == "cache"),))
        if freeze is None:
            freeze = backend == "inductor" and self.target == "cpu"
        options = paged_step_options(backend, self.target, freeze=freeze, small_linears=small_linears)

        def jit() -> nn.Module:
            return torch.compile(gm, backend=backend, dynamic=True, options=options)

        def fallback() -> Callable:
            # an ahead-of-time step's fallback, built on its first refused inputs: Dynamo reads freezing as it traces
            compiled = jit()

            def run(*flat):
                with inductor_freezing(freeze):
                    return compiled(*flat)
            return run

        why_not = self._ahead_of_time_refusal(gm, backend, freeze)
        if ahead_of_time and why_not:
            raise ValueError(f"ahead_of_time=True cannot apply: {why_not}; leave it None to compile with torch.compile")
        if ahead_of_time is None:
            ahead_of_time = why_not is None and ahead_of_time_default()
        step = None
        if ahead_of_time:
            try:
                step = self._ahead_of_time_step(gm, options, fallback)
            except Exception as e:  # a program AOTInductor cannot build: the step torch.compile builds serves it
                log.debug("ahead-of-time compilation failed", exc_info=True)
                log.info("the step is compiled with torch.compile: compiling it ahead of time failed (%s: %s)",
                         type(e).__name__, first_line(e)[:300])
        self.graph_module = step if step is not None else jit()
        if self.cross_writer is not None:  # an encoder-decoder's cross-attention K/V projections, once per request
            self.cross_writer = torch.compile(self.cross_writer, backend=backend, dynamic=True, options=options)
        # freezing matters to Dynamo only, as it traces: an ahead-of-time step's fallback sets it itself (~15 us a step)
        self._freezing = freeze and step is None
        return self

    def _ahead_of_time_refusal(self, gm: nn.Module, backend: str, freeze: bool) -> Optional[str]:
        """Why this step cannot be compiled ahead of time, or None where it can."""
        if backend != "inductor" or self.target != "cpu" or not freeze:
            return "it needs a CPU step compiled by Inductor with freezing"
        if self._saved_program(gm) is None and (not isinstance(gm, GraphModule) or self.example_inputs is None):
            return "the step has no traced graph and example inputs to export"
        if self.cross_writer is not None or self.num_cross_sites:
            return "the step has cross-attention, whose writer runs apart from it"
        if self.static_sizes:
            return "the traced program fixed some input sizes"
        if not self.num_sites:
            return "the step has no paged attention"
        return None

    def _saved_program(self, gm: nn.Module) -> Optional[torch.export.ExportedProgram]:
        """The exported program a step loaded from disk (``pagedattn.load``) runs, where ``gm`` is that step as loaded."""
        if self.example_inputs is None and self._exported is not None and not isinstance(gm, GraphModule):
            return self._exported
        return None

    def _ahead_of_time_step(self, gm: nn.Module, options: Optional[dict], fallback: Callable[[], Callable]) -> nn.Module:
        """``gm`` as an :class:`~pagedattn.aot_step.AotStep`: its package loaded from disk, or exported (sizes 0 and 1
        not specialised) and compiled with ``options`` (Dynamo's guard filter aside: no Dynamo runs it) first. A
        program loaded from disk is compiled as it was saved (a file saved before ``save`` exported sizes 0 and 1
        unspecialised takes sizes of at least 2, ``min_sizes``: the engine pads its steps)."""
        from pagedattn.aot_step import (
            GUARD_METADATA,
            InputGuard,
            hinted_inputs,
            load_or_build,
            package_key,
            program_inputs,
        )
        from pagedattn.serialization import export_paged, paged_export_inputs

        aot_options = {k: v for k, v in (options or {}).items() if k != "guard_filter_fn"}
        # a package calls pagedattn's native operators by name: registered before it loads
        native_ops.paged_ops()
        native_ops.linear_op()

        saved = self._saved_program(gm)

        def build(path: str) -> None:
            program = saved if saved is not None else export_paged(self, gm, size_oblivious=True)
            guard = InputGuard.of(program)
            configs = {**aot_options, "aot_inductor.metadata": {GUARD_METADATA: guard.to_json()}}
            kept = program.example_inputs
            if kept is None:  # saving drops them: inputs at the sizes it was exported at
                program.example_inputs = (hinted_inputs(program), {})
            try:
                with torch.no_grad(), inductor_freezing(True), quiet_tracing():
                    torch._inductor.aoti_compile_and_package(program, package_path=path, inductor_configs=configs)
            finally:
                program.example_inputs = kept

        if saved is not None:
            key = package_key(gm, aot_options, program_inputs(saved), program="saved")
        else:
            key = package_key(gm, aot_options, paged_export_inputs(self), program="traced, sizes 0 and 1 not specialised")
        runner, guard, source = load_or_build(key, build)
        log.info("the paged step runs through AOTInductor's runner (package %s, %s)", key, source)
        return AotStep(runner, guard, gm, fallback, source)

    def allocate_kv_caches(self, num_blocks: int, device: Optional[torch.device | str] = None,
                           dtype: Optional[torch.dtype] = None) -> list[torch.Tensor]:
        """One cache per rewritten site, in the layout of the backend for ``device`` (default: the program's)."""
        backend = self.backend
        if device is not None and torch.device(device).type != backend.device_type:
            backend = get_backend(torch.device(device))
        return backend.allocate_kv_caches(self.cache_specs, num_blocks, self.block_size, dtype, device)

    # --- artefacts

    @property
    def exported_program(self) -> torch.export.ExportedProgram:
        """The paged graph as a ``torch.export`` program (inputs: model inputs, caches, metadata), exported without
        specialising sizes 0 and 1 (``export_paged(size_oblivious=True)``): it takes a step of one token, sequence,
        block or row as it is."""
        if self._exported is None:
            from pagedattn.serialization import export_paged

            self._exported = export_paged(self, size_oblivious=True)
        return self._exported

    def save(self, path: str) -> None:
        """Write the paged program to ``path`` (``pagedattn.load`` reads it in any process)."""
        from pagedattn.serialization import save

        save(self, path)

    def print_report(self) -> str:
        from pagedattn.report import site_table

        return site_table(self.report)
