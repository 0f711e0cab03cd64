"""Runs the pass pipelines over a traced graph: the drop-in graph, the paged graph, and what was found."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from torch.fx import GraphModule

from pagedattn.backends import AttentionBackend, AttentionConfig, CacheSpec
from pagedattn.passes import (
    CANONICAL_PIPELINE,
    CROSS_WRITER_PIPELINE,
    PAGED_PIPELINE,
    AttentionSite,
    PagedSite,
    PassContext,
    PassReport,
    run_pipeline,
)
from pagedattn.tracing import copy_graph_module

log = logging.getLogger("pagedattn")

__all__ = ["RewriteResult", "rewrite_graph"]


@dataclass(frozen=True)
class RewriteResult:
    """The graphs a rewrite produced and what it found."""

    dropin: GraphModule  # canonical pagedattn::attention nodes: computes what the model computes
    paged: GraphModule  # KV-cache writes + paged attention; caches and metadata appended to the inputs
    sites: list[AttentionSite]
    cache_specs: list[CacheSpec]  # one per kv_cache_<i> input of the paged graph, in order
    paged_sites: list[PagedSite]  # the same, by cache input name
    passes: list[PassReport]
    # an encoder-decoder's decoder step: its cross-attention sites (cross_kv_cache_<j> inputs, after the
    # kv_cache_<i>; their specs follow cache_specs' self-attention ones) and the graph that fills them
    cross_sites: tuple[PagedSite, ...] = ()
    cross_writer: Optional[GraphModule] = None
    # why paged mode cannot run the paged graph (it combines tokens outside attention: ``token_locality``), or None
    paged_refusal: Optional[str] = None
    # where token_locality met an op or indexing it cannot follow (paged mode then rests on PagedEngine's packing
    # check), or None
    locality_unproven: Optional[str] = None

    @property
    def report(self) -> list[dict]:
        return [s.report() for s in self.sites]

    @property
    def position_inputs(self) -> dict[int, str]:
        """Flat input index -> name of inputs a rewritten site's mask reads as positions."""
        names = [n.name for n in self.dropin.graph.nodes if n.op == "placeholder"]
        read = {p for s in self.sites if s.status == "rewritten" for p in s.position_inputs}
        return {names.index(p): p for p in sorted(read) if p in names}

    @property
    def padding_inputs(self) -> dict[int, tuple[str, bool]]:
        """Flat input index -> (name, whether its present keys were established as one run per row) of the
        padding inputs rewritten sites read: 0/1 masks, and where the flag says so, left or right padding."""
        names = [n.name for n in self.dropin.graph.nodes if n.op == "placeholder"]
        read: dict[str, bool] = {}
        for s in self.sites:
            if s.status == "rewritten" and s.key_padding is not None:
                read[s.key_padding.name] = read.get(s.key_padding.name, False) or s.key_padding_runs
        return {names.index(p): (p, runs) for p, runs in sorted(read.items()) if p in names}

    @property
    def skipped(self) -> list[str]:
        """Attention sites left as they were: a paged step would mix sequences through them."""
        return [f"{s.name}: {s.reason}" for s in self.sites if s.status != "rewritten" and s.attention]


def rewrite_graph(gm: GraphModule, example_inputs: Sequence, backend: AttentionBackend,
                  constants: frozenset[int] = frozenset(),
                  mask_hints: Optional[list[dict]] = None, max_length: Optional[int] = None,
                  encoder_inputs: frozenset[str] = frozenset(), token_type_runs: int = 4) -> RewriteResult:
    """Run the passes on a flat ATen graph (changed in place into the drop-in graph).

    ``constants`` are positions of inputs that hold model state (parameters, buffers). ``mask_hints``
    (the report of a multi-token trace of the same model) gives the masks of a graph traced for a
    single token, which no probe can settle; ``max_length`` (the model's longest sequence) bounds
    the lengths masks are established for. Every rewritten site must be one ``backend`` supports.
    ``encoder_inputs`` (placeholder names) marks the graph as an encoder-decoder's decoder step whose
    inputs of those names carry the encoder's output: its cross-attention is paged over caches filled
    once per request, by the ``cross_writer`` graph. ``token_type_runs``: a mask read from token types is
    established for up to that many runs of 1s (image blocks) per sequence.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    ctx = PassContext(example_inputs={p.name: x for p, x in zip(placeholders, example_inputs)},
                      constant_inputs=frozenset(placeholders[i].name for i in constants),
                      mask_hints=None if mask_hints is None else list(mask_hints), max_length=max_length,
                      encoder_inputs=frozenset(encoder_inputs), token_type_runs=token_type_runs)
    t0 = time.perf_counter()
    reports = run_pipeline(gm, ctx, CANONICAL_PIPELINE)
    for s in ctx.sites:
        if s.status == "rewritten":
            reasons = backend.supports(site_config(s))
            if reasons:
                raise ValueError(f"backend {backend.name} cannot run site {s.name}: {'; '.join(reasons)}")
    writer = None
    if ctx.encoder_inputs:
        writer = copy_graph_module(gm)  # before the paged pipeline: it reads the canonical sites' K/V
        reports += run_pipeline(writer, ctx, CROSS_WRITER_PIPELINE)
    paged = copy_graph_module(gm)
    reports += run_pipeline(paged, ctx, PAGED_PIPELINE)
    log.info("passes took %.3fs", time.perf_counter() - t0)
    _log_sites(ctx.sites)
    by_name = {s.name: s for s in ctx.sites}
    specs = [CacheSpec(p.site, by_name[p.site].num_kv_heads, by_name[p.site].head_dim,
                       by_name[p.site].key.meta["val"].dtype) for p in [*ctx.paged_sites, *ctx.cross_sites]]
    if ctx.paged_refusal:
        log.info("paged mode refused: %s", ctx.paged_refusal)
    return RewriteResult(gm, paged, ctx.sites, specs, ctx.paged_sites, reports, tuple(ctx.cross_sites),
                         writer if ctx.cross_sites else None, ctx.paged_refusal, ctx.locality_unproven)


def site_config(s: AttentionSite) -> AttentionConfig:
    """A rewritten site as backends' ``supports()`` see it."""
    return AttentionConfig(s.params(), num_heads=s.num_heads, head_size=s.head_dim,
                           dtype=s.query.meta["val"].dtype)


def _log_sites(sites) -> None:
    for s in sites:
        if s.status == "rewritten":
            log.info("site %s rewritten: %s heads / %s kv heads, head %s, %s", s.name, s.num_heads, s.num_kv_heads,
                     s.head_dim, s.params().describe())
        else:
            log.info("site %s skipped: %s", s.name, s.reason)
    if sites and not any(s.status == "rewritten" for s in sites):
        log.warning("pagedattn found %d softmax/SDPA sites but rewrote none: %s", len(sites),
                    "; ".join(f"{s.name}: {s.reason}" for s in sites))

