"""The CPU serving step compiled ahead of time (AOTInductor's C++ runner, ``pagedattn.aot_step``, PagedEngine's
default on the CPU) against the step compiled by ``torch.compile``, on the same inputs.

The step compiled by ``torch.compile`` runs its kernels from Python: Dynamo's and AOTAutograd's wrappers, then
Inductor's generated Python calling each kernel and operator. The ahead-of-time step compiles the same paged program
with the same Inductor options and passes (``program.paged_step_options``, freezing) into a library whose runner calls
them from C++, each call's inputs checked by its guard. This script captures the compiled step's inputs over a few
real engine steps (decodes of 1, 3, 10 and 16 requests, prefills of 150 to 1,024 tokens), runs each through both,
checks the logits against each other and times them, alternating.

    python benchmarks/aoti_step.py                  # float32 and bfloat16, llama16m
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import generate_cpu  # noqa: E402

import pagedattn  # noqa: E402
from pagedattn import program  # noqa: E402
from pagedattn.adapter import prepare_model  # noqa: E402
from pagedattn.aot_step import AotStep  # noqa: E402
from pagedattn.backends.base import use_backend  # noqa: E402


def captured_steps(engine, vocab: int, seed: int = 0) -> list[list]:
    """The compiled step's positional inputs at each step of a few request mixes (tensors copied where small,
    so that a later step does not change them; the caches are the engine's own)."""
    g = torch.Generator().manual_seed(seed)
    step = engine.servable.step.graph_module
    calls, forward = [], step.forward

    def capture(*args, **kwargs):
        # copies outside the step's inference mode, as the engine makes a step's inputs: a prefill's attention
        # (pagedattn::paged_attention's Python kernel) reads their version counters, which inference tensors lack
        with torch.inference_mode(False):
            calls.append([x.clone() if isinstance(x, torch.Tensor) and x.numel() < 100_000 else x for x in args])
        return forward(*args, **kwargs)

    step.forward = capture
    try:
        for batch, new in ((1, 3), (16, 5)):
            for _ in range(batch):
                engine.add_request(torch.randint(1, vocab, (150,), generator=g).tolist(), max_new_tokens=new)
            while engine.has_unfinished():
                engine.step()
    finally:
        step.forward = forward
    return calls


def compare(dtype: torch.dtype, model_name: str, rounds: int) -> None:
    model = generate_cpu.build(dtype, "sdpa", model_name)
    vocab = generate_cpu.MODELS[model_name][0]["vocab_size"]
    engine = pagedattn.PagedEngine(model, num_blocks=1000, block_size=16, max_num_tokens=1024, progress=False,
                                   ahead_of_time=False)  # the step compiled by torch.compile
    engine.generate([[1] * n for n in (300, 7, 40, 2)], max_new_tokens=2)
    rewritten = engine.servable.step
    calls = captured_steps(engine, vocab)
    # the same model's step compiled ahead of time, as PagedEngine compiles it by default (its package built here
    # unless an earlier run left it in Inductor's cache directory)
    t0 = time.perf_counter()
    aot = prepare_model(model, block_size=16, compile=True, ahead_of_time=True).step.graph_module
    t1 = time.perf_counter()
    if not isinstance(aot, AotStep):
        print(f"\n{str(dtype)[6:]}: the step could not be compiled ahead of time (see pagedattn's log)")
        return
    print(f"\n{str(dtype)[6:]}: the ahead-of-time step {aot.source} in {t1 - t0:.1f} s (rewrite and checks included)")
    compiled, seen = rewritten.graph_module, set()
    with torch.inference_mode(), use_backend(rewritten.backend), program.inductor_freezing(True):
        for args in calls:
            tokens = args[0].shape[-1]
            if tokens in seen:
                continue
            seen.add(tokens)
            why = aot.guard.refusal(args)
            if why is not None:
                print(f"  step of {tokens:4d} tokens: the runner does not take it ({why})")
                continue
            ours = aot(*args)[0]
            theirs = compiled(*args)
            theirs = theirs[0] if isinstance(theirs, (tuple, list)) else theirs
            times = {"runner": [], "compiled": []}
            for _ in range(rounds):
                for name, fn in (("runner", aot), ("compiled", compiled)):
                    t0 = time.perf_counter()
                    fn(*args)
                    times[name].append(time.perf_counter() - t0)
            a, b = (statistics.median(times[k]) for k in ("runner", "compiled"))
            diff = (ours.float() - theirs.float()).abs().max().item()
            print(f"  step of {tokens:4d} tokens: runner {1e3 * a:7.3f} ms, compiled step {1e3 * b:7.3f} ms "
                  f"({a / b:.2f}x); logits' largest difference {diff:.3g}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(generate_cpu.MODELS), default="llama16m")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=9, help="alternating timings per step (medians)")
    a = p.parse_args(argv)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    for name in a.dtypes:
        compare(getattr(torch, name), a.model, a.rounds)


if __name__ == "__main__":
    main()
