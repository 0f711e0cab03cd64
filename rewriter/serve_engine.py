"""The engine side of ``rewrite-model serve``: a ``PagedEngine`` stepped by an :class:`EngineCore` that talks to
the HTTP side in messages, either from a child process (:class:`EngineProcess`, what the CLI runs) or from a
thread of the server's own process (:class:`EngineThread`, for an engine built in-process).

The split is vLLM V1's engine core: the HTTP process parses requests, tokenizes, detokenizes and streams; the
engine process does nothing but take commands between steps and step, and after each step sends *one*
message with every request's new tokens. With the engine in its own process the event loop's work per token
(server-sent events, socket writes) no longer takes GIL time from the steps.

Messages (pickled tuples; ``cid`` is the server's id of a request)::

    server -> engine   ("add", cid, prompt, params, room) | ("abort", cid) | ("pause",) | ("resume",) | ("stop",)
    engine -> server   ("ready", EngineInfo) | ("failed", message) | ("out", entries, Gauges) | ("stopped", Gauges)

An entry is ``(cid, new_tokens, finish_reason or None, error or None)``; an error is ``(status, message,
param)``: 400 for a request the engine refuses, 500 for a step that failed. The engine process ignores
SIGINT (the server stops it with ``("stop",)``) and exits as soon as the server's end of its command pipe
closes, so it never outlives the server, however the server ends.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import queue
import signal
import threading
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional, Sequence

from pagedattn.report import first_line
from pagedattn.runtime.frames import call_with_frame_room

log = logging.getLogger("pagedattn.serve")

__all__ = ["EngineCore", "EngineInfo", "Gauges", "EngineProcess", "EngineThread", "EngineStartError",
           "EngineDead", "engine_info", "max_model_len"]


class EngineStartError(RuntimeError):
    """The engine process could not build its engine (the message says why) or died while starting."""


class EngineDead(RuntimeError):
    """The engine process is gone: its pipe closed."""


@dataclass(frozen=True)
class EngineInfo:
    """What the server needs to know of an engine it cannot touch. For an encoder-decoder the prompt is the
    encoder's input and ``max_model_len`` counts decoder tokens (its ``decoder_prompt_len`` start tokens and
    the completion)."""

    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_model_len: Optional[int]
    pid: int
    encoder_decoder: bool = False
    decoder_prompt_len: int = 0

    def room_prompt_len(self, prompt: Sequence[int]) -> int:
        """The tokens of a request that count toward ``max_model_len`` before its completion."""
        return self.decoder_prompt_len if self.encoder_decoder else len(prompt)


class Gauges(NamedTuple):
    """The engine's state after a step or a batch of commands. ``applied``: commands taken in so far (the server
    compares it with the commands it sent to know a snapshot is recent)."""

    running: int
    requests: int  # requests the engine holds for the server (running, waiting or swapped)
    blocks_used: int
    unfinished: bool
    applied: int
    steps: int = 0  # engine steps run so far


def max_model_len(engine) -> Optional[int]:
    """The longest sequence the engine's paged kernels accept: the shortest length a rewritten site's mask is
    established for, and for an encoder-decoder the decoder's positions (None: every length)."""
    limit = engine.length_limit()
    limits = [limit[0]] if limit is not None else []
    s2s = engine.servable.seq2seq
    if s2s is not None and s2s.max_decoder_len is not None:
        limits.append(s2s.max_decoder_len)
    return min(limits) if limits else None


def engine_info(engine) -> EngineInfo:
    s2s = engine.servable.seq2seq
    return EngineInfo(engine.num_blocks, engine.block_size, engine.scheduler.max_num_seqs, max_model_len(engine),
                      os.getpid(), s2s is not None, len(s2s.spec.decoder_prompt) if s2s is not None else 0)


# ----------------------------------------------------------------------------- the core


class EngineCore:
    """Steps ``engine`` while it has work, takes commands (:meth:`put`, from any thread) between steps and hands
    ``emit`` one ``("out", entries, gauges)`` message per step, and one after a batch of commands that leaves the
    engine idle (so that a refusal or an abort is reported without waiting for a step)."""

    def __init__(self, engine, emit: Callable[[tuple], None]):
        self.engine, self.emit = engine, emit
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self._eid: dict[Any, int] = {}  # server id -> engine id
        self._cid: dict[int, Any] = {}  # engine id -> server id
        self._sent: dict[int, int] = {}  # engine id -> tokens reported
        self._entries: list[tuple] = []
        self._paused = False
        self._applied = 0

    def put(self, command: tuple) -> None:
        self.commands.put(command)

    def run(self) -> Gauges:
        """Serve commands and step until ``("stop",)``; then abort what is left and return the final gauges."""
        return call_with_frame_room(self._run)  # one frame-stack chunk for every step, as engine.generate's loop

    def _run(self) -> Gauges:
        with self.engine.bound():
            while True:
                if not self._take(block=self._idle()):
                    break
                if self._idle():
                    self._flush()
                    continue
                self._step()
            self._abort_all()
        return self.gauges()

    def gauges(self) -> Gauges:
        e = self.engine
        return Gauges(len(e.scheduler.running), len(self._cid), e.num_blocks - e.blocks.num_free,
                      e.has_unfinished(), self._applied, e.stats["steps"])

    def _idle(self) -> bool:
        return self._paused or not self.engine.has_unfinished()

    def _take(self, block: bool) -> bool:
        """Apply the commands queued (waiting for one if ``block``); False once told to stop."""
        try:
            command = self.commands.get() if block else self.commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if command[0] == "stop":
                return False
            self._apply(command)
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, command: tuple) -> None:
        kind = command[0]
        self._applied += 1
        if kind == "add":
            self._add(*command[1:])
        elif kind == "abort":
            self._abort(command[1])
        elif kind in ("pause", "resume"):
            self._paused = kind == "pause"
        else:
            log.warning("engine core: unknown command %r ignored", kind)

    def _add(self, cid, prompt: list[int], params, room: Optional[int]) -> None:
        """Validate and queue a request; a refusal becomes a 400 entry naming the problem."""
        s2s = self.engine.servable.seq2seq
        # an encoder-decoder's prompt is its encoder's input: add_request checks it and the decoder's tokens
        why = self.engine.validate(prompt, params) if s2s is None else None
        param = "prompt"
        before = len(prompt) if s2s is None else len(s2s.spec.decoder_prompt)  # what counts toward the room
        if why is None and room and before + params.max_new_tokens > room:
            param = "max_tokens"
            why = (f"the prompt has {len(prompt)} tokens and max_tokens is {params.max_new_tokens}: together more "
                   f"than the {room} tokens a request may reach; shorten the prompt or lower max_tokens"
                   if s2s is None else f"max_tokens is {params.max_new_tokens} but this encoder-decoder's decoder "
                   f"generates at most {room - before} tokens; lower max_tokens")
        if why is None:
            try:
                eid = self.engine.add_request(prompt, params)
            except ValueError as e:
                why = first_line(e).split(": ", 1)[-1]
        if why is not None:
            self._entries.append((cid, [], None, (400, why, param)))
            return
        self._eid[cid], self._cid[eid], self._sent[eid] = eid, cid, 0

    def _abort(self, cid) -> None:
        eid = self._eid.pop(cid, None)
        if eid is not None:
            del self._cid[eid], self._sent[eid]
            self.engine.abort(eid)

    def _abort_all(self) -> None:
        for cid in list(self._eid):
            self._abort(cid)
        self.engine.collect()

    def _step(self) -> None:
        try:
            self.engine.step()
            self._progress()
        except Exception as e:  # never let one bad step end the loop: fail what is in flight, go on
            log.exception("engine step failed")
            self._fail_all(f"the engine failed: {type(e).__name__}: {first_line(e)}")
        self._flush()

    def _progress(self) -> None:
        """Entries for every request's tokens since the last step, finished ones with their reason."""
        entries = self._entries
        for out in self.engine.collect():
            cid = self._cid.pop(out.request_id, None)
            if cid is None:  # aborted by the server: nobody waits for it
                continue
            del self._eid[cid]
            entries.append((cid, out.tokens[self._sent.pop(out.request_id):], out.finish_reason, None))
        for eid, new in self.engine.unfinished_outputs(self._sent).items():
            if new and eid in self._cid:
                self._sent[eid] += len(new)
                entries.append((self._cid[eid], new, None, None))

    def _fail_all(self, message: str) -> None:
        for cid in list(self._eid):
            self._abort(cid)
            self._entries.append((cid, [], None, (500, message, None)))
        self.engine.collect()

    def _flush(self) -> None:
        entries, self._entries = self._entries, []
        self.emit(("out", entries, self.gauges()))


# ----------------------------------------------------------------------------- in a thread


class EngineThread:
    """An engine built in this process, stepped by an :class:`EngineCore` in a thread of its own (the HTTP side and
    the steps share the GIL: for tests, notebooks and engines that cannot be built in another process)."""

    pid = None

    def __init__(self, engine):
        self.engine = engine
        self._core: Optional[EngineCore] = None
        self._thread: Optional[threading.Thread] = None
        self._final: Optional[Gauges] = None

    def start(self) -> EngineInfo:
        return engine_info(self.engine)

    def attach(self, aio, on_message: Callable[[tuple], None], on_dead: Callable[[str], None]) -> None:
        """Start stepping; messages go to ``on_message`` on the event loop ``aio``."""
        self._core = EngineCore(self.engine, lambda msg: aio.call_soon_threadsafe(on_message, msg))
        self._thread = threading.Thread(target=self._run, name="pagedattn-engine-loop", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self._final = self._core.run()

    def send(self, command: tuple) -> None:
        self._core.put(command)

    def close(self, timeout: float = 30.0) -> Optional[Gauges]:
        """Stop the loop (what is left is aborted); the final gauges."""
        if self._thread is None:
            return None
        self._core.put(("stop",))
        self._thread.join(timeout)
        return self._final


# ----------------------------------------------------------------------------- in a process


def _engine_main(factory: Callable[[], Any], commands, outputs) -> None:
    """The engine process: build the engine, say ``ready``, step until told to stop (or the server is gone)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the server decides

    def emit(msg: tuple) -> None:
        try:
            outputs.send(msg)
        except OSError:  # the server is gone: so is its engine
            os._exit(0)

    try:
        engine = factory()
    except BaseException as e:  # noqa: BLE001 -- whatever it is, the server reports it and exits
        emit(("failed", f"{type(e).__name__}: {first_line(e)}"))
        return
    core = EngineCore(engine, emit)
    threading.Thread(target=_read_commands, args=(commands, core), name="pagedattn-engine-commands",
                     daemon=True).start()
    emit(("ready", engine_info(engine)))
    emit(("stopped", core.run()))


def _read_commands(conn, core: EngineCore) -> None:
    """The engine process's command thread: the server's commands into the core's queue; when the server's end
    closes (it exited, however), the process ends at once."""
    while True:
        try:
            command = conn.recv()
        except (EOFError, OSError):
            os._exit(0)
        core.put(command)


class EngineProcess:
    """A ``PagedEngine`` built by ``factory`` (a picklable callable, e.g. a module-level function or a
    ``functools.partial`` of one) in a child process started with ``spawn``, and stepped there.

    :meth:`start` blocks until the engine is built (rewriting and compiling happen in the child) and raises
    :class:`EngineStartError` with the child's reason when it cannot be. The child never outlives this process.
    """

    def __init__(self, factory: Callable[[], Any], start_timeout: float = 1800.0):
        self.factory, self.start_timeout = factory, start_timeout
        self.proc: Optional[multiprocessing.process.BaseProcess] = None
        self._commands = self._outputs = None
        self._send_lock = threading.Lock()  # commands come from the event loop and from other threads (paused())
        self._aio = None
        self._final: Optional[Gauges] = None

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc is not None else None

    def launch(self) -> "EngineProcess":
        """Start the engine process without waiting for it (to do other work while it builds the engine)."""
        if self.proc is not None:
            return self
        ctx = multiprocessing.get_context("spawn")
        cmd_r, self._commands = ctx.Pipe(duplex=False)
        self._outputs, out_w = ctx.Pipe(duplex=False)
        # not daemonic: the engine may start processes of its own (Inductor's compile workers)
        self.proc = ctx.Process(target=_engine_main, args=(self.factory, cmd_r, out_w), name="pagedattn-engine")
        self.proc.start()
        cmd_r.close()  # this process keeps only its own ends: the child sees EOF when they close
        out_w.close()
        atexit.register(self._kill)
        return self

    def start(self) -> EngineInfo:
        """Launch the engine process if need be and wait until its engine is built."""
        self.launch()
        msg = self._wait_ready()
        if msg[0] != "ready":
            self._kill()
            raise EngineStartError(f"the engine could not be built: {msg[1]}")
        log.info("engine process %d ready", self.proc.pid)
        return msg[1]

    def _wait_ready(self) -> tuple:
        waited = 0.0
        while not self._outputs.poll(0.2):
            waited += 0.2
            if not self.proc.is_alive():
                raise EngineStartError(f"the engine process exited while starting (exit code {self.proc.exitcode})")
            if waited > self.start_timeout:
                self._kill()
                raise EngineStartError(f"the engine was not ready after {self.start_timeout:g} s")
        try:
            return self._outputs.recv()
        except EOFError:
            self.proc.join(5)
            raise EngineStartError(f"the engine process exited while starting (exit code {self.proc.exitcode})") \
                from None

    def attach(self, aio, on_message: Callable[[tuple], None], on_dead: Callable[[str], None]) -> None:
        """Read the engine's messages on the event loop ``aio`` (no thread of ours: the pipe wakes the loop)."""
        self._aio, self._on_message, self._on_dead = aio, on_message, on_dead
        aio.add_reader(self._outputs.fileno(), self._readable)

    def _readable(self) -> None:
        try:
            while self._outputs.poll():
                msg = self._outputs.recv()
                if msg[0] == "stopped":
                    self._final = msg[1]
                else:
                    self._on_message(msg)
        except (EOFError, OSError):
            self._detach()
            self.proc.join(1)
            self._on_dead(f"the engine process died (exit code {self.proc.exitcode})")

    def _detach(self) -> None:
        if self._aio is not None:
            self._aio.remove_reader(self._outputs.fileno())
            self._aio = None

    def send(self, command: tuple) -> None:
        """Raises :class:`EngineDead` when the engine process is gone."""
        try:
            with self._send_lock:
                self._commands.send(command)
        except OSError as e:
            raise EngineDead(f"the engine process is gone ({type(e).__name__})") from None

    def close(self, timeout: float = 30.0) -> Optional[Gauges]:
        """Stop the engine (what is left is aborted) and wait for its process; the final gauges (None if it had
        died). Killed if it does not stop within ``timeout`` seconds."""
        if self.proc is None:
            return None
        self._detach()
        try:
            self.send(("stop",))
            while self._final is None and self._outputs.poll(timeout):
                msg = self._outputs.recv()
                if msg[0] == "stopped":
                    self._final = msg[1]
        except (EngineDead, EOFError, OSError):
            pass
        self.proc.join(timeout)
        self._kill()
        return self._final

    def _kill(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        atexit.unregister(self._kill)
        for conn in (self._commands, self._outputs):
            if conn is not None:
                conn.close()
        self._commands = self._outputs = None
