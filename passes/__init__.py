"""FX passes that find attention and replace it with paged attention.

A pass takes a ``GraphModule`` and returns a :class:`PassResult`; what passes learn about
attention sites travels in ``gm.meta["pagedattn_sites"]``.
"""

from pagedattn.passes.classify_mask import classify_mask
from pagedattn.passes.cleanup import remove_dead_code
from pagedattn.passes.insert_paged import METADATA_INPUTS, insert_paged
from pagedattn.passes.match_attention import match_attention
from pagedattn.passes.replace_attention import replace_attention
from pagedattn.passes.site import AttentionSite, PassResult

# model graph -> graph with canonical pagedattn::attention nodes (the drop-in form)
CANONICAL_PIPELINE = (match_attention, classify_mask, replace_attention, remove_dead_code)
# canonical graph -> KV-cache writes + paged attention, caches and metadata as inputs
PAGED_PIPELINE = (insert_paged, remove_dead_code)

__all__ = ["CANONICAL_PIPELINE", "PAGED_PIPELINE", "METADATA_INPUTS", "AttentionSite", "PassResult", "run_pipeline"]


def run_pipeline(gm, pipeline) -> list[PassResult]:
    return [p(gm) for p in pipeline]
