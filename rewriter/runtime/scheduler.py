"""Continuous batching: which requests compute how many tokens this step."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from pagedattn.runtime.blocks import BlockManager, BlockTable, NoFreeBlocks

log = logging.getLogger("pagedattn.runtime")


@dataclass(frozen=True)
class SamplingParams:
    """Greedy when ``temperature == 0``."""

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class Request:
    id: int
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    table: BlockTable = field(default_factory=BlockTable)
    num_computed: int = 0  # tokens whose K/V are in the cache
    finished: bool = False
    finish_reason: Optional[str] = None
    num_preemptions: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def num_pending(self) -> int:
        return self.num_tokens - self.num_computed


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    start: int  # first token position computed this step
    num_tokens: int

    @property
    def completes(self) -> bool:
        """Whether this chunk reaches the end of the request's tokens (so it yields a new token)."""
        return self.start + self.num_tokens == self.request.num_tokens


class Scheduler:
    """Running requests first (oldest first), then waiting ones, under a token budget per step.

    Prefills are chunked to fit the budget. When blocks run out, the newest running request is
    preempted: its blocks are freed and it is recomputed later from its tokens so far.
    """

    def __init__(self, blocks: BlockManager, max_num_tokens: int = 512, max_num_seqs: int = 256):
        if max_num_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_num_tokens and max_num_seqs must be >= 1")
        self.blocks = blocks
        self.max_num_tokens, self.max_num_seqs = max_num_tokens, max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, victim: Request) -> None:
        self.blocks.free(victim.table)
        victim.num_computed = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(victim)
        self.waiting.appendleft(victim)
        log.debug("preempted request %s (recompute)", victim.id)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_tokens
        plan: list[ScheduledChunk] = []
        for req in list(self.running):
            if budget == 0:
                break
            if req not in self.running:  # preempted while making room for an older request
                continue
            n = min(req.num_pending, budget)
            while True:
                try:
                    self.blocks.reserve(req.table, n)
                    break
                except NoFreeBlocks:
                    victim = self.running[-1]
                    self._preempt(victim)
                    if victim is req:
                        break
            if req not in self.running:
                continue
            plan.append(ScheduledChunk(req, req.num_computed, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if not req.table.blocks:
                req.num_computed = self.blocks.allocate_prompt(req.table, req.tokens)
            n = min(req.num_pending, budget)
            try:
                self.blocks.reserve(req.table, n)
            except NoFreeBlocks:
                # waits until blocks are freed, holding none (two waiting requests must not share the cache out)
                self.blocks.free(req.table)
                req.num_computed = 0
                break
            self.waiting.popleft()
            self.running.append(req)
            plan.append(ScheduledChunk(req, req.num_computed, n))
            budget -= n
        return plan

    def finish(self, req: Request, reason: str) -> None:
        req.finished, req.finish_reason = True, reason
        self.blocks.free(req.table)
        if req in self.running:
            self.running.remove(req)
