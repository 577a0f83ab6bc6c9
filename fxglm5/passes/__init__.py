"""Stage 3 of the flow: FX passes over the captured graph. :mod:`fxglm5.passes.pipeline` declares the stages
and the order of the passes in each; importing this package registers every pass (in any order: the
declaration decides the order they run in)."""

import fxglm5.ops  # noqa: F401  (the passes emit these ops)
from fxglm5.passes import fuse_fp8_linear, fuse_fp8_moe  # noqa: F401  (registration)
from fxglm5.passes import fuse_norm_rope_into_cache_writes, insert_paged_cache, select_sampled_rows  # noqa: F401
from fxglm5.passes import fuse_rope_into_indexer_query  # noqa: F401  (registration)
from fxglm5.passes import fuse_add_rms_norm, fuse_cache_writes_into_q_norm, fuse_f32_linear  # noqa: F401
from fxglm5.passes import fuse_add_rms_norm_into_gemm, fuse_add_rms_norm_into_moe  # noqa: F401  (registration)
from fxglm5.passes import fuse_f32_linear_into_route, fuse_index_weights_into_q_norm  # noqa: F401  (registration)
from fxglm5.passes import fuse_indexer_into_q_b  # noqa: F401  (registration)
from fxglm5.passes import fuse_latent_query_into_q_b, fuse_local_experts_into_route  # noqa: F401  (registration)
from fxglm5.passes import fuse_router_into_moe, fuse_shared_expert_into_moe  # noqa: F401  (registration)
from fxglm5.passes import fuse_shared_add_into_moe, fuse_shared_input_gemms, fuse_silu_mul_into_down, lower  # noqa: F401
from fxglm5.passes import match_mla, match_rms_norm, match_rope, match_sparse_mla  # noqa: F401  (registration)
from fxglm5.passes import shard_attention, shard_indexer, shard_lm_head, shard_mlp  # noqa: F401  (registration)
from fxglm5.passes import reduce_in_place, shard_moe_experts  # noqa: F401  (registration)
from fxglm5.passes.manager import PassContext, PassManager, PassResult, op_histogram, run_pipeline
from fxglm5.passes.pipeline import PIPELINE, STAGES, Stage
from fxglm5.passes.registry import REGISTRY, register_pass

__all__ = ["PIPELINE", "PassContext", "PassManager", "PassResult", "REGISTRY", "STAGES", "Stage", "op_histogram",
           "register_pass", "run_pipeline"]
