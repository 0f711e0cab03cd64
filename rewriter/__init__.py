"""pagedattn: turn naive attention in PyTorch models into paged attention."""

from pagedattn import backends  # noqa: F401  (registers torch.ops.pagedattn.*)
from pagedattn.api import RewrittenModel, load, rewrite  # noqa: F401
from pagedattn.backends import AttentionMetadata, build_metadata, get_backend  # noqa: F401
from pagedattn.runtime import paged_context  # noqa: F401
from pagedattn.runtime.engine import PagedEngine, RequestErrors, SamplingParams  # noqa: F401

__version__ = "0.1.0"
