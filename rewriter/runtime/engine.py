"""``PagedEngine``: continuous batching over a rewritten model's paged KV caches."""

from __future__ import annotations

import inspect
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch
from torch import nn

from pagedattn.backends import build_metadata, get_backend
from pagedattn.runtime.blocks import BlockManager
from pagedattn.runtime.context import paged_context
from pagedattn.runtime.scheduler import PreemptionConfig, Request, SamplingParams, ScheduledChunk, Scheduler
from pagedattn.api import _without_hf_cache
from pagedattn.runtime.state import StatefulStep, StateLayout, StatePool, find_recurrent_state

log = logging.getLogger("pagedattn.runtime")

__all__ = ["PagedEngine", "SamplingParams", "RequestOutput", "RequestErrors"]


@dataclass(frozen=True)
class RequestOutput:
    request_id: int
    prompt: list[int]
    tokens: list[int]
    finish_reason: str


class RequestErrors(ValueError):
    """Some requests were rejected; ``results`` holds the others' outputs (None for rejected ones)."""

    def __init__(self, errors: dict[int, str], results: list):
        self.errors, self.results = errors, results
        super().__init__("; ".join(f"request {i}: {msg}" for i, msg in errors.items()))


def _parse_memory(memory, bytes_per_block: int, device: torch.device) -> int:
    if isinstance(memory, float) and 0 < memory <= 1:
        if device.type == "cuda":
            free = torch.cuda.mem_get_info(device)[0]
        else:
            import os

            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        memory = int(free * memory)
    if not isinstance(memory, int) or memory <= 0:
        raise ValueError(f"memory must be a byte count or a fraction in (0, 1], got {memory!r}")
    return memory // bytes_per_block


class PagedEngine:
    """Serve a model with a paged KV cache and continuous batching.

    ``model`` is a Hugging Face causal LM (rewritten on the fly), a ``RewrittenModel``, or a module
    compiled with ``torch.compile(backend="pagedattn")``. Tokens of all scheduled sequences run as
    one ``[1, T]`` step with explicit position ids. ``compile=True`` compiles a rewritten model's
    paged graph with Inductor (once, with dynamic shapes; the first steps pay for it).

    When the cache runs out of blocks the newest running request is preempted.
    ``preemption_mode="recompute"`` (the default) drops its blocks and recomputes its tokens later;
    ``"swap"`` copies its blocks to a host ("cpu") cache of ``swap_space`` bytes (``None``: as many
    blocks as the device cache) with the backend's ``swap_blocks`` and back when blocks free up, so
    nothing is recomputed; a victim that does not fit in the host cache is recomputed. ``stats``
    counts ``preemptions``, ``recomputes``, ``swap_outs`` and ``swap_ins``.

    Models with recurrent state besides attention (Hugging Face hybrids and state-space models:
    linear attention, Mamba, short convolutions) get a state slot per request next to the paged
    KV cache (:mod:`pagedattn.runtime.state`); their steps run one row per sequence (decode tokens
    batched, prefill chunks a row each) and prefix caching is off, since a cached prefix carries no
    state. Pass such a model itself, not a ``RewrittenModel``: the engine traces it with its state.
    """

    def __init__(self, model: nn.Module, *, target: str = "auto", block_size: int = 16,
                 num_blocks: Optional[int] = None, memory: Optional[int | float] = None,
                 max_num_tokens: int = 512, max_num_seqs: int = 256, enable_prefix_caching: bool = True,
                 dtype: Optional[torch.dtype] = None, eos_token_id: Optional[int | Sequence[int]] = None,
                 compile: bool = False, preemption_mode: str = "recompute", swap_space: int | None = None):
        from pagedattn.api import RewrittenModel

        self.preemption = PreemptionConfig(preemption_mode, swap_space)  # bad values fail before the rewrite
        self.backend = get_backend(target)
        self.device = torch.device(self.backend.device_type)
        self.block_size = block_size
        self.vocab_size = _vocab_size(model)
        model_device = _module_device(model)
        if model_device is not None and model_device.type != self.device.type:
            raise ValueError(f"the model's parameters are on {model_device} but target {target!r} runs on "
                             f"{self.device.type}: move the model first (model.to('{self.device.type}'))")
        self._eos = _eos_ids(model, eos_token_id)
        self.state_layout: Optional[StateLayout] = None
        self._token_steps = False  # state that advances one token per step (see _choose_state_mode)
        self.fresh_model = None  # the first step of a sequence, where its initial state is not zeros
        self._one_row = False  # steps run one row per call
        if isinstance(model, RewrittenModel):
            self.model, self._kwargs = model, _input_names(model)
            specs = model.cache_specs
        elif _is_compiled(model):
            self.model, self._kwargs = model, _accepted(_original(model))
            specs = _compiled_cache_specs(model, self._kwargs)
        else:
            self._kwargs = _accepted(model)
            self.state_layout = find_recurrent_state(model)
            if self.state_layout is not None:
                self._choose_state_mode(model, target, block_size, dtype)
            else:
                self.model = _rewrite_plain(model, self._kwargs, target, block_size)
            specs = self.model.cache_specs
        if self.state_layout is not None:
            if self.backend.step_padder(max_num_tokens, max_num_seqs, 1) is not None:
                raise ValueError(f"PagedEngine cannot serve a model with recurrent state on target {target!r}: "
                                 "its steps run one row per sequence, which the padded step shapes of this "
                                 "backend do not cover; use the CPU or CUDA target")
            if enable_prefix_caching:
                log.info("prefix caching is off: a cached prefix holds K/V but not the recurrent state")
                enable_prefix_caching = False
        elif not specs:
            raise ValueError("the model has no rewritten attention sites: nothing to page (see its report)")
        if compile:
            if not isinstance(self.model, RewrittenModel):
                raise ValueError("compile=True applies to models the engine rewrites or a RewrittenModel; "
                                 "a torch.compile'd model is compiled already")
            self.model.compile_paged()
            if self.fresh_model is not None:  # the first steps of sequences whose state the model starts
                self.fresh_model.compile_paged()
        self.cache_specs = specs
        self.cache_dtype = dtype or _cache_dtype(specs, self.state_layout)
        bytes_per_block = max(1, sum(2 * block_size * s["num_kv_heads"] * s["head_size"] for s in specs) *
                              torch.tensor([], dtype=self.cache_dtype).element_size())
        if num_blocks is None:
            num_blocks = _parse_memory(memory, bytes_per_block, self.device) if memory is not None else 2048
        self.num_blocks = int(num_blocks)
        self.kv_caches = [self.backend.allocate_kv_cache(self.num_blocks, block_size, s["num_kv_heads"],
                                                         s["head_size"], self.cache_dtype, self.device)
                          for s in specs]
        self.kv_bytes = sum(c.numel() * c.element_size() for c in self.kv_caches)
        num_host_blocks = self.preemption.num_host_blocks(bytes_per_block, self.num_blocks)
        if preemption_mode == "swap" and num_host_blocks == 0:
            log.warning("swap_space=%s bytes holds no block of %d bytes: every preemption recomputes",
                        swap_space, bytes_per_block)
        # same layout as the device caches, so swap_blocks moves whole blocks between the two
        self.host_kv_caches = [self.backend.allocate_kv_cache(num_host_blocks, block_size, s["num_kv_heads"],
                                                              s["head_size"], self.cache_dtype, "cpu")
                               for s in specs] if num_host_blocks else []
        self.states = StatePool(self.state_layout, self.device) if self.state_layout else None
        if self.state_layout is None:
            self._check_packing()
        self.blocks = BlockManager(self.num_blocks, block_size, enable_prefix_caching, num_host_blocks)
        self.scheduler = Scheduler(self.blocks, max_num_tokens, max_num_seqs, preemption_mode,
                                   max_chunk=1 if self._token_steps else None)
        self._pad = self.backend.step_padder(max_num_tokens, max_num_seqs, self.num_blocks)
        self._ids = itertools.count()
        self._finished: list[RequestOutput] = []
        self._generators: dict[int, torch.Generator] = {}
        self.stats = {"steps": 0, "model_s": 0.0, "overhead_s": 0.0, "tokens": 0,
                      "preemptions": 0, "recomputes": 0, "swap_outs": 0, "swap_ins": 0}

    def _check_packing(self) -> None:
        """Refuse models whose tokens influence each other outside attention.

        Steps pack several sequences into one row and split prompts into chunks across steps; only
        attention knows where a sequence starts and what its cache holds. A model that numbers tokens
        by their index in the step (no ``position_ids``), or that carries state along the row outside
        attention (recurrent, convolution or linear-attention layers), would silently mix sequences.
        Checked by running a sequence alone, after another one in the same step, and in two chunks.
        """
        vocab = self.vocab_size or 2
        first = [(3 + 5 * i) % vocab for i in range(7)]
        second = [(11 + 3 * i) % vocab for i in range(5)]
        bs = self.block_size
        n0, n1 = -(-len(first) // bs), -(-len(second) // bs)
        blocks = n0 + n1
        tables = {0: list(range(n0)), 1: list(range(n0, blocks))}  # each sequence its own blocks

        def run(steps):
            """steps: per step, the (sequence index, tokens) chunks; returns the last row's logits."""
            caches = [self.backend.allocate_kv_cache(blocks, bs, s["num_kv_heads"], s["head_size"],
                                                     self.cache_dtype, self.device) for s in self.cache_specs]
            done, out = {}, None
            for step in steps:
                specs, ids, pos = [], [], []
                for seq, toks in step:
                    start = done.get(seq, 0)
                    specs.append((start, len(toks), tables[seq]))
                    ids += toks
                    pos += list(range(start, start + len(toks)))
                    done[seq] = start + len(toks)
                meta = build_metadata(specs, bs, device=self.device)
                kwargs = self._inputs(ids, pos, [len(ids) - 1])
                with torch.no_grad(), paged_context(caches, meta):
                    out = self._logits(self.model(**kwargs), kwargs, [len(ids) - 1])[-1].float()
            return out

        try:
            alone = run([[(1, second)]])
            checks = {
                "after another sequence in the same step": run([[(0, first), (1, second)]]),
                "in two chunks": run([[(1, second[:3])], [(1, second[3:])]]),
            }
        except Exception as e:  # e.g. a guard of the traced program on the step's token count
            msg = str(e).splitlines()[0] if str(e) else ""
            raise ValueError(f"PagedEngine cannot serve this model: a packed step (2 to 12 tokens) failed "
                             f"({type(e).__name__}: {msg}); its traced forward does not accept every step size") from e
        # GEMMs sum in an order that depends on the step's rows; a bf16/fp16 result shows that as a few ulps
        rtol = max(1e-3, 4 * torch.finfo(self.cache_dtype).eps)
        atol = 1e-4 if rtol == 1e-3 else rtol * float(alone.abs().max())
        for how, got in checks.items():
            if not torch.allclose(alone, got, atol=atol, rtol=rtol):
                why = ("it takes no position_ids and numbers tokens by their index in the step; it needs a forward "
                       "that accepts position_ids, or no absolute positions (ALiBi)"
                       if "position_ids" not in self._kwargs else
                       "tokens influence each other outside attention (recurrent, convolution or linear-attention "
                       "layers, whose state the paged KV cache does not hold); if that state is in the model's "
                       "Hugging Face cache, pass the model itself, not a RewrittenModel, and the engine carries it")
                raise ValueError(f"PagedEngine cannot serve this model: a sequence's logits change when run {how} "
                                 f"(max difference {float((alone - got).abs().max()):.3g}): {why}")

    def _choose_state_mode(self, model: nn.Module, target: str, block_size: int, dtype) -> None:
        """Trace the stateful step for chunks of tokens, or else for one token per sequence and step.

        Some layers read their carried state only on single-token steps (Mamba-1's selective scan
        starts every longer chunk from zeros): their prompts then advance a token per step, in
        batches of rows. A single-token trace shows no mask extent: its sites take their masks from
        a multi-token trace of the model itself. A state that does not start from zeros gets a
        second trace for the first step of each sequence, in which the model starts it itself.
        """
        errors, hints = [], None
        # (tokens per row, rows): chunks in batched rows; one token per row; one token in one row per
        # call, for models whose single-token path mixes the rows of a batch (RWKV's broadcasts them)
        for tokens, rows in ((8, 2), (1, 2), (1, 1)):
            try:
                if tokens == 1 and hints is None:
                    hints = _rewrite_plain(model, self._kwargs, target, block_size).report
                self.model = _rewrite_stateful(model, self.state_layout, self._kwargs, target, block_size,
                                               tokens, rows, hints)
                if not self.state_layout.starts_from_zeros:
                    self.fresh_model = _rewrite_stateful(model, self.state_layout, self._kwargs, target,
                                                         block_size, tokens, rows, hints, fresh=True)
                self.cache_specs, self._token_steps, self._one_row = self.model.cache_specs, tokens == 1, rows == 1
                self.cache_dtype = dtype or _cache_dtype(self.cache_specs, self.state_layout)
                self._check_state(model)
                if errors:
                    log.info("the model's state advances %s (%s)", "one token per step" if rows > 1 else
                             "one token per step and call", "; ".join(errors))
                return
            except (ValueError, RuntimeError) as e:
                errors.append(f"{tokens}-token steps in {rows} rows: "
                              f"{str(e).splitlines()[0] if str(e) else type(e).__name__}")
        raise ValueError("PagedEngine cannot serve this model with its recurrent state: " + "; ".join(errors))

    def _check_state(self, model: nn.Module) -> None:
        """Refuse a stateful model whose steps do not reproduce its own forward.

        A sequence runs as one prefill row, and again as a chunk batched beside another sequence, then
        single tokens batched with it, then a last chunk: each time its last logits must equal the
        model's forward over the whole sequence. This catches state the Hugging Face cache does not hold.
        """
        vocab = self.vocab_size or 2
        seq = [(11 + 3 * i) % vocab for i in range(9)]
        other = [(3 + 5 * i) % vocab for i in range(6)]
        bs = self.block_size
        n0 = -(-len(seq) // bs)
        tables = {0: list(range(n0)), 1: list(range(n0, n0 + -(-len(other) // bs)))}
        blocks = n0 + len(tables[1])

        def run(steps):
            caches = [self.backend.allocate_kv_cache(blocks, bs, s["num_kv_heads"], s["head_size"],
                                                     self.cache_dtype, self.device) for s in self.cache_specs]
            pool, done, last = StatePool(self.state_layout, self.device, capacity=2), {}, None
            for step in steps:
                items = []
                for rid, toks in step:
                    start = done.get(rid, 0)
                    if start == 0:
                        pool.start(rid)
                    items.append((rid, start, toks, tables[rid]))
                    done[rid] = start + len(toks)
                out = self._row_step(caches, pool, items)
                last = next((o for (rid, *_), o in zip(items, out) if rid == 0), last)
            return last.float()

        kw = {"input_ids": torch.tensor([seq], device=self.device)}
        if "position_ids" in self._kwargs:
            kw["position_ids"] = torch.arange(len(seq), device=self.device)[None]
        if "use_cache" in self._kwargs:
            kw["use_cache"] = False
        try:
            with torch.no_grad(), _without_hf_cache(model):
                ref = self._logits(model(**kw), {}, [len(seq) - 1])[-1].float()
            chunked = [[(0, seq[:4]), (1, other[:3])], [(0, seq[4:5]), (1, other[3:4])],
                       [(0, seq[5:6]), (1, other[4:6])], [(0, seq[6:])]]
            if self._token_steps:
                checks = {"a token per step, batched with another sequence": run(_token_by_token(chunked))}
            else:
                checks = {"as one prefill row": run([[(0, seq)]]),
                          "in chunks and single tokens batched with another sequence": run(chunked)}
        except Exception as e:
            msg = str(e).splitlines()[0] if str(e) else ""
            raise ValueError(f"PagedEngine cannot serve this model with its recurrent state: a step failed "
                             f"({type(e).__name__}: {msg})") from e
        # relative to the logits' scale: a lost state can move random-weight logits by as little as 1e-5
        tol = max(2e-5, 8 * torch.finfo(self.cache_dtype).eps) * float(ref.abs().max())
        for how, got in checks.items():
            if float((ref - got).abs().max()) > tol:
                raise ValueError(
                    f"PagedEngine cannot serve this model: run {how}, a sequence's logits differ from the model's "
                    f"own forward (max difference {float((ref - got).abs().max()):.3g}); its state lives outside "
                    "the Hugging Face cache layers the engine carries")

    def _inputs(self, ids: list[int], pos: Optional[list[int]], rows: list[int]) -> dict:
        kwargs = {"input_ids": torch.tensor([ids], device=self.device)}
        if "position_ids" in self._kwargs and pos is not None:
            kwargs["position_ids"] = torch.tensor([pos], device=self.device)
        if "use_cache" in self._kwargs:
            kwargs["use_cache"] = False
        if "logits_to_keep" in self._kwargs:
            kwargs["logits_to_keep"] = torch.tensor(rows, dtype=torch.long, device=self.device)
        return kwargs

    def _logits(self, out, kwargs: dict, rows: list[int]) -> torch.Tensor:
        """``[R, V]`` logits of the rows that complete a sequence."""
        logits = out.logits if hasattr(out, "logits") else out[0] if isinstance(out, (tuple, list)) else out
        if "logits_to_keep" in kwargs:
            return logits[0]
        return logits[0, torch.tensor(rows, dtype=torch.long, device=logits.device)]

    # ----------------------------------------------------------------- requests

    def validate(self, prompt: Sequence[int], params: SamplingParams) -> Optional[str]:
        """Why a request cannot be served, or None."""
        if len(prompt) == 0:
            return "the prompt is empty"
        if params.max_new_tokens <= 0:
            return f"max_new_tokens must be > 0, got {params.max_new_tokens}"
        bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < (self.vocab_size or 2**63)]
        if bad:
            return f"token id {bad[0]!r} is outside the vocabulary (0..{self.vocab_size - 1})"
        need = -(-(len(prompt) + params.max_new_tokens) // self.block_size)
        if need > self.num_blocks:
            return (f"prompt of {len(prompt)} tokens plus {params.max_new_tokens} new ones needs {need} blocks "
                    f"but the cache has {self.num_blocks}; raise num_blocks/memory or shorten the request")
        if params.temperature < 0 or not 0 < params.top_p <= 1 or params.top_k < 0:
            return "temperature must be >= 0, top_p in (0, 1], top_k >= 0"
        return None

    def add_request(self, prompt: Sequence[int], params: Optional[SamplingParams] = None, **kw) -> int:
        """Queue a request; returns its id. Raises ValueError naming what is wrong with it."""
        params = params or SamplingParams(**kw)
        rid = next(self._ids)
        why = self.validate(list(prompt), params)
        if why:
            raise ValueError(f"request {rid}: {why}")
        if params.seed is not None:
            self._generators[rid] = torch.Generator(device="cpu").manual_seed(params.seed)
        self.scheduler.add(Request(rid, [int(t) for t in prompt], params))
        return rid

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def collect(self) -> list[RequestOutput]:
        """Requests finished since the last call."""
        out, self._finished = self._finished, []
        return out

    # --------------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """Run one batch step; returns the requests that finished in it."""
        t0 = time.perf_counter()
        sched = self.scheduler
        before = _preemption_counts(sched)
        plan = sched.schedule()
        self._move_blocks()
        for key, n0, n1 in zip(("preemptions", "recomputes", "swap_outs", "swap_ins"), before,
                               _preemption_counts(sched)):
            self.stats[key] += n1 - n0  # deltas: callers may reset stats between runs
        if not plan:
            # a step that only preempted frees blocks for the next one; otherwise nothing ever will
            if (sched.waiting or sched.swapped) and not sched.running and sched.num_preemptions == before[0]:
                raise RuntimeError("scheduler made no progress with an empty cache: "
                                   f"{len(sched.waiting) + len(sched.swapped)} requests wait for blocks "
                                   "that never free")
            return []
        t1 = time.perf_counter()
        if self.states is not None:
            logits, num_tokens = self._run_rows(plan), sum(c.num_tokens for c in plan)
        else:
            logits, num_tokens, t1 = self._run_packed(plan)
        self.backend.sync()
        if logits.device.type != "cpu":
            logits = logits.cpu()  # one transfer for the whole step, not one per sampled request
        t2 = time.perf_counter()
        finished = self._advance(plan, logits)
        t3 = time.perf_counter()
        self.stats["steps"] += 1
        self.stats["tokens"] += num_tokens
        self.stats["model_s"] += t2 - t1
        self.stats["overhead_s"] += (t1 - t0) + (t3 - t2)
        return finished

    def _run_packed(self, plan: list[ScheduledChunk]) -> tuple[torch.Tensor, int, float]:
        """Every chunk of the step in one ``[1, T]`` row; ``[R, V]`` logits of the completing chunks."""
        ids, pos, rows = [], [], []
        for chunk in plan:
            toks = chunk.request.tokens[chunk.start:chunk.start + chunk.num_tokens]
            ids.extend(toks)
            pos.extend(range(chunk.start, chunk.start + chunk.num_tokens))
            if chunk.completes:
                rows.append(len(ids) - 1)
        num_tokens, num_rows = len(ids), len(rows)
        meta = build_metadata([(c.start, c.num_tokens, c.request.table.blocks) for c in plan], self.block_size,
                              device="cpu" if self._pad else self.device)
        if self._pad is not None:  # a bounded set of step shapes for devices that compile per shape
            meta = self._pad(meta)
            ids += [0] * (meta.num_tokens - num_tokens)
            pos += [0] * (meta.num_tokens - num_tokens)
            rows += [0] * (meta.num_seqs - num_rows)
            meta = meta.to(self.device)
        kwargs = self._inputs(ids, pos, rows)
        t1 = time.perf_counter()
        with torch.no_grad(), paged_context(self.kv_caches, meta):
            out = self.model(**kwargs)
        return self._logits(out, kwargs, rows)[:num_rows], num_tokens, t1  # [R, V]

    def _run_rows(self, plan: list[ScheduledChunk]) -> torch.Tensor:
        """Stateful models: one row per sequence; ``[R, V]`` logits of the completing chunks."""
        for c in plan:
            if c.start == 0:  # new, or recomputed after preemption
                self.states.start(c.request.id)
        items = [(c.request.id, c.start, c.request.tokens[c.start:c.start + c.num_tokens], c.request.table.blocks)
                 for c in plan]
        last = self._row_step(self.kv_caches, self.states, items)
        done = [row for c, row in zip(plan, last) if c.completes]
        return torch.stack(done) if done else torch.empty(0, self.vocab_size or 1)

    def _row_step(self, caches, pool: StatePool, items: list[tuple[int, int, list[int], list[int]]]) -> list:
        """Run ``(request id, start, tokens, block table)`` items as rows: single tokens batched, longer
        chunks one row each (the recurrence runs along a row); first steps through ``fresh_model`` where
        there is one. Returns each item's last-token logits."""
        groups = []
        for first in (True, False) if self.fresh_model is not None else (None,):
            idx = [i for i, it in enumerate(items) if first is None or (it[1] == 0) == first]
            single = [i for i in idx if len(items[i][2]) == 1]
            batched = [[i] for i in single] if self._one_row else [single] if single else []
            groups += [(first, g) for g in batched + [[i] for i in idx if len(items[i][2]) > 1]]
        out: list = [None] * len(items)
        for first, group in groups:
            rows = [items[i] for i in group]
            rids = [r[0] for r in rows]
            meta = build_metadata([(start, len(toks), table) for _, start, toks, table in rows], self.block_size,
                                  device=self.device)
            kwargs = {"input_ids": torch.tensor([r[2] for r in rows], device=self.device),
                      "position_ids": torch.tensor([list(range(r[1], r[1] + len(r[2]))) for r in rows],
                                                   device=self.device),
                      "states": [] if first else pool.gather(rids)}
            with torch.no_grad(), paged_context(caches, meta):
                logits, *states = (self.fresh_model if first else self.model)(**kwargs)  # [B, V], states [B, ...]
            pool.scatter(rids, states)
            for i, row in zip(group, logits):
                out[i] = row
        return out

    def _move_blocks(self) -> None:
        """Run the block moves the scheduler queued, before the step reads or writes the caches.

        Order matters: copy-on-write copies may fill a block that is then swapped out, and a block
        swapped out may be reused as a swap-in destination.
        """
        copies = self.blocks.take_copies()
        if copies:
            pairs = torch.tensor(copies, dtype=torch.long, device=self.device)
            for cache in self.kv_caches:
                self.backend.copy_blocks(cache, pairs)
        swap_out, swap_in = self.blocks.take_swaps()
        for moves, src_caches, dst_caches in ((swap_out, self.kv_caches, self.host_kv_caches),
                                              (swap_in, self.host_kv_caches, self.kv_caches)):
            if moves:
                pairs = torch.tensor(moves, dtype=torch.long)  # swap_blocks puts each column where it is used
                for src, dst in zip(src_caches, dst_caches):
                    self.backend.swap_blocks(src, dst, pairs)

    def _advance(self, plan: list[ScheduledChunk], logits: torch.Tensor) -> list[RequestOutput]:
        done = []
        r = 0
        for chunk in plan:
            req = chunk.request
            self.blocks.commit(req.table, req.tokens, chunk.num_tokens)
            req.num_computed += chunk.num_tokens
            if not chunk.completes:
                continue
            tok = self._sample(req, logits[r])
            r += 1
            req.output.append(tok)
            reason = None
            if tok in req.params.stop_token_ids or tok in self._eos:
                reason = "stop"
            elif len(req.output) >= req.params.max_new_tokens:
                reason = "length"
            if reason:
                self.scheduler.finish(req, reason)
                if self.states is not None:
                    self.states.release(req.id)
                self._generators.pop(req.id, None)
                res = RequestOutput(req.id, req.prompt, list(req.output), reason)
                self._finished.append(res)
                done.append(res)
        return done

    def _sample(self, req: Request, logits: torch.Tensor) -> int:
        p = req.params
        if p.temperature == 0:
            return int(torch.argmax(logits))
        x = logits.float() / p.temperature
        if p.top_k:
            kth = torch.topk(x, min(p.top_k, x.numel())).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        if p.top_p < 1:
            sorted_x, idx = torch.sort(x, descending=True)
            probs = torch.softmax(sorted_x, -1)
            drop = probs.cumsum(-1) - probs > p.top_p
            x = x.scatter(0, idx, sorted_x.masked_fill(drop, float("-inf")))
        probs = torch.softmax(x, -1).cpu()
        return int(torch.multinomial(probs, 1, generator=self._generators.get(req.id)))

    # ----------------------------------------------------------------- generate

    def generate(self, prompts: Iterable[Sequence[int]], max_new_tokens: int = 16, *, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: Optional[int] = None,
                 stop_token_ids: Sequence[int] = ()) -> list[list[int]]:
        """Generated tokens per prompt (greedy unless ``temperature > 0``).

        Invalid requests do not stop the others: after the rest finish, a ``RequestErrors`` names them
        and carries the other results.
        """
        prompts = [list(p) for p in prompts]
        ids: list[Optional[int]] = []
        errors: dict[int, str] = {}
        for i, prompt in enumerate(prompts):
            params = SamplingParams(max_new_tokens, temperature, top_k, top_p,
                                    None if seed is None else seed + i, tuple(stop_token_ids))
            try:
                ids.append(self.add_request(prompt, params))
            except ValueError as e:
                errors[i] = str(e).split(": ", 1)[-1]
                ids.append(None)
                log.error("prompt %d rejected: %s", i, errors[i])
        results: dict[int, list[int]] = {}
        while self.has_unfinished():
            for r in self.step():
                results[r.request_id] = r.tokens
        self.collect()
        out = [results.get(rid) if rid is not None else None for rid in ids]
        if errors:
            raise RequestErrors(errors, out)
        return out

    def overhead_share(self) -> float:
        total = self.stats["model_s"] + self.stats["overhead_s"]
        return self.stats["overhead_s"] / total if total else 0.0


def _preemption_counts(sched: Scheduler) -> tuple[int, int, int, int]:
    return sched.num_preemptions, sched.num_recomputes, sched.num_swap_outs, sched.num_swap_ins


# ------------------------------------------------------------------ model plumbing


def _original(model: nn.Module) -> nn.Module:
    return getattr(model, "_orig_mod", model)


def _is_compiled(model) -> bool:
    return hasattr(model, "_orig_mod") or (hasattr(model, "forward") and hasattr(model.forward, "_torchdynamo_orig_callable"))


def _accepted(model: nn.Module) -> set[str]:
    params = inspect.signature(_original(model).forward).parameters
    names = {n for n in ("input_ids", "position_ids", "use_cache", "logits_to_keep") if n in params}
    if "position_ids" not in names and any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()) \
            and _honours_positions(_original(model), names):
        names.add("position_ids")  # taken through **kwargs (e.g. Hugging Face's decoder-only wrappers)
    return names


def _honours_positions(model: nn.Module, names: set[str]) -> bool:
    """Whether ``position_ids`` passed through ``**kwargs`` reach the model: shifted positions change its output."""
    vocab = _vocab_size(model) or 2
    device = _module_device(model) or "cpu"
    ids = (torch.arange(6, device=device)[None] * 5 + 3) % vocab
    kw = {"use_cache": False} if "use_cache" in names else {}
    try:
        with torch.no_grad():
            a = model(input_ids=ids, position_ids=torch.arange(6, device=device)[None], **kw)
            b = model(input_ids=ids, position_ids=torch.arange(6, device=device)[None] + 7, **kw)
        a, b = (getattr(o, "logits", o[0] if isinstance(o, (tuple, list)) else o) for o in (a, b))
        return isinstance(a, torch.Tensor) and not torch.equal(a, b)
    except Exception:  # a forward that refuses the keyword does not take it
        return False


def _token_by_token(steps: list) -> list:
    """The same chunks split into steps of one token per sequence."""
    out = []
    for step in steps:
        for i in range(max(len(toks) for _, toks in step)):
            out.append([(rid, toks[i:i + 1]) for rid, toks in step if i < len(toks)])
    return out


def _cache_dtype(specs: list[dict], layout: Optional[StateLayout]) -> torch.dtype:
    elem = {s["dtype"] for s in specs} or {str(s.dtype).replace("torch.", "") for s in layout.slots}
    return getattr(torch, sorted(elem)[0])


def _rewrite_plain(model: nn.Module, names: set[str], target: str, block_size: int):
    from pagedattn.api import rewrite

    example = _example_kwargs(names, _vocab_size(model), _module_device(model) or "cpu")
    return rewrite(model, (), example, target=target, block_size=block_size)


def _rewrite_stateful(model: nn.Module, layout: StateLayout, names: set[str], target: str, block_size: int,
                      tokens: int = 8, rows: int = 2, mask_hints: Optional[list[dict]] = None,
                      fresh: bool = False):
    """Rewrite the model's step with its recurrent state as inputs and outputs (see StatefulStep)."""
    from pagedattn.api import rewrite

    device = _module_device(model) or "cpu"
    B, T = rows, tokens  # two rows: the batch dimension stays dynamic
    ids = (torch.arange(B * T, device=device).reshape(B, T) * 5 + 3) % (_vocab_size(model) or 2)
    example = {"input_ids": ids, "position_ids": torch.arange(T, device=device).expand(B, T).contiguous(),
               "states": [] if fresh else [torch.zeros((B, *s.shape), dtype=s.dtype, device=device)
                                           for s in layout.slots]}
    log.info("recurrent state per sequence: %s (%d bytes)", ", ".join(s.name for s in layout.slots),
             layout.bytes_per_sequence)
    rm = rewrite(StatefulStep(model, layout, "position_ids" in names, fresh).eval(), (), example,
                 target=target, block_size=block_size, mask_hints=mask_hints)
    rm._retrace = None  # a step whose program fixed its sizes refuses others: the next mode is tried instead
    return rm


def _input_names(model) -> set[str]:
    spec = model._in_spec
    try:
        kwargs = spec.child(1) if hasattr(spec, "child") else spec.children_specs[1]  # torch < 2.10 has no child()
        return set(kwargs.context)  # (args, kwargs) -> kwargs keys
    except Exception:
        return {"input_ids"}


def _example_kwargs(names: set[str], vocab: Optional[int], device: torch.device | str = "cpu") -> dict:
    T = 8
    # token ids that do not count up by one: the mask classifier must not take them for positions
    kw = {"input_ids": (torch.arange(T, device=device)[None] * 5 + 3) % (vocab or 2)}
    if "position_ids" in names:
        kw["position_ids"] = torch.arange(T, device=device)[None]
    if "use_cache" in names:
        kw["use_cache"] = False
    if "logits_to_keep" in names:
        kw["logits_to_keep"] = torch.tensor([T - 1, 3], device=device)
    return kw


def _module_device(model) -> Optional[torch.device]:
    """Where the model's parameters (or else buffers) live; None when it has neither."""
    for t in itertools.chain(_original(model).parameters(), _original(model).buffers()):
        return t.device
    return None


def _vocab_size(model) -> Optional[int]:
    cfg = getattr(_original(model), "config", None)
    if cfg is None:
        return None
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return getattr(cfg, "vocab_size", None)


def _eos_ids(model, eos) -> set[int]:
    """EOS ids given, else the model's own (generation config first, as Hugging Face generate does)."""
    if eos is None:
        m = _original(model)
        for cfg in (getattr(m, "generation_config", None), getattr(m, "config", None)):
            eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
            if eos is not None:
                break
    if eos is None:
        return set()
    return {eos} if isinstance(eos, int) else set(eos)


def _compiled_cache_specs(model, names: set[str]) -> list[dict]:
    """Compile once in drop-in mode to learn the rewritten sites' cache layout."""
    from pagedattn.compile import last_cache_specs

    with torch.no_grad():
        model(**_example_kwargs(names, _vocab_size(model), _module_device(model) or "cpu"))
    return last_cache_specs()
