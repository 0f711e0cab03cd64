"""bf16/fp16 matmuls in fp32 on CPUs that have no native bf16/fp16 GEMM.

PyTorch runs bf16 ``mm``/``linear`` on CPU through oneDNN only when the CPU has AVX512 (BW, VL, DQ),
AVX-NE-CONVERT or AMX (``torch.ops.mkldnn._is_mkldnn_bf16_supported()``; fp16 needs AVX512-FP16 or
AMX-FP16). Elsewhere (e.g. AVX2-only CPUs) it falls back to a generic GEMM that is 3-9x slower than
fp32 ``mm`` of the same shape, so a bf16 model runs several times slower than in fp32 (measured in
benchmarks/RESULTS.md, "generate_cpu bf16"). Inductor emits the same ``aten.mm`` call, so compiling
does not help.

:class:`Fp32Matmuls` rewrites such matmuls to what oneDNN itself does on AVX512 CPUs without BF16
instructions: convert the operands to fp32 (exact), multiply with fp32 accumulation, round the result
back. With ``cache_weights`` the graph's constant weights (``get_attr``) are converted once and kept as
fp32 buffers of the returned module: 4 more bytes per matmul weight element, for speed at small decode
batches, where converting every weight on every call weighs most (6-12% more time per generation with
8 sequences on a 2-core AVX2 EPYC; within noise with 32). Activations are converted where they are used, which
Inductor fuses into the kernel that produces them. Results are rounded to bf16/fp16 as before but may
differ from the native kernel's by an ulp (another summation order).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from pagedattn.passes.context import PassContext, PassReport

log = logging.getLogger("pagedattn")

__all__ = ["Fp32Matmuls", "native_cpu_matmul"]

aten = torch.ops.aten
# op -> positions of its tensor operands (a bias included)
_MATMULS = {
    aten.linear.default: (0, 1, 2),
    aten.matmul.default: (0, 1),
    aten.mm.default: (0, 1),
    aten.bmm.default: (0, 1),
    aten.addmm.default: (0, 1, 2),
    aten.baddbmm.default: (0, 1, 2),
}


def native_cpu_matmul(dtype: torch.dtype) -> bool:
    """Whether this CPU runs ``dtype`` GEMMs natively (oneDNN), i.e. at least as fast as in fp32."""
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return True


def _val(a) -> torch.Tensor | None:
    v = a.meta.get("val") if isinstance(a, Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _low_precision(node: Node) -> torch.dtype | None:
    """The operands' dtype when ``node`` is a CPU matmul over bf16/fp16 that this CPU runs slowly."""
    if node.op != "call_function" or node.target not in _MATMULS:
        return None
    vals = [_val(node.args[i]) for i in _MATMULS[node.target] if i < len(node.args) and node.args[i] is not None]
    if len(vals) < 2 or any(v is None for v in vals):
        return None
    dtypes = {v.dtype for v in vals}
    if len(dtypes) != 1 or any(v.device.type != "cpu" for v in vals):
        return None
    dtype = dtypes.pop()
    if dtype not in (torch.bfloat16, torch.float16) or native_cpu_matmul(dtype):
        return None
    return dtype


@dataclass(frozen=True)
class Fp32Matmuls:
    """The pass: this CPU's slow bf16/fp16 matmuls of ``gm`` run in fp32, in place.

    ``cache_weights``: keep fp32 copies of constant weights (buffers of ``gm``) instead of converting
    them on every call.
    """

    cache_weights: bool = True
    name: str = "fp32_matmuls"

    def __call__(self, gm: GraphModule, ctx: PassContext) -> PassReport:
        g = gm.graph
        targets = [(n, _low_precision(n)) for n in g.nodes if _low_precision(n) is not None]
        fp32_attrs: dict[str, Node] = {}  # original get_attr target -> get_attr of its fp32 copy

        def up(a, node: Node):
            if not isinstance(a, Node):
                return a
            if a.op == "get_attr" and self.cache_weights:  # a constant weight: converted once
                if a.target not in fp32_attrs:
                    name = "_fp32_" + str(a.target).replace(".", "_")
                    while hasattr(gm, name):
                        name += "_"
                    gm.register_buffer(name, _attr(gm, a.target).detach().float(), persistent=False)
                    with g.inserting_after(a):
                        fp32_attrs[a.target] = g.get_attr(name)
                return fp32_attrs[a.target]
            with g.inserting_before(node):
                return g.call_function(aten.to.dtype, (a, torch.float32))

        for node, dtype in targets:
            operands = _MATMULS[node.target]
            node.args = tuple(up(a, node) if i in operands else a for i, a in enumerate(node.args))
            with g.inserting_after(node):
                back = g.call_function(aten.to.dtype, (node, dtype))
            node.replace_all_uses_with(back, delete_user_cb=lambda user, back=back: user is not back)
        if targets:
            log.info("%d %s matmuls run in fp32: this CPU has no native GEMM for them", len(targets),
                     "/".join(sorted({str(d).replace("torch.", "") for _, d in targets})))
        return PassReport(self.name, bool(targets), f"{len(targets)} matmuls in fp32")


def _attr(gm: torch.nn.Module, target: str) -> torch.Tensor:
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
