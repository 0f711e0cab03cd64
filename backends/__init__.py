"""Paged attention ops and the per-device backends that implement them."""

from pagedattn.backends import ops  # noqa: F401  (defines torch.ops.pagedattn.*)
from pagedattn.backends.base import (  # noqa: F401
    AttentionBackend,
    AttentionConfig,
    AttentionMetadata,
    SequenceSpec,
    build_metadata,
    get_backend,
    set_validation,
    validation_enabled,
)
from pagedattn.backends import sdpa_cpu  # noqa: F401  (registers the CPU kernels)
