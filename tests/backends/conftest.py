import pytest

from pagedattn.backends import native

from ..support import skip_unless_missing_prerequisite


@pytest.fixture(params=["native", "sdpa"])
def decode_path(request, monkeypatch):
    """CPU decodes through the native kernel, or through SDPA (the path where no C compiler is found). A test of
    the SDPA path's own workings asks for it alone: ``@pytest.mark.parametrize("decode_path", ["sdpa"],
    indirect=True)``."""
    if request.param == "native" and native.load() is None:
        skip_unless_missing_prerequisite()
    monkeypatch.setenv("PAGEDATTN_NATIVE", "1" if request.param == "native" else "0")
    return request.param

