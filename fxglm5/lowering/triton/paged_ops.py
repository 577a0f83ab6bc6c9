"""The Triton twins of ``fxglm5.lowering.reference.paged``, under the same names, so the cached RTP ops'
bodies (``fxglm5.lowering.reference.paged_steps.*_step``) run unchanged over either kernel set."""

from fxglm5.lowering.triton.indexer import exact_indexer_topk_paged, indexer_topk_paged
from fxglm5.lowering.triton.mla import mla_paged
from fxglm5.lowering.triton.paged_cache import (latent_query, rms_norm_write_caches, write_exact_index_keys,
                                                write_index_keys, write_indexer_cache, write_latent_cache)
from fxglm5.lowering.triton.sparse_mla import sparse_mla_paged

__all__ = ["exact_indexer_topk_paged", "indexer_topk_paged", "latent_query", "mla_paged", "rms_norm_write_caches",
           "sparse_mla_paged", "write_exact_index_keys", "write_index_keys", "write_indexer_cache",
           "write_latent_cache"]
