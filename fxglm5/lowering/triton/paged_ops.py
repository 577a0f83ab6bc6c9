"""The Triton twins of ``fxglm5.lowering.reference.paged``, under the same names, so the cached RTP ops'
bodies (``fxglm5.lowering.reference.paged_steps.*_step``) run unchanged over either kernel set; and the one-launch
``fp8_linear_latent_query_indexer`` the reference set has not (``paged_steps.latent_query_indexer_step`` runs it where
it applies)."""

from fxglm5.lowering.triton import paged_cache
from fxglm5.lowering.triton.indexer import exact_indexer_topk_paged, indexer_topk_paged
from fxglm5.lowering.triton.latent_query_indexer import fp8_linear_latent_query_indexer
from fxglm5.lowering.triton.mla import mla_paged
from fxglm5.lowering.triton.paged_cache import (latent_query, rms_norm_write_caches, write_exact_index_keys,
                                                write_index_keys, write_indexer_cache, write_latent_cache)
from fxglm5.lowering.triton.sparse_mla import sparse_mla_paged

__all__ = ["exact_indexer_topk_paged", "fp8_linear_latent_query", "fp8_linear_latent_query_indexer",
           "indexer_topk_paged", "latent_query", "mla_paged", "rms_norm_write_caches", "sparse_mla_paged",
           "write_exact_index_keys", "write_index_keys", "write_indexer_cache", "write_latent_cache"]


def fp8_linear_latent_query(x, weight, weight_scale_inv, bias, act_quant, w_uk, q_start, rope_dim, rope_cos=None,
                            rope_sin=None):
    """``paged_cache.fp8_linear_latent_query`` with the reference's arguments (the caller validated): the tokens'
    RoPE tables [..., rope_dim / 2] flattened to [tokens, rope_dim / 2], as the cached ops' bodies flatten theirs."""
    rope = None if rope_cos is None else (rope_cos.reshape(-1, rope_cos.shape[-1]),
                                          rope_sin.reshape(-1, rope_sin.shape[-1]))
    return paged_cache.fp8_linear_latent_query(x, weight, weight_scale_inv, bias, act_quant, w_uk, q_start, rope_dim,
                                               rope)
