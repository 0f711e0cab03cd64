"""The engine with its paged graph compiled by Inductor (``compile=True``)."""

from pagedattn import PagedEngine

from ..rewriter.hf_models import tiny_model
from .test_engine import _prompts, _reference


def test_inductor_compiled_engine_matches_hf():
    m = tiny_model("llama", "eager")
    prompts = _prompts()
    engine = PagedEngine(m, compile=True, block_size=4, max_num_tokens=16)
    assert engine.generate(prompts, max_new_tokens=6) == _reference(m, prompts, 6)
