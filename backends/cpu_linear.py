"""A serving step's linear layers on the CPU: the native kernel for few rows, oneDNN for many.

Inductor's freezing packs each frozen linear weight for oneDNN (``mkldnn._linear_pointwise``). At decode sizes
(one row per running sequence) oneDNN pays ~10 us of set-up per call and reads the weights from DRAM at well under
the copy rate: on llama16m bf16, 16 rows, the step's 25 linears took ~1.2 ms against ~0.54 ms for their weights at
the copy rate. :class:`SmallLinears`, an Inductor post-grad pass for a step compiled with freezing, turns each plain
``mkldnn._linear_pointwise`` (no fused activation) over a frozen packed weight into ``pagedattn::linear`` over the
same packed weight, once it has proved the weight's layout: its buffer's bytes equal the weight's own, unpacked,
laid out as the kernel reads them (:func:`pagedattn.backends.native.to_panels`: panels of 64 columns, oneDNN's
AVX-512 layouts, or for bfloat16 of 32, its AMX layout, which the kernel reads by AMX tiles where it may) or
plainly. A weight in any other layout keeps oneDNN. :func:`linear` runs calls of at most
:data:`SMALL_ROWS` rows with ``csrc/small_linear.c`` and larger ones with oneDNN on the same packed weight, so
prefills are unchanged and memory holds one packed copy, as before. The pass runs before Inductor's own post-grad
passes, so a residual add that oneDNN would have fused into the call becomes part of Inductor's next fused kernel.
A float32 step of a static number of rows (a step of one token) gets MKL's packed linears from Inductor instead
(``mkl._mkl_linear``, which also holds the plain weight): those of up to :data:`SMALL_ROWS` rows take the plain
weight natively (llama16m fp32 at one request: the 25 linears 1.84 → 1.27 ms, the step 3.27 → 2.53 ms).

Numerics: float32 sums and one rounding to the output dtype, as oneDNN's; only the order of the sums differs.
"""

from __future__ import annotations

import hashlib
import logging
from importlib import resources
from typing import Optional

import torch
from torch import Tensor

from pagedattn.backends import native, native_ops
from pagedattn.backends.metadata import validation_enabled

log = logging.getLogger("pagedattn")

__all__ = ["SMALL_ROWS", "linear", "onednn_rows", "SmallLinears", "small_linears_available", "proven_layout",
           "packed_weight_key", "mkl_linear_targets", "plain_rows_name", "restore_plain_rows"]

# Rows up to which a dtype's calls take the native kernel. On a 2-core EPYC (Zen 5), llama16m's 25 linears from DRAM,
# panels against oneDNN on the same packed weights: bf16 0.85 against 1.23 ms at 16 rows, 3.70 against 4.01 at 128;
# fp32 1.52 against 1.89 at 16, 6.86 against 7.43 at 128 (benchmarks/RESULTS.md)
SMALL_ROWS = {torch.bfloat16: 128, torch.float32: 128}


def small_linears_available(dtype: torch.dtype) -> bool:
    """Whether the native library has the small-row linear kernel for ``dtype`` on this machine."""
    lib = native.library()
    return lib is not None and dtype in native.linear_dtypes(lib)


def proven_layout(packed: Tensor) -> Optional[int]:
    """The layout (``native.LINEAR_PANELS``, ``LINEAR_PANELS32`` for bfloat16, or ``LINEAR_PLAIN``) that a
    oneDNN-packed weight's buffer holds, proved by comparing every byte with the weight's values laid out so; None for
    any other."""
    if not packed.is_mkldnn or packed.dim() != 2 or packed.dtype not in (torch.float32, torch.bfloat16):
        return None
    raw = native.onednn_bytes(packed)
    dense = packed.to_dense()  # a layout change: exact
    panels = (native.LINEAR_PANELS, native.LINEAR_PANELS32) if dense.dtype == torch.bfloat16 else \
        (native.LINEAR_PANELS,)
    for layout in panels:
        columns = native.PANEL_COLUMNS[layout]
        if raw.numel() == native.linear_panel_bytes(dense, columns) and \
                torch.equal(raw, native.to_panels(dense, columns).view(torch.uint8)):
            return layout
    if raw.numel() == dense.numel() * dense.element_size() and torch.equal(raw, dense.contiguous().view(-1).view(
            torch.uint8)):
        return native.LINEAR_PLAIN
    return None


def packed_weight_key(packed: Tensor) -> tuple:
    """What a compiled step may depend on in a oneDNN-packed weight: its logical shape, its dtype and the layout its
    bytes are proved to hold (None: another). Inductor's FX graph cache keys a frozen packed weight by this (see
    :mod:`pagedattn.inductor_cache`), so a cached step is reused only where :class:`SmallLinears` would decide as
    it did."""
    return ("onednn packed", tuple(packed.shape), str(packed.dtype), proven_layout(packed))


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], layout: int) -> Tensor:
    """``pagedattn::linear``'s CPU kernel: ``x [..., K] @ weight[N, K].T + bias``, ``weight`` a oneDNN-packed tensor
    whose buffer holds ``layout`` (:func:`proven_layout`) or a plain contiguous one (``native.LINEAR_PLAIN``).
    ``PAGEDATTN_NATIVE=0`` applies when a step is compiled (the pass then leaves oneDNN's calls as they are)."""
    k = x.shape[-1]
    if (x.numel() // k if k else 0) <= SMALL_ROWS.get(x.dtype, 0):
        lib = native.load()
        if lib is not None:
            if weight.is_mkldnn and validation_enabled() and proven_layout(weight) != layout:
                raise ValueError(f"pagedattn::linear: the weight's buffer does not hold layout {layout}")
            out = native.linear(lib, x, weight, bias, torch.get_num_threads(), layout)
            if out is not None:
                return out
    # oneDNN reads a bias as contiguous whatever its strides (torch 2.13): one with gaps goes as a contiguous copy
    bias = None if bias is None else bias.contiguous()
    rows = x.numel() // k if k else 0
    padded = onednn_rows(rows)
    if x.dtype in (torch.bfloat16, torch.float16) and padded != rows:
        xp = x.new_zeros((padded, k))  # [Mp, K]
        xp[:rows] = x.reshape(rows, k)
        out = torch.ops.mkldnn._linear_pointwise(xp, weight, bias, "none", [], "")[:rows]
        return out.view(*x.shape[:-1], out.shape[1])
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def onednn_rows(rows: int) -> int:
    """The rows a bfloat16 or float16 call of ``rows`` goes to oneDNN with: more than 64 padded with zero rows to one
    of 8 sizes an octave (at most 1/8 more). oneDNN builds a GEMM for every new number of rows, and in bfloat16 on a
    Xeon with AMX that costs ~6 ms against ~2 ms to run a 1000 x 384 x 2048 one, while a serving loop's steps come in
    every size (``csrc/linear_op.cpp`` pads alike)."""
    if rows <= 64:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


def _pass_fingerprint() -> str:
    source = resources.files("pagedattn.backends")
    h = hashlib.sha256()
    for name in ("cpu_linear.py", "native.py", "csrc/small_linear.c", "csrc/small_linear_avx2.h"):
        h.update(source.joinpath(name).read_bytes())
    h.update(native_ops.source_digest())
    h.update(b"c++ operator" if native_ops.linear_op() is not None else b"python kernel")  # the op the graph calls
    lib = native.library()  # what the pass may swap on this machine: the kernel's dtypes and their layouts
    for dtype in sorted(SMALL_ROWS, key=str):
        usable = small_linears_available(dtype)
        h.update(f"{dtype}:{usable}:{sorted(native.linear_layouts(lib, dtype)) if usable else ()}".encode())
    return h.hexdigest()


def _swappable(gm: torch.fx.GraphModule, node: torch.fx.Node) -> Optional[Tensor]:
    """The packed weight of a ``mkldnn._linear_pointwise`` node the pass may swap, else None."""
    if len(node.args) != 6 or node.kwargs:
        return None
    x, weight, bias, attr, _, _ = node.args
    if attr != "none" or not isinstance(weight, torch.fx.Node) or weight.op != "get_attr" \
            or not (bias is None or isinstance(bias, torch.fx.Node)):
        return None
    w = getattr(gm, weight.target, None)
    return w if isinstance(w, Tensor) and w.is_mkldnn and w.dim() == 2 else None


try:
    from torch._inductor.custom_graph_pass import CustomGraphPass
except ImportError:  # pragma: no cover - torch without Inductor's custom passes
    CustomGraphPass = object


def mkl_linear_targets() -> tuple:
    """MKL's packed float32 linear (Inductor's choice for a static number of rows), as the graph may name it."""
    op = getattr(getattr(torch.ops, "mkl", None), "_mkl_linear", None)
    return () if op is None else (op, op.default)


def _mkl_swappable(gm: torch.fx.GraphModule, node: torch.fx.Node) -> Optional[Tensor]:
    """The plain weight of a ``mkl._mkl_linear`` node the pass may swap (a frozen constant, at most
    :data:`SMALL_ROWS` static rows), else None."""
    if len(node.args) != 5 or node.kwargs:
        return None
    _, _, original, bias, rows = node.args
    if not (isinstance(original, torch.fx.Node) and original.op == "get_attr") or not isinstance(rows, int) \
            or not (bias is None or isinstance(bias, torch.fx.Node)):
        return None
    w = getattr(gm, original.target, None)
    ok = isinstance(w, Tensor) and not w.is_mkldnn and w.dim() == 2 and rows <= SMALL_ROWS.get(w.dtype, 0)
    return w if ok else None


def _replace(graph: torch.fx.Graph, node: torch.fx.Node, x, weight, bias, layout: int) -> None:
    op = native_ops.linear_op() or torch.ops.pagedattn.linear.default  # the same kernel, without Python where built
    with graph.inserting_before(node):
        call = graph.call_function(op, (x, weight, bias, layout))
    call.meta.update(node.meta)
    node.replace_all_uses_with(call)
    graph.erase_node(node)


def _drop_unread_attributes(gm: torch.fx.GraphModule, names) -> None:
    """The constants no node reads any more, out of the graph and the module (their memory freed)."""
    graph = gm.graph
    for name in set(names):
        for node in list(graph.find_nodes(op="get_attr", target=name)):
            if not node.users:
                graph.erase_node(node)
        if not graph.find_nodes(op="get_attr", target=name) and hasattr(gm, name):
            delattr(gm, name)


_PLAIN_ROWS = "_pagedattn_plain_rows"


def plain_rows_name(weight: str) -> str:
    """The attribute holding the contiguous ``[N, K]`` copy of MKL's plain weight ``weight`` that
    :class:`SmallLinears` gives the native kernel where Inductor keeps that weight transposed."""
    return weight + _PLAIN_ROWS


def _register_plain_rows(gm: torch.fx.GraphModule, name: str, weight: Tensor) -> None:
    from torch._inductor.freezing_utils import enter_freezing, maybe_set_is_frozen_param

    rows = weight.contiguous()
    # a frozen parameter: Inductor's FX graph cache then stores its name, never its values, and a step loaded from the
    # cache takes it from the module it is loaded for (restore_plain_rows makes it there)
    with enter_freezing():
        maybe_set_is_frozen_param(rows)
    gm.register_buffer(name, rows)


def restore_plain_rows(gm: torch.fx.GraphModule, names) -> None:
    """Make the plain-row weights (:func:`plain_rows_name`) among ``names`` that ``gm`` lacks from the weights they
    copy, as :class:`SmallLinears` made them: a step loaded from Inductor's FX graph cache reads them, and the pass
    does not run for it. Names of any other kind are left alone."""
    for name in names:
        if not name.endswith(_PLAIN_ROWS) or hasattr(gm, name):
            continue
        weight = getattr(gm, name.removesuffix(_PLAIN_ROWS), None)
        if isinstance(weight, Tensor) and weight.dim() == 2 and not weight.is_mkldnn:
            _register_plain_rows(gm, name, weight)


class SmallLinears(CustomGraphPass):
    """Inductor post-grad pass (``post_grad_custom_pre_pass``): plain oneDNN linears over frozen weights become
    ``pagedattn::linear`` (see the module's docstring), and so do MKL's float32 linears over a static number of rows
    up to :data:`SMALL_ROWS` (Inductor's choice for a step of one token), over their plain weight (made contiguous
    once where Inductor keeps it transposed; MKL's packed copy is then dropped). Weights of a dtype not in
    :data:`SMALL_ROWS`, or that the native library has no kernel for on this machine, stay as they are."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        from torch._guards import detect_fake_mode
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        gm = graph.owning_module
        layouts: dict[str, Optional[int]] = {}  # weight attribute -> its proved layout
        swapped = 0
        for node in list(graph.find_nodes(op="call_function", target=torch.ops.mkldnn._linear_pointwise.default)):
            w = _swappable(gm, node)
            if w is None or w.dtype not in SMALL_ROWS or not small_linears_available(w.dtype):
                continue
            name = node.args[1].target
            if name not in layouts:
                with unset_fake_temporarily():  # the real buffer, not the fake tensor mode's
                    layouts[name] = proven_layout(w)
            if layouts[name] not in native.linear_layouts(native.load(), w.dtype):  # None: unproved
                continue
            _replace(graph, node, *node.args[:3], layouts[name])
            swapped += 1
        fake_mode, dropped, plain = detect_fake_mode(), [], {}
        for target in mkl_linear_targets():
            for node in list(graph.find_nodes(op="call_function", target=target)):
                w = _mkl_swappable(gm, node)
                if w is None or not small_linears_available(w.dtype):
                    continue
                x, packed, original, bias, _ = node.args
                weight = original
                if not w.is_contiguous():  # [N, K] rows for the kernel, once
                    if original.target not in plain:
                        plain[original.target] = plain_rows_name(original.target)
                        with unset_fake_temporarily():
                            _register_plain_rows(gm, plain[original.target], w)
                    with graph.inserting_before(node):
                        weight = graph.get_attr(plain[original.target])
                    with unset_fake_temporarily():
                        real = getattr(gm, plain[original.target])
                    weight.meta["val"] = fake_mode.from_tensor(real) if fake_mode is not None else real
                    dropped.append(original.target)
                if isinstance(packed, torch.fx.Node) and packed.op == "get_attr":
                    dropped.append(packed.target)
                _replace(graph, node, x, weight, bias, native.LINEAR_PLAIN)
                swapped += 1
        _drop_unread_attributes(gm, dropped)
        if swapped:
            log.debug("pagedattn: %d linear layers run natively at up to %s rows", swapped, SMALL_ROWS)

    def uuid(self) -> str:
        return _pass_fingerprint()
