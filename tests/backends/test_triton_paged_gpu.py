"""The Triton paged attention kernel compiled on an NVIDIA GPU: ``triton_cases.py``'s cases on CUDA tensors.
Skipped without a GPU or Triton."""

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA is not available)"),
]
pytest.importorskip("triton", reason="Triton is not installed")

from .triton_cases import *  # noqa: E402,F403 - the same cases, on the GPU


@pytest.fixture
def device():  # noqa: F811 - the cases' CPU fixture, on CUDA here
    return "cuda"
