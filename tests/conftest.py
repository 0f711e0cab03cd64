import os

# Inductor compiles its kernels in-process here (read when Inductor's config is first imported, so before torch): its
# default on 2 cores, a pool of compile workers, starts Python processes that import torch in each of the suite's
# processes (the two xdist workers, every test that starts a fresh process), on cores that the other worker already
# keeps busy. Cold runs of the suite (empty Inductor cache) took ~30 s less this way (benchmarks/RESULTS.md).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from pagedattn.backends import set_validation  # noqa: E402

# One intra-op thread (``PAGEDATTN_TEST_THREADS`` to change it), here and in the processes tests start.
# The tests' models are tiny: a second thread only adds a synchronisation per op, and while other
# processes share the cores every parallel region waits for a descheduled thread (a 2-layer model's
# engine run took 45x longer with 2 threads than with 1 on a loaded 2-core machine). Tests of
# thread-dependent code set their own counts (test_sdpa_cpu.py::test_decode_chunking_follows_thread_count).
THREADS = int(os.environ.get("PAGEDATTN_TEST_THREADS", "1"))
os.environ["OMP_NUM_THREADS"] = str(THREADS)
torch.set_num_threads(THREADS)

# Engines the tests start compile their CPU step with torch.compile unless a test asks for the ahead-of-time step (the
# default outside the tests): each AOTInductor package of a tiny model takes ~15 s to build, and the suite's many models
# and saved programs would spend its time budget on that. The ahead-of-time step is held to the eager step, to Hugging
# Face and to the torch.compile'd step in tests/rewriter/test_aot_step.py and tests/runtime/test_engine_compile.py, and
# across architectures by the slow sweep there; PAGEDATTN_AHEAD_OF_TIME=1 runs the whole suite through it.
os.environ.setdefault("PAGEDATTN_AHEAD_OF_TIME", "0")


def pytest_addoption(parser):
    """pyproject's addopts ask pytest-xdist for two workers (one per core: every worker runs one thread);
    where it is not installed (the XLA environment, ``.ci/xla-env``) its options are accepted and the
    tests run in this process."""
    try:
        import xdist  # noqa: F401
    except ImportError:
        group = parser.getgroup("xdist", "distributed testing (pytest-xdist is not installed: ignored)")
        # the private spelling xdist itself uses: pytest keeps lowercase short options for its own
        group._addoption("-n", "--numprocesses", dest="numprocesses", default=None, help="ignored")
        group.addoption("--dist", default="no", help="ignored")


@pytest.fixture(autouse=True)
def _validate_and_seed():
    # tests always run with metadata validation on; the hot path may leave it off
    torch.manual_seed(0)
    set_validation(True)
    yield
    set_validation(None)


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches and counters cleared before and after: compiled graphs of one test never serve another."""
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="session")
def llama():
    """The tiny Llama, its Hugging Face greedy tokens for ``prompts()`` (16 each; a shorter greedy run is a
    prefix), and the model rewritten as the engine rewrites it. Shared by many modules: read and serve it,
    never change it."""
    import pagedattn

    from .support import engine_example, hf_generate, prompts, tiny_model

    m = tiny_model("llama", "eager")
    return m, hf_generate(m, prompts(), 16), pagedattn.rewrite(m, (), engine_example(m))
