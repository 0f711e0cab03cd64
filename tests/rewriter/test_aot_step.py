"""The paged step compiled ahead of time (``compile_paged(ahead_of_time=True)``, ``pagedattn.aot_step``): the same
logits as the eager paged step at every size, sizes of one included (the program is exported without specialising
them); its package loaded by a later start; inputs outside its program refused and run by the fallback; a package
that cannot be built or loaded handled."""

import dataclasses
import logging
import os
import zipfile

import pytest
import torch

import pagedattn
from pagedattn import aot_step
from pagedattn.adapter import prepare_model
from pagedattn.aot_step import AotStep, InputGuard, load_or_build, package_key
from pagedattn.backends import build_metadata, huge_pages, native_ops, set_validation
from pagedattn.runtime.shapes import graph_count

from ..support import engine_example, hf_generate, prompts, tiny_model

BS = 4


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    """Packages in a directory of this module's own: its first build is cold, the later ones load it. The ahead-of-time
    step is the default here, as outside the tests (the suite's conftest turns it off elsewhere)."""
    directory = tmp_path_factory.mktemp("aot_steps")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(aot_step, "package_dir", lambda: str(directory))
        mp.setenv("PAGEDATTN_AHEAD_OF_TIME", "1")
        yield directory


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def served(model, packages):
    """The model prepared as the engine prepares it, its step compiled ahead of time, and eagerly (with validation, as
    the tests' own engines: a module's fixture is made before the function-scoped fixture turns it on)."""
    set_validation(True)
    aot = prepare_model(model, block_size=BS, compile=True, ahead_of_time=True)
    eager = prepare_model(model, block_size=BS, compile=False)
    return aot, eager


def test_step_is_the_runner_and_its_package_is_kept(served, packages):
    aot, _ = served
    step = aot.step.graph_module
    assert isinstance(step, AotStep) and step.source == "built"
    assert [p.suffix for p in packages.iterdir()] == [".pt2"]  # the package, no temporary file left


LONG = list(range(8, 60))  # 52 blocks: 208 tokens, far past the export's example (two sequences of a few tokens)

STEPS = (  # (sequences as (cached tokens, new tokens, block numbers), rows whose logits are read)
    ([(0, 1, [0])], [0]),  # one sequence, one token, one block, one row: every size 1
    ([(1, 1, [0])], [0]),  # its decode
    ([(0, 6, [1, 2])], [5]),  # a prompt over two blocks
    ([(2, 1, [0]), (6, 1, [1, 2]), (0, 3, [3])], [0, 1, 4]),  # decodes beside a prompt
    ([(3, 1, [0]), (7, 1, [1, 2])], [0, 1]),  # decodes alone
    ([(4, 9, [0, 1, 2, 3])], [2, 8]),  # a long prompt after its cached tokens, two rows
    ([(0, 150, LONG)], [149]),  # a prompt of 150 tokens over 38 blocks
    ([(150, 1, LONG), (13, 1, [0, 1, 2, 3])], [0, 1]),  # its decode, a 38-block table beside a 4-block one
    ([(151, 48, LONG)], [0, 47]),  # a chunk at an offset, to 199 tokens
    ([(199, 1, LONG)], [0]),  # one decode at a long context
)


def _same_logits_at_every_step(aot, eager, vocab: int, tolerance: dict, cache_tolerance: dict) -> None:
    """``STEPS`` through both servables on caches of their own: the logits, then the caches, alike."""
    caches = {"aot": aot.allocate_kv_caches(LONG[-1] + 1), "eager": eager.allocate_kv_caches(LONG[-1] + 1)}
    g = torch.Generator().manual_seed(0)
    for seqs, rows in STEPS:
        n = sum(new for _, new, _ in seqs)
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        pos = [p for ctx, new, _ in seqs for p in range(ctx, ctx + new)]
        meta = build_metadata(seqs, BS)
        ours = aot.run_packed(caches["aot"], meta, ids, pos, rows)
        theirs = eager.run_packed(caches["eager"], meta, ids, pos, rows)
        torch.testing.assert_close(ours, theirs, **tolerance)
    for a, b in zip(caches["aot"], caches["eager"]):  # the writes too
        torch.testing.assert_close(a, b, **cache_tolerance)
    assert aot.step.graph_module._fallback is None  # every step ran in the runner


def _steps_through(servable, vocab: int) -> tuple[list, list]:
    """``STEPS`` through ``servable`` on caches of its own: each step's logits, and the caches after them."""
    caches = servable.allocate_kv_caches(LONG[-1] + 1)
    g = torch.Generator().manual_seed(0)
    logits = []
    for seqs, rows in STEPS:
        n = sum(new for _, new, _ in seqs)
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        pos = [p for ctx, new, _ in seqs for p in range(ctx, ctx + new)]
        logits.append(servable.run_packed(caches, build_metadata(seqs, BS), ids, pos, rows))
    return logits, caches


def test_a_cpu_package_runs_from_aligned_constants_as_the_package_loader_runs_it(served, model, packages):
    aot, _ = served
    step = aot.step.graph_module
    assert isinstance(step.runner, aot_step.CpuPackage)
    constants = step.runner.constants()
    assert constants and all(huge_pages.buffer_span(t)[0] % 64 == 0 for t in constants.values())  # cache lines
    assert any(t.is_mkldnn for t in constants.values())  # frozen linear weights, packed for oneDNN
    if native_ops.load() and huge_pages.enabled():  # all of them in one buffer (asked onto huge pages)
        start, size = huge_pages.buffer_span(step.runner._buffer)
        assert all(start <= a and a + n <= start + size for a, n in map(huge_pages.buffer_span, constants.values()))
    path = next(p for p in packages.iterdir() if p.suffix == ".pt2" and
                aot_step.load_cpu_package(str(p)).get_metadata() == step.runner.get_metadata())
    unpadded = dataclasses.replace(aot, min_step=1)
    ours = _steps_through(unpadded, model.config.vocab_size)
    runner = step.runner
    step.runner = torch._inductor.aoti_load_package(str(path))  # its constants where AOTInductor's loader puts them
    try:
        theirs = _steps_through(unpadded, model.config.vocab_size)
    finally:
        step.runner = runner
    for a, b in zip(ours[0] + ours[1], theirs[0] + theirs[1]):
        assert torch.equal(a, b)  # the same bytes read by the same code
    # AOTInductor holds the constants it is handed for good: a package is loaded once a process, then shared
    assert aot_step.load_cpu_package(str(path)) is aot_step.load_cpu_package(str(path))


def _onednn_weight(dtype, n=96, k=160):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n)).to(dtype)
    return torch.ops.mkldnn._reorder_linear_weight(w, 16), w


def _reduced():
    """bfloat16 where oneDNN packs it (AVX512-BF16, AVX-NE-CONVERT or AMX), else float32: the copies are bytes
    either way."""
    return torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32


def test_copies_on_huge_pages_are_the_tensors_bytes_side_by_side_in_one_buffer():
    if not (native_ops.load() and huge_pages.enabled()):
        pytest.skip("pagedattn's C++ operators or huge pages are off here")
    from pagedattn.backends import native

    packed16, w16 = _onednn_weight(_reduced())
    packed32, w32 = _onednn_weight(torch.float32, 70, 33)
    tensors = {"a": packed16, "norm": torch.randn(7), "ids": torch.arange(5), "b": packed32, "scalar": torch.tensor(2.5)}
    buffer, copies = aot_step.copies_on_huge_pages(tensors)
    start, size = huge_pages.buffer_span(buffer)
    spans = sorted(huge_pages.buffer_span(c) if c.is_mkldnn else (c.data_ptr(), c.numel() * c.element_size())
                   for c in copies.values())
    assert all(a % aot_step.COPY_ALIGNMENT == 0 and start <= a and a + n <= start + size for a, n in spans)
    assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:]))  # one after another, none overlapping
    for name, t in tensors.items():
        c = copies[name]
        assert c.is_mkldnn == t.is_mkldnn and c.shape == t.shape and c.dtype == t.dtype
        assert torch.equal(native.onednn_bytes(c), native.onednn_bytes(t)) if t.is_mkldnn else torch.equal(c, t)
    x = torch.randn(3, 160).to(packed16.dtype)  # oneDNN reads the copy in place, as the original
    linear = torch.ops.mkldnn._linear_pointwise
    assert torch.equal(linear(x, copies["a"], None, "none", [], ""), linear(x, packed16, None, "none", [], ""))
    buffer.zero_()
    assert not native.onednn_bytes(copies["a"]).any() and not copies["norm"].any()  # the buffer's bytes, not copies


def test_copies_on_huge_pages_refuse_a_onednn_copy_that_reads_other_bytes(monkeypatch):
    if not (native_ops.load() and huge_pages.enabled()):
        pytest.skip("pagedattn's C++ operators or huge pages are off here")
    packed, _ = _onednn_weight(_reduced())
    monkeypatch.setattr(native_ops, "onednn_from_buffer", lambda buffer, offset, like: like)  # the original's bytes
    assert aot_step.copies_on_huge_pages({"w": packed}) is None


def test_copies_on_huge_pages_leave_views_and_a_process_without_huge_pages_to_the_caller(monkeypatch):
    assert aot_step.copies_on_huge_pages({"w": torch.randn(8, 8)[:, :4]}) is None  # strided: the caller clones
    assert aot_step.copies_on_huge_pages({"w": torch.randn(8)[2:]}) is None  # an offset into a larger storage
    monkeypatch.setenv("PAGEDATTN_HUGE_PAGES", "0")
    assert aot_step.copies_on_huge_pages({"w": torch.randn(8)}) is None


def test_packages_of_other_kinds_are_left_to_the_package_loader(tmp_path):
    def package(*names):
        path = tmp_path / f"{len(list(tmp_path.iterdir()))}.pt2"
        with zipfile.ZipFile(path, "w") as z:
            for name in names:
                z.writestr(name, b"{}" if name.endswith(".json") else b"")
        return str(path)

    model_dir = "k/data/aotinductor/model/"
    assert aot_step.load_cpu_package(package(model_dir + "m.cpp")) is None  # no library
    assert aot_step.load_cpu_package(package(model_dir + "a.so", model_dir + "b.so")) is None  # two
    assert aot_step.load_cpu_package(package(model_dir + "m.so", model_dir + "m_metadata.json",
                                             "k/data/weights/w")) is None  # weights beside it
    assert aot_step.load_cpu_package(package(model_dir + "m.so")) is None  # no metadata


def test_logits_equal_the_eager_step_at_every_size(served, model):
    # unpadded (min_step 1): the runner takes steps of one sequence, one block and one row as they are, and contexts,
    # tables and offsets far past the sizes it was exported at
    aot, eager = served
    _same_logits_at_every_step(dataclasses.replace(aot, min_step=1), eager, model.config.vocab_size,
                               dict(atol=2e-4, rtol=1e-4), dict(atol=2e-5, rtol=1e-5))


@pytest.mark.slow
def test_bfloat16_logits_equal_the_eager_step_to_its_rounding(packages):
    m = tiny_model("llama").to(torch.bfloat16)
    set_validation(True)
    aot = prepare_model(m, block_size=BS, compile=True, ahead_of_time=True)
    assert isinstance(aot.step.graph_module, AotStep)
    eager = prepare_model(m, block_size=BS, compile=False)
    _same_logits_at_every_step(dataclasses.replace(aot, min_step=1), eager, m.config.vocab_size,
                               dict(atol=3e-2, rtol=2e-2), dict(atol=3e-2, rtol=2e-2))


def test_engine_tokens_equal_hugging_face_and_a_second_start_loads_the_package(model, packages):
    ps = prompts()
    ref = hf_generate(model, ps, 8)
    before = graph_count()
    engine = pagedattn.PagedEngine(model, block_size=BS, num_blocks=96, max_num_tokens=24, progress=False)
    assert isinstance(engine.model.graph_module, AotStep)  # ahead of time by default on the CPU
    assert engine.model.graph_module.source == "loaded"  # built by the fixture above: same model and options
    assert engine.generate(ps, max_new_tokens=8) == ref
    assert graph_count() == before  # no Dynamo graph: the runner serves every step


def test_decode_steps_computed_ahead_through_the_runner_equal_hugging_face(model, packages):
    """Greedy runs computed ahead in bursts as long as a run (``burst_ms`` far above a step's time) through the
    ahead-of-time step's runner, its inputs checked once per run: tokens are Hugging Face's, and no step went to the
    fallback."""
    ps = prompts()
    engine = pagedattn.PagedEngine(model, block_size=BS, num_blocks=96, max_num_tokens=24, progress=False,
                                   burst_ms=1e9)
    assert isinstance(engine.model.graph_module, AotStep)
    assert engine.generate(ps, max_new_tokens=12) == hf_generate(model, ps, 12)
    assert engine.stats["ahead_steps"] > 0 and engine.model.graph_module._fallback is None


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["mistral", "qwen2", "gpt2", "gpt_neox", "phi", "opt", "falcon", "gemma2"])
def test_architectures_through_the_ahead_of_time_step_generate_like_hugging_face(arch, packages):
    m = tiny_model(arch)
    ps = prompts()
    engine = pagedattn.PagedEngine(m, block_size=BS, num_blocks=96, max_num_tokens=24, progress=False)
    assert isinstance(engine.model.graph_module, AotStep)
    assert engine.generate(ps, max_new_tokens=8) == hf_generate(m, ps, 8)
    assert engine.model.graph_module._fallback is None


def test_the_environment_turns_it_off(model, packages, monkeypatch):
    monkeypatch.setenv("PAGEDATTN_AHEAD_OF_TIME", "0")
    rm = pagedattn.rewrite(model, (), engine_example(model)).compile_paged()
    assert not isinstance(rm.graph_module, AotStep)


def test_guard_refuses_what_the_program_does_not_take(served):
    aot, _ = served
    guard = aot.step.graph_module.guard
    assert InputGuard.from_json(guard.to_json()) == guard
    flat = [torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long), False,
            torch.zeros(1, dtype=torch.long)]
    caches = aot.allocate_kv_caches(4)
    meta = build_metadata([(0, 3, [0])], BS)
    good = [*flat, *caches, *meta.tensors()]
    assert len(good) == guard.count and guard.refusal(good) is None
    # the step's sizes (tokens, rows, sequences, blocks) may be 0 or 1: the program was exported without specialising
    lower = {sym: lo for sym, lo, _ in guard.ranges}
    sizes = {i: sizes for i, _, sizes in guard.tensors}
    for i, dim in ((0, 1), (3, 0), (len(good) - 3, 0), (len(good) - 3, 1), (len(good) - 2, 0)):
        assert lower[sizes[i][dim]] == 0, (i, dim, guard.ranges)

    def changed(i, x):
        return [x if j == i else y for j, y in enumerate(good)]

    assert "inputs" in guard.refusal(good[:-1])
    assert "int64" in guard.refusal(changed(0, flat[0].int()))  # dtype
    assert "differs" in guard.refusal(changed(1, torch.zeros(1, 4, dtype=torch.long)))  # ids and positions: one length
    assert "outside the program's range" in guard.refusal(changed(0, torch.zeros(3, 3, dtype=torch.long)))  # batch
    assert "contiguous" in guard.refusal(changed(4, caches[0].transpose(-1, -2)))
    assert "built for" in guard.refusal(changed(2, True))  # use_cache, a constant of the program


def test_guard_compares_the_sizes_the_program_constrains():
    guard = InputGuard(count=3, tensors=((0, torch.float32, ("s0", "s1")), (1, torch.int64, ("s0",)),
                                         (2, torch.float32, ("s2", 4))),
                       ranges=(("s0", 0, None), ("s1", 0, None), ("s2", 2, 8)))
    ok = [torch.zeros(5, 7), torch.zeros(5, dtype=torch.long), torch.zeros(3, 4)]
    assert guard.refusal(ok) is None
    assert guard.refusal([torch.zeros(5, 1000), *ok[1:]]) is None  # s1: one size names it, no bound: any size
    assert guard.refusal([torch.zeros(0, 7), torch.zeros(0, dtype=torch.long), ok[2]]) is None
    assert "differs" in guard.refusal([ok[0], torch.zeros(6, dtype=torch.long), ok[2]])  # s0 twice: equal
    assert "range [2, 8]" in guard.refusal([*ok[:2], torch.zeros(9, 4)])  # s2 named once, but bounded
    assert "range [2, 8]" in guard.refusal([*ok[:2], torch.zeros(1, 4)])
    assert "fixed one to 4" in guard.refusal([*ok[:2], torch.zeros(3, 5)])
    assert "contiguous CPU tensor" in guard.refusal([torch.zeros(7, 5).t(), *ok[1:]])
    assert "contiguous CPU tensor" in guard.refusal([ok[0], ok[1].int(), ok[2]])
    assert "contiguous CPU tensor" in guard.refusal([ok[0], ok[1], torch.zeros(3, 4, 1)])
    assert "contiguous CPU tensor" in guard.refusal([ok[0], 5, ok[2]])


class _Runner:
    def __init__(self):
        self.loader, self.calls = self, []

    def boxed_run(self, tensors):
        self.calls.append(len(tensors))
        out = [tensors[0] + 1]
        tensors.clear()  # as AOTInductor's package loader does
        return out


def test_refused_inputs_run_the_fallback_built_once(caplog):
    guard = InputGuard(count=2, tensors=((0, torch.float32, ("s0", 2)),), ranges=(("s0", 2, 8),), constants=((1, 3),))
    made = []

    def fallback():
        made.append(1)
        return lambda x, k: [x - 1]

    step = AotStep(_Runner(), guard, torch.nn.Identity(), fallback, "loaded")
    x = torch.zeros(4, 2)
    assert (step(x, 3)[0] == 1).all() and step.runner.calls == [1]
    with caplog.at_level(logging.INFO, logger="pagedattn"):
        for refused in ((torch.zeros(9, 2), 3),  # above the range
                        (torch.zeros(1, 2), 3),  # below it
                        (torch.zeros(4, 3), 3),  # a static size
                        (x, 4)):  # another constant
            assert (step(*refused)[0] == -1).all()
    assert made == [1] and step.runner.calls == [1]
    assert "cannot take these inputs" in caplog.text and "outside the program's range" in caplog.text


def test_prepared_inputs_are_checked_once_and_run_as_they_are_then():
    guard = InputGuard(count=2, tensors=((0, torch.float32, ("s0", 2)),), ranges=(("s0", 2, 8),), constants=((1, 3),))
    step = AotStep(_Runner(), guard, torch.nn.Identity(), lambda: None, "loaded")
    x = torch.zeros(4, 2)
    call = step.prepared([x, 3])
    x += 5  # values may change after the check: the call reads them as they are
    assert (call()[0] == 6).all() and (call()[0] == 6).all()  # the loader empties its list: each call gets its own
    assert step.runner.calls == [1, 1]
    # counter-examples: inputs the guard refuses are not prepared (they would take the fallback)
    assert step.prepared([torch.zeros(9, 2), 3]) is None
    assert step.prepared([x, 4]) is None
    assert step.runner.calls == [1, 1]


def test_package_key_follows_weights_options_and_code(model):
    rm = pagedattn.rewrite(model, (), engine_example(model))
    gm, inputs = rm.graph_module, [torch.zeros(1, 2, dtype=torch.long), False]
    key = package_key(gm, {"size_asserts": False}, inputs)
    assert package_key(gm, {"size_asserts": False}, inputs) == key
    assert package_key(gm, {"size_asserts": True}, inputs) != key
    assert package_key(gm, {"size_asserts": False}, [torch.zeros(1, 2, dtype=torch.int32), False]) != key
    weight = next(p for p in gm.parameters() if p.dim() == 2)
    kept = weight[0, 0].item()
    with torch.no_grad():
        weight[0, 0] += 1
        try:
            assert package_key(gm, {"size_asserts": False}, inputs) != key
        finally:
            weight[0, 0] = kept
    assert package_key(gm, {"size_asserts": False}, inputs) == key


def test_a_package_that_does_not_load_is_built_again(tmp_path, monkeypatch):
    (tmp_path / "k.pt2").write_bytes(b"not a package")
    built, loaded = [], []

    def fake_load(path):
        if open(path, "rb").read() == b"not a package":
            raise RuntimeError("bad zip")
        loaded.append(path)
        return "runner", "guard"

    def build(path):
        built.append(path)
        with open(path, "wb") as f:
            f.write(b"package")

    monkeypatch.setattr(aot_step, "_load", fake_load)
    assert load_or_build("k", build, str(tmp_path)) == ("runner", "guard", "built")
    assert sorted(os.listdir(tmp_path)) == ["k.pt2"] and built and built[0].endswith(".pt2")
    assert load_or_build("k", build, str(tmp_path))[2] == "loaded" and len(built) == 1

    def failing(path):
        open(path, "wb").close()
        raise RuntimeError("compiler failed")

    with pytest.raises(RuntimeError, match="compiler failed"):
        load_or_build("j", failing, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["k.pt2"]  # no half-written package left


def test_a_step_that_cannot_be_built_is_compiled_with_torch_compile(model, monkeypatch, caplog, tmp_path):
    monkeypatch.setattr(aot_step, "package_dir", lambda: str(tmp_path))

    def refuse(*args, **kwargs):
        raise RuntimeError("AOTInductor cannot build this")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", refuse)
    rm = pagedattn.rewrite(model, (), engine_example(model))
    with caplog.at_level(logging.INFO, logger="pagedattn"):
        rm.compile_paged(ahead_of_time=True)
    assert not isinstance(rm.graph_module, AotStep) and hasattr(rm.graph_module, "_orig_mod")
    assert "AOTInductor cannot build this" in caplog.text


def test_ahead_of_time_where_it_cannot_apply_says_why(model):
    rm = pagedattn.rewrite(model, (), engine_example(model))
    with pytest.raises(ValueError, match="ahead_of_time=True cannot apply: it needs a CPU step compiled by Inductor"):
        rm.compile_paged(backend="eager", ahead_of_time=True)


@pytest.mark.parametrize("exported", ["size_oblivious", "specialised"])
def test_a_program_loaded_from_disk_is_compiled_as_saved(exported, model, packages, tmp_path):
    # no example inputs to export again: the saved program is compiled as it is. Saved now, it takes sizes of 1 and
    # steps run unpadded; a file saved before (export specialised sizes of 1 away) takes sizes of at least 2, and the
    # engine pads every step to them, single tokens too, as it does running such a program eagerly
    from pagedattn.serialization import export_paged

    path = str(tmp_path / "step.pt2")
    rm = pagedattn.rewrite(model, (), engine_example(model))
    if exported == "specialised":
        rm._exported = export_paged(rm)  # as files saved before this were exported
    rm.save(path)
    least = 2 if exported == "specialised" else 0
    ps = prompts()
    ref = hf_generate(model, ps, 6)
    for source in ("built", "loaded"):
        loaded = pagedattn.load(path)
        assert loaded.min_sizes == least
        engine = pagedattn.PagedEngine(loaded, block_size=BS, num_blocks=96, max_num_tokens=24, progress=False)
        step = engine.model.graph_module
        assert isinstance(step, AotStep) and step.source == source
        assert engine.servable.min_step == least and engine.servable.pad_single_token == bool(least)
        assert min(lower for _, lower, _ in step.guard.ranges) == (2 if least else 0)
        assert engine.generate(ps, max_new_tokens=6) == ref
        assert engine.generate(ps[:1], max_new_tokens=6) == ref[:1]  # one sequence: single-token steps
        assert step._fallback is None  # every step in the runner
