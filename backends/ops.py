"""The custom ops (``torch.ops.pagedattn.*``) and their fake kernels.

The schemas are flat (torch.library needs that): the per-site parameters are the fields of
:class:`~pagedattn.backends.params.AttentionParams`, generated into every schema that takes them,
and each kernel decodes its arguments once into ``AttentionParams`` and (for the paged ops)
:class:`~pagedattn.backends.metadata.AttentionMetadata`. One kernel per op serves every device:
it hands the call to the active backend for the tensors' device (``base.active_backend``).

Conventions shared by every backend:

- ``query`` / ``key`` / ``value`` are flattened over tokens: ``[T, heads, head_size]``;
- ``write_kv_cache`` runs before ``paged_attention`` reads the same step's tokens;
- ``sliding_window <= 0`` means no window, ``softcap <= 0`` no soft-cap.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Optional

import torch
from torch import Tensor
from torch.autograd.graph import increment_version

from pagedattn.backends import cpu_linear, native_ops, position_mod, reference
from pagedattn.backends.base import active_backend, bound_backend
from pagedattn.backends.metadata import AttentionMetadata, too_long, validation_enabled
from pagedattn.backends.params import AttentionParams, params_schema

__all__ = ["write_kv_cache", "write_kv_cache_functional", "paged_attention", "attention", "PARAMS_OFFSET",
           "fake_paged_attention", "fake_write_kv_cache",
           "dropin_values", "forget_prepared_calls"]

_PARAMS = params_schema()
# positional index of the first AttentionParams field in each op's arguments
PARAMS_OFFSET = {"attention": 4, "paged_attention": 7}


# The paged ops run on every step of a serving loop, so they are defined with ``torch.library.Library`` and a
# kernel for CompositeExplicitAutograd: ``torch.library.custom_op``'s Python wrappers (its autograd Function,
# the aliasing check, the in-place version bump in Python) cost ~30-40 us a call on top of the kernel, a few
# percent of a small model's decode step. The dispatcher does not bump a custom op's written tensor's version
# (torch 2.13): the write does it itself, so memos keyed on a cache's version see every write.
_LIB = torch.library.Library("pagedattn", "FRAGMENT")
_LIB.define("write_kv_cache(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()")
_LIB.define("write_kv_cache_functional(Tensor key, Tensor value, Tensor kv_cache, Tensor slot_mapping) -> Tensor")
_LIB.define("paged_attention(Tensor query, Tensor? key, Tensor? value, Tensor kv_cache, Tensor block_tables, "
            f"Tensor seq_lens, Tensor query_start_loc, {_PARAMS}) -> Tensor")


# A serving step calls each paged op once per layer with the same metadata tensors, shapes and parameters, and what
# a call derives from them (its parameters, its checks, the backend's plan) is the same at every layer: ~30 us of
# Python a call against a decode kernel of ~50 us. A backend with ``prepares_calls`` may hand back a prepared call
# for them (``prepare_attend``, ``prepare_write``). It is kept per thread, keyed by the metadata tensors themselves
# (the same objects, unchanged: their versions) and by everything the checks read (backend, shapes, strides,
# dtypes, devices, parameters); a later call that matches runs it directly. Parameters holding tensors are never
# prepared (they would be compared by value); full validation (``validation_enabled``) always takes the slow path.
_PREPARED = threading.local()
_PREPARED_ENTRIES = 4  # an encoder-decoder step alternates its self- and cross-attention metadata


def _prepared(kind: str, tensors: tuple, signature: tuple):
    for entry in getattr(_PREPARED, kind, ()):
        if all(a is b for a, b in zip(entry[0], tensors)) and entry[1] == signature:
            return entry[2]
    return None


def _keep_prepared(kind: str, tensors: tuple, signature: tuple, run) -> None:
    memo = _PREPARED.__dict__.setdefault(kind, [])
    memo.insert(0, (tensors, signature, run))
    del memo[_PREPARED_ENTRIES:]


def forget_prepared_calls() -> None:
    """Drop this thread's prepared calls: later calls ask their backend again (for instrumentation that wraps a
    backend's methods mid-run; serving never needs it). The C++ stand-ins of the ops ask the bound backend again too
    (a method wrapped on it is no longer its own: they leave its calls to it)."""
    _PREPARED.__dict__.clear()
    native_ops.ask_backend_again(bound_backend())


def _write_signature(backend, key: Tensor, value: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> tuple:
    return (backend, slot_mapping._version, slot_mapping.shape, slot_mapping.dtype, slot_mapping.device,
            slot_mapping.stride(), key.shape, key.dtype, key.device, key.stride(), value.shape, value.dtype,
            value.device, value.stride(), kv_cache.shape, kv_cache.dtype, kv_cache.device, kv_cache.stride())


def _attend_signature(backend, query: Tensor, key: Optional[Tensor], kv_cache: Tensor, block_tables: Tensor,
                      seq_lens: Tensor, query_start_loc: Tensor, params: tuple) -> tuple:
    return (backend, block_tables._version, seq_lens._version, query_start_loc._version, block_tables.shape,
            block_tables.dtype, block_tables.device, block_tables.stride(), seq_lens.shape, seq_lens.dtype,
            seq_lens.device, query_start_loc.shape, query_start_loc.dtype, query_start_loc.device, query.shape,
            query.dtype, query.device, query.stride(), kv_cache.shape, kv_cache.dtype, kv_cache.device,
            kv_cache.stride(), key is None, params)


def write_kv_cache(key: Tensor, value: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write the new tokens' K ``[T, Hkv, D]`` and V into ``kv_cache`` at ``slot_mapping`` (-1 skips)."""
    _write(key, value, kv_cache, slot_mapping)
    if not kv_cache.is_inference():  # an inference tensor has no version to bump
        increment_version(kv_cache)


def _write(key: Tensor, value: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
    backend = active_backend(kv_cache.device)
    full = validation_enabled()
    prepare = backend.prepares_calls and not full
    signature = _write_signature(backend, key, value, kv_cache, slot_mapping) if prepare else None
    run = _prepared("write", (slot_mapping,), signature) if prepare else None
    if run is not None:
        run(key, value, kv_cache)
        return
    backend.check_write(key, value, kv_cache, slot_mapping, full=full)
    run = backend.prepare_write(key, value, kv_cache, slot_mapping) if prepare else None
    if run is None:
        backend.write(key, value, kv_cache, slot_mapping)
        return
    _keep_prepared("write", (slot_mapping,), signature, run)
    run(key, value, kv_cache)


def write_kv_cache_functional(key: Tensor, value: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> Tensor:
    """Like :func:`write_kv_cache` but returns the updated cache and leaves the input untouched."""
    out = kv_cache.clone()
    write_kv_cache(key, value, out, slot_mapping)
    return out


def paged_attention(query: Tensor, key: Optional[Tensor], value: Optional[Tensor], kv_cache: Tensor,
                    block_tables: Tensor, seq_lens: Tensor, query_start_loc: Tensor, *params) -> Tensor:
    """Attention of every new token over its sequence's cached keys, in one call.

    ``query`` is ``[T, Hq, D]``; sequence ``i`` owns rows ``query_start_loc[i]:query_start_loc[i+1]``
    and has ``seq_lens[i]`` keys in total (its new tokens included, causal aligned bottom-right).
    ``key``/``value`` are the new tokens' K/V (``None`` when the step has none, e.g. cross-attention
    over a cache filled once); backends may read them directly instead of the cache. ``params`` are
    the fields of ``AttentionParams``. Returns ``[T, Hq, head_size_v]``; rows past
    ``query_start_loc[-1]`` (padding) are zero.
    """
    if (key is None) != (value is None):
        raise ValueError("paged_attention: key and value are the step's new K/V, both given or both None (a step "
                         "without new keys); got only one of them")
    backend = active_backend(kv_cache.device)
    full = validation_enabled()
    prepare = backend.prepares_calls and not full
    tensors = (block_tables, seq_lens, query_start_loc)
    signature = _attend_signature(backend, query, key, kv_cache, *tensors, params) if prepare else None
    run = _prepared("attend", tensors, signature) if prepare else None
    if run is not None:
        return run(query, key, value, kv_cache)
    p = AttentionParams.from_args(params)
    meta = AttentionMetadata(None, block_tables, seq_lens, query_start_loc, backend.cache_geometry(kv_cache)[1])
    backend.check_attend(query, kv_cache, meta, p, full=full)
    run = backend.prepare_attend(query, key, kv_cache, meta, p) \
        if prepare and not any(isinstance(a, Tensor) for a in params) else None
    if run is None:
        return backend.attend(query, key, value, kv_cache, meta, p)
    _keep_prepared("attend", tensors, signature, run)
    return run(query, key, value, kv_cache)


class _InferenceOnly(torch.autograd.Function):
    """Passes paged attention's output through; its backward refuses with the reason."""

    @staticmethod
    def forward(ctx, out, *inputs):
        return out.view_as(out)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("pagedattn: paged attention is inference-only (the KV cache is written in place); "
                           "train or fine-tune the rewritten model in drop-in mode, outside paged_context")


def _paged_attention_autograd(*args) -> Tensor:
    with torch._C._AutoDispatchBelowAutograd():
        out = torch.ops.pagedattn.paged_attention.default(*args)
    if not torch.is_grad_enabled():  # serving: no scan of the ~30 arguments
        return out
    inputs = [t for t in args if isinstance(t, Tensor) and t.requires_grad]
    return _InferenceOnly.apply(out, *inputs) if inputs else out


def fake_paged_attention(query, key, value, kv_cache, block_tables, seq_lens, query_start_loc, *params, **named):
    """``paged_attention``'s fake kernel (its output's shape), also its C++ stand-in's (``native_ops``)."""
    p = AttentionParams.from_args(params) if not named else AttentionParams(*params, **named)
    return query.new_empty((query.shape[0], query.shape[1], p.head_size_v))


def fake_write_kv_cache(key, value, kv_cache, slot_mapping) -> None:
    """``write_kv_cache``'s fake kernel (nothing to return), also its C++ stand-in's."""
    return None


# Dynamo must not trace into a kernel that runs eagerly inside a compiled region (a graph an eager backend hands
# back to Dynamo runs with its frame hook set)
_LIB.impl("write_kv_cache", torch.compiler.disable(write_kv_cache), "CompositeExplicitAutograd")
_LIB.impl("write_kv_cache_functional", torch.compiler.disable(write_kv_cache_functional), "CompositeExplicitAutograd")
_LIB.impl("paged_attention", torch.compiler.disable(paged_attention), "CompositeExplicitAutograd")
_LIB.impl("paged_attention", torch.compiler.disable(_paged_attention_autograd), "Autograd")
torch.library.register_fake("pagedattn::write_kv_cache", fake_write_kv_cache, lib=_LIB)
torch.library.register_fake("pagedattn::write_kv_cache_functional",
                            lambda key, value, kv_cache, slot_mapping: torch.empty_like(kv_cache), lib=_LIB)
torch.library.register_fake("pagedattn::paged_attention", fake_paged_attention, lib=_LIB)


# ---------------------------------------------------------------- a serving step's linears on the CPU

# Put in place of oneDNN's and MKL's linears by an Inductor pass over a frozen CPU step (pagedattn.backends.cpu_linear),
# never by the rewrite: ``x [..., K] @ weight [N, K].T (+ bias [N])``, the weight oneDNN-packed with its buffer in
# ``layout``, or plain; its kernel is cpu_linear.linear. A oneDNN-packed weight dispatches on MkldnnCPU.
_LIB.define("linear(Tensor x, Tensor weight, Tensor? bias, int layout) -> Tensor")
_linear_kernel = torch.compiler.disable(cpu_linear.linear)
_LIB.impl("linear", _linear_kernel, "CPU")
_LIB.impl("linear", _linear_kernel, "MkldnnCPU")
torch.library.register_fake("pagedattn::linear",
                            lambda x, weight, bias, layout: x.new_empty((*x.shape[:-1], weight.shape[0])), lib=_LIB)


# ---------------------------------------------------------------- canonical attention


@torch.library.custom_op(
    "pagedattn::attention", mutates_args=(),
    schema=f"(Tensor query, Tensor key, Tensor value, Tensor? key_padding, {_PARAMS}) -> Tensor")
def attention(query: Tensor, key: Tensor, value: Tensor, key_padding: Optional[Tensor], *params) -> Tensor:
    """Dense attention as the rewriter proved a site computes: the drop-in form of a site.

    ``query [B, Hq, S, D]``, ``key/value [B, Hkv, L, D]``; the ``S`` queries are the last ``S`` of
    ``L`` positions; ``key_padding [B, L]`` is nonzero for keys that may be seen. Semantics:
    :mod:`pagedattn.backends.reference`. Returns ``[B, Hq, S, Dv]``.
    """
    present = None if key_padding is None else key_padding != 0
    p = AttentionParams.from_args(params)
    if 0 < p.max_seq_len < key.shape[2]:
        raise ValueError(f"pagedattn::attention: {key.shape[2]} keys: {too_long(p.max_seq_len)}")
    values = dropin_values(p, key.shape[2])
    q_pos = k_pos = None
    if p.positions_from_first_key and present is not None and present.dim() == 2:
        L, Q = key.shape[2], query.shape[2]
        first = (present.cumsum(-1) == 0).sum(-1, keepdim=True)  # [B, 1] left-padding keys
        q_pos = reference.query_positions(L, Q, key.device)[None] - first  # [B, Q]
        k_pos = torch.arange(L, device=key.device)[None] - first  # [B, L]
    return reference.dense_attention(query, key, value, p, q_pos=q_pos, k_pos=k_pos, key_present=present,
                                     values=values)


def dropin_values(p: AttentionParams, num_keys: int) -> Optional[Tensor]:
    """A drop-in call's per-row values for a program that reads some, from the model input it reads them
    from (``position_data``): ``ValueError`` for an input of a shape its proof did not cover."""
    spec = position_mod.value_spec(p.position_mod)
    if spec is None:
        return None
    if p.position_data is None:
        raise ValueError(f"pagedattn::attention: the site's mask reads input {spec.input!r}, which was not given")
    data = p.position_data
    if spec.kind == "runs" and data.dim() == 2 and data.shape[-1] != num_keys:
        raise ValueError(f"pagedattn::attention: input {spec.input!r} has {data.shape[-1]} tokens per row but the "
                         f"attention has {num_keys} keys")
    return position_mod.values_from_input(spec, data)


@attention.register_fake
def _(query, key, value, key_padding, *params):
    return query.new_empty((*query.shape[:-1], value.shape[-1]))


# ------------------------------------------------------------------------- autograd
# The drop-in op differentiates the reference itself (exact float32 math), so training and
# fine-tuning through a rewritten graph get the gradients the original model would.

def _attention_setup(ctx, inputs, output):
    query, key, value, key_padding, *params = inputs
    p = AttentionParams.from_args(params)
    ctx.save_for_backward(query, key, value, key_padding, p.alibi_slopes, p.sinks)
    ctx.params = dataclasses.replace(p, alibi_slopes=None, sinks=None)  # tensors travel as saved tensors


def _attention_backward(ctx, grad):
    query, key, value, key_padding, alibi, sinks = ctx.saved_tensors
    leaves = [t.detach().requires_grad_(need) for t, need in zip((query, key, value), ctx.needs_input_grad[:3])]
    sinks_at = PARAMS_OFFSET["attention"] + [f.name for f in dataclasses.fields(AttentionParams)].index("sinks")
    sink_leaf = None if sinks is None else sinks.detach().requires_grad_(ctx.needs_input_grad[sinks_at])
    p = dataclasses.replace(ctx.params, alibi_slopes=alibi, sinks=sink_leaf)
    wrt = [t for t in (*leaves, sink_leaf) if t is not None and t.requires_grad]
    with torch.enable_grad():
        out = reference.dense_attention(*leaves, p, key_present=None if key_padding is None else key_padding != 0,
                                        exact=True, values=dropin_values(p, key.shape[2]))
        grads = iter(torch.autograd.grad(out, wrt, grad, allow_unused=True)) if wrt else iter(())
    gq, gk, gv, gsinks = (next(grads) if t is not None and t.requires_grad else None for t in (*leaves, sink_leaf))
    # one gradient per input: (query, key, value, key_padding, *AttentionParams fields)
    return (gq, gk, gv, None, *(gsinks if f.name == "sinks" else None for f in dataclasses.fields(AttentionParams)))


attention.register_autograd(_attention_backward, setup_context=_attention_setup)
