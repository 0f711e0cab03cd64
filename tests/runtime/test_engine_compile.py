"""PagedEngine compiled by default: one graph for every step a serving loop runs, the same greedy tokens
as the eager engine, start-up progress; the step padding that keeps the graph count bounded."""

import random

import pytest
import torch

from pagedattn import PagedEngine
from pagedattn.adapter import first_step
from pagedattn.aot_step import AotStep
from pagedattn.backends import build_metadata
from pagedattn.runtime.shapes import graph_count, pad_packed_step

from ..support import prompts, tiny_model


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def compiled(llama):
    """A default engine (compiled at start-up; ahead of time, as outside the tests) and what start-up printed."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDATTN_AHEAD_OF_TIME", "1")
        engine = PagedEngine(llama, block_size=4, num_blocks=96, max_num_tokens=24, max_num_seqs=8)
    return engine, err.getvalue()


@pytest.fixture(scope="module")
def jit_compiled(llama):
    """The engine with its step compiled by torch.compile (``ahead_of_time=False``): padded steps, Dynamo's graphs."""
    return PagedEngine(llama, block_size=4, num_blocks=96, max_num_tokens=24, max_num_seqs=8, progress=False,
                       ahead_of_time=False), ""


@pytest.fixture(scope="module")
def eager(llama):
    return PagedEngine(llama, block_size=4, num_blocks=96, max_num_tokens=24, compile=False, progress=False)


def test_default_engine_is_compiled_with_progress(compiled):
    engine, printed = compiled
    # compiled ahead of time on the CPU: its program takes sizes of 1 as they are, so no step is padded
    assert isinstance(engine.model.graph_module, AotStep) and engine.servable.min_step == 0
    assert "compiling the paged step with Inductor" in printed and "done in" in printed
    assert "rewriting LlamaForCausalLM" in printed


@pytest.mark.parametrize("which", ["compiled", "jit_compiled"])
def test_compiled_greedy_equals_eager(which, eager, request):
    engine, _ = request.getfixturevalue(which)
    ps = prompts()
    assert engine.generate(ps, max_new_tokens=6) == eager.generate(ps, max_new_tokens=6)


@pytest.mark.parametrize("which", ["compiled", "jit_compiled"])
def test_no_recompiles_over_many_varying_steps(which, request):
    # requests arrive while others run: decode-only steps at batch 1..8, prefill-only steps, chunked
    # prompts with no logits row, mixed steps; 200 steps and not one new graph (the step torch.compile builds: its
    # steps padded into two graphs compiled at start-up; the ahead-of-time step: no Dynamo graph at all)
    engine, _ = request.getfixturevalue(which)
    assert engine.servable.min_step == (2 if which == "jit_compiled" else 0)
    rng = random.Random(0)
    before, steps, kinds = graph_count(), 0, set()
    while steps < 200:
        if rng.random() < 0.3 and len(engine.scheduler.running) < 8:
            n = rng.choice([1, 2, 3, 5, 9, 17, 30, 41])
            engine.add_request([rng.randrange(1, 100) for _ in range(n)], max_new_tokens=rng.randint(1, 12))
        if not engine.has_unfinished():
            continue
        plan_before = engine.stats["tokens"]
        engine.step()
        steps += 1
        kinds.add(min(engine.stats["tokens"] - plan_before, 3))
    assert kinds == {1, 2, 3}  # single-token, two-token and longer steps all ran
    assert graph_count() == before


def test_frozen_step_guards_its_inputs_not_its_modules(llama, eager, monkeypatch):
    # with freezing the weights are constants of the compiled step: Dynamo's guards on the graph module's
    # attributes are left out, those on the step's inputs, the shape environment and global state stay
    import pagedattn.program as program

    real, seen = program.frozen_step_options, []

    def recording(freeze):
        options = real(freeze)
        assert options is not None  # the CPU step compiles with freezing
        keep_fn = options["guard_filter_fn"]

        def record(entries):
            keep = keep_fn(entries)
            seen.extend(zip(entries, keep))
            return keep
        return {"guard_filter_fn": record}

    monkeypatch.setattr(program, "frozen_step_options", recording)
    # the step torch.compile builds (Dynamo's guards): the one a step compiled ahead of time falls back to
    engine = PagedEngine(llama, block_size=4, num_blocks=96, max_num_tokens=24, progress=False, ahead_of_time=False)
    ps = prompts()[:3]
    assert engine.generate(ps, max_new_tokens=4) == eager.generate(ps, max_new_tokens=4)
    kept = [e for e, k in seen if k]
    dropped = [e for e, k in seen if not k]
    assert dropped and all(e.orig_guard.source.is_unspecialized_nn_module() for e in dropped)
    assert {"GLOBAL_STATE", "SHAPE_ENV"} <= {e.guard_type for e in kept}
    matched = {e.name for e in kept if e.guard_type == "TENSOR_MATCH"}
    assert {"input_ids", "kv_cache_0", "block_tables", "seq_lens"} <= matched


def test_serving_steps_leave_out_inductors_output_checks_only_outside_validation(llama, eager, monkeypatch):
    # the generated code's per-call checks that each kernel's output matches its fake stay under validation (as
    # the tests run: every kernel is held to its fake) and are left out when serving
    from torch.profiler import profile

    import pagedattn.program as program
    from pagedattn.backends import cpu_linear, native_ops, set_validation

    seen, real = [], program.torch.compile

    def recording(*args, options=None, **kwargs):
        seen.append(options)
        return real(*args, options=options, **kwargs)

    monkeypatch.setattr(program.torch, "compile", recording)
    assert program.serving_step_options() == {}
    set_validation(False)
    engine = PagedEngine(llama, block_size=4, num_blocks=96, max_num_tokens=24, progress=False, ahead_of_time=False)
    ps = prompts()[:3]
    with profile() as prof:
        out = engine.generate(ps, max_new_tokens=4)
    assert out == eager.generate(ps, max_new_tokens=4)
    assert seen and all(o["size_asserts"] is False and o["alignment_asserts"] is False for o in seen)
    # and the linears run in the C++ operator, with no Python kernel around them (where both are built here)
    ops = {e.key for e in prof.key_averages()}
    if cpu_linear.small_linears_available(torch.float32) and native_ops.linear_op() is not None:
        assert "pagedattn_native::linear" in ops and not ops & {"pagedattn::linear", "mkldnn::_linear_pointwise"}
    # and the paged ops' C++ stand-ins: every write and decode runs there, prefills go on to the Python ops
    if native_ops.paged_ops() is not None:
        counts = {e.key: e.count for e in prof.key_averages()}
        layers = llama.config.num_hidden_layers
        assert counts["pagedattn_native::write_kv_cache"] == counts["pagedattn_native::paged_attention"]
        assert "pagedattn::write_kv_cache" not in counts
        prefills = counts.get("pagedattn::paged_attention", 0)
        assert 0 < prefills < counts["pagedattn_native::paged_attention"] and prefills % layers == 0


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_cpu_step_is_compiled_with_frozen_packed_weights(compiled):
    # Inductor's freezing repacks the linear weights for oneDNN once (faster GEMMs at decode sizes), and the
    # decode-sized calls on them go to pagedattn's kernel where it is built; the setting is on only while the step
    # runs (Dynamo reads it when it traces), not left for other compiles
    import torch._inductor.config as inductor_config
    from torch.profiler import profile

    from pagedattn.backends import cpu_linear

    engine, _ = compiled
    engine.add_request([5, 6, 7], max_new_tokens=3)
    with profile() as prof:
        while engine.has_unfinished():
            engine.step()
    engine.collect()
    ops = {e.key for e in prof.key_averages()}
    if cpu_linear.small_linears_available(torch.float32):  # every call here has at most SMALL_ROWS rows
        assert "pagedattn::linear" in ops and "mkldnn::_linear_pointwise" not in ops
    # else oneDNN's packed GEMMs run inside the step's compiled code (AOTInductor calls them through its C shim,
    # which the profiler does not record): no linear runs as an ATen op either way
    assert not ops & {"aten::addmm", "aten::mm", "aten::linear", "aten::matmul"}
    assert inductor_config.freezing is False


def test_freezing_needs_inductor(llama):
    from pagedattn import rewrite

    with pytest.raises(ValueError, match="freeze=True needs the inductor backend"):
        rewrite(llama, torch.tensor([[1, 2, 3]])).compile_paged("eager", freeze=True)


def test_small_linears_need_a_frozen_cpu_step(llama, monkeypatch):
    # the pass goes into the options of a frozen CPU step only, and small_linears=False leaves it out
    import pagedattn.program as program
    from pagedattn import rewrite
    from pagedattn.backends.cpu_linear import SmallLinears
    from pagedattn.backends.shared_values import RealizeSharedValues

    with pytest.raises(ValueError, match="small_linears=True needs a CPU step compiled with freezing"):
        rewrite(llama, torch.tensor([[1, 2, 3]])).compile_paged(freeze=False, small_linears=True)
    seen = []
    monkeypatch.setattr(program.torch, "compile", lambda gm, **kw: seen.append(kw["options"]) or gm)
    for small in (None, False):
        rewrite(llama, torch.tensor([[1, 2, 3]])).compile_paged(small_linears=small, ahead_of_time=False)
    kinds = [[type(p) for p in o["post_grad_custom_pre_pass"].passes] if "post_grad_custom_pre_pass" in o else []
             for o in seen]
    assert SmallLinears in kinds[0] and SmallLinears not in kinds[1]
    assert all(RealizeSharedValues in k for k in kinds)  # every Inductor CPU step computes a rotary table once


def test_compile_false_and_progress_off(eager, capsys):
    # eager's start-up printed nothing (progress off) and left the graph as it was
    assert eager.servable.min_step == 0 and type(eager.model.graph_module).__name__ == "GraphModule"
    PagedEngine(eager.servable, num_blocks=8, progress=False)  # a ServableModel is served as it is
    assert capsys.readouterr().err == ""


# ------------------------------------------------------------------------------ step padding


def test_pad_packed_step_floors_every_size():
    meta = build_metadata([(5, 2, [3])], block_size=8)  # one sequence, one block, one logits row
    padded, ids, pos, rows = pad_packed_step(meta, [7, 9], [5, 6], [1], floor=2)
    assert (ids, pos, rows) == ([7, 9], [5, 6], [1, 1])
    assert padded.seq_lens.tolist() == [7, 0] and padded.query_start_loc.tolist() == [0, 2, 2]
    assert padded.block_tables.tolist() == [[3, 0], [0, 0]]
    meta = build_metadata([(5, 1, [3]), (0, 1, [4])], block_size=8)  # two 1-token sequences: T = 2
    padded, *_ = pad_packed_step(meta, [7, 8], [5, 0], [0, 1], floor=2)
    assert padded.slot_mapping.tolist() == [3 * 8 + 5, 4 * 8]


def test_single_token_steps_keep_their_size():
    # a decode at batch 1 stays [1, 1] (its own graph): padding would double every matmul's work
    meta = build_metadata([(5, 1, [3])], block_size=8)
    padded, ids, pos, rows = pad_packed_step(meta, [7], [5], [0], floor=2)
    assert (ids, pos, rows) == ([7], [5], [0]) and padded.slot_mapping.tolist() == [3 * 8 + 5]
    assert padded.seq_lens.tolist() == [6] and padded.block_tables.tolist() == [[3, 0]]
    _, _, _, rows = pad_packed_step(meta, [7], [5], [], floor=2)  # a 1-token chunk needing no logits
    assert rows == [0]
    same = build_metadata([(0, 3, [0]), (9, 2, [1, 2])], block_size=8)
    assert pad_packed_step(same, [1, 2, 3, 4, 5], [0, 1, 2, 9, 10], [2, 4], floor=2)[0] is same


def test_no_logits_rows_padded():
    meta = build_metadata([(0, 3, [0])], block_size=4)  # a chunk that does not complete its prompt
    _, _, _, rows = pad_packed_step(meta, [1, 2, 3], [0, 1, 2], [], floor=2)
    assert rows == [0, 0]


def test_padded_step_gives_the_same_logits(eager):
    import dataclasses

    sv = eager.servable
    padded = dataclasses.replace(sv, min_step=2)
    for servable in (sv, padded):
        caches = servable.allocate_kv_caches(4)
        meta = build_metadata([(0, 5, [0, 1])], 4)
        out = servable.run_packed(caches, meta, [3, 1, 4, 1, 5], list(range(5)), [4])
        decode = build_metadata([(5, 1, [0, 1])], 4)
        out2 = servable.run_packed(caches, decode, [9], [5], [0])
        assert out.shape == out2.shape == (1, servable.vocab_size)
        if servable is sv:
            want = (out, out2)
    torch.testing.assert_close(out, want[0])
    torch.testing.assert_close(out2, want[1])
    assert first_step(padded).shape == (2, sv.vocab_size)


def test_a_step_runs_in_inference_mode_and_returns_logits_callers_may_update(compiled, monkeypatch):
    from pagedattn.backends import get_backend

    engine, _ = compiled
    sv = engine.servable
    cls = type(sv.backend or get_backend(torch.device("cpu")))
    seen = []
    real = cls.attend

    def spy(self, *args):
        seen.append(torch.is_inference_mode_enabled())
        return real(self, *args)

    caches = sv.allocate_kv_caches(4)
    meta = build_metadata([(0, 5, [0, 1])], 4)
    with monkeypatch.context() as m:
        m.setattr(cls, "attend", spy)
        logits = sv.run_packed(caches, meta, [3, 1, 4, 1, 5], list(range(5)), [4])
    assert seen and all(seen)
    assert not logits.is_inference()
    logits.add_(1.0)  # an inference tensor would refuse this outside inference mode
    read_only = sv.run_packed(caches, meta, [3, 1, 4, 1, 5], list(range(5)), [4], writable=False)
    assert read_only.is_inference() and torch.equal(read_only + 1.0, logits)  # the engine's own use: no copy
    before = graph_count()
    engine.generate(prompts()[:2], max_new_tokens=3)
    assert graph_count() == before  # start-up compiled the step in the mode it runs in: no recompile


@pytest.mark.parametrize("which", ["compiled", "eager"])
def test_steps_computed_ahead_run_in_the_mode_a_single_step_runs_in(which, eager, request, monkeypatch):
    # a greedy run's steps computed in bursts run in inference mode on the CPU, as a single step does: in grad mode
    # every op of the step would pass the autograd layer (and an eager step's would record a graph for the weights'
    # gradients); nothing compiles again
    from pagedattn import adapter

    engine = request.getfixturevalue(which)
    engine = engine[0] if which == "compiled" else engine
    real, modes = adapter.DecodeSteps.greedy, []

    def spy(self, j):
        modes.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled()))
        return real(self, j)

    monkeypatch.setattr(adapter.DecodeSteps, "greedy", spy)
    monkeypatch.setattr(engine, "burst_ms", 1e9)
    ps = prompts()[:3]
    ahead, before = engine.stats["ahead_steps"], graph_count()
    assert engine.generate(ps, max_new_tokens=8) == eager.generate(ps, max_new_tokens=8)
    assert engine.stats["ahead_steps"] > ahead and modes and set(modes) == {(True, False)}
    assert graph_count() == before


def test_the_cpu_backend_warms_onednns_sizes_for_reduced_precision_steps_only():
    from pagedattn.backends import get_backend
    from pagedattn.backends.cpu_linear import onednn_rows

    backend = get_backend("cpu")
    mkldnn = torch.backends.mkldnn.is_available()
    for dtype, has in ((torch.bfloat16, "_is_mkldnn_bf16_supported"), (torch.float16, "_is_mkldnn_fp16_supported")):
        sizes = backend.warm_step_sizes(1024, dtype)
        if not (mkldnn and getattr(torch.ops.mkldnn, has)()):  # no oneDNN GEMM in that dtype on this CPU: none
            assert sizes == (), dtype
            continue
        assert sizes == tuple(sorted({onednn_rows(m) for m in range(65, 1025)})) and len(sizes) == 32
        assert sizes[0] == 72 and sizes[-1] == 1024
    # float32 calls go unpadded, each size built by its first step (taken to cost nothing; on a 2-core EPYC, Zen 4,
    # +0.6-2.7 ms a call: benchmarks/RESULTS.md, 2026-11-28)
    assert backend.warm_step_sizes(1024, torch.float32) == ()
    assert backend.warm_step_sizes(64, torch.bfloat16) == ()  # no call that large


def test_warm_steps_run_each_size_once_on_caches_of_their_own(llama, monkeypatch):
    import contextlib
    import io

    from pagedattn import adapter

    servable = adapter.prepare_model(llama, block_size=4, compile=False, progress=False)
    seen = []
    real = type(servable).run_packed

    def spy(self, caches, meta, ids, pos, rows, **kw):
        seen.append((len(ids), meta.query_start_loc.diff().max().item(), max(pos), len(rows), caches))
        return real(self, caches, meta, ids, pos, rows, **kw)

    monkeypatch.setattr(type(servable), "run_packed", spy)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        adapter.warm_steps(servable, (72, 100), progress=True)
    assert [s[:4] for s in seen] == [(72, 32, 31, 3), (100, 32, 31, 4)]  # prompts of at most 32 tokens
    assert "building oneDNN's GEMMs for 2 step sizes" in err.getvalue()
    engine_caches = servable.allocate_kv_caches(4)
    assert all(c is not e for s in seen for c in s[4] for e in engine_caches)
    seen.clear()
    adapter.warm_steps(servable, ())
    assert seen == []


def test_an_engine_warms_a_compiled_step_at_start_only(compiled, eager, monkeypatch):
    from pagedattn import adapter

    calls = []
    monkeypatch.setattr(type(compiled[0].backend), "warm_step_sizes", lambda self, n, dtype: (n + 6,))
    monkeypatch.setattr(adapter, "warm_steps", lambda servable, sizes, progress: calls.append((servable, sizes)))
    for engine, warmed in ((compiled[0], True), (eager, False)):
        calls.clear()
        PagedEngine(engine.servable, block_size=4, num_blocks=16, max_num_tokens=24, progress=False)
        assert calls == ([(engine.servable, (30,))] if warmed else [])


@pytest.mark.slow
def test_a_second_engine_loads_its_frozen_step_from_inductors_cache(llama, eager, tmp_path, monkeypatch):
    # a warm start: both steps' code from the FX graph cache (the multi-token step's oneDNN-packed weights and the
    # float32 single-token step's MKL linears, each with the small-linear pass's kernels), the same greedy tokens
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    ps = prompts()[:3]
    want = eager.generate(ps, max_new_tokens=6)
    seen = []
    for _ in range(2):
        torch._dynamo.reset()
        counters.clear()
        engine = PagedEngine(llama, block_size=4, num_blocks=96, max_num_tokens=24, progress=False)
        seen.append({k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")})
        assert engine.generate(ps, max_new_tokens=6) == want
    assert seen[0].get("fxgraph_cache_miss") and not seen[0].get("fxgraph_cache_hit"), seen
    assert seen[1].get("fxgraph_cache_hit") == seen[0]["fxgraph_cache_miss"] and set(seen[1]) == {"fxgraph_cache_hit"}, \
        seen
