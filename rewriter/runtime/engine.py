"""``PagedEngine``: continuous batching over a rewritten model's paged KV caches."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Optional, Sequence

import torch
from torch import nn

from pagedattn.backends import (
    AttentionMetadata,
    CrossMetadata,
    build_cross_metadata,
    build_decode_metadata,
    build_metadata,
    position_mod,
)
from pagedattn.backends.base import SplitKVBackend, argmax_tokens, use_backend
from pagedattn.runtime.blocks import BlockManager
from pagedattn.runtime.cuda_graphs import CaptureFailed, DecodeGraphs, DeviceTokens
from pagedattn.runtime.frames import call_with_frame_room
from pagedattn.runtime.scheduler import PreemptionConfig, Request, SamplingParams, ScheduledChunk, Scheduler
from pagedattn.runtime.shapes import first_rows, pad_cross
from pagedattn.runtime.state import StatePool
from pagedattn.seq2seq import encoder_key

if TYPE_CHECKING:
    from pagedattn.adapter import DecodeSteps

log = logging.getLogger("pagedattn.runtime")

# statistics that count decode steps computed ahead (``burst_ms``): their values follow measured step times
TIMED_COUNTS = frozenset({"ahead_steps", "dropped_steps"})

__all__ = ["PagedEngine", "SamplingParams", "RequestOutput", "RequestErrors"]


@dataclass(frozen=True)
class RequestOutput:
    request_id: int
    prompt: list[int]
    tokens: list[int]
    finish_reason: str


@dataclass(frozen=True)
class PendingStep:
    """An asynchronous decode step on its way through the device: its plan, the tokens it samples there (the next
    step reads its input ids from them) and their copy to the host, complete once ``copied`` is."""

    plan: list[ScheduledChunk]
    tokens: torch.Tensor  # [n] long, on the device
    host: torch.Tensor  # [n] long, on the host
    copied: Optional["torch.cuda.Event"]

    def read(self) -> list[int]:
        """The sampled tokens, once the step and their copy are done."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.host.tolist()


@dataclass
class DecodeRun:
    """Decode steps of the same requests planned together (``PagedEngine(plan_ahead=k)``): their blocks reserved and
    their metadata built as the first one runs. Step ``j`` computes each request's token at ``starts[i] + j``."""

    requests: list[Request]
    starts: list[int]
    metas: list[AttentionMetadata]  # one per step
    taken: int = 0  # steps run so far
    steps: Optional[DecodeSteps] = None  # the steps prepared to run back to back (greedy runs), else None
    stops: Optional[list[frozenset]] = None  # each request's stop tokens (its own and the model's), where any has some
    tokens: list[list[int]] = field(default_factory=list)  # step j's tokens, computed when given or before


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

    ``model`` is a Hugging Face causal LM (rewritten on the fly), a ``RewrittenModel``, a module
    compiled with ``torch.compile(backend="pagedattn")``, or a ``ServableModel`` from
    ``pagedattn.adapter.prepare_model`` (which the engine calls for the others). Tokens of all scheduled sequences run as
    one ``[1, T]`` step with explicit position ids.

    The step is compiled with Inductor by default (``compile=None``: a packed step on CPU or CUDA
    that is not compiled already; ``True`` also compiles the row steps of models with recurrent
    state; ``False`` runs it eager). Compiling happens here, before the first request. On the CPU the step is
    compiled ahead of time (``ahead_of_time=None``: where it applies; ``False``: with ``torch.compile``):
    AOTInductor's runner over one program for every step size, its package kept on disk and loaded by a later start
    (``RewrittenModel.compile_paged``). A step compiled by ``torch.compile`` is padded to sizes of at least 2
    (single-token steps excepted: they have a graph of their own) so that every step runs one of the two graphs
    compiled at start-up (``pagedattn.runtime.shapes``), and a second start of the same model reuses Inductor's
    on-disk caches. ``progress`` (default on) prints each start-up stage (rewriting, compiling, checking) and its
    time on stderr.

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

    Encoder-decoders (Hugging Face seq2seq and speech-seq2seq models, or a
    :class:`pagedattn.seq2seq.Seq2SeqSpec`) take each request's encoder input as its prompt: token ids,
    or a dict of encoder inputs such as ``{"input_features": [mels, frames]}`` (Whisper). Each request
    also gets cross-attention blocks for its encoder's K/V: allocated at admission, filled by the
    encoder (run once, batched across the requests admitted in a step, in groups of similar lengths:
    ``stats["encoder_runs"]`` counts the encoder's calls, ``stats["encoder_requests"]`` the requests), freed with the request and
    swapped or recomputed with it on preemption. Its decoder starts from the model's decoder start
    token, with the generation config's forced first and last tokens; outputs are the generated
    decoder tokens (without the start token), as Hugging Face ``generate`` returns them after it.
    Prefix caching shares decoder blocks between requests with the same encoder input only.

    Prefix-LMs (PaliGemma's bidirectional prefix, Gemma-3's bidirectional image blocks: masks that read
    ``token_type_ids``, proven over them, see ``pagedattn.backends.position_mod``) take a request as
    ``{"input_ids": ids, "token_type_ids": types}`` (one type per prompt token; a plain prompt has none of
    the bidirectional type). Each bidirectional span is computed in one step (a step never ends inside
    one, and a span longer than ``max_num_tokens`` is refused), generated tokens get the type outside the
    spans, and prefix caching shares blocks only between requests with the same spans and the same
    tokens up to the last span's end. ``token_type_runs`` (default 4) is the most runs of the bidirectional
    type (Gemma-3's images) a request may carry, as vLLM's ``limit_mm_per_prompt``: the mask is proven for that
    many at start-up (the proof takes longer the more), and a request with more is refused, naming the limit.

    On CUDA, decode-only steps (a token per sequence) run as CUDA graphs by default (``cuda_graphs=None``;
    :mod:`pagedattn.runtime.cuda_graphs`): padded to the next capture size (1, 2, 4, then multiples of 8 up to
    ``max_num_seqs``, at most 256) and a power-of-two number of block-table columns, their inputs loaded into
    persistent buffers in one transfer (an encoder-decoder's cross blocks and encoder lengths too), each shape
    captured on its first step and replayed after. Prefill and mixed steps, the encoder, and models with
    recurrent state or per-request mask values run eagerly; ``cuda_graphs=False`` turns
    the graphs off, ``True`` where they cannot run is an error naming why. ``decode_graphs`` holds them (None:
    every step eager).

    Greedy decode steps through those graphs run asynchronously (``async_decode=True``, the default), as vLLM's
    async scheduling: a step's tokens are sampled on the device and read back while the next step already
    runs, its input ids taken from them on the device, so the host's work for a step (scheduling, the buffers'
    load, reading tokens, stop checks) overlaps the device's instead of leaving it idle. A step starts before
    the previous one is read only where it is sure to be the same requests' next token: nothing waits or is
    swapped out, no request reaches its token limit, a forced token or sampling with a temperature, and the
    cache has a block for every one (so nothing is preempted); otherwise the previous step is read first. A
    request that stops on a stop token has one more token computed by the step already under way, which is
    dropped (its K/V go to a block freed with the request). Tokens stream one step later than they are
    sampled.

    Decode steps are planned ``plan_ahead`` at a time (default 16; 1: each on its own) where steps run packed
    without CUDA graphs (on the CPU, or on CUDA with ``cuda_graphs=False``; not for models with recurrent state,
    encoder-decoders, per-request mask values or padded steps). When a step is decode-only and no request waits or is
    swapped out, the engine reserves the blocks its requests need for the next ``k`` tokens (``k`` at most
    ``plan_ahead`` and no request's remaining tokens; only where the cache has them free, so nothing is preempted for
    it) and builds the metadata of those ``k`` steps at once. Each later ``step()`` of the run then runs the model,
    samples and hands out the tokens, without scheduling or building metadata again, for as long as nothing changes:
    a request added, finished, stopped or aborted ends the run before the next step, which is scheduled as usual
    (reserved blocks stay with their requests). Each ``step()`` still computes one token per request, so tokens,
    streaming and a new request's wait are as with ``plan_ahead=1``; ``stats["planned_steps"]`` counts the steps that
    ran from a run's plan.

    A run of greedy requests (the model's step packed, as on the CPU) has its steps' inputs built and checked once
    and may be computed ahead, as vLLM's multi-step scheduling does: a ``step()`` that finds its step not computed
    yet runs it and the run's next ones back to back, each step's tokens the next one's input ids, for about
    ``burst_ms`` of the model's time (default 20; 0: one step at a time), and later ``step()`` calls give their
    tokens. Between steps the host's work (the requests' bookkeeping, streaming, the compiled step's input checks)
    then no longer runs between kernels that leave its data out of cache (llama16m in bf16 on a 2-core CPU: a
    decode step 2-3 ms, so bursts of 6-9 steps at the default). A burst ends at a step where a request gives a stop
    token. Every ``step()`` gives the tokens a step planned on its own would, and nothing changes what is computed:
    where the run ends before tokens computed ahead were given (a request added, aborted or preempted), they are
    dropped and computed again as usual (``stats["dropped_steps"]``), and the next bursts start at one step. The
    cost is time: a ``step()`` that computes ahead takes up to ``burst_ms`` longer, and a request added then waits
    that long (streamed tokens come in groups). Runs with a sampled request compute each step as it is given (a draw
    ahead would change later draws). ``stats["ahead_steps"]`` counts the steps computed before the ``step()`` that
    gave them (these counts follow measured step times).

    Before its first request a CUDA engine serves a few of its own, one step of each kind (``warm_up=None``;
    ``True`` elsewhere, ``False`` never): a fresh prompt, decodes, and a step with prefix-cache hits beside a
    fresh prompt. Kernels that load or compile on their first call then do so at start-up, not in the first such
    step of a serving process. It leaves no request, cached prefix or statistic behind.
    """

    def __init__(self, model: nn.Module, *, target="auto", block_size: int = 16,
                 num_blocks: Optional[int] = None, memory: Optional[int | float] = None,
                 max_num_tokens: int = 512, max_num_seqs: int = 256, enable_prefix_caching: bool = True,
                 dtype: Optional[torch.dtype] = None, eos_token_id: Optional[int | Sequence[int]] = None,
                 compile: Optional[bool] = None, preemption_mode: str = "recompute", swap_space: int | None = None,
                 progress: bool = True, cuda_graphs: Optional[bool] = None, token_type_runs: int = 4,
                 async_decode: bool = True, ahead_of_time: Optional[bool] = None, warm_up: Optional[bool] = None,
                 plan_ahead: int = 16, burst_ms: float = 20.0):
        self.preemption = PreemptionConfig(preemption_mode, swap_space)  # bad values fail before the rewrite
        if isinstance(plan_ahead, bool) or not isinstance(plan_ahead, int) or plan_ahead < 1:
            raise ValueError(f"plan_ahead must be an int >= 1 (decode steps planned at once; 1: each on its own), "
                             f"got {plan_ahead!r}")
        self.burst_ms = _burst_ms(burst_ms)
        self.servable = _servable(model, target, block_size, dtype, eos_token_id, compile, progress, token_type_runs,
                                  ahead_of_time)
        sv = self.servable
        self.backend, self.device, self.block_size = sv.backend, sv.device, sv.block_size
        self.vocab_size, self.cache_specs, self.cache_dtype = sv.vocab_size, list(sv.cache_specs), sv.cache_dtype
        self._eos = set(sv.eos_ids)
        self._seq2seq = sv.seq2seq
        self._last_cross: Optional[tuple[tuple, CrossMetadata]] = None  # see _cross_metadata
        if sv.state is not None and enable_prefix_caching:
            log.info("prefix caching is off: a cached prefix holds K/V but not the recurrent state")
            enable_prefix_caching = False
        bytes_per_block = max(1, sv.bytes_per_block())
        if num_blocks is None:
            num_blocks = _parse_memory(memory, bytes_per_block, self.device) if memory is not None else 2048
        self.num_blocks = int(num_blocks)
        self.kv_caches = sv.allocate_kv_caches(self.num_blocks)
        self.kv_bytes = sum(c.numel() * c.element_size() for c in self.kv_caches)
        num_host_blocks = self.preemption.num_host_blocks(bytes_per_block, self.num_blocks)
        if preemption_mode == "swap" and num_host_blocks == 0:
            log.warning("swap_space=%s bytes holds no block of %d bytes: every preemption recomputes",
                        swap_space, bytes_per_block)
        # same layout as the device caches, so swap_blocks moves whole blocks between the two
        self.host_kv_caches = sv.allocate_kv_caches(num_host_blocks, device="cpu") if num_host_blocks else []
        self.states = StatePool(sv.state.slots, self.device) if sv.state is not None else None
        # the servable's block size: a ServableModel passed in keeps its own, whatever block_size says
        self.blocks = BlockManager(self.num_blocks, self.block_size, enable_prefix_caching, num_host_blocks)
        self.scheduler = Scheduler(self.blocks, max_num_tokens, max_num_seqs, preemption_mode,
                                   max_chunk=1 if sv.token_steps else None)
        self._pad = self.backend.step_padder(max_num_tokens, max_num_seqs, self.num_blocks)
        # packed steps on these caches, bound once (a device that pads its steps moves their metadata: the full path)
        self._packed_call = sv.packed_call(self.kv_caches) if self._pad is None and sv.state is None else None
        self._warm(max_num_tokens, progress)
        self.decode_graphs = self._decode_graphs(cuda_graphs, max_num_seqs)
        self._length_limit = self._limit_from_report()  # the report does not change: read it once
        self.async_decode = async_decode
        self._pending: Optional[PendingStep] = None  # the asynchronous decode step not read back yet
        # decode runs (DecodeRun) where steps run packed: not for steps padded per shape, rows or extra step inputs
        self.plan_ahead = plan_ahead if self._pad is None and sv.state is None and sv.seq2seq is None and \
            sv.values is None else 1
        self._run: Optional[DecodeRun] = None
        self._step_s: Optional[float] = None  # a prepared decode step's time, as last measured (burst sizes)
        self._burst_cap = self.plan_ahead  # 1 after steps computed ahead were dropped, doubled by each burst after
        # add_request/abort may come from other threads (a server) while one thread steps: they queue here
        # under a short lock and are taken in between steps, under the step lock (never mid-step)
        self._step_lock = threading.RLock()
        self._inbox_lock = threading.Lock()
        self._inbox: list[Request] = []
        self._aborts: list[int] = []
        self._start_counts()
        self._warm_kinds(warm_up, progress)

    def _start_counts(self) -> None:
        """A new engine's request ids, finished requests, sampling generators and statistics: set at construction and
        again after the start-up warm-up (``_warm_kinds``)."""
        self._ids = itertools.count()
        self._finished: list[RequestOutput] = []
        self._generators: dict[int, torch.Generator] = {}
        self.stats = {"steps": 0, "model_s": 0.0, "overhead_s": 0.0, "tokens": 0,
                      "preemptions": 0, "recomputes": 0, "swap_outs": 0, "swap_ins": 0,
                      "encoder_runs": 0, "encoder_requests": 0, "encoder_s": 0.0,
                      "overlapped_steps": 0,  # decode steps started before the previous one was read back
                      "planned_steps": 0,  # decode steps run from a DecodeRun's plan, not scheduled on their own
                      "ahead_steps": 0,  # planned steps computed before the step() that gave their tokens
                      "dropped_steps": 0}  # planned steps computed ahead whose run ended before they were given

    def _warm(self, max_num_tokens: int, progress: bool) -> None:
        """A compiled step runs once at each size its backend says is worth it (``warm_step_sizes``)."""
        from pagedattn.adapter import step_is_compiled, warm_steps

        if self._pad is None and step_is_compiled(self.servable):
            warm_steps(self.servable, self.backend.warm_step_sizes(max_num_tokens, self.cache_dtype), progress)

    def _warm_kinds(self, wanted: Optional[bool], progress: bool) -> None:
        """Serve a few requests of every kind of step before the first real one, then forget them: a fresh
        prompt and its decodes, then one step of a prompt that goes on from its cached prefix by one token (a
        decode inside an eager step), one by a few tokens (a chunk over cached keys) and a fresh prompt, two of each,
        then their decodes. What loads or compiles on first use in those paths (on CUDA: xFormers' kernels for paged and
        gathered keys, imported and built by Triton at their first call) then does so at start-up, not in the
        first prefix-cache hit of a serving process (a one-off of ~0.6 s on an H200). The engine then holds no
        request, no cached prefix, no statistics and hands out its request ids and blocks as before. Default
        (``warm_up=None``): on CUDA, for decoder-only models with prefix caching; ``True`` where it cannot run
        is a ValueError naming why."""
        if wanted is False or (wanted is None and self.device.type != "cuda"):
            return
        bs = self.block_size
        prefix = [1] * (2 * bs)
        # two sequences of each kind in the second step (kernels may be built apart for a batch of one)
        first = [prefix + [1, 1, 1]]
        second = [prefix + [1], prefix + [2], prefix + [1, 1, 1], prefix + [2, 2, 2], [2] * (bs + 1), [3] * (bs + 2)]
        params = SamplingParams(max_new_tokens=4)
        why = ("its steps run as rows (recurrent state)" if self.states is not None else
               "it is an encoder-decoder" if self._seq2seq is not None else
               "its masks read per-request values" if self.servable.values is not None else
               "prefix caching is off" if not self.blocks.enable_prefix_caching else
               next(filter(None, (self.validate(p, params) for p in first + second)), None))
        if why is not None and wanted is None:
            return
        if why is not None:
            raise ValueError(f"warm_up=True: the engine cannot warm up its step kinds: {why}")
        from pagedattn.adapter import Stages

        with Stages(progress).stage("serving one step of each kind (fresh, prefix-cache hit, mixed, decode)"):
            self.generate(first, max_new_tokens=4)  # a fresh prompt, then decodes; its full blocks cached
            self.generate(second, max_new_tokens=4)  # a decode and a chunk over cached keys beside a fresh prompt
        self.blocks.reset_prefix_cache()
        self.blocks.prefix_hits = 0
        self.scheduler.reset_counts()
        self._start_counts()
        if self.decode_graphs is not None:  # its captures stay: the graphs are start-up's
            self.decode_graphs.stats.update(replays=0, eager=0)

    def _decode_graphs(self, wanted: Optional[bool], max_num_seqs: int) -> Optional[DecodeGraphs]:
        """The decode steps' CUDA graphs (``runtime.cuda_graphs``): by default on CUDA for packed decoder-only
        steps; ``True`` where they cannot run is a ValueError naming why."""
        sv = self.servable
        why = ("the device is not CUDA" if self.device.type != "cuda" else
               "the model has recurrent state (its steps run as rows)" if sv.state is not None else
               "its masks read per-request values (prefix-LM spans)" if sv.values is not None else
               f"the {self.backend.name} backend's cache layout is not split K/V"
               if not isinstance(self.backend, SplitKVBackend) else None)
        if wanted is False or (wanted is None and why is not None):
            return None
        if why is not None:
            raise ValueError(f"cuda_graphs=True: {why}")
        return DecodeGraphs(sv, self.kv_caches, max_num_seqs, width=self.num_blocks)

    @property
    def model(self) -> nn.Module:
        """The step the engine runs (a ``RewrittenModel`` or a compiled module)."""
        return self.servable.step

    # ----------------------------------------------------------------- requests

    def validate(self, prompt: Sequence[int], params: SamplingParams) -> Optional[str]:
        """Why a request cannot be served, or None. ``prompt`` holds Python ints (see ``token_ids``)."""
        if len(prompt) == 0:
            return "the prompt is empty"
        if params.max_new_tokens <= 0:
            return f"max_new_tokens must be > 0, got {params.max_new_tokens}"
        bad = [t for t in prompt if not 0 <= t < (self.vocab_size or 2**63)]
        if bad:
            return f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})"
        need = -(-(len(prompt) + params.max_new_tokens) // self.block_size)
        if need > self.num_blocks:
            return (f"prompt of {len(prompt)} tokens plus {params.max_new_tokens} new ones needs {need} blocks "
                    f"but the cache has {self.num_blocks}; raise num_blocks/memory or shorten the request")
        if params.temperature < 0 or not 0 < params.top_p <= 1 or params.top_k < 0:
            return "temperature must be >= 0, top_p in (0, 1], top_k >= 0"
        limit = self.length_limit()
        # the last new token is sampled, never attended: the longest sequence a site sees is one shorter
        if limit is not None and len(prompt) + params.max_new_tokens - 1 > limit[0]:
            top, site, how = limit
            return (f"prompt of {len(prompt)} tokens plus {params.max_new_tokens} new ones reach "
                    f"{len(prompt) + params.max_new_tokens - 1} positions, but {site}'s mask is established for "
                    f"sequences of up to {top} ({how}); shorten the request")
        return None

    def length_limit(self) -> Optional[tuple[int, str, str]]:
        """``(length, site, how)``: the longest sequence the rewritten masks are established for, the site
        that sets it and how its mask was established (None: every length). Requests that would grow past it
        are refused when added, not failed inside a step."""
        return self._length_limit

    def _limit_from_report(self) -> Optional[tuple[int, str, str]]:
        sites = [r for r in getattr(self.model, "report", None) or []
                 if r.get("status") == "rewritten" and r.get("mask_up_to")]
        if not sites:
            return None
        r = min(sites, key=lambda r: r["mask_up_to"])
        return int(r["mask_up_to"]), r.get("name", "a site"), r.get("mask_established") or "established"

    def add_request(self, prompt, params: Optional[SamplingParams] = None, **kw) -> int:
        """Queue a request; returns its id. Raises ValueError naming what is wrong with it.

        ``prompt``: token ids as a list of ints, a 1-D numpy array or a 1-D torch tensor (any integer
        dtype, any device). For an encoder-decoder these are the encoder's input ids; a dict of encoder
        inputs without the batch dimension (``{"input_features": tensor}``) gives other inputs.
        """
        params = params or SamplingParams(**kw)
        rid = next(self._ids)
        try:
            req = self._request(rid, prompt, params)
        except ValueError as e:
            raise ValueError(f"request {rid}: {e}") from None
        if params.seed is not None:
            self._generators[rid] = torch.Generator(device="cpu").manual_seed(params.seed)
        with self._inbox_lock:
            self._inbox.append(req)
        self._take_commands_if_idle()
        return rid

    def _request(self, rid: int, prompt, params: SamplingParams) -> Request:
        """A validated request (ValueError says what is wrong)."""
        if self._seq2seq is None:
            extra = {}
            if isinstance(prompt, dict):
                prompt, extra = self._split_inputs(prompt)
            ids = token_ids(prompt)
            why = self.validate(ids, params)
            if why:
                raise ValueError(why)
            req = Request(rid, ids, params)
            if self.servable.values is not None:
                self._prefix_lm(req, extra.get(self.servable.values.input))
            return req
        s2s = self._seq2seq
        inputs = s2s.request_inputs(prompt)
        enc_len, dec = s2s.encoder_len(inputs), list(s2s.spec.decoder_prompt)
        src = inputs.get("input_ids")
        if enc_len < 1:
            raise ValueError("the encoder input is empty")
        bad = [t for t in (src.tolist() if src is not None else ()) if not 0 <= t < (self.vocab_size or 2**63)]
        if bad:
            raise ValueError(f"token id {bad[0]} of the encoder input is outside the vocabulary "
                             f"(0..{self.vocab_size - 1})")
        limit = s2s.spec.max_source_len
        if limit is not None and enc_len > limit:
            raise ValueError(f"the encoder input has {enc_len} tokens but the encoder takes at most {limit}")
        room = s2s.max_decoder_len  # the decoder's position table ends there (BART's learned positions)
        if room is not None and len(dec) + params.max_new_tokens > room:
            raise ValueError(f"max_new_tokens is {params.max_new_tokens} but this model's decoder generates at most "
                             f"{room - len(dec)} tokens (its positions end at {s2s.spec.max_target_len})")
        need = -(-enc_len // self.block_size) + -(-(len(dec) + params.max_new_tokens) // self.block_size)
        if need > self.num_blocks:
            raise ValueError(f"an encoder input of {enc_len} tokens and {params.max_new_tokens} new tokens need {need} "
                             f"blocks (cross-attention and decoder) but the cache has {self.num_blocks}")
        why = self.validate(dec, params)
        if why:
            raise ValueError(why)
        forced = {}
        if s2s.spec.forced_bos is not None and len(dec) == 1:
            forced[0] = int(s2s.spec.forced_bos)
        if s2s.spec.forced_eos is not None:  # as generate: the last token a request may have is EOS
            forced[params.max_new_tokens - 1] = int(s2s.spec.forced_eos)
        req = Request(rid, dec, params, encoder_inputs=inputs, encoder_len=enc_len, forced=forced)
        req.table.salt = encoder_key(inputs)
        return req

    def _split_inputs(self, prompt: dict) -> tuple:
        """A prompt given as a dict of inputs: its token ids and the request's other inputs (a prefix-LM's
        token types); ValueError for inputs the model does not take per request."""
        if "input_ids" not in prompt:
            raise ValueError(f"a prompt given as a dict needs 'input_ids' (got {sorted(prompt)})")
        spec = self.servable.values
        allowed = {spec.input} if spec is not None else set()
        extra = {k: v for k, v in prompt.items() if k != "input_ids"}
        for name in extra:
            if name in self.servable.unserved_inputs:
                raise ValueError(f"this model is served without {name!r}: {self.servable.unserved_inputs[name]}")
            if name not in allowed:
                takes = f"; it takes {sorted(allowed)}" if allowed else ""
                raise ValueError(f"input {name!r} is not one this model takes per request{takes}")
        return prompt["input_ids"], extra

    def _prefix_lm(self, req: Request, given) -> None:
        """A prefix-LM request's values, spans and token types (``given``: its prompt's token types, or for a
        prefix-length input one int; None: no span), checked as the model's masks were proven."""
        spec = self.servable.values
        n = len(req.prompt)
        if given is None:
            data = torch.full((1, n), spec.outside) if spec.kind == "runs" else torch.zeros(1, dtype=torch.long)
        elif spec.kind == "runs":
            data = torch.as_tensor(token_ids(given) if not isinstance(given, torch.Tensor) else given.reshape(-1))
            if data.dim() != 1 or data.shape[0] != n or data.dtype.is_floating_point:
                raise ValueError(f"{spec.input!r} must give one integer type per prompt token ({n}), got shape "
                                 f"{tuple(data.shape)}")
            data = data[None]
        else:
            if isinstance(given, bool) or not isinstance(given, int):
                raise ValueError(f"{spec.input!r} must be one integer, got {given!r}")
            data = torch.tensor([given])
        values = position_mod.values_from_input(spec, data)[0].tolist()
        spans = position_mod.spans(spec, values)
        if spans and spans[-1][1] > n:
            raise ValueError(f"{spec.input!r} makes a span end at {spans[-1][1]}, past the prompt's {n} tokens: "
                             "generated tokens cannot belong to a span")
        longest = max((e - s for s, e in spans), default=0)
        if longest > self.scheduler.max_num_tokens:
            raise ValueError(f"a bidirectional span of {longest} tokens is computed in one step, but a step holds "
                             f"at most max_num_tokens={self.scheduler.max_num_tokens}; raise it")
        req.values, req.spans = tuple(values), tuple(spans)
        if spec.kind == "runs":
            req.token_types = data[0].tolist()
        if spans:  # K/V of a span's tokens depend on its later tokens: share blocks only with the same spans
            req.table.salt = hash(("spans", req.spans, tuple(req.prompt[:spans[-1][1]])))

    def abort(self, request_id: int) -> None:
        """Stop a request and free its KV blocks (and state slot) at once; ``collect()`` reports it with
        ``finish_reason="abort"``. An unknown or already finished id is ignored.

        Safe from any thread: while another thread is inside ``step()`` the abort is applied as that step
        ends (a request that finished in it stays finished); otherwise before ``abort`` returns.
        """
        with self._inbox_lock:
            self._aborts.append(request_id)
        self._take_commands_if_idle()

    def has_unfinished(self) -> bool:
        return bool(self._inbox or self._aborts) or self.scheduler.has_work()

    @property
    def steps_ahead(self) -> int:
        """Decode steps computed ahead (``burst_ms``) that later ``step()`` calls will give without running the model.
        A timing of steps that starts and ends where this is 0 counts the model's time of every step it records, and
        of no other."""
        run = self._run
        return len(run.tokens) - run.taken if run is not None and run.steps is not None else 0

    def unfinished_outputs(self, since: Optional[dict[int, int]] = None) -> dict[int, list[int]]:
        """Tokens generated so far by each unfinished request, by id (for streaming between steps); with
        ``since``, only those after the first ``since[id]`` (0 for ids not in it), so a streamer copies each
        token once."""
        since = since or {}
        with self._step_lock:
            s = self.scheduler
            return {r.id: r.output[since.get(r.id, 0):] for queue in (s.running, s.swapped, s.waiting) for r in queue}

    def _take_commands_if_idle(self) -> None:
        """Apply queued adds and aborts now unless a step is running (it applies them as it ends)."""
        if self._step_lock.acquire(blocking=False):
            try:
                self._take_commands()
            finally:
                self._step_lock.release()

    def _take_commands(self) -> None:
        """Queued requests join the scheduler, then queued aborts run (so a request aborted right after
        being added is found). Called with the step lock held."""
        with self._inbox_lock:
            added, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
        for req in added:
            self.scheduler.add(req)
        for rid in aborts:
            req = self.scheduler.abort(rid)
            if req is None:
                continue
            if self.states is not None:
                self.states.release(rid)
            self._generators.pop(rid, None)
            self._finished.append(RequestOutput(rid, req.prompt, list(req.output), "abort"))
            if self._run is not None and any(r is req for r in self._run.requests):
                self._end_run(self._run)  # its later steps would hold the request: dropped now, not at the next step

    def collect(self) -> list[RequestOutput]:
        """Requests finished since the last call."""
        out, self._finished = self._finished, []
        return out

    # --------------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """Run one batch step; returns the requests that finished in it.

        Requests added or aborted from other threads meanwhile are taken in before it schedules and as it ends.
        A loop of steps runs faster inside ``pagedattn.runtime.frames.call_with_frame_room(loop)``, as ``generate``'s
        and the server's loops run: one frame-stack chunk for all its steps, not one mapped per step (~4 % of a
        small model's decode step on the CPU).
        """
        with self._step_lock:
            self._take_commands()
            done = call_with_frame_room(self._step)  # a step's cost must not depend on the caller's stack depth
            self._take_commands()
            return done

    def _step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        run = self._run
        if run is not None:
            if self._run_goes_on(run):
                return self._run_step(run, t0)
            self._end_run(run)
        done: list[RequestOutput] = []
        if self._pending is not None and not self._continues():
            done += self._resolve()  # the next step needs the pending step's tokens on the host
        sched = self.scheduler
        before = _preemption_counts(sched)
        plan = sched.schedule()
        self._move_blocks()
        for key, n0, n1 in zip(("preemptions", "recomputes", "swap_outs", "swap_ins"), before,
                               _preemption_counts(sched)):
            self.stats[key] += n1 - n0  # deltas: callers may reset stats between runs
        if self._pending is not None and (sched.num_preemptions != before[0] or
                                          not all(c.request.inflight for c in plan)):
            plan = self._resolve_into(plan, done)  # not the continuation _continues foresaw: read the tokens first
        if not plan:
            # a step that only preempted frees blocks for the next one; otherwise nothing ever will
            if (sched.waiting or sched.swapped) and not sched.running and sched.num_preemptions == before[0]:
                raise RuntimeError("scheduler made no progress with an empty cache: "
                                   f"{len(sched.waiting) + len(sched.swapped)} requests wait for blocks "
                                   "that never free")
            return done
        if self._seq2seq is not None:
            self._encode(plan)
        t1 = time.perf_counter()
        launched = self._launch(plan)
        if launched is not None:
            previous, self._pending = self._pending, launched
            if previous is not None:
                done += self._resolve(previous)  # waits for the previous step while this one queues behind it
            t2 = time.perf_counter()
            self._count(len(plan), t0, t1, t2, t2)
            return done
        if self._pending is not None:  # this step reads its input ids on the host
            plan = self._resolve_into(plan, done)
            if not plan:
                return done
        run = self._plan_run(plan)
        if run is not None:
            self._run = run
            return done + self._run_step(run, t0)
        if self.states is not None:
            logits, num_tokens = self._run_rows(plan), sum(c.num_tokens for c in plan)
        else:
            logits, num_tokens, t1 = self._run_packed(plan)
        self.backend.sync()
        logits, greedy = self._greedy_rows(logits, [c.request for c in plan if c.completes])
        t2 = time.perf_counter()
        done += self._advance(plan, logits, greedy)
        self._count(num_tokens, t0, t1, t2, time.perf_counter())
        return done

    def _greedy_rows(self, logits: torch.Tensor, requests: list[Request]) -> tuple[torch.Tensor, Optional[list[int]]]:
        """A step's ``[R, V]`` logits for sampling on the host, and every row's argmax where the rows' requests are
        greedy and the logits on a device (there the argmax runs on the device and only the ids come back; None
        otherwise: ``_advance`` takes it on the host)."""
        if logits.device.type == "cpu":
            return logits, None
        if all(r.params.temperature == 0 for r in requests):
            return logits, self.backend.argmax_rows(logits)
        return logits.cpu(), None  # one transfer for the whole step, not one per sampled request

    # ------------------------------------------------------------ planned decode runs

    def _plan_run(self, plan: list[ScheduledChunk]) -> Optional[DecodeRun]:
        """A run of decode steps starting with ``plan`` (see ``plan_ahead``), its blocks reserved; None where ``plan``
        is not a decode step that can go on as one: a chunk of more than one token, a request waiting or swapped out
        (the next step would admit it), a forced token, fewer than two tokens left to some request, or too few free
        blocks for all of them."""
        s = self.scheduler
        if self.plan_ahead < 2 or self.decode_graphs is not None or s.waiting or s.swapped:
            return None
        steps = self.plan_ahead
        for c in plan:
            req = c.request
            if c.num_tokens != 1 or not c.completes or req.forced:
                return None
            steps = min(steps, req.params.max_new_tokens - len(req.output))
        if steps < 2:
            return None
        tables = [c.request.table for c in plan]
        if sum(self.blocks.blocks_needed(t, steps) for t in tables) > self.blocks.num_free:
            return None
        for t in tables:
            self.blocks.reserve(t, steps)  # the step's own token has its block already: these are the next ones'
        starts = [c.start for c in plan]
        metas = build_decode_metadata(starts, [t.blocks for t in tables], self.block_size, steps, device=self.device)
        reqs = [c.request for c in plan]
        run = DecodeRun(reqs, starts, metas)
        if all(r.params.temperature == 0 for r in reqs):  # a sampled token would draw from its generator ahead
            ids = [r.token_slice(c, c + 1)[0] for r, c in zip(reqs, starts)]
            run.steps = self.servable.decode_steps(self._packed_call, metas, starts, ids)
            stops = [frozenset(r.params.stop_token_ids) | self._eos for r in reqs]
            run.stops = stops if any(stops) else None
        return run

    def _end_run(self, run: DecodeRun) -> None:
        """The run ends before its next step: tokens computed ahead for later steps are dropped (the steps are
        scheduled again as usual), and the next bursts start small again."""
        self._run = None
        dropped = len(run.tokens) - run.taken
        if dropped > 0:
            self.stats["dropped_steps"] += dropped
            self._burst_cap = 1

    def _compute_ahead(self, run: DecodeRun) -> None:
        """The run's next steps from the first one not computed, as many as ``burst_ms`` allows (at least one),
        back to back: each step's greedy tokens become the next one's input ids without the host's bookkeeping in
        between. A step where some request gives a stop token is the last (the run ends with it)."""
        steps, j = run.steps, len(run.tokens)
        count = burst_steps(self.burst_ms / 1e3, self._step_s, len(run.metas) - j, self._burst_cap)
        t0 = time.perf_counter()
        with steps.bound():
            for i in range(j, j + count):
                toks = steps.greedy(i)
                run.tokens.append(toks)
                if run.stops is not None and any(t in s for t, s in zip(toks, run.stops)):
                    break
        done = len(run.tokens) - j
        self._step_s = (time.perf_counter() - t0) / done
        self.stats["ahead_steps"] += done - 1
        if done == count:  # not ended by a stop token
            self._burst_cap = min(self.plan_ahead, 2 * self._burst_cap)

    def _run_goes_on(self, run: DecodeRun) -> bool:
        """Whether the run's next step is the one ``schedule`` would make: steps are left, nothing waits or is swapped
        out, and the same requests run (a request leaves ``running`` only by finishing, being aborted or being
        preempted, and only ``schedule`` preempts or admits)."""
        s = self.scheduler
        return run.taken < len(run.metas) and not s.waiting and not s.swapped and len(s.running) == len(run.requests)

    def _run_step(self, run: DecodeRun, t0: float) -> list[RequestOutput]:
        """The run's next step: each request's last token in, a token out (``_advance``); computed now, or by an
        earlier step of the run (``burst_ms``)."""
        j = run.taken
        run.taken = j + 1
        reqs = run.requests
        plan = [ScheduledChunk(r, start + j, 1) for r, start in zip(reqs, run.starts)]
        t1 = time.perf_counter()
        if run.steps is not None:
            if j == len(run.tokens):
                self._compute_ahead(run)
            logits, greedy = None, run.tokens[j]
        else:
            ids = [c.request.token_slice(c.start, c.start + 1)[0] for c in plan]
            logits = self.servable.run_packed(self.kv_caches, run.metas[j], ids, [c.start for c in plan],
                                              range(len(plan)), writable=False, call=self._packed_call)
            self.backend.sync()
            logits, greedy = self._greedy_rows(logits, reqs)
        t2 = time.perf_counter()
        done = self._advance(plan, logits, greedy)
        if done or run.taken == len(run.metas):
            self._end_run(run)  # its requests changed, or its plan is spent
        self.stats["planned_steps"] += 1
        self._count(len(reqs), t0, t1, t2, time.perf_counter())
        return done

    def _count(self, num_tokens: int, t0: float, t1: float, t2: float, t3: float) -> None:
        """A step's statistics: scheduling until ``t1``, the model until ``t2``, the tokens' handling until ``t3``."""
        self.stats["steps"] += 1
        self.stats["tokens"] += num_tokens
        self.stats["model_s"] += t2 - t1
        self.stats["overhead_s"] += (t1 - t0) + (t3 - t2)

    # ------------------------------------------------------ asynchronous decode steps

    def _continues(self) -> bool:
        """Whether the next step can start before the pending one is read back: it will be a decode step of the
        same requests (as ``schedule`` will make it: nothing waits or is swapped out, the token budget holds them
        all, the cache a block for each, so nothing is preempted), each one's input the pending step's token
        for it, and each one going on after that token (below its token limit; greedy, no forced token)."""
        s = self.scheduler
        if s.waiting or s.swapped or not s.running or len(s.running) > s.max_num_tokens:
            return False
        need = 0
        for req in s.running:
            if req.inflight != 1 or req.params.temperature != 0 or len(req.output) in req.forced or \
                    len(req.output) + 1 >= req.params.max_new_tokens:
                return False
            need += self.blocks.room_for(req.table, 1)
        return need <= self.blocks.num_free

    def _launch(self, plan: list[ScheduledChunk]) -> Optional[PendingStep]:
        """Start a greedy decode-only step through the decode graphs without waiting for its tokens (None where
        it cannot run so): its input ids from the host, or on the device from the pending step's tokens."""
        pending = self._pending
        if self.decode_graphs is None or not self.async_decode or self.states is not None or \
                not all(c.request.params.temperature == 0 for c in plan):
            return None
        ids = None  # from the host
        if pending is not None:
            if not all(c.request.inflight == 1 and len(c.request.output) not in c.request.forced for c in plan):
                return None
            row = {id(c.request): i for i, c in enumerate(pending.plan)}
            ids = DeviceTokens(pending.tokens, [row[id(c.request)] for c in plan])
        logits = self._through_graphs(plan, ids, copy=False)
        if logits is None:
            return None
        self.stats["overlapped_steps"] += pending is not None
        tokens = argmax_tokens(logits)  # [n], as argmax_rows picks them
        copied = None
        if tokens.device.type == "cuda":  # into pinned memory: a copy to pageable memory would wait for the step
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True).copy_(tokens, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        else:
            host = tokens
        for c in plan:
            req = c.request
            req.num_computed += 1
            req.inflight += 1
            self.blocks.count(req.table, 1)  # the next step reserves past it; registered once its id is read
        return PendingStep(plan, tokens, host, copied)

    def _resolve(self, pending: Optional[PendingStep] = None) -> list[RequestOutput]:
        """Read an asynchronous step's tokens back (default: the pending one's) and advance its requests."""
        if pending is None:
            pending, self._pending = self._pending, None
        done = []
        for c, tok in zip(pending.plan, pending.read()):
            req = c.request
            if req.finished:  # stopped in the step before, or aborted, while this one ran: its token is dropped
                continue
            req.inflight -= 1
            if req.table.blocks and not req.table.on_host:
                self.blocks.register(req.table, lambda req=req: req.tokens, c.start, c.start + 1)
            res = self._emit(req, tok)
            if res is not None:
                done.append(res)
        return done

    def _resolve_into(self, plan: list[ScheduledChunk], done: list[RequestOutput]) -> list[ScheduledChunk]:
        """Read the pending step back before ``plan`` runs (into ``done``); ``plan`` without the requests that
        finished in it."""
        done += self._resolve()
        return [c for c in plan if not c.request.finished]

    def _encode(self, plan: list[ScheduledChunk]) -> None:
        """Run the encoder once for the step's requests whose cross-attention blocks are not filled yet
        (newly admitted or recomputed), in one padded batch, and write their cross-attention K/V."""
        new = [c.request for c in plan if not c.request.encoded]
        if not new:
            return
        t0 = time.perf_counter()
        s2s = self._seq2seq
        bucketed = self._pad is not None  # a device that compiles per shape: a bounded number of encoder shapes
        for group, states, lens in s2s.encode_groups([r.encoder_inputs for r in new], self.device, bucketed):
            reqs = [new[i] for i in group]
            for r, n in zip(reqs, lens):
                if n != r.encoder_len:
                    raise RuntimeError(f"request {r.id}: the encoder gave {n} states, {r.encoder_len} were expected")
            s2s.write_cross(self.kv_caches, states, lens, [r.cross_table.blocks for r in reqs], self.block_size)
            self.stats["encoder_runs"] += 1
        if bucketed:  # the encoder and its writes as graphs of their own, not prepended to the step's
            self.backend.sync()
        self.stats["encoder_requests"] += len(new)
        for r in new:
            r.encoded = True
        self.stats["encoder_s"] += time.perf_counter() - t0

    def _run_packed(self, plan: list[ScheduledChunk]) -> tuple[torch.Tensor, int, float]:
        """Every chunk of the step in one ``[1, T]`` row; ``[R, V]`` logits of the completing chunks. A decode-only
        step (one token per sequence, each completing it) runs in its CUDA graph where there is one."""
        t1 = time.perf_counter()
        logits = self._through_graphs(plan)
        if logits is not None:
            return logits, len(plan), t1
        ids, pos, rows = [], [], []
        spec = self.servable.values
        types: list[int] = []
        for chunk in plan:
            toks = chunk.request.token_slice(chunk.start, chunk.start + chunk.num_tokens)
            ids.extend(toks)
            pos.extend(range(chunk.start, chunk.start + chunk.num_tokens))
            if chunk.completes:
                rows.append(len(ids) - 1)
            if spec is not None and spec.kind == "runs":
                known = chunk.request.token_types or []
                types += [known[p] if p < len(known) else spec.outside
                          for p in range(chunk.start, chunk.start + chunk.num_tokens)]
        values = None
        if spec is not None:
            values = torch.tensor([list(c.request.values) for c in plan], dtype=torch.long)
        num_tokens, num_rows = len(ids), len(rows)
        meta = build_metadata([(c.start, c.num_tokens, c.request.table.blocks) for c in plan], self.block_size,
                              device="cpu" if self._pad else self.device)
        if self._pad is not None:  # a bounded set of step shapes for devices that compile per shape
            meta = self._pad(meta)
            ids += [0] * (meta.num_tokens - num_tokens)
            pos += [0] * (meta.num_tokens - num_tokens)
            rows += [0] * (meta.num_seqs - num_rows)
            meta = meta.to(self.device)
        cross = self._cross_metadata(plan) if self._seq2seq is not None else None
        if cross is not None and self._pad is not None:  # one row per padded sequence, bucketed block columns
            width = int(cross.block_tables.shape[1])
            cross = pad_cross(cross, meta.num_seqs, 1 << (width - 1).bit_length()).to(self.device)
        t1 = time.perf_counter()
        logits = self.servable.run_packed(self.kv_caches, meta, ids, pos, rows, cross=cross, values=values,
                                          token_types=types or None, writable=False,  # only read: no copy
                                          call=self._packed_call)
        # [R, V]: a padded step's (self._pad) padding rows cut off
        return first_rows(logits, num_rows), num_tokens, t1

    def _through_graphs(self, plan: list[ScheduledChunk], ids: Optional[DeviceTokens] = None,
                        copy: bool = True) -> Optional[torch.Tensor]:
        """A decode-only step (one token per sequence, each completing it) through the decode graphs: ``[n, V]``
        logits (``copy=False``: the graph's own output, see ``DecodeGraphs.run``); None where the graphs do not take
        it, or where a capture failed (the step then runs eagerly, as every step after it). ``ids``: its tokens read
        on the device (default: from the host)."""
        graphs = self.decode_graphs
        seq2seq = self._seq2seq is not None
        if graphs is None or not all(c.num_tokens == 1 and c.completes for c in plan) or \
                not graphs.fits(len(plan), max(len(c.request.table.blocks) for c in plan),
                                max(len(c.request.cross_table.blocks) for c in plan) if seq2seq else 0):
            return None
        if ids is None:
            ids = [c.request.token_slice(c.start, c.start + 1)[0] for c in plan]
        bs = self.block_size
        tables = [c.request.table.blocks for c in plan]
        try:
            return graphs.run(ids, [c.start for c in plan],
                              [t[c.start // bs] * bs + c.start % bs for c, t in zip(plan, tables)], tables,
                              [c.start + 1 for c in plan],
                              [c.request.cross_table.blocks for c in plan] if seq2seq else None,
                              [c.request.encoder_len for c in plan] if seq2seq else None, copy=copy)
        except CaptureFailed as e:
            log.warning("decode steps run without CUDA graphs: %s", e)
            self.decode_graphs = None
            return None

    def _cross_metadata(self, plan: list[ScheduledChunk]) -> CrossMetadata:
        """The step's cross metadata; the same tensors as the previous step's while the step's requests and
        their cross blocks stay the same (every decode step between admissions): the backends memoise what
        they derive from a block table (decode plans, checks) by the tensor itself, and the cross blocks and
        encoder lengths of a request never change while it runs."""
        key = tuple((c.request.id, c.request.encoder_len, tuple(c.request.cross_table.blocks)) for c in plan)
        last = self._last_cross
        if last is not None and last[0] == key:
            return last[1]
        cross = build_cross_metadata([k[2] for k in key], [k[1] for k in key], self.block_size,
                                     device="cpu" if self._pad else self.device)
        self._last_cross = (key, cross)
        return cross

    def _run_rows(self, plan: list[ScheduledChunk]) -> torch.Tensor:
        """Stateful models: one row per sequence; ``[R, V]`` logits of the completing chunks."""
        for c in plan:
            if c.start == 0:  # new, or recomputed after preemption
                self.states.start(c.request.id)
        items = [(c.request.id, c.start, c.request.tokens[c.start:c.start + c.num_tokens], c.request.table.blocks)
                 for c in plan]
        last = self.servable.run_rows(self.kv_caches, self.states, items)
        done = [row for c, row in zip(plan, last) if c.completes]
        return torch.stack(done) if done else torch.empty(0, self.vocab_size or 1)

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

    def _advance(self, plan: list[ScheduledChunk], logits: torch.Tensor,
                 greedy: Optional[list[int]] = None) -> list[RequestOutput]:
        done = []
        r = 0
        if greedy is None:  # every row's argmax in one call: a call per row costs more than the argmax itself
            greedy = self.backend.argmax_rows(logits)
        for chunk in plan:
            req = chunk.request
            self.blocks.commit(req.table, lambda req=req: req.tokens, chunk.num_tokens)
            req.num_computed += chunk.num_tokens
            if not chunk.completes:
                continue
            tok = greedy[r] if req.params.temperature == 0 else self._sample(req, logits[r])
            r += 1
            res = self._emit(req, tok)
            if res is not None:
                done.append(res)
        return done

    def _emit(self, req: Request, tok: int) -> Optional[RequestOutput]:
        """Append a sampled token (or the one the request forces there); finish the request where it stops."""
        tok = req.forced.get(len(req.output), tok)
        req.output.append(tok)
        reason = None
        if tok in req.params.stop_token_ids or tok in self._eos:
            reason = "stop"
        elif len(req.output) >= req.params.max_new_tokens:
            reason = "length"
        if not reason:
            return None
        self.scheduler.finish(req, reason)
        if self.states is not None:
            self.states.release(req.id)
        self._generators.pop(req.id, None)
        res = RequestOutput(req.id, req.prompt, list(req.output), reason)
        self._finished.append(res)
        return res

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

    def generate(self, prompts: Iterable, max_new_tokens: int = 16, *, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: Optional[int] = None,
                 stop_token_ids: Sequence[int] = ()) -> list[list[int]]:
        """Generated tokens per prompt (greedy unless ``temperature > 0``); prompts as ``add_request`` takes them.

        Invalid requests do not stop the others: after the rest finish, a ``RequestErrors`` names them
        and carries the other results.
        """
        if isinstance(prompts, (str, bytes)) or prompts is None:
            raise TypeError(f"generate() takes a list of prompts (token ids), got {type(prompts).__name__}")
        prompts = list(prompts)
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
                log.debug("prompt %d rejected: %s", i, errors[i])
        results = call_with_frame_room(self._run_to_completion)  # one frame-stack chunk for all its steps
        out = [results.get(rid) if rid is not None else None for rid in ids]
        if errors:
            raise RequestErrors(errors, out)
        return out

    def _run_to_completion(self) -> dict[int, list[int]]:
        results: dict[int, list[int]] = {}
        with self.bound():
            while self.has_unfinished():
                for r in self.step():
                    results[r.request_id] = r.tokens
        self.collect()
        return results

    def bound(self):
        """A context in which this engine's steps find its backend already bound (``use_backend``): a loop of steps
        inside it binds the backend once, not once a step (each binding tells the C++ ops about it and back, ~0.05 ms
        a step after a step's kernels have left the interpreter's data out of cache; llama16m on a 2-core EPYC,
        same-process A/Bs: 0.2-2 % of its serving time)."""
        return use_backend(self.backend)

    def overhead_share(self) -> float:
        """The share of the steps' time the engine spent around the model call (scheduling, metadata, sampling and
        handling the tokens); the Python inside the model call (Dynamo's, the generated code's) counts as the
        model's."""
        total = self.stats["model_s"] + self.stats["overhead_s"]
        return self.stats["overhead_s"] / total if total else 0.0


def burst_steps(budget_s: float, step_s: Optional[float], left: int, cap: int) -> int:
    """How many of a decode run's ``left`` next steps to compute at once: as many as take ``budget_s`` at ``step_s``
    a step, at least one (one where no step was measured yet), at most ``cap``."""
    if step_s is None or budget_s <= 0 or step_s <= 0:
        return 1
    return max(1, min(left, cap, int(budget_s / step_s)))


def _burst_ms(value) -> float:
    """``burst_ms`` checked: a finite number of milliseconds >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or value == float("inf"):
        raise ValueError(f"burst_ms must be a number of milliseconds >= 0 (0: one decode step per step()), got "
                         f"{value!r}")
    return float(value)


def token_ids(prompt) -> list[int]:
    """A prompt as Python ints: a sequence of integers, a 1-D integer numpy array or torch tensor.

    Booleans, floats, ``None`` and anything nested are refused with the offending value named.
    """
    if prompt is None:
        raise ValueError("the prompt is None; give token ids (a list of ints, or a 1-D integer array or tensor)")
    if isinstance(prompt, (str, bytes)):
        raise ValueError(f"the prompt is text ({prompt[:20]!r}); tokenize it first")
    if isinstance(prompt, torch.Tensor) or type(prompt).__module__ == "numpy":
        dtype = str(prompt.dtype)
        if prompt.ndim != 1:
            raise ValueError(f"the prompt has shape {tuple(prompt.shape)}; give one 1-D sequence of token ids per "
                             "request (e.g. ids[0] of a [1, T] batch)")
        if "int" not in dtype or "bool" in dtype:
            raise ValueError(f"the prompt's dtype is {dtype}; token ids are integers")
        return [int(t) for t in prompt.tolist()]
    if not isinstance(prompt, Iterable):
        raise ValueError(f"the prompt {prompt!r} is not a sequence of token ids")
    out = []
    for t in prompt:
        kind = type(t).__module__, type(t).__name__
        if isinstance(t, bool) or kind[1] == "bool_" or isinstance(t, float) or t is None \
                or (kind[0] == "numpy" and "int" not in kind[1]):
            raise ValueError(f"token id {t!r} is not an integer")
        if isinstance(t, torch.Tensor):
            if t.dim() != 0 or t.dtype.is_floating_point or t.dtype == torch.bool:
                raise ValueError(f"token id {t!r} is not an integer")
            t = t.item()
        try:
            out.append(int(t.__index__()))
        except (AttributeError, TypeError):
            raise ValueError(f"token id {t!r} is not an integer") from None
    return out


def _preemption_counts(sched: Scheduler) -> tuple[int, int, int, int]:
    return sched.num_preemptions, sched.num_recomputes, sched.num_swap_outs, sched.num_swap_ins


# ------------------------------------------------------------------ the model


def _servable(model, target, block_size, dtype, eos_token_id, compile, progress, token_type_runs, ahead_of_time):
    """The model as the engine runs it: a ``ServableModel`` as given, or one the adapter prepares."""
    from pagedattn.adapter import ServableModel, prepare_model

    if isinstance(model, ServableModel):
        return model
    return prepare_model(model, target=target, block_size=block_size, dtype=dtype, eos_token_id=eos_token_id,
                         compile=compile, progress=progress, token_type_runs=token_type_runs,
                         ahead_of_time=ahead_of_time)
