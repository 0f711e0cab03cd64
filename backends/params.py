"""What one attention site computes besides its operands: :class:`AttentionParams`.

The custom ops take these parameters as flat schema arguments (torch.library needs a flat schema);
the schema is generated from the dataclass's fields, and each op decodes them once into an
``AttentionParams``. Adding a per-site parameter means: a field here (appended, with a default, so
saved programs keep loading), and the backends that implement it.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Generic, Optional, TypeVar

import torch

__all__ = ["AttentionParams", "AttentionConfig", "CacheSpec", "params_schema"]

T = TypeVar("T")  # torch.Tensor at run time; torch.fx.Node while a pass builds or reads a graph


@dataclass(frozen=True)
class AttentionParams(Generic[T]):
    """Per-site attention parameters.

    ``scale`` multiplies ``q · k``; ``softcap > 0`` caps the scaled scores as ``c * tanh(s / c)``;
    ``alibi_slopes [Hq]`` add ``slope * (key position - query position)`` after the cap;
    ``causal`` lets a query see keys at or before its own position (queries aligned bottom-right);
    ``sliding_window > 0`` keeps only keys fewer than that many positions back; ``sinks [Hq]`` are
    per-head logits that join the softmax's normalisation and contribute no value;
    ``chunk_size > 0`` (chunked local attention, Llama 4's ``attention_chunk_size``) cuts the sequence
    into chunks of that many positions and lets a query see only keys of its own chunk (causal
    attention only; with a window too, a key must satisfy both).
    ``head_size_v`` is the value head size (the output's last dimension).
    ``max_seq_len > 0`` is the longest sequence the site's mask was established for (the model's
    maximum, a buffer the mask reads, or the sizes a static graph was compiled at): longer ones are
    refused, not computed with a mask nobody proved there.
    ``positions_from_first_key`` (drop-in calls with key padding only) counts positions from each
    row's first present key, as Hugging Face's chunked masks do under left padding; paged sequences
    hold no padding, so it changes nothing there.
    ``position_mod`` (JSON; empty: none) is the site's own mask and bias program over query position,
    key position and head, for masks and biases that are none of the above but depend on positions
    only; ``position_tables`` holds the constant tables it reads (:mod:`pagedattn.backends.position_mod`).
    Its mask applies on top of the others; its bias is added with ALiBi's.
    ``position_data`` is what a program that reads per-request values (a prefix-LM mask from
    ``token_type_ids``: ``position_mod.value_spec``) reads them from. Unlike the other fields it is
    the same for every site of a call, not a property of one: in drop-in mode the model's own input
    (``[B, tokens]`` token types or ``[B]`` prefix lengths, turned into values by
    ``position_mod.values_from_input``), in paged mode the step's values, ``[num_seqs, count]`` int64,
    one row per sequence of the metadata.
    Which keys are visible is stated once, in :mod:`pagedattn.backends.reference`.
    """

    scale: float
    causal: bool
    sliding_window: int
    softcap: float
    alibi_slopes: Optional[T]
    num_kv_heads: int
    head_size_v: int
    sinks: Optional[T] = None
    chunk_size: int = 0
    max_seq_len: int = 0
    positions_from_first_key: bool = False
    position_mod: str = ""
    position_tables: Optional[T] = None
    position_data: Optional[T] = None

    @property
    def window(self) -> int:
        """The sliding window, 0 when there is none (a window only applies to causal attention)."""
        return self.sliding_window if self.causal and self.sliding_window > 0 else 0

    @property
    def chunk(self) -> int:
        """The attention chunk size, 0 when there is none (chunks only apply to causal attention)."""
        return self.chunk_size if self.causal and self.chunk_size > 0 else 0

    def args(self) -> tuple:
        """The flat schema arguments, in schema order."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))

    @classmethod
    def from_args(cls, args: typing.Sequence) -> "AttentionParams":
        return cls(*args)

    def describe(self) -> str:
        parts = [f"scale {self.scale:.4g}", "causal" if self.causal else "bidirectional"]
        if self.window:
            parts.append(f"window {self.window}")
        if self.chunk:
            parts.append(f"chunk {self.chunk}")
        if self.softcap > 0:
            parts.append(f"softcap {self.softcap:g}")
        if self.alibi_slopes is not None:
            parts.append("alibi")
        if self.sinks is not None:
            parts.append("sinks")
        if self.position_mod:
            parts.append("position program")
        return ", ".join(parts)


@dataclass(frozen=True)
class AttentionConfig:
    """One site as a backend's ``supports()`` sees it: its parameters and operand shapes."""

    params: AttentionParams
    num_heads: int
    head_size: int
    dtype: torch.dtype = torch.float32

    @property
    def group_size(self) -> int:
        return self.num_heads // self.params.num_kv_heads


_SCHEMA_TYPES = {float: "float", bool: "bool", int: "int", str: "str"}


def _schema_type(hint) -> str:
    if hint in _SCHEMA_TYPES:
        return _SCHEMA_TYPES[hint]
    if typing.get_origin(hint) is typing.Union and type(None) in typing.get_args(hint):
        return "Tensor?"  # Optional[T]
    raise TypeError(f"AttentionParams field type {hint!r} has no schema type")


def _schema_default(value) -> str:
    if value is None:
        return "None"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, str):
        return '"' + value + '"'
    return repr(value)


def params_schema() -> str:
    """The ``AttentionParams`` fields as custom-op schema arguments."""
    hints = typing.get_type_hints(AttentionParams)
    parts = []
    for f in dataclasses.fields(AttentionParams):
        default = "" if f.default is dataclasses.MISSING else f"={_schema_default(f.default)}"
        parts.append(f"{_schema_type(hints[f.name])} {f.name}{default}")
    return ", ".join(parts)


@dataclass(frozen=True)
class CacheSpec:
    """The KV cache one paged site needs: its kv heads, head size and dtype (``site`` names it)."""

    site: str
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    def bytes_per_block(self, block_size: int, dtype: Optional[torch.dtype] = None) -> int:
        """K and V of one block."""
        return 2 * block_size * self.num_kv_heads * self.head_size * (dtype or self.dtype).itemsize

    def to_json(self) -> dict:
        return {"site": self.site, "num_kv_heads": self.num_kv_heads, "head_size": self.head_size,
                "dtype": str(self.dtype).replace("torch.", "")}

    @classmethod
    def from_json(cls, d: dict) -> "CacheSpec":
        dtype = getattr(torch, str(d["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"cache spec of site {d.get('site')!r}: unknown dtype {d['dtype']!r}")
        return cls(str(d["site"]), int(d["num_kv_heads"]), int(d["head_size"]), dtype)
