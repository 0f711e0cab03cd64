"""A serving step's linear layers on the CPU: the native kernel for few rows, oneDNN for many.

Inductor's freezing packs each frozen linear weight for oneDNN (``mkldnn._linear_pointwise``). At decode sizes
(one row per running sequence) oneDNN pays ~10 us of set-up per call and reads the weights from DRAM at well under
the copy rate: on llama16m bf16, 16 rows, the step's 25 linears took ~1.2 ms against ~0.54 ms for their weights at
the copy rate. :class:`SmallLinears`, an Inductor post-grad pass for a step compiled with freezing, turns each plain
``mkldnn._linear_pointwise`` (no fused activation) over a frozen packed weight into ``pagedattn::linear`` over the
same packed weight, once it has proved the weight's layout: its buffer's bytes equal the weight's own, unpacked,
laid out as the kernel reads them (:func:`pagedattn.backends.native.to_panels`, panels of 64 columns, oneDNN's
AVX-512 layouts) or plainly. A weight in any other layout keeps oneDNN. :func:`linear` runs calls of at most
:data:`SMALL_ROWS` rows with ``csrc/small_linear.c`` and larger ones with oneDNN on the same packed weight, so
prefills are unchanged and memory holds one packed copy, as before. The pass runs before Inductor's own post-grad
passes, so a residual add that oneDNN would have fused into the call becomes part of Inductor's next fused kernel.

Numerics: float32 sums and one rounding to the output dtype, as oneDNN's; only the order of the sums differs.
"""

from __future__ import annotations

import hashlib
import logging
from importlib import resources
from typing import Optional

import torch
from torch import Tensor

from pagedattn.backends import native
from pagedattn.backends.metadata import validation_enabled

log = logging.getLogger("pagedattn")

__all__ = ["SMALL_ROWS", "linear", "SmallLinears", "small_linears_available", "proven_layout"]

# Rows up to which a dtype's calls take the native kernel. On a 2-core EPYC (Zen 5), llama16m's 25 linears from DRAM,
# panels against oneDNN on the same packed weights: bf16 0.85 against 1.23 ms at 16 rows, 3.70 against 4.01 at 128;
# fp32 1.52 against 1.89 at 16, 6.86 against 7.43 at 128 (benchmarks/RESULTS.md)
SMALL_ROWS = {torch.bfloat16: 128, torch.float32: 128}


def small_linears_available(dtype: torch.dtype) -> bool:
    """Whether the native library has the small-row linear kernel for ``dtype`` on this machine."""
    lib = native.library()
    code = {torch.float32: native.FEATURE_LINEAR_F32, torch.bfloat16: native.FEATURE_LINEAR_BF16}.get(dtype)
    return lib is not None and code is not None and bool(native.features(lib) & code)


def proven_layout(packed: Tensor) -> Optional[int]:
    """The layout (``native.LINEAR_PANELS`` or ``LINEAR_PLAIN``) that a oneDNN-packed weight's buffer holds, proved
    by comparing every byte with the weight's values laid out so; None for any other."""
    if not packed.is_mkldnn or packed.dim() != 2 or packed.dtype not in (torch.float32, torch.bfloat16):
        return None
    raw = native.onednn_bytes(packed)
    dense = packed.to_dense()  # a layout change: exact
    if raw.numel() == native.linear_panel_bytes(dense) and torch.equal(raw, native.to_panels(dense).view(torch.uint8)):
        return native.LINEAR_PANELS
    if raw.numel() == dense.numel() * dense.element_size() and torch.equal(raw, dense.contiguous().view(-1).view(
            torch.uint8)):
        return native.LINEAR_PLAIN
    return None


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], layout: int) -> Tensor:
    """``pagedattn::linear``'s CPU kernel: ``x [..., K] @ weight[N, K].T + bias``, ``weight`` a oneDNN-packed tensor
    whose buffer holds ``layout`` (:func:`proven_layout`) or a plain contiguous one (``native.LINEAR_PLAIN``)."""
    k = x.shape[-1]
    if (x.numel() // k if k else 0) <= SMALL_ROWS.get(x.dtype, 0):
        lib = native.load()
        if lib is not None:
            if weight.is_mkldnn and validation_enabled() and proven_layout(weight) != layout:
                raise ValueError(f"pagedattn::linear: the weight's buffer does not hold layout {layout}")
            out = native.linear(lib, x, weight, bias, torch.get_num_threads(), layout)
            if out is not None:
                return out
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _pass_fingerprint() -> str:
    source = resources.files("pagedattn.backends")
    h = hashlib.sha256()
    for name in ("cpu_linear.py", "native.py", "csrc/small_linear.c"):
        h.update(source.joinpath(name).read_bytes())
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


class SmallLinears(CustomGraphPass):
    """Inductor post-grad pass (``post_grad_custom_pre_pass``): plain oneDNN linears over frozen weights become
    ``pagedattn::linear`` (see the module's docstring). Weights of a dtype not in :data:`SMALL_ROWS`, or that the
    native library has no kernel for on this machine, stay with oneDNN."""

    def __call__(self, graph: torch.fx.Graph) -> None:
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
            if layouts[name] is None:
                continue
            x, weight, bias = node.args[:3]
            with graph.inserting_before(node):
                call = graph.call_function(torch.ops.pagedattn.linear.default, (x, weight, bias, layouts[name]))
            call.meta.update(node.meta)
            node.replace_all_uses_with(call)
            graph.erase_node(node)
            swapped += 1
        if swapped:
            log.debug("pagedattn: %d linear layers run natively at up to %s rows", swapped, SMALL_ROWS)

    def uuid(self) -> str:
        return _pass_fingerprint()
