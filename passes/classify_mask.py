"""Establish each site's mask and bias for every length the model accepts, or leave the site.

The mask and bias terms found on the score path are cut out of the graph as a small program of the
inputs they depend on and read as a formula over query and key positions (``mask_program``). Its
kind is then *proven* — causal, sliding window, chunked, none; ALiBi slopes; key padding from an
input in either convention — for every length up to the model's maximum (or every length, when
neither the model nor the program bounds it). What cannot be proven is left dense, with the reason
(and, where the solver found one, a query and key at which the mask differs). Nothing is sampled:
a classification checked at a few lengths would be a guess.

What each input the mask reads by value stands for:

- ``[batch, keys]`` 0/1 or boolean inputs: key padding (``attention_mask``; ``src_key_padding_mask``,
  whose True means "ignore", is recognised by the proof);
- integer inputs that counted up by one in the example: positions, proven for positions that count
  up by one from any offset per row (drop-in calls with other positions are checked at call time);
- model state (parameters, buffers): read as constants;
- per-request values: where no reading above establishes the mask, a ``[batch, keys]`` 0/1 input (not
  named as a mask: ``attention_mask`` and ``key_padding_mask`` stay key padding) is tried as token types
  (up to ``PassContext.token_type_runs`` runs of 1s among 0s, then of 0s among 1s, then one run of either: Gemma-3's image
  blocks, PaliGemma's prefix) and a ``[batch]`` integer input as a prefix length;
  the mask must then be a position program over them (``position_program``) that lets a query see later
  keys only inside its own span (``prove_spans``: a span is computed in one step);
- anything else — token ids (top-k indexers, pad-token masks), float masks handed in by the caller —
  makes the mask depend on data: the site is left.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from torch.fx import GraphModule, Node

from pagedattn.backends.params import AttentionParams
from pagedattn.backends.position_mod import ValueSpec, value_spec, values_from_input
from pagedattn.passes.context import PassContext, PassReport
from pagedattn.passes.mask_program import (
    MaskKind,
    NotEstablished,
    establish,
    extract_program,
    read_mask,
    reads_by_value,
    value_nodes,
)
from pagedattn.passes.position_program import position_program, program_padding, prove_spans, sees_later_keys
from pagedattn.passes.site import AttentionSite, same_size, shape

log = logging.getLogger("pagedattn.passes")

# how a mask was established, in a report, when the trace's forward fixed its length (``mask_hints``)
FIXED_LENGTH = "at the trace's fixed length"

__all__ = ["classify_mask", "input_roles", "FIXED_LENGTH"]


def classify_mask(gm: GraphModule, ctx: PassContext) -> PassReport:
    memo: dict[tuple, Any] = {}
    placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    for index, site in enumerate(ctx.sites):
        if site.status != "matched":
            continue
        if ctx.mask_hints is not None and _single_token(site):
            _apply_hint(site, ctx.mask_hints, index, len(ctx.sites))
            continue
        if not site.biases and not site.conds and not site.factors:
            _plain(site)
            continue
        if site.sdpa_causal:
            site.skip("SDPA with both is_causal and attn_mask")
            continue
        key = (tuple((id(n), f) for n, f in site.biases), tuple((id(n), k) for n, k in site.conds),
               tuple((id(n), i, j) for n, i, j in site.factors), site.num_heads)
        if key not in memo:
            memo[key] = _classify(gm, site, ctx)
        result = memo[key]
        if isinstance(result, str):
            site.skip(result)
            continue
        site.mask_kind, site.window, site.chunk = result.kind, result.window, result.chunk
        site.alibi_slopes = result.alibi
        site.key_padding = placeholders[result.key_padding] if result.key_padding else None
        site.key_padding_keeps_true = result.padding_keeps_true
        site.key_padding_runs = result.padding_runs
        site.positions_from_first_key = result.positions_from_first_key
        site.mask_up_to, site.mask_how = result.up_to, result.how
        site.position_mod, site.position_tables = result.position_mod, result.position_tables
        site.position_inputs = result.positions
        site.position_data = placeholders[result.values_input] if result.values_input else None
        site.later_keys = result.later_keys
    _one_value_reading(ctx.sites)
    n = sum(s.mask_kind is not None for s in ctx.sites)
    return PassReport("classify_mask", False, f"{n} masks established from {len(memo)} distinct mask programs")


def _one_value_reading(sites: list[AttentionSite]) -> None:
    """A paged step carries one row of per-request values per sequence: every site that reads such values
    must read them from the same input in the same way (the first site's); the others are left."""
    first = None
    for site in sites:
        if site.status != "matched" or site.position_data is None:
            continue
        spec = value_spec(site.position_mod)
        if first is None:
            first = spec
        elif spec != first:
            site.skip(f"its mask reads input {spec.input!r} as per-request values ({spec}) but another site reads "
                      f"them as {first}; a step carries one reading")


def _plain(site: AttentionSite) -> None:
    """No mask terms: SDPA's own ``is_causal`` (aligned top-left, so only when queries and keys are the
    same tokens), or no mask at all."""
    if site.sdpa_causal and not same_size(shape(site.query)[2], shape(site.key)[2]):
        site.skip("SDPA's is_causal aligns the causal mask top-left; with fewer queries than keys that is not "
                  "the bottom-right alignment of a step continuing its cache")
        return
    site.mask_kind = "causal" if site.sdpa_causal else "none"
    site.mask_how = "the operator"


def _single_token(site: AttentionSite) -> bool:
    """A graph traced for one query against one key: its mask shows no extent."""
    sq, sk = shape(site.query), shape(site.key)
    return isinstance(sq[2], int) and isinstance(sk[2], int) and int(sq[2]) == int(sk[2]) == 1


def _apply_hint(site: AttentionSite, hints: list[dict], index: int, num_sites: int) -> None:
    """Take the mask of the same site in a multi-token trace of the same model (``rewrite(mask_hints=...)``)."""
    if len(hints) != num_sites:
        site.skip(f"single-token graph: its mask cannot be established, and the multi-token trace given as hints "
                  f"has {len(hints)} attention sites, not {num_sites}")
        return
    h = hints[index]
    if h.get("status") != "rewritten":
        site.skip(f"single-token graph: the multi-token trace left this site ({h.get('reason')})")
    elif h.get("alibi") or h.get("key_padding"):
        site.skip("single-token graph: ALiBi slopes and key padding cannot be read from one token")
    else:
        site.mask_kind, site.window, site.chunk = h["mask"], h.get("window"), h.get("chunk")
        how = h.get("mask_established") or "proof"
        site.mask_up_to, site.mask_how = h.get("mask_up_to"), f"hint from a multi-token trace: {how}"
        site.later_keys = bool(h.get("later_keys"))
        if site.mask_up_to and FIXED_LENGTH in how:
            log.warning("%s: a single-token graph takes its %s mask from a multi-token trace of fixed sizes, where "
                        "it was established up to %d positions only; PagedEngine refuses longer requests",
                        site.name, site.mask_kind, site.mask_up_to)


# ----------------------------------------------------------------------------- one site


def _classify(gm: GraphModule, site: AttentionSite, ctx: PassContext):
    """The site's ``MaskKind``, or the reason it cannot be established."""
    try:
        roles, constants, candidates, refusal = _roles(gm, site, ctx)
        with torch.no_grad():
            try:
                if refusal:  # an input only per-request values could explain
                    raise NotEstablished(refusal)
                kind = _by_roles(gm, site, ctx, roles, constants)
            except NotEstablished as first:
                kind = _with_values(gm, site, ctx, roles, constants, candidates, first)
    except NotEstablished as e:
        return str(e)
    if kind.chunk and "chunk_size" not in {f.name for f in dataclasses.fields(AttentionParams)}:
        return f"chunked attention (chunks of {kind.chunk}) has no paged kernel here yet"
    log.debug("site %s: %s established by %s up to %s", site.name, kind.kind, kind.how, kind.up_to or "every length")
    return kind


def _reader(gm: GraphModule, site: AttentionSite, ctx: PassContext, roles: dict, constants: dict):
    def read(keys_present, prefix: str):
        return read_mask(gm, site, roles, constants, ctx.max_length, keys_present, prefix)
    return read


def _by_roles(gm: GraphModule, site: AttentionSite, ctx: PassContext, roles: dict, constants: dict) -> MaskKind:
    """A kind with its own kernel, else a position program (beside key padding, where there is some)."""
    padding = [name for name, role in roles.items() if role == "padding"]
    read = _reader(gm, site, ctx, roles, constants)
    try:
        return establish(read, padding)
    except NotEstablished as first:
        return _positional(read, first, padding)


def _with_values(gm: GraphModule, site: AttentionSite, ctx: PassContext, roles: dict, constants: dict,
                 candidates: dict, why: NotEstablished) -> MaskKind:
    """The mask as a position program over an input read as per-request values (token types, a prefix
    length), each of its readings in turn (``candidates``); the first reason stands when none holds."""
    errors = []
    for name, specs in candidates.items():
        example = ctx.example_inputs.get(name)
        for spec in specs:
            if not _covers(spec, example):  # the example itself must be an input the proof covers
                errors.append((spec, "its example is not of that shape"))
                continue
            tried = {**{k: r for k, r in roles.items() if k != name}, name: spec}
            padding = [k for k, r in tried.items() if r == "padding"]
            read = _reader(gm, site, ctx, tried, constants)
            try:
                kind = _positional(read, why, padding, spans=True)
            except NotEstablished as e:
                errors.append((spec, str(e).removeprefix(f"{why}; nor is it a mask or bias over positions only: ")))
                continue
            return dataclasses.replace(kind, values_input=name)
    if not errors:
        raise why
    tried = [e for e in errors if e[1] != "its example is not of that shape"]
    spec, last = (tried or errors)[-1]
    what = "a length per row" if spec.kind == "scalar" else "token types"
    raise NotEstablished(f"{why}; nor with input {spec.input!r} as {what}: {last}")


def _positional(read, why: NotEstablished, padding: list[str], spans: bool = False) -> MaskKind:
    """No kind with its own kernel: the generic path, when the mask and bias depend on positions only
    (beside key padding, where the site has a padding input); with ``spans``, on positions and an input's
    per-request values, letting a query see later keys only inside its span."""
    errors = []
    # a boolean padding input whose True means "ignore" reads as every key hidden when all True
    for present in (True, "false") if padding else (True,):
        try:
            mod, tables, f, terms = position_program(read, present)
            if spans:
                if not f.values:
                    raise NotEstablished("the mask does not read the input's values")
                prove_spans(f)
            pad = program_padding(read, f, terms, padding) if padding else (None, True, False, False)
        except NotEstablished as e:
            errors.append(str(e))
            continue
        longest = f.maximize(f.L)
        up_to = None if longest is None or longest >= 2 ** 31 - 1 else longest
        return MaskKind("positional", up_to=up_to, positions=tuple(f.positions), how="proof (position program)",
                        position_mod=mod, position_tables=tables, key_padding=pad[0], padding_keeps_true=pad[1],
                        padding_runs=pad[2], positions_from_first_key=pad[3],
                        later_keys=not spans and sees_later_keys(f))
    raise NotEstablished(f"{why}; nor is it a mask or bias over positions only: {errors[0]}")


def input_roles(gm: GraphModule, site: AttentionSite,
                ctx: PassContext) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """What each placeholder the mask terms read by value stands for (``read_mask``'s roles, and the values
    of constant inputs); raises NotEstablished for data-dependent masks."""
    roles, constants, _, refusal = _roles(gm, site, ctx)  # per-request values are classify_mask's alone
    if refusal:
        raise NotEstablished(refusal)
    return roles, constants


def _roles(gm: GraphModule, site: AttentionSite, ctx: PassContext) -> tuple[dict, dict, dict, str]:
    """``input_roles``' roles and constants, the inputs that may also be read as per-request values (name ->
    the ``ValueSpec`` readings to try, in order), and why the mask depends on data (empty when it need not:
    an input no role explains is refused unless read as values)."""
    terms = [n for n, _ in site.biases] + [n for n, _ in site.conds] + [n for n, _, _ in site.factors]
    module, inputs = extract_program(gm, terms)
    values = value_nodes(module)
    inner = {n.name: n for n in module.graph.nodes if n.op == "placeholder"}
    key_len = shape(site.key)[2]
    batch = shape(site.query)[0]
    roles, constants, candidates, refusals = {}, {}, {}, {}
    for p in inputs:
        if not reads_by_value(inner[p.name], values) or not isinstance(p.meta.get("val"), torch.Tensor):
            continue
        example = ctx.example_inputs.get(p.name)
        if isinstance(example, torch.Tensor) and example.is_meta:
            raise NotEstablished(f"the mask reads input '{p.name}', whose example has no values (a meta tensor): "
                                 "trace with real inputs")
        v = p.meta["val"]
        per_row = _one_per_row(v, batch, key_len)
        if p.name in ctx.constant_inputs:
            roles[p.name], constants[p.name] = "constant", example
        elif _looks_like_padding(p, example, key_len):
            roles[p.name] = "padding"
            if not v.dtype.is_floating_point and "mask" not in p.name.lower():
                # a mask by name (attention_mask, key_padding_mask) is key padding, never token types: paged
                # steps hold no padding, and a mask read otherwise stays refused
                candidates[p.name] = _token_type_readings(p.name, ctx.token_type_runs)
        elif _looks_like_positions(example) and not per_row:
            roles[p.name] = "positions"
        elif not v.dtype.is_floating_point and v.dtype != torch.bool:
            if per_row:
                candidates[p.name] = [ValueSpec(p.name, "scalar")]
            refusals[p.name] = (f"the mask depends on the token values of input '{p.name}' (data-dependent "
                                "sparsity, e.g. a top-k key indexer, or a mask computed from token ids)")
        else:
            refusals[p.name] = f"the mask depends on the values of input '{p.name}' (a caller-provided mask or bias)"
    unexplained = [msg for name, msg in refusals.items() if name not in candidates]
    if unexplained:
        raise NotEstablished(unexplained[0])
    return roles, constants, candidates, next(iter(refusals.values()), "")


def _covers(spec: ValueSpec, example) -> bool:
    """Whether a reading of an input as per-request values covers the input's example."""
    if not isinstance(example, torch.Tensor):
        return False
    try:
        values_from_input(spec, example)
    except ValueError:
        return False
    return True


def _token_type_readings(name: str, runs: int) -> list[ValueSpec]:
    """How a 0/1 input is tried as token types: up to ``runs`` spans of 1s (Gemma-3's image blocks) or of 0s,
    then one (the proofs' cost grows with ``runs``)."""
    many = [ValueSpec(name, "runs", 1, 0, runs), ValueSpec(name, "runs", 0, 1, runs)] if runs > 1 else []
    return [*many, ValueSpec(name, "runs", 1, 0, 1), ValueSpec(name, "runs", 0, 1, 1)]


def _one_per_row(v: torch.Tensor, batch, key_len) -> bool:
    """A ``[batch]`` tensor: one value per row (a prefix length), not one per token."""
    return v.dim() == 1 and same_size(v.shape[0], batch) and not same_size(v.shape[0], key_len)


def _looks_like_padding(p: Node, example, key_len) -> bool:
    """A ``[batch, keys]`` boolean or 0/1 input (Hugging Face's ``attention_mask``, PyTorch's
    ``key_padding_mask``)."""
    v = p.meta.get("val")
    return (isinstance(v, torch.Tensor) and v.dim() == 2
            and (same_size(v.shape[1], key_len) or _hint(v.shape[1]) == _hint(key_len))
            and (v.dtype == torch.bool or (isinstance(example, torch.Tensor) and _is_01(example))))


def _looks_like_positions(example) -> bool:
    """Integer positions: each row of the example counts up by one, possibly restarting at 0 (several
    sequences packed in one row, as a paged step passes them). Proofs cover positions counting up by
    one; calls with restarts are checked where they run dense."""
    if not (isinstance(example, torch.Tensor) and not example.dtype.is_floating_point and
            example.dtype != torch.bool and example.dim() >= 1 and example.numel() > 0):
        return False
    rows = example.reshape(-1, example.shape[-1])
    if rows.shape[-1] == 1:
        return bool((rows >= 0).all())
    step = rows[:, 1:] - rows[:, :-1]
    return bool((rows >= 0).all() and ((step == 1) | (rows[:, 1:] == 0)).all() and (step == 1).any())


def _is_01(t: torch.Tensor) -> bool:
    return t.numel() > 0 and bool(((t == 0) | (t == 1)).all())


def _hint(dim) -> int:
    return int(dim.node.hint) if isinstance(dim, torch.SymInt) else int(dim)

