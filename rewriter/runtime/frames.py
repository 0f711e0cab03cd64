"""Room on CPython's frame stack for a serving step.

From 3.11 on, CPython keeps a thread's frames in chunks of at least 16 KiB. A call that does not fit in the
current chunk gets a new one from ``mmap``, and the chunk is unmapped as soon as that call returns. A loop
whose calls start near the end of a chunk therefore maps, faults in and unmaps a fresh chunk at every call
that crosses the boundary. In a compiled decode step that is dozens of calls: measured on the llama16m CPU
step, 37 ``mmap``/``munmap`` pairs and ~37 page faults per step, ~15 % of the step, depending only on how
deep the caller's stack happened to be (``engine.generate`` was fast, the same steps from a script's own loop
were not, and the other way round for another build of the step).

:func:`call_with_frame_room` runs a call inside a frame that reserves value-stack slots it never touches:
that frame starts a chunk of 256 KiB, and the step's frames fill its untouched remainder instead of
crossing a chunk boundary: one chunk per call, whatever the caller's depth. Calls nested in one run in its
chunk, so a loop of steps run inside one call (``engine.generate``) maps no chunk per step at all.
"""

from __future__ import annotations

import sys
import threading
from typing import Callable, TypeVar

T = TypeVar("T")

# value-stack slots the spacer frame reserves (8 bytes each): 128 KiB, so its chunk is 256 KiB and the
# call's own frames have ~128 KiB after it. The slots are never written: untouched pages cost nothing.
ROOM_SLOTS = 16384


def _call(fn):
    return fn()


def _with_room(fn: Callable) -> Callable:
    code = fn.__code__.replace(co_stacksize=fn.__code__.co_stacksize + ROOM_SLOTS)
    return type(fn)(code, fn.__globals__, "call_with_frame_room")


# Before 3.11 frames are heap objects whose slots are all cleared on creation: a spacer would only cost.
_spacer = _with_room(_call) if sys.version_info >= (3, 11) else _call


_inside = threading.local()  # whether this thread runs inside a spacer (restored when the call ends)


def call_with_frame_room(fn: Callable[[], T]) -> T:
    """``fn()``, run with ~128 KiB of CPython frame stack to itself (see the module docstring); inside another
    such call, ``fn()`` as it is (it already has that room)."""
    if getattr(_inside, "active", False):
        return fn()
    _inside.active = True
    try:
        return _spacer(fn)
    finally:
        _inside.active = False
