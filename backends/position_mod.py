"""Position programs: a site's own mask and bias as a function of query position, key position and head.

A site whose mask or additive bias is neither causal, a window, chunks nor ALiBi, but depends only on
positions (T5's bucketed relative bias, sink tokens plus a window, dilated windows, a capped or
logarithmic distance bias), carries the program the rewriter read from the model, proven to depend on
nothing else, in ``AttentionParams.position_mod``; constant tables it reads (a learned bias per bucket)
travel flat in ``AttentionParams.position_tables``. Every backend evaluates it for exactly the query and
key positions a step touches, through :func:`evaluate` (called by :mod:`pagedattn.backends.reference`),
so serving it costs ``O(queries x keys)`` per step and never a table over every length. A program that
reads positions only through the distance ``k - q`` (:func:`by_distance`, proven from its text: T5's
buckets, distance biases) costs ``O(queries + keys)``: it is evaluated once per distance the step's
pairs span and spread over them (:func:`evaluate_by_distance` gives the values by distance, as the CPU's
native kernels take them).

The program is JSON, a list of nodes each referring to earlier ones by index::

    {"version": 1, "float": "float32", "nodes": [...], "allowed": i or null, "bias": i or null}

Leaves: ``["q"]`` (the query's position), ``["k"]`` (the key's), ``["h"]`` (the query head),
``["n"]`` (the sequence's length: the program was read at as many queries as keys), ``["int", v]``,
``["real", v]``, ``["bool", v]``, and ``["val", i]``: value ``i`` of the query's sequence among those the
program's ``values`` describe (below). Operations: ``add sub mul div`` (``div`` is true division),
``idiv``/``mod`` (floor division and remainder by a positive divisor), ``neg``, ``lt le gt ge eq ne``,
``and or not xor``, ``ite`` (condition, then, else), ``to_real``, ``to_int`` (floor), ``call`` (a float
function by name, on one argument: ``["call", "log", x]``), ``lut`` (``["lut", kind, x, offset, lo,
size, default]``: ``tables[offset + x - lo]`` for ``lo <= x < lo + size``, else ``default``), ``tval``
(``["tval", kind, offset]``: one table value, so that layers differing only in learned values share a
program) and
``table`` (``["table", offset, [sizes...], i0, i1, ...]``: an n-d table, indices clamped into it).
Integers compute in int64, reals in the program's float dtype (the one the model computed them in,
so a float rounded to an integer bucket rounds as the model's did).

A program may also read values fixed per request (``"values"``, :class:`ValueSpec`): a prefix-LM mask
built from ``token_type_ids`` (PaliGemma's bidirectional prefix, Gemma-3's bidirectional image blocks)
or from a prefix length. The rewriter proved the mask a function of the positions and a few integers
per sequence, each a boundary of a *span*: ``{"input": name, "kind": "runs", "inside": v, "outside": u,
"runs": R}`` reads a ``[batch, tokens]`` input of ``u`` with at most ``R`` runs of ``v`` as their
boundaries ``[s_0, e_0, s_1, e_1, ...]`` (runs a sequence does not have lie past every position,
:data:`NO_RUN` on); ``{"input": name, "kind": "scalar"}`` reads a ``[batch]`` input (a prefix
length ``P``: one span ``[0, P)``). A query sees later keys only inside its own span (proven too), so
a span is computed in one step. :func:`values_from_input` turns the model's input into the values
(refusing inputs of another shape), :func:`spans` gives a sequence's spans.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

__all__ = ["evaluate", "prepare", "finish", "Prepared", "FUNCTIONS", "describe", "by_distance", "evaluate_by_distance",
           "prepare_by_distance", "finish_by_distance", "reads_length", "has_bias", "ValueSpec", "value_spec",
           "values_from_input", "default_values", "spans", "NO_RUN", "ProgramText", "program_text"]

# where the runs a sequence does not have begin (run r of those at NO_RUN + 2r): past every position
NO_RUN = 1 << 40

# float functions a program may call (what the rewriter keeps opaque in its proofs)
FUNCTIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "log": torch.log, "log2": torch.log2, "log10": torch.log10, "log1p": torch.log1p, "exp": torch.exp,
    "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "sigmoid": torch.sigmoid, "tanh": torch.tanh, "sin": torch.sin,
    "cos": torch.cos, "erf": torch.erf,
}

_BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.true_divide,
    "idiv": torch.floor_divide, "mod": torch.remainder,
    "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge, "eq": torch.eq, "ne": torch.ne,
    "and": torch.logical_and, "or": torch.logical_or, "xor": torch.logical_xor,
}


_LEAF_OPS = ("q", "k", "h", "n", "val", "int", "real", "bool")


@dataclass(frozen=True)
class ValueSpec:
    """What per-request values a program reads, and from which model input (see the module doc)."""

    input: str
    kind: str  # "runs" | "scalar"
    inside: int = 1  # runs: the value inside a span
    outside: int = 0  # runs: the value everywhere else (generated tokens get it)
    runs: int = 1  # runs: at most this many spans per sequence

    @property
    def count(self) -> int:
        """Values per sequence."""
        return 2 * self.runs if self.kind == "runs" else 1

    def to_json(self) -> dict:
        if self.kind == "scalar":
            return {"input": self.input, "kind": "scalar"}
        return {"input": self.input, "kind": "runs", "inside": self.inside, "outside": self.outside,
                "runs": self.runs}

    @classmethod
    def from_json(cls, d) -> "ValueSpec":
        if not isinstance(d, dict) or d.get("kind") not in ("runs", "scalar") or not isinstance(d.get("input"), str):
            raise ValueError(f"position program: bad values description {d!r}")
        if d["kind"] == "scalar":
            return cls(d["input"], "scalar")
        inside, outside, runs = d.get("inside"), d.get("outside"), d.get("runs")
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (inside, outside, runs)) \
                or inside == outside or runs < 1:
            raise ValueError(f"position program: bad values description {d!r}")
        return cls(d["input"], "runs", inside, outside, runs)


@dataclass(frozen=True)
class _Program:
    float_dtype: torch.dtype
    nodes: tuple
    allowed: Optional[int]
    bias: Optional[int]
    tabled: tuple  # node -> whether it reads the tables (a lookup, or a node after one)
    dead_after: tuple  # position-only node -> the nodes no later position-only node (nor any lookup) reads
    dead_after_tabled: tuple  # table-reading node -> the nodes no later node reads
    constants: dict  # node -> its value (CPU), for nodes that read no position
    on_device: dict  # device -> constants there (filled on first use)
    values: Optional[ValueSpec] = None  # per-request values the program reads (["val", i] leaves)
    # where the program reads positions only through their distance (:func:`_relative`): node -> (b, c), the node
    # being b * (k - q) + c, for the nodes it reads positions through; the other nodes built from q and k by
    # integer sums and products by constants are never evaluated. None: it reads them otherwise.
    relative: Optional[dict] = None
    by_form: frozenset = frozenset()  # those other nodes
    reads_length: bool = False  # whether it reads the sequence's length (["n"])


@functools.lru_cache(maxsize=128)
def _parse(text: str) -> _Program:
    """Decode and check a program once per distinct text (a pure function of it)."""
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"position_mod is not a position program (bad JSON: {e})") from None
    if not isinstance(d, dict) or d.get("version") != 1:
        raise ValueError("position_mod is not a version-1 position program")
    dtype = {"float32": torch.float32, "float64": torch.float64}.get(d.get("float"))
    if dtype is None:
        raise ValueError(f"position program: unknown float dtype {d.get('float')!r}")
    nodes = tuple(tuple(n) for n in d["nodes"])
    values = ValueSpec.from_json(d["values"]) if d.get("values") is not None else None
    for i, n in enumerate(nodes):
        op = n[0]
        if op == "val" and (values is None or not isinstance(n[1], int) or not 0 <= n[1] < values.count):
            raise ValueError(f"position program: node {i} reads a per-request value the program does not describe")
        if op in _LEAF_OPS:
            continue
        if op == "call" and n[1] not in FUNCTIONS:
            raise ValueError(f"position program: unknown function {n[1]!r}")
        refs = _refs(n)
        if any(not isinstance(r, int) or not 0 <= r < i for r in refs):
            raise ValueError(f"position program: node {i} refers to a later node")
    tabled = _tabled(nodes)
    keep = {d.get("allowed"), d.get("bias")}
    constants = _fold(nodes, dtype)
    dead, dead_tabled = _lifetimes(nodes, tabled, keep)
    relative, by_form = _relative(nodes, constants, keep - {None})
    return _Program(dtype, nodes, d.get("allowed"), d.get("bias"), tabled, dead, dead_tabled, constants, {}, values,
                    relative, by_form, any(n[0] == "n" for n in nodes))


def _wrap64(x: int) -> int:
    """``x`` as int64 arithmetic leaves it (modulo 2^64, signed)."""
    return (x + (1 << 63)) % (1 << 64) - (1 << 63)


def _relative(nodes: tuple, constants: dict, outputs: set) -> tuple[Optional[dict], frozenset]:
    """Whether the program reads positions only through ``k - q``, read from its text (a proof, not a sample).

    Every node built from the leaves ``q`` and ``k`` and integer constants by ``add``, ``sub``, ``neg`` and ``mul``
    by a constant is ``a * q + b * k + c`` with integer ``a, b, c``: int64 arithmetic is exact modulo 2^64, so the
    node's value is that form's, wrapped. Where such a node is read by any other operation (or is an output), that
    operation sees the positions through it alone; if each of those forms has ``a == -b``, it is
    ``b * (k - q) + c``, and the whole program is a function of the distance (and of the head, the length and the
    per-request values). Returns those nodes' ``(b, c)`` (None when one reads ``q`` or ``k`` otherwise) and the
    other nodes built from positions by such sums and products, which nothing else reads."""
    forms: dict[int, tuple[int, int, int]] = {}  # node -> (a, b, c): a * q + b * k + c
    positional = set()  # the forms that read q or k (``q - q`` too, whose form is a constant's)
    for i, n in enumerate(nodes):
        op = n[0]
        c = constants.get(i)
        if any(r in positional for r in _refs(n)) or op in ("q", "k"):
            positional.add(i)
        if op == "q":
            forms[i] = (1, 0, 0)
        elif op == "k":
            forms[i] = (0, 1, 0)
        elif c is not None:
            if c.dtype == torch.long and c.dim() == 0:
                forms[i] = (0, 0, _wrap64(int(c)))
        elif op in ("add", "sub") and n[1] in forms and n[2] in forms:
            x, y = forms[n[1]], forms[n[2]]
            sign = 1 if op == "add" else -1
            forms[i] = tuple(_wrap64(u + sign * v) for u, v in zip(x, y))
        elif op == "neg" and n[1] in forms:
            forms[i] = tuple(_wrap64(-u) for u in forms[n[1]])
        elif op == "mul" and n[1] in forms and n[2] in forms:
            x, y = forms[n[1]], forms[n[2]]
            if x[:2] == (0, 0):
                x, y = y, x
            if y[:2] == (0, 0):  # a form times a constant
                forms[i] = tuple(_wrap64(u * y[2]) for u in x)
    reads = set(outputs)  # forms some other operation reads
    for i, n in enumerate(nodes):
        if i not in forms:
            reads.update(_refs(n))
    out = {}
    for r in reads:
        if r in forms and r in positional:
            a, b, c = forms[r]
            if a != _wrap64(-b):
                return None, frozenset()
            out[r] = (b, c)
    return out, frozenset(i for i in forms if i in positional and i not in out)


def _tabled(nodes: tuple) -> tuple:
    out: list = []
    for n in nodes:
        leaf = n[0] in _LEAF_OPS
        out.append(not leaf and (n[0] in ("lut", "table", "tval") or any(out[r] for r in _refs(n))))
    return tuple(out)


def _lifetimes(nodes: tuple, tabled: tuple, keep: set) -> tuple[tuple, tuple]:
    """When each intermediate can be dropped: in the position-only pass (nodes a lookup reads are
    kept for :func:`finish`), and in the table pass."""
    last_plain, last_tabled = {}, {}
    for i, n in enumerate(nodes):
        if n[0] in _LEAF_OPS:
            continue
        for r in _refs(n):
            (last_tabled if tabled[i] else last_plain)[r] = i
    dead = [[] for _ in nodes]
    dead_tabled = [[] for _ in nodes]
    for r, i in last_plain.items():
        if r not in keep and r not in last_tabled:
            dead[i].append(r)
    for r, i in last_tabled.items():
        if r not in keep:
            dead_tabled[i].append(r)
    return tuple(map(tuple, dead)), tuple(map(tuple, dead_tabled))


_LEAVES = ("q", "k", "h", "n", "val")


def _fold(nodes: tuple, fdt: torch.dtype) -> dict:
    """Nodes that read no position: computed once, on the CPU, in the dtypes the program computes in."""
    env: list = []
    out = {}
    for i, n in enumerate(nodes):
        if n[0] in _LEAVES or (n[0] not in ("int", "real", "bool") and any(r not in out for r in _refs(n))) \
                or n[0] in ("lut", "table", "tval"):
            env.append(None)
            continue
        env.append(_node(n, env, {}, None, fdt, torch.device("cpu")))
        out[i] = env[i]
    return out


def _refs(n: tuple) -> list:
    op = n[0]
    if op in _LEAF_OPS:
        return []
    if op == "call":
        return [n[2]]
    if op == "lut":
        return [n[2], n[6]]
    if op == "tval":
        return []
    if op == "table":
        return list(n[3:])
    return list(n[1:])


@dataclass(frozen=True)
class ProgramText:
    """A checked program's parts, for translating it to another IR (ONNX): ``nodes`` as in the module doc, the
    dtype reals compute in, the nodes giving the mask and the bias (None: none), the per-request values read."""

    nodes: tuple
    float_dtype: torch.dtype
    allowed: Optional[int]
    bias: Optional[int]
    values: Optional[ValueSpec]


def program_text(text: str) -> ProgramText:
    """The parts of a program (``ValueError`` when it is not one)."""
    p = _parse(text)
    return ProgramText(p.nodes, p.float_dtype, p.allowed, p.bias, p.values)


def has_bias(text: str) -> bool:
    """Whether the program adds a bias (else it only masks)."""
    return _parse(text).bias is not None


def value_spec(text: str) -> Optional[ValueSpec]:
    """The per-request values a program reads (None: positions only)."""
    return _parse(text).values if text else None


def values_from_input(spec: ValueSpec, data: Tensor) -> Tensor:
    """The program's per-sequence values ``[B, count]`` (int64) from the model input it was proven for:
    ``[B, tokens]`` token types (``runs``) or ``[B]`` prefix lengths (``scalar``). Raises ``ValueError``,
    naming the input, when it has a shape the proof did not cover (other values, more runs, a negative
    length)."""
    if spec.kind == "scalar":
        x = data.reshape(-1) if data.dim() == 2 and data.shape[-1] == 1 else data
        if x.dim() != 1 or x.dtype.is_floating_point:
            raise ValueError(f"input {spec.input!r} must be one integer per row (shape [batch]), got "
                             f"{x.dtype} of shape {tuple(data.shape)}")
        if bool((x < 0).any()):
            raise ValueError(f"input {spec.input!r} holds a negative length: the rewritten masks were established "
                             "for lengths >= 0")
        return x.long()[:, None]
    if data.dim() != 2:
        raise ValueError(f"input {spec.input!r} must be [batch, tokens], got shape {tuple(data.shape)}")
    x = data.long()
    inside = x == spec.inside
    if not bool((inside | (x == spec.outside)).all()):
        raise ValueError(f"input {spec.input!r} holds values other than {spec.outside} and {spec.inside}: the "
                         "rewritten masks were established for those two only")
    first = inside & ~torch.nn.functional.pad(inside, (1, 0))[:, :-1]  # a run begins
    last = inside & ~torch.nn.functional.pad(inside, (0, 1))[:, 1:]  # a run ends (after this token)
    count = first.sum(-1)
    if bool((count > spec.runs).any()):
        row = int(torch.argmax((count > spec.runs).to(torch.int8)))
        raise ValueError(f"input {spec.input!r} has {int(count[row])} runs of {spec.inside}s in row {row}: the "
                         f"rewritten masks were established for at most {spec.runs} (one run of {spec.outside}s "
                         f"between them); pass at most {spec.runs} such spans per sequence, or rewrite with "
                         f"token_type_runs={int(count[row])} (PagedEngine takes it too)")
    out = default_values(spec, x.shape[0], x.device)
    rows, cols = first.nonzero(as_tuple=True)
    k = torch.cumsum(first.long(), -1)[rows, cols] - 1  # which run of its row
    out[rows, 2 * k] = cols
    rows, cols = last.nonzero(as_tuple=True)
    k = torch.cumsum(last.long(), -1)[rows, cols] - 1
    out[rows, 2 * k + 1] = cols + 1
    return out


def default_values(spec: ValueSpec, num_seqs: int, device=None) -> Tensor:
    """Values of sequences without any span: every token ``outside`` (no prefix, no image)."""
    if spec.kind == "scalar":
        return torch.zeros((num_seqs, 1), dtype=torch.long, device=device)
    row = [NO_RUN + i for i in range(2 * spec.runs)]  # runs past every position, in order
    return torch.tensor(row, dtype=torch.long, device=device).repeat(num_seqs, 1)


def spans(spec: ValueSpec, values: Sequence[int]) -> list[tuple[int, int]]:
    """A sequence's spans ``[(start, end), ...]`` from its values: the positions whose queries may see
    later keys (only inside their own span)."""
    if spec.kind == "scalar":
        return [(0, int(values[0]))] if int(values[0]) > 0 else []
    pairs = [(int(values[2 * r]), int(values[2 * r + 1])) for r in range(spec.runs)]
    return [(s, e) for s, e in pairs if s < NO_RUN]


def by_distance(text: str) -> bool:
    """Whether the program reads positions only through the distance ``k - q`` (proven from its text): a step's
    pairs of consecutive queries and keys then evaluate it once per distance (``Q + L - 1`` values, not ``Q x L``)."""
    return _parse(text).relative is not None


def describe(text: str) -> str:
    """A short summary for reports: how many operations, whether it masks and adds a bias."""
    p = _parse(text)
    parts = [f"{len(p.nodes)} operations"]
    if p.allowed is not None:
        parts.append("mask")
    if p.bias is not None:
        parts.append("bias")
    return "position program (" + ", ".join(parts) + ")"


@dataclass(frozen=True)
class Prepared:
    """A program evaluated at some positions up to its table lookups: what :func:`finish` completes
    for any tables. Layers that share a program and a step's positions share one (only the learned
    tables differ between them), so the position arithmetic runs once per step, not once per layer."""

    program: _Program
    env: tuple  # node -> value, for the nodes finish still needs (None elsewhere)
    leaves: dict
    shape: tuple  # (B, 1, Q, L); (B, 1, 1, Q + L - 1) by distance
    by_distance: Optional[tuple] = None  # (Q, L): evaluated at each distance, spread over the pairs by finish


def prepare(text: str, q_pos: Tensor, k_pos: Tensor, seq_len: Tensor | int, num_heads: int,
            values: Optional[Tensor] = None) -> Prepared:
    """The position-only part of :func:`evaluate` (arguments as there)."""
    p = _parse(text)
    dev = q_pos.device
    leaves = {
        "q": q_pos.long()[:, None, :, None],  # [B, 1, Q, 1]
        "k": k_pos.long()[:, None, None, :],  # [B, 1, 1, L]
        "h": torch.arange(num_heads, device=dev)[None, :, None, None],  # [1, H, 1, 1]
        "n": _lengths(seq_len, dev),
    }
    if p.values is not None:
        leaves["val"] = _value_leaves(p, values, dev)
    rows = max(q_pos.shape[0], k_pos.shape[0], values.shape[0] if p.values is not None else 1)
    nq, nk = q_pos.shape[1], k_pos.shape[1]
    distance = _distances(p, q_pos, k_pos, leaves["n"])  # [B|1, 1, 1, Q + L - 1] or None
    env = _position_part(p, leaves, distance, dev)
    if distance is not None:
        return Prepared(p, env, leaves, (rows, 1, 1, nq + nk - 1), (nq, nk))
    return Prepared(p, env, leaves, (rows, 1, nq, nk))


def _position_part(p: _Program, leaves: dict, distance: Optional[Tensor], dev) -> tuple:
    """The program's nodes that read no table, at the leaves' positions, or at ``distance`` (``k - q``, for a
    program that reads positions only through it)."""
    if dev not in p.on_device:  # a memo of pure values, per device
        p.on_device[dev] = {i: v.to(dev) for i, v in p.constants.items()}
    consts = p.on_device[dev]
    env: list = []
    for i, n in enumerate(p.nodes):
        if p.tabled[i]:
            env.append(None)
            continue
        c = consts.get(i)
        if distance is not None and p.relative.get(i) is not None:
            b, c0 = p.relative[i]
            env.append(distance * b + c0)
        elif distance is not None and i in p.by_form:
            env.append(None)  # a sum or product a distance node stands for: never read
        else:
            env.append(c if c is not None else _node(n, env, leaves, None, p.float_dtype, dev))
        for r in p.dead_after[i]:  # [Q, L]-sized intermediates: keep only those still to be read
            env[r] = None
    return tuple(env)


def evaluate_by_distance(text: str, tables: Optional[Tensor], distances: Tensor, seq_len: Tensor | int,
                         num_heads: int, values: Optional[Tensor] = None
                         ) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """A program that reads positions only through ``k - q`` (:func:`by_distance`) at ``distances [B|1, W]``
    (``k - q``): ``(allowed [B|1, W] bool or None, bias [B|1, Hq|1, W] float32 or None)``, what :func:`evaluate`
    gives every pair at that distance. ``seq_len`` (an int or ``[B|1]``) and ``values`` as there."""
    return finish_by_distance(prepare_by_distance(text, distances, seq_len, num_heads, values), tables)


def finish_by_distance(prepared: Prepared, tables: Optional[Tensor]) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """:func:`evaluate_by_distance` from :func:`prepare_by_distance`'s part and the tables."""
    allowed, bias = finish(prepared, tables)
    return (None if allowed is None else allowed[:, 0]), (None if bias is None else bias[:, :, 0])


def reads_length(text: str) -> bool:
    """Whether the program reads its sequence's length (``["n"]``)."""
    return _parse(text).reads_length


def prepare_by_distance(text: str, distances: Tensor, seq_len: Tensor | int, num_heads: int,
                        values: Optional[Tensor] = None) -> Prepared:
    """The position-only part of :func:`evaluate_by_distance` (arguments as there): layers sharing a program share
    it, :func:`finish_by_distance` completes it with each one's tables."""
    p = _parse(text)
    if p.relative is None:
        raise ValueError("position program: it reads positions other than through their distance k - q")
    dev = distances.device
    lengths = _lengths(seq_len, dev)
    if lengths.shape[2] != 1:
        raise ValueError("position program by distance: one length per row, not per query")
    leaves = {"h": torch.arange(num_heads, device=dev)[None, :, None, None], "n": lengths}
    if p.values is not None:
        leaves["val"] = _value_leaves(p, values, dev)
    rows = max(distances.shape[0], lengths.shape[0], values.shape[0] if p.values is not None else 1)
    env = _position_part(p, leaves, distances.long()[:, None, None, :], dev)
    return Prepared(p, env, leaves, (rows, 1, 1, distances.shape[1]))


def _value_leaves(p: _Program, values: Optional[Tensor], dev) -> list:
    """The per-request values' leaves, ``[B|1, 1, 1, 1]`` each."""
    if values is None:
        raise ValueError(f"this position program reads per-sequence values (from input {p.values.input!r}) "
                         "but none were given")
    v = values.to(device=dev, dtype=torch.long)
    if v.dim() != 2 or v.shape[-1] != p.values.count:
        raise ValueError(f"position program: values must be [sequences, {p.values.count}], got {tuple(v.shape)}")
    return [v[:, i].reshape(-1, 1, 1, 1) for i in range(v.shape[-1])]


def _distances(p: _Program, q_pos: Tensor, k_pos: Tensor, lengths: Tensor) -> Optional[Tensor]:
    """``k - q`` at each of the ``Q + L - 1`` distances a row's pairs span, ``[B|1, 1, 1, Q + L - 1]`` (entry
    ``j - i + Q - 1`` for query ``i`` and key ``j``), where the program reads positions only through their distance
    and every pair at one distance is alike: each row's queries and keys consecutive positions, its length (if
    read) one for all its queries. None elsewhere: there, and for a single query or key (no pairs to share), on
    devices where checking positions would stall the step, the program is evaluated pair by pair."""
    nq, nk = q_pos.shape[1], k_pos.shape[1]
    if p.relative is None or nq < 2 or nk < 2 or q_pos.device.type != "cpu":
        return None
    if p.reads_length and lengths.shape[2] != 1:
        return None
    q, k = q_pos.long(), k_pos.long()
    if not (bool((q.diff(dim=-1) == 1).all()) and bool((k.diff(dim=-1) == 1).all())):
        return None
    first = k[:, :1] - q[:, :1] - (nq - 1)  # [B|1, 1]: key 0 against query Q - 1
    return (first + torch.arange(nq + nk - 1, device=q.device))[:, None, None, :]


def _spread(v: Tensor, nq: int, nk: int) -> Tensor:
    """``[..., Q + L - 1]`` values by distance (entry ``j - i + Q - 1``) as ``[..., Q, L]`` over the pairs."""
    v = v.contiguous()
    # row Q - 1 - i of the view starts at entry Q - 1 - i: the view's rows flipped are the pairs' rows
    view = v.as_strided((*v.shape[:-1], nq, nk), (*v.stride()[:-1], 1, 1))
    return view.flip(-2)


def finish(prepared: Prepared, tables: Optional[Tensor]) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """Complete a prepared program with its tables: :func:`evaluate`'s result."""
    p, leaves, shape = prepared.program, prepared.leaves, prepared.shape
    env = list(prepared.env)
    dev = leaves["h"].device
    for i, n in enumerate(p.nodes):
        if p.tabled[i]:
            env[i] = _node(n, env, leaves, tables, p.float_dtype, dev)
            for r in p.dead_after_tabled[i]:
                env[r] = None
    allowed = bias = None
    if p.allowed is not None:
        a = env[p.allowed]
        a = a if isinstance(a, Tensor) else torch.tensor(bool(a), device=dev)
        if a.dim() == 4:
            a = a[:, :1]  # the rewriter proved the mask the same for every head (it may read the bias's table)
        allowed = a.to(torch.bool).expand(shape)[:, 0]  # [B, Q, L]; by distance [B, 1, Q + L - 1]
        if prepared.by_distance is not None:
            allowed = _spread(allowed[:, 0], *prepared.by_distance)
    if p.bias is not None:
        b = env[p.bias]
        b = b if isinstance(b, Tensor) else torch.tensor(float(b), device=dev)
        b = b.to(torch.float32)
        bias = b.expand(shape[0], b.shape[1] if b.dim() == 4 else 1, shape[2], shape[3])
        if prepared.by_distance is not None:
            bias = _spread(bias[:, :, 0], *prepared.by_distance)
    return allowed, bias


def evaluate(text: str, tables: Optional[Tensor], q_pos: Tensor, k_pos: Tensor, seq_len: Tensor | int,
             num_heads: int, values: Optional[Tensor] = None) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """The program at every (query, key) pair: ``(allowed [B|1, Q, L] bool or None, bias [B|1, Hq|1, Q, L]
    float32 or None)``.

    ``q_pos [B|1, Q]`` and ``k_pos [B|1, L]`` are positions in the sequence; ``seq_len`` (an int, or
    ``[B|1]`` / ``[B|1, Q]``) is the length of each query's sequence: every real key lies before it.
    Keys at or past it get values nobody reads (the caller masks them), never an error. ``values
    [B|1, count]`` are the sequences' per-request values, for a program that reads some (``value_spec``).
    """
    return finish(prepare(text, q_pos, k_pos, seq_len, num_heads, values), tables)


def _lengths(seq_len, dev) -> Tensor:
    if isinstance(seq_len, int):
        return torch.tensor(seq_len, device=dev).reshape(1, 1, 1, 1)
    s = seq_len.to(dev).long()
    return s.reshape(s.shape[0], 1, 1, 1) if s.dim() == 1 else s[:, None, :, None]  # [B, 1, Q|1, 1]


def _node(n: tuple, env: list, leaves: dict, tables: Optional[Tensor], fdt: torch.dtype, dev):
    op = n[0]
    if op == "val":
        return leaves["val"][n[1]]
    if op in leaves:
        return leaves[op]
    if op == "int":
        return torch.tensor(int(n[1]), dtype=torch.long, device=dev)
    if op == "real":
        return torch.tensor(float(n[1]), dtype=fdt, device=dev)
    if op == "bool":
        return torch.tensor(bool(n[1]), device=dev)
    if op in _BINARY:
        return _BINARY[op](env[n[1]], env[n[2]])
    if op == "neg":
        return torch.neg(env[n[1]])
    if op == "not":
        return torch.logical_not(env[n[1]])
    if op == "ite":
        return torch.where(env[n[1]].to(torch.bool), env[n[2]], env[n[3]])
    if op == "to_real":
        return env[n[1]].to(fdt)
    if op == "to_int":
        x = env[n[1]]
        # floor; a value beyond int64 (an unused branch's log(0)) is clamped rather than left to the cast
        return x.floor().clamp(-2.0 ** 62, 2.0 ** 62).nan_to_num(0.0).to(torch.long) if x.is_floating_point() else x
    if op == "call":
        return FUNCTIONS[n[1]](env[n[2]].to(fdt))
    if op == "tval":
        return _as(tables[n[2]].to(dev), n[1], fdt)
    if op == "lut":
        kind, x, offset, lo, size, default = n[1:]
        idx = env[x] - lo
        inside = (idx >= 0) & (idx < size)
        vals = tables[offset:offset + size].to(dev)[idx.clamp(0, size - 1)]
        return torch.where(inside, _as(vals, kind, fdt), env[default])
    if op == "table":
        offset, sizes, idx = n[1], n[2], [env[i] for i in n[3:]]
        flat = torch.zeros((), dtype=torch.long, device=dev)
        for i, s in zip(idx, sizes):
            flat = flat * s + i.clamp(0, s - 1)
        vals = tables[offset:offset + math.prod(sizes)].to(dev)
        return vals[flat].to(fdt)
    raise ValueError(f"position program: unknown operation {op!r}")


def _as(vals: Tensor, kind: str, fdt: torch.dtype) -> Tensor:
    if kind == "bool":
        return vals != 0
    if kind == "int":
        return vals.to(torch.long)
    return vals.to(fdt)
