"""What the passes of one rewrite share: a typed context, and the report each pass returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from pagedattn.passes.site import AttentionSite

__all__ = ["PassContext", "PassReport", "PagedSite", "StepIndex"]


@dataclass(frozen=True)
class StepIndex:
    """A node whose values number the step's tokens (``token_locality``): in the model's forward each token's
    position, in a paged step its index in the step, so the paged graph computes it from the positions.

    ``kind`` "range": ``arange(start, start + T)`` (positions plus ``start``); "table": a constant cut to its first
    ``T`` rows along ``dim`` (its rows at the positions)."""

    kind: str
    start: int = 0
    dim: int = 0


@dataclass(frozen=True)
class PagedSite:
    """One paged site of a paged graph: its cache input and the site it pages."""

    cache_input: str  # placeholder name, kv_cache_<i> (cross_kv_cache_<j> for cross-attention)
    site: str  # AttentionSite.name


@dataclass
class PassContext:
    """Inputs of a rewrite and what its passes find, passed to every pass.

    ``example_inputs`` maps placeholder names to the traced example values; ``constant_inputs``
    names placeholders that hold model state (parameters, buffers); ``mask_hints`` is the report of
    a multi-token rewrite of the same model, for graphs traced on one token (see ``classify_mask``).
    ``encoder_inputs`` names the placeholders that carry an encoder's output (an encoder-decoder's
    decoder step): attention whose keys and values are computed from them alone is cross-attention.
    Passes fill ``sites`` (``match_attention`` onwards), ``step_indices`` and ``paged_refusal``
    (``token_locality``), ``paged_sites``, ``cross_sites`` and ``token_count`` (``insert_paged``).
    """

    example_inputs: dict[str, Any] = field(default_factory=dict)
    constant_inputs: frozenset[str] = frozenset()
    mask_hints: Optional[list[dict]] = None
    max_length: Optional[int] = None  # the model's longest sequence (its config's), bounding mask proofs
    token_type_runs: int = 4  # runs of 1s (image blocks) per sequence a token-type mask is established for
    sites: list[AttentionSite] = field(default_factory=list)
    paged_sites: list[PagedSite] = field(default_factory=list)
    encoder_inputs: frozenset[str] = frozenset()
    cross_sites: list[PagedSite] = field(default_factory=list)  # cross_kv_cache_<j> inputs, in order
    token_count: Any = None  # the paged sites' query length S ([B, H, S, D]; a symbol), set by insert_paged
    # token_locality: node name -> StepIndex (None: not read, a graph of fixed token count), and why paged mode
    # cannot serve the graph (it combines tokens outside attention), or None
    step_indices: Optional[dict[str, StepIndex]] = None
    paged_refusal: Optional[str] = None
    locality_unproven: Optional[str] = None  # an op or indexing token_locality cannot follow, where it met one

    def site(self, name: str) -> AttentionSite:
        return next(s for s in self.sites if s.name == name)


@dataclass(frozen=True)
class PassReport:
    """What one pass did: whether it changed the graph, a one-line summary, and how long it took."""

    name: str
    changed: bool
    detail: str = ""
    seconds: float = 0.0
