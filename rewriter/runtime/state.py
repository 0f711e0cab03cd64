"""Per-request recurrent state slots next to the paged KV cache (hybrid and state-space models).

Linear-attention, Mamba, short-convolution and RNN layers carry a fixed-size state along the
sequence instead of a growing K/V history. As in vLLM's state cache, each request owns one slot of
every state tensor; the model adapter (``pagedattn.hf_state``) says which tensors those are and
how the model's step takes and returns them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["StateSlot", "StatePool"]


@dataclass(frozen=True)
class StateSlot:
    """One state tensor: reached from the cache object by ``path`` (attributes and indices), per sequence."""

    path: tuple  # e.g. ("layers", 0, "conv_states", 0), ("linear_cache", 3), ("rnn_state", 0, 1), (2,)
    shape: tuple[int, ...]  # without the batch dimension
    dtype: torch.dtype

    @property
    def name(self) -> str:
        return ".".join(str(p) for p in self.path)

    @property
    def in_linear_layer(self) -> bool:
        return self.path[0] == "layers"


class StatePool:
    """State tensors of every request: one row (slot) per request, grown on demand."""

    def __init__(self, slots: Sequence[StateSlot], device: torch.device, capacity: int = 8):
        self.slots = tuple(slots)
        self.device = device
        self.tensors = [torch.zeros((capacity, *s.shape), dtype=s.dtype, device=device) for s in self.slots]
        self.slot_of: dict[int, int] = {}
        self.free_slots = list(range(capacity))[::-1]

    @property
    def capacity(self) -> int:
        return self.tensors[0].shape[0]

    def start(self, rid: int) -> None:
        """Zero the request's state (a new sequence, or one recomputed from its first token)."""
        if rid not in self.slot_of:
            if not self.free_slots:
                self._grow()
            self.slot_of[rid] = self.free_slots.pop()
        slot = self.slot_of[rid]
        for t in self.tensors:
            t[slot].zero_()

    def release(self, rid: int) -> None:
        slot = self.slot_of.pop(rid, None)
        if slot is not None:
            self.free_slots.append(slot)

    def gather(self, rids: Sequence[int]) -> list[torch.Tensor]:
        idx = self._index(rids)
        return [t.index_select(0, idx) for t in self.tensors]  # each [B, ...]

    def scatter(self, rids: Sequence[int], states: Sequence[torch.Tensor]) -> None:
        idx = self._index(rids)
        for t, new in zip(self.tensors, states):
            t.index_copy_(0, idx, new.to(t.dtype))

    def _index(self, rids: Sequence[int]) -> torch.Tensor:
        missing = [r for r in rids if r not in self.slot_of]
        if missing:
            raise RuntimeError(f"requests {missing} continue a sequence whose state was never started")
        return torch.tensor([self.slot_of[r] for r in rids], dtype=torch.long, device=self.device)

    def _grow(self) -> None:
        old = self.capacity
        self.tensors = [torch.cat([t, torch.zeros_like(t)]) for t in self.tensors]
        self.free_slots.extend(range(2 * old - 1, old - 1, -1))
