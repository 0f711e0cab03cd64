"""What the passes share: the attention-site record, pass results and small graph helpers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch.fx import Node

from pagedattn.backends import position_mod
from pagedattn.backends.params import AttentionParams

aten = torch.ops.aten

# a fill value or an additive term at or below this is a mask, not data (Hugging Face masks with
# finfo.min, older code with -1e4 or -10000)
MASK_LIMIT = -1e4

# ops that only re-label or copy data without changing values
IDENTITY_OPS = {
    aten.clone.default, aten.contiguous.default, aten.alias.default, aten.detach.default,
    aten.lift_fresh_copy.default, aten.detach_.default,
}
CAST_OPS = {
    aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.to.device, aten.type_as.default,
}
VIEW_OPS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
# in-place arithmetic seen in exported models, read as its functional form on the score path
INPLACE_ALIASES = {
    aten.mul_.Tensor: aten.mul.Tensor, aten.div_.Tensor: aten.div.Tensor, aten.add_.Tensor: aten.add.Tensor,
    aten.mul_.Scalar: aten.mul.Scalar, aten.div_.Scalar: aten.div.Scalar, aten.masked_fill_.Scalar: aten.masked_fill.Scalar,
}
SOFTMAX_OPS = {aten.softmax.int, aten._softmax.default, aten._safe_softmax.default}
CONTRACTION_OPS = {aten.matmul.default, aten.bmm.default, aten.baddbmm.default, aten.einsum.default}
SDPA_OPS = {aten.scaled_dot_product_attention.default}


@dataclass
class AttentionSite:
    """One softmax or SDPA call and what the passes proved about it."""

    name: str
    anchor: Node  # the softmax (or SDPA) node
    status: str = "matched"  # matched -> rewritten | skipped
    reason: str = ""
    # canonical operands, [B, H, S, D] / [B, Hkv, L, D]
    query: Optional[Node] = None
    key: Optional[Node] = None
    value: Optional[Node] = None
    output: Optional[Node] = None  # node whose value the site's result replaces
    output_layout: Any = None  # how [B, Hq, S, Dv] maps back onto `output`
    num_heads: Optional[int] = None
    num_kv_heads: Optional[int] = None
    head_dim: Optional[int] = None
    scale: Optional[float] = None
    softcap: Optional[float] = None
    sinks: Optional[Node] = None  # state holding one attention-sink logit per query head
    # mask terms found on the score path: (node, factor) additive, (node, keep_when_true) boolean
    biases: list = field(default_factory=list)
    conds: list = field(default_factory=list)
    # 0/1 factors on the scores: (node, biases seen, conds seen) — the terms applied after the factor
    # (recorded before it, walking back from the softmax) must mask every score it zeroes
    factors: list = field(default_factory=list)
    sdpa_causal: bool = False
    # filled by classification
    mask_kind: Optional[str] = None  # none | causal | sliding_window | chunked
    window: Optional[int] = None
    chunk: Optional[int] = None
    alibi_slopes: Optional[torch.Tensor] = None
    key_padding: Optional[Node] = None
    key_padding_keeps_true: bool = True  # False: True marks keys to ignore (nn.MultiheadAttention)
    key_padding_runs: bool = False  # established for padding whose present keys are one run per row
    positions_from_first_key: bool = False  # with padding, positions count from the row's first key
    mask_up_to: Optional[int] = None  # the longest key length the mask is established for (None: every length)
    later_keys: bool = False  # its mask may let a query see a later key: served by the drop-in, refused paged
    mask_how: Optional[str] = None  # "proof", "the operator" (SDPA's own mask), a hint
    position_mod: str = ""  # mask kind "positional": its program (pagedattn.backends.position_mod)
    position_tables: Optional[torch.Tensor] = None
    position_inputs: tuple = ()  # inputs the mask reads as positions (proven for positions counting up by one)
    # the input a position program reads per-request values from (token types, a prefix length): a placeholder
    position_data: Optional[Node] = None
    # False for a softmax that is no attention at all (a router, a classifier): leaving it does not mix sequences
    attention: bool = True
    # set when paged: "self" (a KV cache written by the step's tokens) or "cross" (an encoder's K/V,
    # written once per request, read by every decoder step)
    attention_type: str = ""
    # an encoder-decoder step's site: the first mask term whose value may vary over (query, key) pairs
    # (passes.cross_attention.mark_varying_masks; None: not examined, and cross-attention refuses the site)
    mask_varying: Optional[str] = None

    def params(self) -> AttentionParams:
        """The site's parameters as classified (``alibi_slopes`` a tensor, ``sinks`` the graph node)."""
        chunk = {"chunk_size": int(self.chunk)} if self.chunk else {}
        if self.key_padding is not None and self.positions_from_first_key:
            chunk["positions_from_first_key"] = True
        if self.position_mod:
            chunk["position_mod"] = self.position_mod
            chunk["position_tables"] = self.position_tables
        if self.mask_up_to and not (self.mask_how or "").startswith("hint"):
            # a hint's bound is the multi-token trace's size: the single-token graph is traced and checked on
            # sequences longer than that, so the bound is not a kernel check here; PagedEngine refuses
            # requests past it (its length_limit, from the report)
            chunk["max_seq_len"] = int(self.mask_up_to)
        return AttentionParams(
            scale=float(self.scale), causal=self.mask_kind in ("causal", "sliding_window", "chunked"),
            sliding_window=int(self.window or 0), softcap=float(self.softcap or 0.0), alibi_slopes=self.alibi_slopes,
            num_kv_heads=int(self.num_kv_heads), head_size_v=int(self.value.meta["val"].shape[-1]), sinks=self.sinks,
            **chunk)

    def skip(self, reason: str) -> "AttentionSite":
        self.status, self.reason = "skipped", reason
        return self

    def report(self) -> dict:
        return {
            "name": self.name,
            "status": self.status,
            "reason": self.reason,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "scale": self.scale,
            "mask": self.mask_kind,
            "window": self.window,
            "softcap": self.softcap,
            "alibi": self.alibi_slopes is not None,
            "sinks": self.sinks is not None,
            "chunk": self.chunk,
            "key_padding": self.key_padding.name if self.key_padding is not None else None,
            "key_padding_ignores_true": None if self.key_padding is None else not self.key_padding_keeps_true,
            "key_padding_runs": self.key_padding is not None and self.key_padding_runs,
            "positions_from_first_key": self.key_padding is not None and self.positions_from_first_key,
            "mask_established": self.mask_how,
            "mask_up_to": self.mask_up_to,
            "later_keys": self.later_keys,
            "position_program": position_mod.describe(self.position_mod) if self.position_mod else None,
            "position_inputs": list(self.position_inputs),
            "position_values": self.position_data.name if self.position_data is not None else None,
            "attention": self.attention,
            "attention_type": self.attention_type,
        }


def val(node: Any) -> Any:
    """The traced example value (a FakeTensor for tensors) of a node, or the constant itself."""
    if isinstance(node, Node):
        return node.meta.get("val")
    return node


def shape(node: Any) -> Optional[tuple]:
    v = val(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def same_size(a: Any, b: Any) -> bool:
    """Whether two (possibly symbolic) sizes are provably equal."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        return bool(statically_known_true(a == b))
    except Exception:
        return False


# ops whose result aliases their first argument: an in-place write through them lands in that argument
ALIASING_VIEWS = {aten.slice.Tensor, aten.select.int, aten.view.default, aten.transpose.int, aten.unsqueeze.default,
                  aten.squeeze.dim, aten.expand.default, aten.permute.default, aten.alias.default, aten.narrow.default,
                  aten.as_strided.default}


def written_tensor(n: Node) -> Optional[Node]:
    """The tensor an in-place op writes into, through views of it (``ALIASING_VIEWS``); None for an op that writes
    into nothing."""
    schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
    if schema is None or not schema.arguments or schema.arguments[0].alias_info is None \
            or not schema.arguments[0].alias_info.is_write or not n.args or not isinstance(n.args[0], Node):
        return None
    base = n.args[0]
    while base.op == "call_function" and base.target in ALIASING_VIEWS:
        base = base.args[0]
    return base


def is_full_slice(node: Node) -> bool:
    if node.target is not aten.slice.Tensor:
        return False
    args = list(node.args) + [None] * (5 - len(node.args))
    start, end, step = args[2], args[3], args[4]
    return start in (None, 0) and (end is None or (isinstance(end, int) and end >= 2**62)) and step in (None, 1)


def skip_identity(node: Any, casts: bool = True) -> Any:
    """Walk up through ops that do not change values (copies, full slices, optionally casts)."""
    while isinstance(node, Node) and node.op == "call_function" and (
        node.target in IDENTITY_OPS
        or (casts and node.target in CAST_OPS)
        or is_full_slice(node)
        or (node.target is aten.dropout.default and (node.args[1] == 0 or node.args[2] is False))
    ):
        node = node.args[0]
    return node


def scalar(x: Any) -> Optional[float]:
    """A Python number, or None."""
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, Node) and x.op == "call_function" and x.target is aten.scalar_tensor.default \
            and isinstance(x.args[0], (int, float)) and not isinstance(x.args[0], bool):
        return float(x.args[0])  # torch.tensor(-inf) built in the graph
    return None
