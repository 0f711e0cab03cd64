"""``rewrite-model serve``: an OpenAI-compatible HTTP server over ``PagedEngine`` (FastAPI + uvicorn).

    app = create_app(engine, tokenizer, ServeConfig(model_name="demo"))
    run(app, bind("127.0.0.1", 8000))

The engine steps in a process of its own (:class:`~pagedattn.serve_engine.EngineProcess`, what
``rewrite-model serve`` runs; or, for an engine built in this process, in a thread). The server's event loop
(:class:`EngineLoop`) sends it requests and aborts and receives one message per engine step with every
request's new tokens, which it fans out to the requests' streams.

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream: true`` as server-sent
events), ``GET /v1/models``, ``GET /health`` and ``GET /metrics`` (Prometheus). Errors are OpenAI-shaped
JSON, ``{"error": {"message", "type", "param", "code"}}``: 4xx naming the problem for bad requests, 503 when
the waiting queue is full, the server is shutting down or the engine process has died (requests in flight
when it died get a 500). A client that disconnects aborts its request (its KV blocks are freed between
steps).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import socket
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedattn.report import first_line
from pagedattn.runtime.engine import PagedEngine
from pagedattn.runtime.scheduler import SamplingParams
from pagedattn.serve_engine import (
    EngineDead,
    EngineInfo,
    EngineProcess,
    EngineStartError,
    EngineThread,
    Gauges,
    max_model_len,
)

log = logging.getLogger("pagedattn.serve")

__all__ = ["ServeConfig", "ApiError", "TextStream", "EngineLoop", "EngineProcess", "EngineStartError", "Metrics",
           "create_app", "bind", "run", "BackgroundServer", "chat_prompt_ids", "completion_prompt_ids",
           "max_model_len"]

MAX_STOPS = 4  # as the OpenAI API allows
RATE_WINDOW_S = 5.0  # tokens/s gauge: output tokens of the last this many seconds


@dataclass(frozen=True)
class ServeConfig:
    """What the server says about itself and how much it takes on.

    ``max_queue``: requests that may wait beyond the engine's ``max_num_seqs`` running ones; more get a 503.
    ``max_model_len``: prompt plus completion tokens one request may reach (None: the engine's limit, see
    :func:`max_model_len`). ``chat_template``: a Jinja template for chat requests instead of the tokenizer's.
    """

    model_name: str
    max_queue: int = 256
    max_model_len: Optional[int] = None
    chat_template: Optional[str] = None
    default_max_tokens: int = 16  # /v1/completions, as the API defines it; chat defaults to the room left


class ApiError(Exception):
    """A request the server refuses: its HTTP status and one line naming the problem."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        kind = {404: "not_found_error", 503: "overloaded_error"}.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error")
        headers = {"Retry-After": "1"} if self.status == 503 else None
        return JSONResponse({"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}},
                            status_code=self.status, headers=headers)


# ----------------------------------------------------------------------------- request bodies


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    """Fields both endpoints share. Unknown fields are ignored (clients send many); the ones that would change
    the answer and are not supported are refused by :func:`_refuse_unsupported`."""

    model_config = ConfigDict(extra="allow")
    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None  # an extension (vLLM's): 0 = off
    n: Optional[int] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Any] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict] = None
    user: Optional[str] = None
    return_token_ids: Optional[bool] = False  # an extension (vLLM's): the generated token ids per choice


class CompletionRequest(_Common):
    prompt: Any = None
    echo: Optional[bool] = False
    logprobs: Optional[int] = None
    suffix: Optional[str] = None
    best_of: Optional[int] = None


class ChatRequest(_Common):
    messages: Any = None
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = None
    tools: Optional[list] = None
    tool_choice: Optional[Any] = None
    response_format: Optional[dict] = None


def _refuse_unsupported(req: _Common) -> None:
    """400 for parameters that would change the answer and that this server does not implement."""
    if req.n not in (None, 1):
        raise ApiError(400, f"n={req.n} is not supported: this server returns one choice per request; "
                            "send n separate requests (with different seeds)", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise ApiError(400, f"{name} is not supported; leave it out or set it to 0", name)
    if req.logit_bias:
        raise ApiError(400, "logit_bias is not supported; leave it out", "logit_bias")
    if req.logprobs:
        raise ApiError(400, "logprobs are not supported; leave logprobs out", "logprobs")
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise ApiError(400, "echo is not supported; leave it out (the prompt is yours already)", "echo")
        if req.suffix:
            raise ApiError(400, "suffix (insertion) is not supported; leave it out", "suffix")
        if req.best_of not in (None, 1):
            raise ApiError(400, f"best_of={req.best_of} is not supported; leave it out", "best_of")
    if isinstance(req, ChatRequest):
        if req.tools or req.tool_choice not in (None, "none"):
            raise ApiError(400, "tools and tool_choice are not supported; leave them out", "tools")
        if req.response_format and req.response_format.get("type") != "text":
            raise ApiError(400, f"response_format {req.response_format.get('type')!r} is not supported; only "
                                "'text'", "response_format")


# ----------------------------------------------------------------------------- prompts and parameters


def completion_prompt_ids(prompt: Any, tokenizer) -> list[int]:
    """A completion request's ``prompt`` as token ids: a string, a list of token ids, or a one-element list of
    either. Raises :class:`ApiError` naming what is wrong."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # the API's batch form with one prompt
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: give the prompt as a list of token ids", "prompt")
        return list(tokenizer(prompt)["input_ids"])
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError(400, f"batched prompts ({len(prompt)}) are not supported; send one request per prompt",
                       "prompt")
    if isinstance(prompt, list):
        bad = next((t for t in prompt if isinstance(t, bool) or not isinstance(t, int)), None)
        if bad is not None:
            raise ApiError(400, f"prompt: token id {bad!r} is not an integer", "prompt")
        return list(prompt)
    if prompt is None:
        raise ApiError(400, "prompt is missing: give a string or a list of token ids", "prompt")
    raise ApiError(400, f"prompt must be a string or a list of token ids, got {type(prompt).__name__}", "prompt")


def _message_text(i: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: text only
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ApiError(400, f"messages[{i}].content: part of type {kind!r} is not supported; only text",
                               "messages")
            parts.append(part["text"])
        return "".join(parts)
    if content is None:
        return ""
    raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts", "messages")


def chat_prompt_ids(messages: Any, tokenizer, template: Optional[str] = None) -> list[int]:
    """Chat ``messages`` rendered with the tokenizer's chat template (or ``template``) and tokenized, with the
    assistant's turn opened. Raises :class:`ApiError` when there is no template or the messages are malformed."""
    if tokenizer is None:
        raise ApiError(400, "this model has no tokenizer, so chat is not available; use /v1/completions with "
                            "token ids", "messages")
    template = template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ApiError(400, "this model's tokenizer has no chat template; use /v1/completions, or start the server "
                            "with --chat-template FILE", "messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    msgs = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a string 'role'", "messages")
        msgs.append({"role": m["role"], "content": _message_text(i, m.get("content"))})
    try:
        text = tokenizer.apply_chat_template(msgs, chat_template=template, tokenize=False,
                                             add_generation_prompt=True)
    except Exception as e:  # templates raise their own errors (e.g. roles that must alternate)
        raise ApiError(400, f"the chat template rejected the messages: {first_line(e)}", "messages") from e
    # the template writes any special tokens (BOS) itself
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _stops(stop: Any, tokenizer) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ApiError(400, "stop must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"stop takes at most {MAX_STOPS} strings, got {len(stops)}", "stop")
    if any(s == "" for s in stops):
        raise ApiError(400, "stop strings must not be empty", "stop")
    if stops and tokenizer is None:
        raise ApiError(400, "stop strings need a tokenizer and this model has none; leave stop out", "stop")
    return tuple(stops)


def sampling_params(req: _Common, max_tokens: Optional[int], prompt_len: int, room: int) -> SamplingParams:
    """The engine's sampling parameters for a request, with the API's defaults (temperature 1, top_p 1).

    ``max_tokens`` None asks for as many tokens as fit in ``room`` (the tokens a request may reach).
    """
    if max_tokens is None:
        max_tokens = room - prompt_len
        if max_tokens < 1:
            raise ApiError(400, f"the prompt has {prompt_len} tokens, which leaves no room to generate within "
                                f"{room}; shorten it", "messages")
    elif max_tokens < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    temperature = 1.0 if req.temperature is None else req.temperature
    if not 0 <= temperature <= 2:
        raise ApiError(400, f"temperature must be between 0 and 2, got {temperature}", "temperature")
    top_p = 1.0 if req.top_p is None else req.top_p
    if not 0 < top_p <= 1:
        raise ApiError(400, f"top_p must be in (0, 1], got {top_p}", "top_p")
    top_k = req.top_k or 0
    if top_k < 0:
        raise ApiError(400, f"top_k must be >= 0 (0 = off), got {top_k}", "top_k")
    return SamplingParams(max_new_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                          seed=req.seed)


# ----------------------------------------------------------------------------- detokenizing


class TextStream:
    """Generated tokens to text pieces: a piece never splits a UTF-8 character, never shows a stop string or the
    start of one that may still complete, and ``stopped`` says when one completed (the text before it is the
    last piece). Without a tokenizer every piece is empty (clients get token ids)."""

    WINDOW = 8  # tokens decoded per push at most (then the window slides on, keeping CONTEXT tokens)
    CONTEXT = 4  # tokens before the new ones: a tokenizer's leading-space rules see what precedes them

    def __init__(self, tokenizer, stops: Sequence[str] = ()):
        self.tokenizer, self.stops = tokenizer, tuple(stops)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # decoded so far: complete characters only
        self.emitted = 0  # characters of ``text`` handed out
        self.stopped = False
        self._start = 0  # the decode window: ids[_start:]
        self._done = 0  # characters of the window's text already in ``text``
        self._decode = _decoder(tokenizer)

    def push(self, token: int) -> str:
        """Take one token; returns the text it lets out (often "")."""
        self.ids.append(token)
        if self.tokenizer is None or self.stopped:
            return ""
        # one decode of a short window per token, not of the whole output: O(1) per token
        window = self._decode(self.ids[self._start:])
        if len(window) > self._done and not window.endswith("\ufffd"):  # U+FFFD: a character still incomplete
            self.text += window[self._done:]
            self._done = len(window)
            if len(self.ids) - self._start > self.WINDOW:  # slide at a point where every character is complete
                self._start = len(self.ids) - self.CONTEXT
                self._done = len(self._decode(self.ids[self._start:]))
        return self._release(final=False)

    def flush(self) -> str:
        """The rest, when the request ends (an incomplete last character comes out as U+FFFD)."""
        if self.tokenizer is not None and not self.stopped:
            window = self._decode(self.ids[self._start:])
            self.text += window[self._done:]
            self._done = len(window)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        hits = [i for i in (self.text.find(s, self.emitted) for s in self.stops) if i >= 0]
        if hits:  # a stop string is complete: only the text before it goes out
            end, self.stopped = min(hits), True
        else:
            end = len(self.text) if final else max(self.emitted, len(self.text) - self.hold)
        out, self.emitted = self.text[self.emitted:end], end
        return out


def _decoder(tokenizer):
    """``ids -> text`` without special tokens. A fast tokenizer's own ``tokenizers`` backend when transformers
    would not change its output (no clean-up of spaces): transformers' ``decode`` wrapper costs several times
    the decode itself, and the server decodes once per generated token."""
    if tokenizer is None:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


# ----------------------------------------------------------------------------- metrics


class Metrics:
    """Prometheus metrics of one server, in a registry of its own (two servers in a process do not mix)."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.running = Gauge("pagedattn_requests_running", "Requests being generated", registry=r)
        self.waiting = Gauge("pagedattn_requests_waiting", "Requests admitted and waiting for the engine", registry=r)
        self.kv_blocks_used = Gauge("pagedattn_kv_blocks_used", "KV-cache blocks in use", registry=r)
        self.kv_blocks_total = Gauge("pagedattn_kv_blocks_total", "KV-cache blocks in the cache", registry=r)
        self.tokens_per_second = Gauge("pagedattn_output_tokens_per_second",
                                       f"Output tokens per second over the last {RATE_WINDOW_S:g} s", registry=r)
        self.prompt_tokens = Counter("pagedattn_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.output_tokens = Counter("pagedattn_output_tokens", "Generated tokens", registry=r)
        self.engine_steps = Counter("pagedattn_engine_steps",
                                    "Engine steps run since the engine was built (each one forward of its batch)",
                                    registry=r)
        self.finished = Counter("pagedattn_requests_finished", "Requests that ended, by finish reason",
                                ["finish_reason"], registry=r)
        self.rejected = Counter("pagedattn_requests_rejected", "Requests refused, by HTTP status", ["status"],
                                registry=r)
        lat = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.ttft = Histogram("pagedattn_time_to_first_token_seconds", "Request arrival to its first token",
                              buckets=lat, registry=r)
        self.itl = Histogram("pagedattn_inter_token_latency_seconds", "Time between a request's tokens",
                             buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5), registry=r)
        self.e2e = Histogram("pagedattn_request_latency_seconds", "Request arrival to its end", buckets=lat,
                             registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)


# ----------------------------------------------------------------------------- the engine loop


@dataclass(eq=False)
class _Stream:
    """One request as the server sees it; the loop thread puts its events on ``queue`` (via the event loop)."""

    rid: int
    queue: asyncio.Queue
    t_submit: float
    sent: int = 0  # tokens handed to the queue
    t_last: float = 0.0


@dataclass
class _Rate:
    """Output tokens per second over a sliding window."""

    window: float = RATE_WINDOW_S
    events: deque = field(default_factory=deque)  # (time, tokens)
    total: int = 0

    def add(self, now: float, n: int) -> float:
        if n:
            self.events.append((now, n))
            self.total += n
        while self.events and self.events[0][0] < now - self.window:
            self.total -= self.events.popleft()[1]
        return self.total / self.window


class EngineLoop:
    """The server's side of the engine: requests in flight, each with an asyncio queue of its events.

    ``engine`` is an :class:`~pagedattn.serve_engine.EngineProcess` (the engine steps in a process of its own)
    or a ``PagedEngine`` of this process (it steps in a thread: :class:`~pagedattn.serve_engine.EngineThread`).
    :meth:`submit` and :meth:`abort` are called from the event loop and never wait for a step. The engine sends
    one message per step with every request's new tokens; :meth:`_on_message` fans it out to the requests'
    queues. At most ``max_num_seqs + max_queue`` requests are in flight; :meth:`submit` answers 503 beyond.
    Events on a request's queue: ``("tokens", ids)``, then ``("finish", reason)``; or ``("error", status, message,
    param)`` (400: the engine refused the request; 500: a step failed or the engine process died); or
    ``("aborted", why)`` when the server aborts it (shutdown).
    """

    def __init__(self, engine: PagedEngine | EngineProcess, metrics: Metrics, max_queue: int = 256):
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.transport = engine if isinstance(engine, EngineProcess) else EngineThread(engine)
        self.metrics = metrics
        self.info: EngineInfo = self.transport.start()  # an engine process: blocks until it is built
        self.capacity = self.info.max_num_seqs + max_queue
        self.gauges = Gauges(0, 0, 0, False, 0)  # the engine's latest
        self.final: Optional[Gauges] = None  # the engine's state as it stopped
        self.dead: Optional[str] = None  # why the engine is gone (its process died)
        self._streams: dict[int, _Stream] = {}
        self._ids = itertools.count()
        self._sent = 0  # commands sent (the engine reports how many it applied)
        self._stopping = False
        self._aio: Optional[asyncio.AbstractEventLoop] = None
        self._rate = _Rate()
        self._steps_counted = 0  # engine steps already in the steps counter
        metrics.kv_blocks_total.set(self.info.num_blocks)

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    @property
    def settled(self) -> bool:
        """Nothing in flight, and the engine's latest state (after every command sent) holds no request and no
        block: what tests and health checks wait for."""
        g = self.gauges
        return not self._streams and g.applied == self._sent and not g.unfinished and g.blocks_used == 0

    def start(self, aio_loop: asyncio.AbstractEventLoop) -> None:
        self._aio = aio_loop
        self.transport.attach(aio_loop, self._on_message, self._on_dead)

    def _send(self, command: tuple) -> None:
        self._sent += 1
        try:
            self.transport.send(command)
        except EngineDead as e:
            self._on_dead(str(e))

    def submit(self, prompt: list[int], params: SamplingParams, room: Optional[int] = None) -> _Stream:
        """Add a request; raises :class:`ApiError` (503 when full, shutting down or the engine is gone). The engine
        refuses a request it cannot serve with a 400 event (see :class:`EngineLoop`)."""
        if self.dead:
            raise ApiError(503, f"the engine is not running ({self.dead}); retry on another server",
                           code="engine_dead")
        if self._stopping:
            raise ApiError(503, "the server is shutting down; retry on another server", code="shutting_down")
        if len(self._streams) >= self.capacity:
            raise ApiError(503, f"the server is at capacity ({len(self._streams)} requests in flight, "
                                f"{self.info.max_num_seqs} generating at a time and the rest queued); "
                                "retry later", code="overloaded")
        stream = _Stream(next(self._ids), asyncio.Queue(), time.perf_counter())
        self._streams[stream.rid] = stream
        self._send(("add", stream.rid, prompt, params, room))
        self.metrics.prompt_tokens.inc(len(prompt))
        return stream

    def abort(self, stream: _Stream, why: str = "aborted", reason: str = "abort") -> None:
        """Stop a request whose client went away or that hit a stop string (call it from the event loop); the
        engine frees its blocks between steps. Idempotent: a finished request is left alone. ``reason`` is the
        finish reason the metrics count it under."""
        if self._streams.pop(stream.rid, None) is None:
            return
        self.metrics.finished.labels(reason).inc()
        stream.queue.put_nowait(("aborted", why))  # whoever still reads the request's events stops
        if not self.dead:
            self._send(("abort", stream.rid))

    async def events(self, stream: _Stream) -> AsyncIterator[tuple]:
        """The request's events, up to and including its last. Token events already queued come as one (a reader
        that fell behind catches up in one chunk instead of one per step)."""
        queue = stream.queue
        while True:
            event = await queue.get()
            while event[0] == "tokens" and not queue.empty():
                nxt = queue.get_nowait()
                if nxt[0] != "tokens":
                    yield event
                    event = nxt
                    break
                event = ("tokens", event[1] + nxt[1])
            yield event
            if event[0] != "tokens":
                return

    @contextlib.contextmanager
    def paused(self):
        """Hold the engine between steps (requests are admitted and wait; nothing is generated), e.g. to fill
        the queue in a test or for maintenance. Callable from any thread."""
        self._command_from_any_thread(("pause",))
        try:
            yield
        finally:
            self._command_from_any_thread(("resume",))

    def _command_from_any_thread(self, command: tuple) -> None:
        with contextlib.suppress(RuntimeError):  # RuntimeError: no event loop runs in this thread
            if asyncio.get_running_loop() is self._aio:
                self._send(command)
                return
        done = threading.Event()

        def send():
            self._send(command)
            done.set()

        self._aio.call_soon_threadsafe(send)
        done.wait(10)

    def drain(self, grace: float) -> None:
        """Start a graceful shutdown (call it from the event loop): new requests get 503 at once, and the ones in
        flight get ``grace`` seconds to finish before they are aborted (their clients get a 503 error, or an
        error event in a stream)."""
        self._stopping = True
        self._aio.call_later(grace, self._abort_all)

    def _abort_all(self) -> None:
        for stream in list(self._streams.values()):
            self.abort(stream, "the server shut down before the request finished")

    def stop(self, timeout: float = 30.0) -> Optional[Gauges]:
        """Refuse new requests, abort those in flight (their clients get an ``aborted`` event) and stop the engine
        (its process ends); the engine's final state."""
        self._stopping = True
        self._abort_all()
        self.final = self.transport.close(timeout)
        if self.final is None:
            log.warning("the engine stopped without reporting its state (%s)", self.dead or "it did not answer")
        elif self.final.unfinished or self.final.blocks_used:
            log.warning("the engine stopped with requests unfinished or blocks in use: %s", self.final)
        else:
            log.info("engine stopped: %d of %d KV blocks free", self.info.num_blocks - self.final.blocks_used,
                     self.info.num_blocks)
        return self.final

    # --- messages from the engine, on the event loop

    def _on_message(self, msg: tuple) -> None:
        """One step's (or one batch of commands') news: each request's tokens, ends and refusals."""
        if msg[0] != "out":
            log.warning("unexpected message from the engine: %r", msg[0])
            return
        _, entries, gauges = msg
        now = time.perf_counter()
        new_tokens = 0
        for cid, tokens, finish, error in entries:
            stream = self._streams.get(cid)
            if stream is None:  # aborted by the server meanwhile: nobody waits for it
                continue
            if tokens:
                new_tokens += self._advance(stream, tokens, now)
            if error is not None:
                self._end(stream, ("error", *error), "error" if error[0] >= 500 else "rejected", now)
            elif finish is not None:
                self._end(stream, ("finish", finish), finish, now)
        self.gauges = gauges
        self._update_gauges(now, new_tokens)

    def _advance(self, stream: _Stream, new: list[int], now: float) -> int:
        """Hand ``new`` tokens to the stream; observe its latencies."""
        if stream.sent == 0:
            self.metrics.ttft.observe(now - stream.t_submit)
        else:
            gap = (now - stream.t_last) / len(new)  # a request that caught up (after preemption) shares the gap
            for _ in new:
                self.metrics.itl.observe(gap)
        stream.sent, stream.t_last = stream.sent + len(new), now
        stream.queue.put_nowait(("tokens", new))
        return len(new)

    def _end(self, stream: _Stream, event: tuple, reason: str, now: float) -> None:
        del self._streams[stream.rid]
        stream.queue.put_nowait(event)
        if reason != "rejected":  # a refused request is counted by its status (the API's error handler)
            self.metrics.finished.labels(reason).inc()
            self.metrics.e2e.observe(now - stream.t_submit)

    def _update_gauges(self, now: float, new_tokens: int = 0) -> None:
        m, g = self.metrics, self.gauges
        m.output_tokens.inc(new_tokens)
        steps = max(0, g.steps - self._steps_counted)  # the engine's count since start, as a counter's increments
        if steps:
            m.engine_steps.inc(steps)
            self._steps_counted = g.steps
        m.tokens_per_second.set(self._rate.add(now, new_tokens))
        m.running.set(g.running)
        m.waiting.set(max(0, len(self._streams) - g.running))
        m.kv_blocks_used.set(g.blocks_used)

    def _on_dead(self, why: str) -> None:
        """The engine process is gone: every request in flight gets a 500, every new one a 503."""
        if self.dead:
            return
        self.dead = why
        log.error("%s: requests in flight fail, new ones are refused", why)
        streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.queue.put_nowait(("error", 500, f"{why}; the request was lost", None))
            self.metrics.finished.labels("error").inc()
        self._update_gauges(time.perf_counter())


# ----------------------------------------------------------------------------- responses


@dataclass(frozen=True)
class _Piece:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: Optional[str] = None


@dataclass
class _Usage:
    prompt_tokens: int
    completion_tokens: int = 0

    def to_json(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


async def _watch_disconnect(request: Request, on_disconnect) -> None:
    """Call ``on_disconnect`` when the client goes away (uvicorn answers ``receive()`` once it does)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            return


class _Service:
    """The endpoints' logic over one engine loop."""

    def __init__(self, loop: EngineLoop, tokenizer, config: ServeConfig):
        self.loop, self.tokenizer, self.config = loop, tokenizer, config
        info = loop.info
        limits = [info.num_blocks * info.block_size, config.max_model_len or info.max_model_len]
        self.room = min(x for x in limits if x)  # tokens one request may reach

    def check_model(self, name: Optional[str]) -> None:
        if name is not None and name != self.config.model_name:
            raise ApiError(404, f"model {name!r} is not served here; this server serves {self.config.model_name!r} "
                                "(GET /v1/models)", "model", "model_not_found")

    def admit(self, req: _Common, prompt: list[int], max_tokens: Optional[int]) -> tuple[SamplingParams, tuple]:
        """The request's sampling parameters and stop strings; 400 for malformed ones. What only the engine knows
        (an empty prompt, token ids outside the vocabulary, more blocks than the cache has, more than ``room``
        tokens) it checks as it takes the request in, and refuses with a 400 before the first token."""
        return (sampling_params(req, max_tokens, self.loop.info.room_prompt_len(prompt), self.room),
                _stops(req.stop, self.tokenizer))

    async def pieces(self, request: Request, prompt: list[int], params: SamplingParams, stops: tuple,
                     usage: _Usage) -> AsyncIterator[_Piece]:
        """The request's output as text pieces; the last carries the finish reason. Aborts the request when
        the client disconnects, a stop string completes, or the consumer stops early."""
        stream = self.loop.submit(prompt, params, self.room)
        watcher = asyncio.create_task(_watch_disconnect(request, lambda: self.loop.abort(stream, "client gone")))
        text = TextStream(self.tokenizer, stops)
        try:
            async for event in self.loop.events(stream):
                kind = event[0]
                if kind == "tokens":
                    piece, ids = "", []
                    for tok in event[1]:
                        piece += text.push(tok)
                        ids.append(tok)
                        if text.stopped:
                            break
                    usage.completion_tokens = len(text.ids)
                    if text.stopped:
                        self.loop.abort(stream, "stop string", reason="stop")
                        yield _Piece(piece, tuple(ids), "stop")
                        return
                    if piece or ids:
                        yield _Piece(piece, tuple(ids))
                elif kind == "finish":
                    yield _Piece(text.flush(), (), event[1])
                    return
                elif kind == "error":
                    status, message, param = event[1:]
                    raise ApiError(status, message, param, code="engine_error" if status >= 500 else None)
                else:  # aborted by the server
                    raise ApiError(503, event[1], code="shutting_down")
        finally:
            watcher.cancel()
            self.loop.abort(stream)  # a no-op once it finished


def _chunk_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class _ChunkFormat:
    """Server-sent events of one streamed response. The common chunk (some text, no finish reason) is the
    pre-serialised envelope around the JSON-escaped text: it goes out once per request per engine step, and
    building and serialising the whole object each time was a large part of the server's cost per token."""

    def __init__(self, head: dict, choice: dict, key: tuple[str, ...]):
        self.head, self.choice, self.key = head, choice, key
        probe = "\x00probe\x00"
        whole = _sse({**head, "choices": [self._choice(probe, None)]})
        self._before, self._after = whole.split(json.dumps(probe))

    def _choice(self, text, finish) -> dict:
        c = json.loads(json.dumps(self.choice))  # a fresh nested copy
        d = c
        for k in self.key[:-1]:
            d = d[k]
        d[self.key[-1]] = text
        c["finish_reason"] = finish
        return c

    def text(self, text: str) -> str:
        return f"{self._before}{json.dumps(text, ensure_ascii=False)}{self._after}"

    def full(self, text, finish, extra: Optional[dict] = None) -> str:
        c = self._choice(text, finish)
        return _sse({**self.head, "choices": [{**c, **(extra or {})}]})

    def usage(self, usage: _Usage) -> str:
        return _sse({**self.head, "choices": [], "usage": usage.to_json()})


def _event_stream(first: _Piece, pieces: AsyncIterator[_Piece], render, opening: Sequence[str] = (),
                  closing=lambda: ()) -> StreamingResponse:
    """An SSE response: ``opening`` events, ``render(piece)`` for each piece (None: nothing to send), then
    ``closing()`` and ``[DONE]``. An error after the status line went out is sent as an error event."""

    async def events():
        try:
            for e in opening:
                yield e
            piece = first
            while True:
                event = render(piece)
                if event:
                    yield event
                if piece.finish_reason:
                    break
                piece = await anext(pieces)
            for e in closing():
                yield e
        except ApiError as e:
            yield _sse({"error": {"message": e.message, "type": "server_error", "param": None, "code": e.code}})
        finally:
            await pieces.aclose()  # aborts the request if it is still running (client gone)
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _complete(service: _Service, request: Request, body: CompletionRequest):
    service.check_model(body.model)
    _refuse_unsupported(body)
    prompt = completion_prompt_ids(body.prompt, service.tokenizer)
    max_tokens = service.config.default_max_tokens if body.max_tokens is None else body.max_tokens
    params, stops = service.admit(body, prompt, max_tokens)
    usage = _Usage(len(prompt))
    ids = body.return_token_ids or service.tokenizer is None
    head = {"id": _chunk_id("cmpl"), "object": "text_completion", "created": int(time.time()),
            "model": service.config.model_name}
    pieces = service.pieces(request, prompt, params, stops, usage)
    if not body.stream:
        text, token_ids, finish = await _gather(pieces)
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        if ids:
            choice["token_ids"] = token_ids
        return {**head, "choices": [choice], "usage": usage.to_json()}
    first = await anext(pieces)  # errors before the first token still get their status code
    fmt = _ChunkFormat(head, {"index": 0, "text": "", "logprobs": None, "finish_reason": None}, ("text",))

    def render(p: _Piece) -> Optional[str]:
        if ids or p.finish_reason:
            return fmt.full(p.text, p.finish_reason, {"token_ids": list(p.token_ids)} if ids else None)
        return fmt.text(p.text) if p.text else None  # tokens held back (partial character, stop string) wait

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return _event_stream(first, pieces, render, closing=lambda: [fmt.usage(usage)] if include_usage else [])


async def _chat(service: _Service, request: Request, body: ChatRequest):
    service.check_model(body.model)
    _refuse_unsupported(body)
    prompt = chat_prompt_ids(body.messages, service.tokenizer, service.config.chat_template)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params, stops = service.admit(body, prompt, max_tokens)
    usage = _Usage(len(prompt))
    ids = bool(body.return_token_ids)
    head = {"id": _chunk_id("chatcmpl"), "created": int(time.time()), "model": service.config.model_name}
    pieces = service.pieces(request, prompt, params, stops, usage)
    if not body.stream:
        text, token_ids, finish = await _gather(pieces)
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish}
        if ids:
            choice["token_ids"] = token_ids
        return {**head, "object": "chat.completion", "choices": [choice], "usage": usage.to_json()}
    first = await anext(pieces)
    head = {**head, "object": "chat.completion.chunk"}
    fmt = _ChunkFormat(head, {"index": 0, "delta": {"content": ""}, "logprobs": None, "finish_reason": None},
                       ("delta", "content"))

    def render(p: _Piece) -> Optional[str]:
        out = ""
        if p.text or (ids and p.token_ids):
            out = fmt.full(p.text, None, {"token_ids": list(p.token_ids)}) if ids else fmt.text(p.text)
        if p.finish_reason:  # the last chunk: an empty delta and the reason
            out += _sse({**head, "choices": [{"index": 0, "delta": {}, "logprobs": None,
                                              "finish_reason": p.finish_reason}]})
        return out or None

    opening = [_sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}]})]
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return _event_stream(first, pieces, render, opening, lambda: [fmt.usage(usage)] if include_usage else [])


async def _gather(pieces: AsyncIterator[_Piece]) -> tuple[str, list[int], str]:
    text, ids, finish = [], [], None
    async for p in pieces:
        text.append(p.text)
        ids.extend(p.token_ids)
        finish = p.finish_reason or finish
    return "".join(text), ids, finish


# ----------------------------------------------------------------------------- the app


def _validation_message(exc: RequestValidationError) -> tuple[str, Optional[str]]:
    """One line for pydantic's first complaint: invalid JSON, or a field of the wrong type."""
    err = exc.errors()[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    if err.get("type") == "json_invalid":
        return f"the request body is not valid JSON ({err.get('ctx', {}).get('error', err.get('msg'))})", None
    if not loc:
        return "the request body must be a JSON object", None
    return f"{'.'.join(loc)}: {err.get('msg')}", loc[0]


def create_app(engine: PagedEngine | EngineProcess, tokenizer, config: ServeConfig) -> FastAPI:
    """The OpenAI-compatible app over ``engine`` (tokenizer may be None: prompts as token ids): an
    :class:`EngineProcess` (started here, which blocks until its engine is built; the engine steps in its own
    process) or a ``PagedEngine`` of this process (it steps in a thread). Its lifespan starts the engine loop and
    stops it (in-flight requests aborted, every block freed, the engine process ended); ``app.state.engine_loop``
    is the loop, ``app.state.metrics`` the metrics."""
    metrics = Metrics()
    loop = EngineLoop(engine, metrics, config.max_queue)
    service = _Service(loop, tokenizer, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loop.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            loop.stop()

    app = FastAPI(title="pagedattn", summary="OpenAI-compatible server over PagedEngine", lifespan=lifespan)
    app.state.engine_loop, app.state.metrics = loop, metrics

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        metrics.rejected.labels(str(exc.status)).inc()
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        if param is None:  # a body that is not an object: say so if it is not JSON at all (any content type)
            try:
                json.loads(await request.body())
            except ValueError as e:
                message = f"the request body is not valid JSON ({first_line(e)})"
        metrics.rejected.labels("400").inc()
        return ApiError(400, message, param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        detail = f"{request.method} {request.url.path}: {exc.detail}"
        return ApiError(exc.status_code, detail).response()

    @app.exception_handler(Exception)
    async def crash(request: Request, exc: Exception):
        log.exception("request failed")
        return ApiError(500, f"internal error: {type(exc).__name__}: {first_line(exc)}").response()

    @app.get("/health")
    async def health():
        pid = loop.transport.pid
        if loop.dead:
            return JSONResponse({"status": "engine down", "error": loop.dead, "engine_pid": pid}, status_code=503)
        return {"status": "ok", "requests_in_flight": loop.in_flight, "engine_pid": pid}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "pagedattn", "max_model_len": service.room}]}

    @app.get("/metrics")
    async def prometheus():
        loop._update_gauges(time.perf_counter())  # the tokens/s window moves on while the engine idles
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _complete(service, request, body)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        return await _chat(service, request, body)

    return app


# ----------------------------------------------------------------------------- running it


def bind(host: str = "127.0.0.1", port: int = 8000) -> socket.socket:
    """A listening socket (port 0: a free one, see ``getsockname()``); raises OSError when the address is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _uvicorn_server(app: FastAPI, shutdown_timeout: float, log_level: str, access_log: bool = False):
    import uvicorn

    class GracefulServer(uvicorn.Server):
        """Ends in-flight requests itself ``shutdown_timeout`` seconds into a shutdown, so that their clients get
        an error and uvicorn, which waits longer, never has to cancel a response half-sent."""

        async def shutdown(self, sockets=None) -> None:
            app.state.engine_loop.drain(shutdown_timeout)
            await super().shutdown(sockets)

    # access logs off unless asked: the library stays quiet (uvicorn's own warnings and errors still show)
    config = uvicorn.Config(app, log_level=log_level, access_log=access_log,
                            timeout_graceful_shutdown=shutdown_timeout + 10, lifespan="on")
    return GracefulServer(config)


def run(app: FastAPI, sock: socket.socket, *, shutdown_timeout: float = 5.0, log_level: str = "warning",
        access_log: bool = False) -> None:
    """Serve ``app`` on ``sock`` until SIGINT/SIGTERM: then in-flight requests get ``shutdown_timeout`` seconds to
    finish, the rest are aborted, and the engine loop stops with every block freed."""
    _uvicorn_server(app, shutdown_timeout, log_level, access_log).run(sockets=[sock])


class BackgroundServer:
    """``app`` served from a thread of this process on ``host``:``port`` (0: a free port), for tests and notebooks::

        with BackgroundServer(app) as srv:
            openai.OpenAI(base_url=srv.url, api_key="-")...
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, shutdown_timeout: float = 2.0):
        self.app = app
        self.sock = bind(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}/v1"
        self._server = _uvicorn_server(app, shutdown_timeout, "warning")
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self.sock]},
                                        name="pagedattn-server", daemon=True)

    def start(self, timeout: float = 30.0) -> "BackgroundServer":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on port {self.port} did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Graceful shutdown, as on SIGINT."""
        self._server.should_exit = True
        self._thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
