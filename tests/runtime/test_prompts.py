"""Prompts as users have them: lists of ints, numpy arrays and torch tensors; everything else refused."""

import numpy as np
import pytest
import torch

import pagedattn
from pagedattn import PagedEngine, RequestErrors

from ..support import VOCAB, engine_example, prompts, tiny_model


@pytest.fixture(scope="module")
def engine():
    m = tiny_model("llama", "eager")
    return PagedEngine(pagedattn.rewrite(m, (), engine_example(m)), compile=False, num_blocks=64)


@pytest.mark.parametrize("convert", [
    list, tuple, np.array, lambda p: np.array(p, dtype=np.int32), torch.tensor,
    lambda p: torch.tensor(p, dtype=torch.int32), lambda p: torch.tensor([p])[0],
    lambda p: [np.int64(t) for t in p], lambda p: [torch.tensor(t) for t in p],
], ids=["list", "tuple", "numpy", "numpy-int32", "tensor", "tensor-int32", "tensor-row", "numpy-scalars",
        "tensor-scalars"])
def test_prompt_forms_give_the_same_tokens(engine, convert):
    ps = prompts()[:3]
    assert engine.generate([convert(p) for p in ps], max_new_tokens=4) == engine.generate(ps, max_new_tokens=4)


def test_a_batch_tensor_is_its_rows(engine):
    ps = [p[:5] for p in prompts()[:3]]
    assert engine.generate(torch.tensor(ps), max_new_tokens=3) == engine.generate(ps, max_new_tokens=3)


@pytest.mark.parametrize("bad, match", [
    ([1, True, 3], "token id True is not an integer"),
    ([1, 2.0], "token id 2.0 is not an integer"),
    (None, "the prompt is None"),
    ([1, None], "token id None is not an integer"),
    (np.array([1.0, 2.0]), "dtype is float64"),
    (torch.tensor([True, False]), "dtype is torch.bool"),
    (torch.tensor([[1, 2]]), "shape \\(1, 2\\)"),
    ("hello", "tokenize it first"),
    ([1, VOCAB + 5], f"token id {VOCAB + 5} is outside the vocabulary"),
    (np.array([-1, 2]), "token id -1 is outside the vocabulary"),
    ([], "the prompt is empty"),
])
def test_bad_prompts_name_the_request_and_the_value(engine, bad, match):
    with pytest.raises(RequestErrors, match=match) as e:
        engine.generate([[1, 2, 3], bad], max_new_tokens=2)
    assert list(e.value.errors) == [1]  # the other request is served
    assert e.value.results[0] is not None and e.value.results[1] is None
    with pytest.raises(ValueError, match=r"request \d+: .*" + match):
        engine.add_request(bad, max_new_tokens=2)
