"""Continuous batching: which requests compute how many tokens this step."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from pagedattn.runtime.blocks import BlockManager, BlockTable, NoFreeBlocks

log = logging.getLogger("pagedattn.runtime")

PREEMPTION_MODES = ("recompute", "swap")


@dataclass(frozen=True)
class PreemptionConfig:
    """How requests give their blocks back when the cache runs out.

    ``"recompute"`` frees a victim's blocks and recomputes its tokens later. ``"swap"`` copies them
    to ``swap_space`` bytes of host cache and back when blocks free up (recompute when the host cache
    is full too); ``swap_space=None`` sizes the host cache like the device cache.
    """

    mode: str = "recompute"
    swap_space: int | None = None

    def __post_init__(self):
        if self.mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.mode!r}")
        if self.swap_space is None:
            return
        if self.mode != "swap":
            raise ValueError(f"swap_space={self.swap_space!r} is given but preemption_mode is {self.mode!r}: "
                             "pass preemption_mode='swap' to use it, or leave swap_space out")
        if isinstance(self.swap_space, bool) or not isinstance(self.swap_space, int):
            raise TypeError(f"swap_space must be a byte count (an int, e.g. 4 * 2**30 for 4 GiB), "
                            f"got {self.swap_space!r}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 bytes, got {self.swap_space}: pass a byte count, "
                             "or None to size the host cache like the device cache")

    def num_host_blocks(self, bytes_per_block: int, num_device_blocks: int) -> int:
        """Host cache blocks to allocate: none for recompute."""
        if self.mode != "swap":
            return 0
        if self.swap_space is None:
            return num_device_blocks
        return self.swap_space // bytes_per_block


@dataclass(frozen=True)
class SamplingParams:
    """Greedy when ``temperature == 0``."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()


@dataclass(eq=False)  # a request is itself: queues test membership by identity, not by comparing token lists
class Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    table: BlockTable = field(default_factory=BlockTable)
    num_computed: int = 0  # tokens whose K/V are in the cache
    # tokens sampled by asynchronous decode steps still running on the device: counted in num_tokens (the next
    # step computes the first of them, its id read on the device), appended to ``output`` once read back
    inflight: int = 0
    finished: bool = False
    finish_reason: str | None = None
    num_preemptions: int = 0
    # an encoder-decoder request: its encoder inputs, how many encoder tokens its cross-attention blocks
    # hold, those blocks (allocated at admission, freed, swapped and recomputed with the request), whether
    # they hold the encoder's K/V yet, and the output tokens its generation config forces (index -> token)
    encoder_inputs: dict | None = None
    encoder_len: int = 0
    cross_table: BlockTable = field(default_factory=BlockTable)
    encoded: bool = False
    forced: dict[int, int] = field(default_factory=dict)
    # a prefix-LM request: its per-request values (what its masks read: position_mod.values_from_input of its
    # token types), its spans [start, end) (a query there sees later keys of its span only, so a step never
    # ends inside one), and its prompt's token types (generated tokens get the model's "outside" type)
    values: tuple[int, ...] | None = None
    spans: tuple[tuple[int, int], ...] = ()
    token_types: list[int] | None = None

    @property
    def swapped(self) -> bool:
        """Preempted by swapping: its computed tokens' K/V wait in host blocks."""
        return self.table.on_host

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def token_slice(self, start: int, stop: int) -> list[int]:
        """``tokens[start:stop]`` without joining the whole prompt and output first (a decode step's one token)."""
        p = len(self.prompt)
        if start >= p:
            return self.output[start - p:stop - p]
        if stop <= p:
            return self.prompt[start:stop]
        return self.prompt[start:] + self.output[:stop - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output) + self.inflight

    @property
    def num_pending(self) -> int:
        return self.num_tokens - self.num_computed

    def chunk(self, budget: int) -> int:
        """How many of its pending tokens to compute in a step of at most ``budget``: never a step that ends
        inside a span (its queries would miss the span's later keys) — cut before the span, else (a chunk that
        starts inside one, after a prefix-cache hit) all of it, else nothing this step."""
        start = self.num_computed
        n = min(self.num_pending, budget)
        for lo, hi in self.spans:
            end = start + n
            if lo < end < hi:
                if lo > start:
                    n = lo - start
                else:
                    n = hi - start if hi - start <= budget else 0
        return n


class ScheduledChunk(NamedTuple):
    """``num_tokens`` of ``request``'s tokens from position ``start``, computed in one step. A tuple: a serving step
    makes one per running request, and a frozen dataclass's fields cost twice a tuple's to set."""

    request: Request
    start: int  # first token position computed this step
    num_tokens: int

    @property
    def completes(self) -> bool:
        """Whether this chunk reaches the end of the request's tokens (so it yields a new token)."""
        return self.start + self.num_tokens == self.request.num_tokens


class Scheduler:
    """Running requests first (oldest first), then swapped-out ones, then waiting ones, under a token
    budget per step.

    Prefills are chunked to fit the budget (and ``max_chunk`` tokens of a request per step: 1 for
    models whose state advances one token at a time). When blocks run out, the newest running request is
    preempted. With ``preemption_mode="recompute"`` its blocks are freed and it is recomputed later
    from its tokens so far. With ``"swap"`` its blocks move to the block manager's host pool (the
    engine copies them, see ``BlockManager.take_swaps``) and come back before any waiting request is
    admitted; a victim that does not fit in the host pool is recomputed instead. As in vLLM, nothing
    is swapped in during a step that preempted: that step has no room to spare.
    """

    def __init__(self, blocks: BlockManager, max_num_tokens: int = 512, max_num_seqs: int = 256,
                 preemption_mode: str = "recompute", max_chunk: int | None = None):
        if max_num_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_num_tokens and max_num_seqs must be >= 1")
        if max_chunk is not None and max_chunk < 1:
            raise ValueError(f"max_chunk must be >= 1 or None, got {max_chunk}")
        self.max_chunk = max_chunk or max_num_tokens  # tokens of one request per step
        PreemptionConfig(preemption_mode)  # validates the mode
        self.blocks = blocks
        self.max_num_tokens, self.max_num_seqs = max_num_tokens, max_num_seqs
        self.preemption_mode = preemption_mode
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()  # oldest first, like waiting
        self.reset_counts()

    def reset_counts(self) -> None:
        """Preemptions, recomputes, swap-outs and swap-ins counted from zero (a new scheduler's counts)."""
        self.num_preemptions = 0  # all preemptions: recomputes plus swap-outs
        self.num_recomputes = 0
        self.num_swap_outs = 0
        self.num_swap_ins = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def _cross_blocks_needed(self, req: Request) -> int:
        """Cross-attention blocks an encoder-decoder request still needs (0 once it holds them)."""
        if not req.encoder_len or req.cross_table.blocks:
            return 0
        return -(-req.encoder_len // self.blocks.block_size)

    def _free(self, req: Request) -> None:
        """Give back every block of a request, its cross-attention blocks too (their K/V are recomputed)."""
        self.blocks.free(req.table)
        if req.cross_table.blocks:
            self.blocks.free(req.cross_table)
        req.encoded = False

    def _can_swap_out(self, req: Request) -> bool:
        return self.blocks.can_swap_out(req.table) and \
            len(req.table.blocks) + len(req.cross_table.blocks) <= self.blocks.num_free_host

    def _can_swap_in(self, req: Request, n: int) -> bool:
        return self.blocks.can_swap_in(req.table, n) and \
            self.blocks.swap_in_blocks_needed(req.table, n) + len(req.cross_table.blocks) <= self.blocks.num_free

    def _preempt(self, victim: Request) -> None:
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(victim)
        if self.preemption_mode == "swap" and self._can_swap_out(victim):
            self.blocks.swap_out(victim.table)
            if victim.cross_table.blocks:
                self.blocks.swap_out(victim.cross_table)
            self.num_swap_outs += 1
            # appendleft: victims go newest first, so the oldest ends up first in line again
            self.swapped.appendleft(victim)
            log.debug("preempted request %s (swapped out %d blocks)", victim.id, len(victim.table.blocks))
            return
        if self.preemption_mode == "swap":
            log.debug("host swap space full: request %s is recomputed instead", victim.id)
        self._free(victim)
        victim.num_computed = 0
        self.num_recomputes += 1
        self.waiting.appendleft(victim)
        log.debug("preempted request %s (recompute)", victim.id)

    def _swap_in(self, budget: int, plan: list[ScheduledChunk]) -> int:
        """Bring swapped-out requests back (oldest first) while they fit; returns the budget left."""
        while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.swapped[0]
            n = req.chunk(min(budget, self.max_chunk))
            if n == 0 or not self._can_swap_in(req, n):
                break  # the oldest goes first: later ones wait rather than overtake it
            self.blocks.swap_in(req.table)
            if req.cross_table.on_host:
                self.blocks.swap_in(req.cross_table)
            self.blocks.reserve(req.table, n)  # fits: can_swap_in counted these blocks
            self.swapped.popleft()
            self.num_swap_ins += 1
            self.running.append(req)
            plan.append(ScheduledChunk(req, req.num_computed, n))
            budget -= n
            log.debug("swapped in request %s", req.id)
        return budget

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_tokens
        plan: list[ScheduledChunk] = []
        preemptions = self.num_preemptions
        for req in list(self.running):
            if budget == 0:
                break
            # preempted while making room for an older request (a list scan: only once this step preempted)
            if self.num_preemptions != preemptions and req not in self.running:
                continue
            n = req.chunk(min(budget, self.max_chunk))
            if n == 0:  # a span that does not fit what is left of the step: the next step
                continue
            while True:
                try:
                    self.blocks.reserve(req.table, n)
                    break
                except NoFreeBlocks:
                    victim = self.running[-1]
                    self._preempt(victim)
                    if victim is req:
                        break
            if self.num_preemptions != preemptions and req not in self.running:
                continue
            plan.append(ScheduledChunk(req, req.num_computed, n))
            budget -= n
        if self.num_preemptions == preemptions:
            budget = self._swap_in(budget, plan)
        # swapped-out requests hold computed tokens: new ones must not take the blocks they wait for
        while not self.swapped and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if not req.table.blocks:
                req.num_computed = self.blocks.allocate_prompt(req.table, req.tokens)
            n = req.chunk(min(budget, self.max_chunk))
            if n == 0:  # its span waits for a step with room for all of it
                self._free(req)
                req.num_computed = 0
                break
            try:
                cross = self._cross_blocks_needed(req)
                if cross + self.blocks.blocks_needed(req.table, n) > self.blocks.num_free:
                    raise NoFreeBlocks
                if cross:
                    self.blocks.allocate(req.cross_table, cross)
                self.blocks.reserve(req.table, n)
            except NoFreeBlocks:
                # waits until blocks are freed, holding none (two waiting requests must not share the cache out)
                self._free(req)
                req.num_computed = 0
                break
            self.waiting.popleft()
            self.running.append(req)
            plan.append(ScheduledChunk(req, req.num_computed, n))
            budget -= n
        return plan

    def finish(self, req: Request, reason: str) -> None:
        req.finished, req.finish_reason = True, reason
        self._free(req)
        if req in self.running:
            self.running.remove(req)

    def abort(self, request_id: int) -> Request | None:
        """Drop the unfinished request ``request_id`` wherever it is (running, swapped out or waiting) and
        free its blocks, device or host, at once. Returns it, or None when no unfinished request has that id.

        Call it between steps: the blocks of a step's plan are in use until the step ends.
        """
        for queue in (self.running, self.swapped, self.waiting):
            req = next((r for r in queue if r.id == request_id), None)
            if req is not None:
                queue.remove(req)
                req.finished, req.finish_reason = True, "abort"
                self._free(req)
                req.num_computed = 0
                return req
        return None
