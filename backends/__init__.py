"""Paged attention ops and the per-device backends that implement them.

``params`` and ``metadata`` hold what a call carries (per site, per step); ``reference`` states the
semantics once; ``ops`` defines ``torch.ops.pagedattn.*``; ``base`` the backend interface and the
per-device defaults; ``sdpa_cpu``, ``xformers_cuda`` and ``pallas_xla`` implement it.
"""

from pagedattn.backends import ops  # noqa: F401  (defines torch.ops.pagedattn.*)
from pagedattn.backends.base import (
    AttentionBackend,
    active_backend,
    get_backend,
    register_backend,
    use_backend,
)
from pagedattn.backends.metadata import (
    CROSS_METADATA_FIELDS,
    METADATA_FIELDS,
    AttentionMetadata,
    CrossMetadata,
    SequenceSpec,
    build_cross_metadata,
    build_decode_metadata,
    build_metadata,
    cross_slot_mapping,
    set_validation,
    validation_enabled,
)
from pagedattn.backends.params import AttentionConfig, AttentionParams, CacheSpec

__all__ = [
    "AttentionBackend",
    "AttentionConfig",
    "AttentionMetadata",
    "AttentionParams",
    "CROSS_METADATA_FIELDS",
    "CacheSpec",
    "CrossMetadata",
    "METADATA_FIELDS",
    "SequenceSpec",
    "active_backend",
    "build_cross_metadata",
    "build_decode_metadata",
    "build_metadata",
    "cross_slot_mapping",
    "get_backend",
    "register_backend",
    "set_validation",
    "use_backend",
    "validation_enabled",
]
