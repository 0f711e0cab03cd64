"""How far a serving step is from the machine's limit: bytes and FLOPs a step must move and do, against
copy bandwidth and matmul throughput measured in the same process.

A step's limit is ``max(bytes / copy bandwidth, FLOPs / matmul rate)``:

- bytes: every weight the step multiplies by, once (the model's own dtype; embedding rows only for the
  step's tokens), the K/V it reads from the cache (each sequence's cached context, every layer) and the
  K/V it writes (its new tokens). Activations are left out (they stay in cache at these sizes), so the
  figure is a lower bound. The bandwidth is DRAM's: a step whose weights fit the last-level cache and stay there
  (llama16m's 25 MB in bf16 under a 32 MiB L3, while the host's other tenants leave it alone) reads them faster,
  and a decode step at a small batch, bound by bytes, can then show more than 100 %.
- FLOPs: ``2 * parameters`` per token for the layers' matmuls, ``2 * vocab * hidden`` per row whose logits
  are needed (the engine's ``logits_to_keep``), and ``4 * heads * head_size`` per (query, visible key)
  pair for attention (causal; a window or chunk would only lower it).
- the machine: a large ``dst.copy_(src)`` (read + write bytes per second) and a large square ``mm``, or on
  the CPU oneDNN's linear over packed weights where it is faster (what the compiled step runs);
  for bf16/fp16 models the faster of the dtype's own GEMM and fp32's (the operands are exact in fp32,
  which is what the engine runs on CPUs without native bf16 GEMMs). Best of a few repetitions: the
  machine's peak, so fractions are conservative.

Used by ``benchmarks/generate_cpu.py`` and ``benchmarks/attention_cuda.py`` (``measure_machine`` takes a
device). The time a runner takes, divided into the summed limit of the steps it ran, is its fraction of
the roofline (1.0 = at the limit). ``generate_cpu.py`` also prints each step's limit with its matmuls and its
attention one after the other (:meth:`StepCost.sequential_limit_s`): what kernels that run in turn, as the CPU
step's do, could reach at best; the gap between the two limits is what overlapping them could win.

    python benchmarks/roofline.py          # print this machine's copy bandwidth and matmul rate
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import torch

from pagedattn.passes.fp32_matmuls import native_cpu_matmul
from pagedattn.runtime.frames import call_with_frame_room

# (context tokens already cached, new tokens this step, whether the chunk's last logits are needed)
StepChunk = tuple[int, int, bool]


# ------------------------------------------------------------------------------ the machine


@dataclass(frozen=True)
class Machine:
    """What the hardware does at best, measured in this process."""

    copy_bytes_per_s: float  # read + write bytes per second of a large copy
    matmul_flops_per_s: float  # FLOPs per second of a large square matmul
    device: str
    threads: int

    def describe(self) -> str:
        return (f"{self.device}: copy {self.copy_bytes_per_s / 1e9:.1f} GB/s (read + write), matmul "
                f"{self.matmul_flops_per_s / 1e9:.0f} GFLOP/s, {self.threads} threads")


def _best_seconds(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_machine(dtype: torch.dtype = torch.float32, device: str = "cpu", copy_bytes: int = 256 << 20,
                    matmul_size: int = 2048, repeats: int = 5) -> Machine:
    """Copy bandwidth and matmul rate of ``device`` (best of ``repeats``; see the module docstring)."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    src = torch.empty(copy_bytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    copy_s = _best_seconds(functools.partial(torch.Tensor.copy_, torch.empty_like(src), src), repeats, sync)
    del src
    rates = []
    # a CPU without the dtype's own GEMM (bf16 without AVX-512 or AMX) runs it 3-9x slower than fp32, and the engine
    # runs such matmuls in fp32 (passes/fp32_matmuls.py): timing it would only take minutes of a generic kernel
    own = device != "cpu" or native_cpu_matmul(dtype)
    for dt in {torch.float32, dtype} if own else {torch.float32}:
        a, b = (torch.randn(matmul_size, matmul_size, device=device).to(dt) for _ in range(2))
        rates.append(2 * matmul_size ** 3 / _best_seconds(functools.partial(torch.mm, a, b), repeats, sync))
        packed = _onednn_linear(a, b) if device == "cpu" else None
        if packed is not None:
            rates.append(2 * matmul_size ** 3 / _best_seconds(packed, repeats, sync))
    return Machine(2 * copy_bytes / copy_s, max(rates), device, torch.get_num_threads())


def graph_replay_seconds(graph, repeats: int) -> float:
    """GPU seconds per replay of a captured ``torch.cuda.CUDAGraph``, ``repeats`` replays back to back timed by
    CUDA events (the host's launches hidden behind them)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def _onednn_linear(x: torch.Tensor, w: torch.Tensor) -> Optional[Callable[[], torch.Tensor]]:
    """oneDNN's linear over weights packed once, as the engine's compiled CPU step runs its matmuls (Inductor's
    freezing): on some CPUs it is more than twice MKL's ``mm`` (MKL's AVX-512 paths are Intel-only; on a 2-core
    AMD EPYC, fp32: ~500 against ~210 GFLOP/s), so leaving it out would put the limit too high. None where the
    build has no oneDNN."""
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, x.shape[0])
        run = functools.partial(torch.ops.mkldnn._linear_pointwise, x, packed, None, "none", [], "")
        run()
        return run
    except (AttributeError, RuntimeError):
        return None


# ------------------------------------------------------------------------------ the model


@dataclass(frozen=True)
class ModelShape:
    """What a decoder-only transformer's step costs per token, read from a Hugging Face config."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_size: int
    body_params: int  # matmul weights every token passes through (all but the embeddings and the LM head)
    head_params: int  # LM head (vocab x hidden)
    weight_bytes: int  # bytes a step reads of the weights (body + head; the model's dtype)
    weight_element_bytes: int
    cache_element_bytes: int

    @classmethod
    def of(cls, model: torch.nn.Module, cache_dtype: Optional[torch.dtype] = None) -> "ModelShape":
        cfg = model.config
        heads = cfg.num_attention_heads
        head_size = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        emb = model.get_input_embeddings().weight
        out = model.get_output_embeddings().weight
        seen = {id(emb)}
        body = sum(p.numel() for p in model.parameters() if p.dim() >= 2 and id(p) not in seen and p is not out)
        elt = emb.element_size()
        return cls(cfg.num_hidden_layers, cfg.hidden_size, heads, getattr(cfg, "num_key_value_heads", heads),
                   head_size, body, out.numel(), (body + out.numel()) * elt, elt,
                   torch.empty((), dtype=cache_dtype or emb.dtype).element_size())


@dataclass(frozen=True)
class StepCost:
    """What one step must move and compute."""

    weight_bytes: int
    kv_read_bytes: int
    kv_write_bytes: int
    flops: int
    attention_flops: int = 0  # of ``flops``: the attention's (query, key) products; the rest are the matmuls'

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes

    def limit_s(self, machine: Machine) -> float:
        """Seconds the step takes at best: whichever of moving its bytes and doing its FLOPs is slower."""
        return max(self.bytes / machine.copy_bytes_per_s, self.flops / machine.matmul_flops_per_s)

    def sequential_limit_s(self, machine: Machine) -> float:
        """Seconds the step takes at best where its matmuls and its attention run one after the other, as the CPU
        step's kernels do: the matmuls' limit (their weights, their FLOPs) plus the attention's (the K/V it reads
        and writes, its FLOPs). At least :meth:`limit_s`; above it where one part is bound by FLOPs and the other
        by bytes (a decode step's matmuls at a few dozen rows, its attention over long contexts), which only
        running the two at once would hide."""
        bw, rate = machine.copy_bytes_per_s, machine.matmul_flops_per_s
        return (max(self.weight_bytes / bw, (self.flops - self.attention_flops) / rate) +
                max((self.kv_read_bytes + self.kv_write_bytes) / bw, self.attention_flops / rate))

    def __add__(self, other: "StepCost") -> "StepCost":
        return StepCost(self.weight_bytes + other.weight_bytes, self.kv_read_bytes + other.kv_read_bytes,
                        self.kv_write_bytes + other.kv_write_bytes, self.flops + other.flops,
                        self.attention_flops + other.attention_flops)


ZERO = StepCost(0, 0, 0, 0)


def step_cost(shape: ModelShape, chunks: Sequence[StepChunk]) -> StepCost:
    """The cost of one step running ``chunks`` (see ``StepChunk``) through ``shape``'s model."""
    tokens = sum(n for _, n, _ in chunks)
    rows = sum(1 for *_, done in chunks if done)
    kv_per_token = 2 * shape.kv_heads * shape.head_size * shape.cache_element_bytes * shape.layers
    pairs = sum(n * c + n * (n + 1) // 2 for c, n, _ in chunks)  # causal (query, key) pairs
    attention = 4 * shape.heads * shape.head_size * pairs * shape.layers
    flops = 2 * shape.body_params * tokens + 2 * shape.head_params * rows + attention
    embedding_rows = tokens * shape.hidden * shape.weight_element_bytes
    return StepCost(shape.weight_bytes + embedding_rows, kv_per_token * sum(c for c, _, _ in chunks),
                    kv_per_token * tokens, flops, attention)


def padded_batch_cost(shape: ModelShape, prompt_lens: Sequence[int], new_tokens: int) -> StepCost:
    """The minimum work of generating ``new_tokens`` after each prompt, one prefill step then decode
    steps of the whole batch (what Hugging Face ``generate`` must do at least; its padding not counted)."""
    total = step_cost(shape, [(0, n, True) for n in prompt_lens])
    for i in range(1, new_tokens):
        total = total + step_cost(shape, [(n + i - 1, 1, True) for n in prompt_lens])
    return total


def step_kind(chunks: Sequence[StepChunk]) -> str:
    """``decode``: one new token per sequence; ``prefill``: no decode token; ``mixed``: both."""
    decode = sum(1 for c, n, _ in chunks if n == 1 and c > 0)
    if decode == len(chunks):
        return "decode"
    return "prefill" if decode == 0 else "mixed"


# ------------------------------------------------------------------------------ an engine's steps


@dataclass(frozen=True)
class TimedStep:
    chunks: tuple[StepChunk, ...]
    seconds: float


class StepRecorder:
    """Times every ``engine.step()`` and records what it computed: what the scheduler planned (wraps it), or, for a
    decode step the engine ran from a plan made with an earlier one (``stats["planned_steps"]``, see
    ``PagedEngine(plan_ahead=...)``), the previous step's decodes one position further (a planned step follows a step
    of the same requests)."""

    def __init__(self, engine):
        self.engine, self.steps, self._last, self._prev = engine, [], (), ()
        schedule = engine.scheduler.schedule

        def recording():
            plan = schedule()
            self._last = tuple((c.start, c.num_tokens, c.completes) for c in plan)
            return plan

        engine.scheduler.schedule = recording

    def step(self):
        stats = getattr(self.engine, "stats", {})
        planned = stats.get("planned_steps", 0)
        t0 = time.perf_counter()
        out = self.engine.step()
        dt = time.perf_counter() - t0
        if not self._last and stats.get("planned_steps", 0) > planned:
            self._last = tuple((start + 1, n, completes) for start, n, completes in self._prev)
        if self._last:
            self.steps.append(TimedStep(self._last, dt))
        self._prev, self._last = self._last, ()
        return out

    def run(self) -> None:
        """Step until every request finished, in one frame-stack chunk as ``engine.generate``'s and the server's
        loops run (``pagedattn.runtime.frames``)."""
        call_with_frame_room(self._run)

    def _run(self) -> None:
        with self.engine.bound():  # the backend bound once for the loop, as generate's loop binds it
            while self.engine.has_unfinished():
                self.step()


def summarise(steps: Iterable[TimedStep], shape: ModelShape, machine: Machine) -> dict[str, tuple]:
    """Per step kind and in all: ``(steps, seconds, limit seconds, cost)``."""
    out: dict[str, list] = {}
    for s in steps:
        cost = step_cost(shape, s.chunks)
        for kind in (step_kind(s.chunks), "all"):
            row = out.setdefault(kind, [0, 0.0, 0.0, ZERO])
            row[0] += 1
            row[1] += s.seconds
            row[2] += cost.limit_s(machine)
            row[3] = row[3] + cost
    return {k: tuple(v) for k, v in out.items()}


def sequential_limit(steps: Iterable[TimedStep], shape: ModelShape, machine: Machine) -> float:
    """Seconds ``steps`` take at best with each step's matmuls and attention one after the other
    (:meth:`StepCost.sequential_limit_s`, summed over the steps)."""
    return sum(step_cost(shape, s.chunks).sequential_limit_s(machine) for s in steps)


def format_cost_row(name: str, steps: int, seconds: float, limit: float, cost: StepCost) -> str:
    return (f"  {name:26} {steps:6d} {cost.weight_bytes / 1e6 / steps:9.1f} {cost.kv_read_bytes / 1e6 / steps:8.2f} "
            f"{cost.kv_write_bytes / 1e6 / steps:8.3f} {cost.flops / 1e9 / steps:9.3f} {1e3 * limit / steps:9.3f} "
            f"{1e3 * seconds / steps:9.3f} {limit / seconds:8.0%}")


COST_HEADER = (f"  {'step kind':26} {'steps':>6} {'weight MB':>9} {'KV rd MB':>8} {'KV wr MB':>8} {'GFLOP':>9} "
               f"{'limit ms':>9} {'took ms':>9} {'of limit':>8}")


def step_kinds(engine, shape: ModelShape, machine: Machine, *, vocab: int, context: int = 256,
               batches: Sequence[int] = (1, 8, 32, 64), mixed_prefill: int = 256, mixed_batch: int = 16,
               long_prefill: int = 1024, repeats: int = 8, seed: int = 0) -> list[str]:
    """Rows of a table: the engine's time per step kind against the limit (per-step figures).

    Decode at each batch size over ``context``-token prompts; ``mixed_batch`` decodes next to one
    ``mixed_prefill``-token prompt; one ``long_prefill``-token prompt alone. Prompts are random tokens
    (no prefix-cache hits); the engine needs blocks for ``max(batches)`` such requests.
    """
    g = torch.Generator().manual_seed(seed)

    def prompt(n):
        return torch.randint(1, vocab, (n,), generator=g).tolist()

    rec = StepRecorder(engine)
    rows = [COST_HEADER]
    budget = engine.scheduler.max_num_tokens
    for b in batches:
        # the first requests decode while the last ones still prefill: enough new tokens to outlast that, and to
        # reach a burst's edge before and after the timed steps (a run plans at most plan_ahead steps)
        new = repeats + 2 + -(-b * context // budget) + 2 * getattr(engine, "plan_ahead", 0)
        rids = _decoding(engine, rec, [prompt(context) for _ in range(b)], new)
        to_burst_edge(engine, rec)
        rec.steps.clear()
        for _ in range(repeats):
            rec.step()
        to_burst_edge(engine, rec)  # the steps the last timed call computed ahead, timed in it, counted
        assert all(len(s.chunks) == b and step_kind(s.chunks) == "decode" for s in rec.steps)
        rows.append(format_cost_row(f"decode, batch {b} (ctx {context})",
                                    *summarise(rec.steps, shape, machine)["all"]))
        _finish(engine, rec, rids)
    # mixed: decoders plus one prompt that completes in the same step (max_new_tokens=1 ends it there)
    rec.steps.clear()
    rids = [engine.add_request(prompt(context), max_new_tokens=2 * repeats + 4) for _ in range(mixed_batch)]
    while any(not r.output for r in _running(engine, rids)):
        rec.step()
    mixed = []
    for _ in range(repeats):
        engine.add_request(prompt(mixed_prefill), max_new_tokens=1)
        rec.steps.clear()
        rec.step()
        mixed += [s for s in rec.steps if step_kind(s.chunks) == "mixed"]
    if mixed:
        rows.append(format_cost_row(f"mixed: {mixed_batch} dec + {mixed_prefill} pre",
                                    *summarise(mixed, shape, machine)["all"]))
    _finish(engine, rec, rids)
    rec.steps.clear()
    for _ in range(max(2, repeats // 2)):
        engine.add_request(prompt(long_prefill), max_new_tokens=1)
        rec.run()
    rows.append(format_cost_row(f"prefill, {long_prefill} tokens", *summarise(rec.steps, shape, machine)["all"]))
    return rows


# torch.profiler records whose own time is a kernel's, by what it computes (substrings of the records' names: the
# native C++ operators, their Python fallbacks and oneDNN's or ATen's GEMMs)
KERNEL_RECORDS = (("linears", ("linear", "aten::mm", "aten::addmm")), ("attention", ("paged_attention",)),
                  ("cache writes", ("write_kv_cache",)))
# the native library's kernel clock (pagedattn.backends.native.kernel_clock): its kinds as a breakdown names them
CLOCK_PARTS = (("linears", "linear"), ("attention", "decode"), ("cache writes", "write"), ("SiLU x up", "silu_mul"),
               ("argmax", "argmax"))


def decode_breakdown(engine, *, vocab: int, batch: int = 16, context: int = 200, steps: int = 20,
                     seed: int = 1) -> str:
    """Where a decode step's time goes: ``batch`` requests of ``context`` random tokens (fewer where the engine's free
    blocks would not hold them) decoding, ``steps`` steps timed as they run with the native library's kernel clock on
    (:func:`pagedattn.backends.native.kernel_clock`: each kernel's wall time on the calling thread, its OpenMP threads'
    work inside it, taken inside the library; two clock reads a call). The rest of the step is the same steps' time
    less the kernels': Python (the engine's and the generated code's), the AOT runner, the dispatcher and the operators
    around the kernels, Inductor's small kernels, the threads' start and end. The steps and their kernels are timed in
    one window: on a host whose speed moves by 20 % from one window to the next, kernels timed in a window of their own
    could take longer than the steps of another (a negative rest). Where the step calls no native kernel (another
    backend, the library off), ``torch.profiler``'s records of the step's operators stand in (:data:`KERNEL_RECORDS`:
    their self time, the profiler's own cost in it, which makes them ~10-45 % long on this benchmark's machine), and
    the steps are timed in a window of their own, without the profiler. Each
    ``step()`` computes its own step here (``burst_ms=0``: steps computed ahead would fall in one window's ``step()``
    calls and be timed in another's). One line of text."""
    burst = getattr(engine, "burst_ms", None)
    if burst is not None:
        engine.burst_ms = 0.0
    try:
        return _decode_breakdown(engine, vocab, batch, context, steps, seed)
    finally:
        if burst is not None:
            engine.burst_ms = burst


def _decode_breakdown(engine, vocab: int, batch: int, context: int, steps: int, seed: int) -> str:
    g = torch.Generator().manual_seed(seed)
    new = 2 * steps + 5 + -(-batch * context // engine.scheduler.max_num_tokens)
    bs = engine.block_size
    context = min(context, engine.blocks.num_free // batch * bs - new)  # every request keeps its blocks: no preemption
    rec = StepRecorder(engine)
    rids = _decoding(engine, rec, [torch.randint(1, vocab, (context,), generator=g).tolist() for _ in range(batch)],
                     new)
    lib = _clock_library(rec)

    def timed():
        for _ in range(steps):
            rec.step()

    rec.steps.clear()
    if lib is not None:
        own, how = _clocked_kernels(lib, timed, steps)  # the steps timed as they run, in the same window
        wall = _decode_seconds(rec, batch, steps)
    else:
        call_with_frame_room(timed)  # as a serving loop runs its steps (pagedattn.runtime.frames)
        wall = _decode_seconds(rec, batch, steps)
        own, how = _profiled_operators(timed, steps)
    _finish(engine, rec, rids)
    rest = wall - sum(own.values())
    parts = ", ".join(f"{n} {1e3 * t:.2f} ms ({t / wall:.0%})" for n, t in own.items())
    return (f"  decode step at batch {batch} (ctx {context}): {1e3 * wall:.2f} ms; {how}: {parts}; the rest (Python, "
            f"the runner and dispatch, Inductor's small kernels, threads' start and end) {1e3 * rest:.2f} ms "
            f"({rest / wall:.0%})")


def _decode_seconds(rec: "StepRecorder", batch: int, steps: int) -> float:
    """The mean seconds of the ``steps`` steps ``rec`` recorded, each a decode step of ``batch`` requests."""
    assert len(rec.steps) == steps and all(len(s.chunks) == batch and step_kind(s.chunks) == "decode"
                                           for s in rec.steps)
    return sum(s.seconds for s in rec.steps) / steps


def _clock_library(rec: "StepRecorder"):
    """The native library where one decode step (run here) calls its linear or decode kernel, else None."""
    from pagedattn.backends import native

    lib = native.library()
    if lib is None:
        return None
    with native.kernel_clock(lib) as totals:
        call_with_frame_room(rec.step)
    return lib if totals["linear"][0] or totals["decode"][0] else None


def _clocked_kernels(lib, timed: Callable[[], None], steps: int) -> tuple[dict[str, float], str]:
    """Each native kernel's seconds a step over ``steps`` steps of ``timed`` (the library's kernel clock)."""
    from pagedattn.backends import native

    with native.kernel_clock(lib) as totals:
        call_with_frame_room(timed)
    own = {name: totals[kind][1] / steps for name, kind in CLOCK_PARTS if totals[kind][0]}
    return own, "native kernels (timed inside the library)"


def _profiled_operators(timed: Callable[[], None], steps: int) -> tuple[dict[str, float], str]:
    """The step's operators' self time a step under ``torch.profiler`` (:data:`KERNEL_RECORDS`)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        call_with_frame_room(timed)
    own = dict.fromkeys((name for name, _ in KERNEL_RECORDS), 0.0)
    for record in prof.key_averages():
        name = next((n for n, keys in KERNEL_RECORDS if any(k in record.key for k in keys)), None)
        if name is not None:
            own[name] += record.self_cpu_time_total / 1e6 / steps  # microseconds over the profiled steps
    return own, "operators (torch.profiler's self times)"


def to_burst_edge(engine, rec: StepRecorder) -> None:
    """Step until no decode step computed ahead is left (``PagedEngine.steps_ahead``, ``burst_ms``): a step that
    computes ahead takes the time of the steps it computes, and the later ``step()`` calls that give them take none,
    so a window of recorded steps that starts and ends here holds the model's time of exactly its steps (one that
    ends inside a burst holds the time of steps it does not record, and one that starts inside it records steps
    whose time it does not hold)."""
    while getattr(engine, "steps_ahead", 0):
        rec.step()


def _decoding(engine, rec: StepRecorder, prompts, new: int) -> list[int]:
    """Requests of ``prompts`` (``new`` tokens each) stepped through their prefills until every one decodes, the
    recorder's steps then cleared; their ids."""
    rids = [engine.add_request(p, max_new_tokens=new) for p in prompts]
    while any(r.num_computed < r.num_tokens - 1 or not r.output for r in _running(engine, rids)):
        rec.step()
    rec.steps.clear()
    return rids


def _finish(engine, rec: StepRecorder, rids) -> None:
    """End the requests: aborted where the engine can, else run to the end."""
    if hasattr(engine, "abort"):
        for r in rids:
            engine.abort(r)
        engine.collect()
    rec.run()


def _running(engine, rids):
    sched = engine.scheduler
    return [r for r in list(sched.running) + list(sched.waiting) if r.id in set(rids)]


def main() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        print(f"{str(dtype):16}", measure_machine(dtype).describe())


if __name__ == "__main__":
    main()
