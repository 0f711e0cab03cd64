"""pagedattn: turn naive attention in PyTorch models into paged attention.

The flow, one module per step (see the README, "How the code is organised"):
``tracing`` (model -> ATen graph) -> ``driver`` (runs ``pagedattn.passes``) -> ``program``
(``RewrittenModel``) -> ``serialization`` (save/load) | ``compile`` (``torch.compile`` backend) ->
``adapter`` (model -> ``ServableModel``) -> ``runtime`` (``PagedEngine``, caches, scheduler), with
``pagedattn.backends`` running the paged ops on each device.
"""

from pagedattn import backends  # noqa: F401  (registers torch.ops.pagedattn.*)
from pagedattn.api import RewrittenModel, load, rewrite, rewrite_exported
from pagedattn.backends import AttentionMetadata, build_cross_metadata, build_metadata, get_backend
from pagedattn.runtime import paged_context
from pagedattn.runtime.engine import PagedEngine, RequestErrors, SamplingParams

__all__ = [
    "AttentionMetadata",
    "PagedEngine",
    "RequestErrors",
    "RewrittenModel",
    "SamplingParams",
    "build_cross_metadata",
    "build_metadata",
    "get_backend",
    "load",
    "paged_context",
    "rewrite",
    "rewrite_exported",
]

__version__ = "0.1.0"
