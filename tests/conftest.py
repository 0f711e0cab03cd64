import pytest
import torch

from pagedattn.backends import set_validation


@pytest.fixture(autouse=True)
def _validate_and_seed():
    # tests always run with metadata validation on; the hot path may leave it off
    torch.manual_seed(0)
    set_validation(True)
    yield
    set_validation(None)
