"""The engine's own host work in a decode step on the CPU: scheduling, the step's ids and metadata, the Python around
the compiled step's runner, sampling and the requests' bookkeeping, with the model call itself replaced by the output
it gave, so that the figure is the host's alone and no kernel's. Also the real step's time and the part of it that
runs outside the runner (the step's kernels leave the interpreter's data out of cache, so there the host's part costs
several times its warm figure). Last, the runner's own work: the step's runner called alone on a real step's inputs,
with every native kernel bound to a stand-in that returns at once (its allocations, views, operator calls and
Inductor's kernels are left), called back to back and right after a real call. Every figure moves with a shared
host's speed (1.4x between two runs minutes apart on a 2-vCPU EPYC): compare code by the best of several runs taken
close together.

    python benchmarks/host_step.py                      # llama16m, bf16, 16 requests of 176 tokens
    python benchmarks/host_step.py --requests 64 --dtype float32
"""

from __future__ import annotations

import argparse
import ctypes
import inspect
import logging
import statistics
import time

import generate_cpu  # benchmarks/generate_cpu.py, beside this script
import torch

import pagedattn
from pagedattn.aot_step import AotStep
from pagedattn.backends import native, native_ops
from pagedattn.runtime.frames import call_with_frame_room

# kernels that return at once, under the C library's names: the operators then leave their outputs as allocated
STAND_INS = b"""
extern "C" {
static int stand_in(const void *args) { (void)args; return 0; }
int pagedattn_linear(const void *a) { return stand_in(a); }
int pagedattn_silu_mul(const void *a) { return stand_in(a); }
int pagedattn_paged_decode(const void *a) { return stand_in(a); }
int pagedattn_write_kv(const void *a) { return stand_in(a); }
int pagedattn_prefill(const void *a) { return stand_in(a); }
}
"""


def _steps_seconds(engine, steps: int) -> tuple[float, int]:
    """Seconds per step over at least ``steps`` steps, run as a serving loop runs them (backend bound, one frame
    chunk), and how many: from a burst's edge to a burst's edge (``PagedEngine.steps_ahead`` 0 before and after), so
    that the window holds the time of exactly the steps it counts (``roofline.to_burst_edge``)."""
    def loop():
        with engine.bound():
            while engine.steps_ahead:
                engine.step()
            t0 = time.perf_counter()
            n = 0
            while n < steps or engine.steps_ahead:
                engine.step()
                n += 1
            return time.perf_counter() - t0, n
    seconds, n = call_with_frame_room(loop)
    return seconds / n, n


def _stand_ins():
    """The library of :data:`STAND_INS`, None where the C++ operators or a compiler are missing."""
    cxx = native_ops.cxx_compiler()
    if cxx is None or not native_ops.load():
        return None
    path = native.build_shared({"stand_ins.cpp": STAND_INS}, cxx, ("-O2", "-shared", "-fPIC"), "bench_stand_ins",
                               unit_cache=False)
    return None if path is None else ctypes.CDLL(str(path))


def _runner_alone(engine, run, inputs: list, calls: int, stand_ins) -> tuple[float, float, float]:
    """Median seconds of the runner's call on ``inputs``: (the real call, every kernel a stand-in called back to back,
    a stand-in call right after a real one)."""
    def timed():
        t0 = time.perf_counter()
        run(list(inputs))  # a list of its own: the package loader empties the one it is given
        return time.perf_counter() - t0

    real, alone, after = [], [], []
    with engine.bound(), torch.inference_mode():  # as a CPU step runs (runtime.context.step_mode)
        try:
            for _ in range(calls):
                real.append(timed())
            native_ops.bind_kernels(stand_ins)
            for _ in range(calls):
                alone.append(timed())
            for _ in range(calls):
                native_ops.bind_kernels()
                timed()
                native_ops.bind_kernels(stand_ins)
                after.append(timed())
        finally:
            native_ops.bind_kernels()
    return statistics.median(real), statistics.median(alone), statistics.median(after)


class _Runner:
    """A stand-in for the step's runner whose loader's ``boxed_run`` is ``run``."""

    def __init__(self, run):
        self.loader = self
        self.boxed_run = run


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama16m", choices=sorted(generate_cpu.MODELS))
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--context", type=int, default=176)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    logging.getLogger("pagedattn").setLevel(logging.ERROR)
    model = generate_cpu.build(getattr(torch, a.dtype), "sdpa", a.model)
    vocab = model.config.vocab_size
    # every timed step, stubbed ones too, adds a token, and so does each window's way to a burst's edge at both ends
    edge = inspect.signature(pagedattn.PagedEngine).parameters["plan_ahead"].default  # the most a burst computes
    new = (a.steps + 2 * edge) * (2 * a.repeats + 1) + 8
    blocks = a.requests * -(-(a.context + new) // 16) + 16
    engine = pagedattn.PagedEngine(model, num_blocks=blocks, block_size=16, max_num_tokens=1024, progress=False)
    step = engine.model.graph_module
    if not isinstance(step, AotStep):
        raise SystemExit(f"the engine's step is {type(step).__name__}, not an ahead-of-time step: nothing to stub")
    g = torch.Generator().manual_seed(0)
    for _ in range(a.requests):
        engine.add_request(torch.randint(1, vocab, (a.context,), generator=g).tolist(), max_new_tokens=new)
    while any(not r.output for r in list(engine.scheduler.running) + list(engine.scheduler.waiting)):
        engine.step()
    real = min(_steps_seconds(engine, a.steps)[0] for _ in range(a.repeats))
    inside = [0.0]
    runner = step.runner  # the step calls runner.loader.boxed_run, directly or through prepared steps

    captured: list = []  # a real step's inputs to the runner

    def timed(tensors):
        captured[:] = tensors
        t0 = time.perf_counter()
        out = runner.loader.boxed_run(tensors)
        inside[0] += time.perf_counter() - t0
        return out

    step.runner = _Runner(timed)
    with_runner, counted = _steps_seconds(engine, a.steps)
    runner_s = inside[0] / counted
    kept = {}  # the runner's output for the first stubbed step, returned for every later one

    def stub(tensors):
        if "out" not in kept:
            kept["out"] = runner.loader.boxed_run(tensors)
        return kept["out"]

    step.runner = _Runner(stub)
    host = min(_steps_seconds(engine, a.steps)[0] for _ in range(a.repeats))
    step.runner = runner
    print(f"{a.model} {a.dtype}, decode steps of {a.requests} requests (context {a.context}+):")
    print(f"  a step {real * 1e3:.3f} ms (best of {a.repeats} x {a.steps}); outside the runner "
          f"{(with_runner - runner_s) * 1e6:.0f} us of {with_runner * 1e3:.3f} ms")
    print(f"  the host's work alone (the runner's output stored, warm caches): {host * 1e6:.1f} us a step")
    stand_ins = _stand_ins()
    if stand_ins is None:
        print("  the runner's own work: not measured (the C++ operators or a C++ compiler are missing)")
        return
    real_s, alone_s, after_s = _runner_alone(engine, runner.loader.boxed_run, captured, a.steps, stand_ins)
    print(f"  the runner's call {real_s * 1e6:.0f} us; with every native kernel a stand-in that returns at once "
          f"{alone_s * 1e6:.0f} us called back to back, {after_s * 1e6:.0f} us right after a real call (medians of "
          f"{a.steps}): its allocations, views, operator calls and Inductor's kernels")


if __name__ == "__main__":
    main()
