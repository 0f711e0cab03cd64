"""FX passes that find attention and replace it with paged attention.

A pass is a callable ``(GraphModule, PassContext) -> PassReport``: it changes the graph in place
and records what it learns in the typed :class:`PassContext`. A pipeline is a tuple of passes;
:func:`run_pipeline` runs one, linting the graph after each pass.

    model graph --CANONICAL_PIPELINE--> canonical pagedattn::attention nodes (the drop-in graph)
                --PAGED_PIPELINE-->     KV-cache writes + pagedattn::paged_attention,
                                        caches and metadata as graph inputs (the paged graph), step
                                        indices numbered by position; or a reason paged mode refuses it

Passes that serve one runtime are applied where it needs them: ``FunctionalCacheWrites`` (XLA,
ONNX), ``Fp32Matmuls`` (CPUs without native bf16/fp16 GEMMs) and ``ConcatLinears`` (CUDA steps
compiled by ``compile_paged``, unless ``concat_linears=False``).
"""

from pagedattn.passes.classify_mask import classify_mask
from pagedattn.passes.cleanup import remove_dead_code
from pagedattn.passes.concat_linears import ConcatLinears
from pagedattn.passes.context import PagedSite, PassContext, PassReport
from pagedattn.passes.cross_attention import cross_kv_writes, mark_varying_masks
from pagedattn.passes.fp32_matmuls import Fp32Matmuls, native_cpu_matmul
from pagedattn.passes.functional_cache_writes import FunctionalCacheWrites
from pagedattn.passes.insert_paged import insert_paged
from pagedattn.passes.match_attention import match_attention
from pagedattn.passes.packed_positions import packed_positions
from pagedattn.passes.pipeline import Pass, PassError, run_pipeline
from pagedattn.passes.replace_attention import replace_attention
from pagedattn.passes.site import AttentionSite
from pagedattn.passes.token_locality import token_locality

# model graph -> graph with canonical pagedattn::attention nodes (the drop-in form)
CANONICAL_PIPELINE = (match_attention, classify_mask, mark_varying_masks, replace_attention, remove_dead_code)
# canonical graph -> KV-cache writes + paged attention, caches and metadata as inputs (token_locality first proves
# that outside attention each token is computed alone, and finds what numbers tokens, or says why paged mode cannot)
PAGED_PIPELINE = (token_locality, insert_paged, packed_positions, remove_dead_code)
# canonical graph of an encoder-decoder's decoder step -> the graph writing its cross-attention caches
CROSS_WRITER_PIPELINE = (cross_kv_writes,)

__all__ = [
    "CANONICAL_PIPELINE",
    "CROSS_WRITER_PIPELINE",
    "PAGED_PIPELINE",
    "AttentionSite",
    "ConcatLinears",
    "Fp32Matmuls",
    "FunctionalCacheWrites",
    "PagedSite",
    "Pass",
    "PassContext",
    "PassError",
    "PassReport",
    "classify_mask",
    "cross_kv_writes",
    "insert_paged",
    "mark_varying_masks",
    "match_attention",
    "native_cpu_matmul",
    "packed_positions",
    "remove_dead_code",
    "replace_attention",
    "run_pipeline",
    "token_locality",
]
