"""A CPU serving step through AOTInductor's C++ runner against the engine's compiled step, on the same inputs.

The engine's compiled step runs its kernels from Python: Dynamo's and AOTAutograd's wrappers, then Inductor's
generated Python calling each kernel and operator (``generate_cpu.py --breakdown`` puts a third of a fp32 decode
step outside the kernels). AOTInductor compiles the same paged program (``RewrittenModel.exported_program``) with
the same Inductor options and passes (``program.paged_step_options``, freezing) into a library whose runner
calls them from C++. This script captures the compiled step's inputs over a few real engine steps (decodes of 1,
3, 10 and 16 requests, prefills of 150 to 1,024 tokens), runs each through both, checks the logits against each
other and times them, alternating.

    python benchmarks/aoti_step.py                  # float32 and bfloat16, llama16m

Not a serving path yet: the package is built here, once per run (its compile time is printed), and a step the
runner refuses is reported, not served.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import generate_cpu  # noqa: E402

import pagedattn  # noqa: E402
from pagedattn import program  # noqa: E402
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
    engine = pagedattn.PagedEngine(model, num_blocks=1000, block_size=16, max_num_tokens=1024, progress=False)
    engine.generate([[1] * n for n in (300, 7, 40, 2)], max_new_tokens=2)
    rewritten = engine.servable.step
    calls = captured_steps(engine, vocab)
    # the compiled step's own Inductor options and passes (Dynamo's guard filter aside: no Dynamo here), with freezing
    options = {k: v for k, v in program.paged_step_options("inductor", "cpu", freeze=True).items()
               if k != "guard_filter_fn"}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        exported = rewritten.exported_program
        t1 = time.perf_counter()
        with torch.no_grad(), program.inductor_freezing(True):
            path = torch._inductor.aoti_compile_and_package(exported, package_path=os.path.join(tmp, "step.pt2"),
                                                            inductor_configs=options)
        t2 = time.perf_counter()
        runner = torch._inductor.aoti_load_package(path)
        t3 = time.perf_counter()
    print(f"\n{str(dtype)[6:]}: export {t1 - t0:.1f} s, AOTInductor compile {t2 - t1:.1f} s, load {t3 - t2:.2f} s")
    compiled, seen = rewritten.graph_module, set()
    with torch.inference_mode(), use_backend(rewritten.backend), program.inductor_freezing(True):
        for args in calls:
            tokens = args[0].shape[-1]
            if tokens in seen:
                continue
            seen.add(tokens)
            try:
                ours = runner(*args)[0]
            except Exception as e:  # reported: the runner is not a serving path yet
                print(f"  step of {tokens:4d} tokens: the runner refused it ({str(e).splitlines()[0][:120]})")
                continue
            theirs = compiled(*args)
            theirs = theirs[0] if isinstance(theirs, (tuple, list)) else theirs
            times = {"runner": [], "compiled": []}
            for _ in range(rounds):
                for name, fn in (("runner", runner), ("compiled", compiled)):
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
