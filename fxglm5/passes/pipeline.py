"""The declared pass pipeline: the stages in the order they run and, per stage, its passes in order.

This declaration, not the order in which ``fxglm5.passes`` imports the pass modules, decides what runs when:
a pass depends on what earlier ones left in the graph (``fuse_norm_rope_into_cache_writes`` folds the
``rms_norm`` / ``rope`` nodes the match stage made, next to the cache writes ``insert_paged_cache`` made),
so an order that followed the imports would change whenever someone sorted them. Every pass module still
registers its function (``registry.register_pass``); registering a pass this file does not declare, or under
another stage, is an error, and so is running a stage whose declared pass is not registered.

A stage's name is its string value, so ``"match"`` and ``Stage.MATCH`` are the same key. The shard stage (the
rank's tensor / expert-parallel part of the fused graph, ``PassContext.mapping``; a no-op at world size 1) is the
first load-time stage: an exported artifact stores match + fuse only, so it stays rank-agnostic.

The fuse_kernels stage is the decode step's kernel count: each of its passes turns a chain that ran as several small
kernels (an add and a norm, a cast and a float32 GEMV and two scalar multiplies, five ops of expert-id glue, the
router's GEMV and its routing, a silu and a multiply before a GEMM, the shared expert's add after the MoE and its
GEMMs beside the MoE's, the router beside the experts' GEMMs, the query latent's norm and the two cache writes
beside it, the indexer's head weights beside those, the latent query and the indexer beside the q_b GEMM, a residual
add and norm before the MoE or the GEMM that reads them) into one op of ``fxglm5.ops.fused`` whose reference is that
chain. It runs on the device graph only (after shard and cache), where the chains are final; the lower stage then
binds kernels.
"""

from __future__ import annotations

import enum


class Stage(str, enum.Enum):
    MATCH = "match"  # generic math -> canonical ops (sparse_mla, rms_norm, rope ...)
    FUSE = "fuse"  # FP8 dequantization folded into the GEMMs and the MoE
    SHARD = "shard"  # the rank's slices of heads / experts / vocabulary + the collectives (fxglm5.parallel)
    CACHE = "cache"  # canonical attention -> paged RTP ops over the caches
    FUSE_KERNELS = "fuse_kernels"  # chains of small ops -> one kernel each (fxglm5.ops.fused), shared-input GEMMs
    LOWER = "lower"  # fxglm5 ops -> the backend kernels of the device

    def __str__(self) -> str:
        return self.value


STAGES: tuple[Stage, ...] = tuple(Stage)

PIPELINE: dict[Stage, tuple[str, ...]] = {
    Stage.MATCH: ("match_sparse_mla", "match_mla", "match_rms_norm", "match_rope"),
    Stage.FUSE: ("fuse_fp8_linear", "fuse_fp8_moe"),
    # each pass shards one block and adds its own collective (shard_indexer's is inside the op it splits), so any
    # subset leaves a correct program
    Stage.SHARD: ("shard_attention", "shard_indexer", "shard_mlp", "shard_moe_experts", "shard_lm_head"),
    # both rewrite what insert_paged_cache made: the row selection at the output, the cached ops' inputs
    Stage.CACHE: ("insert_paged_cache", "select_sampled_rows", "fuse_norm_rope_into_cache_writes",
                  "fuse_rope_into_indexer_query"),
    # after the shard and cache stages, which still need each projection's own GEMM and the canonical norms and
    # routers: the router's ids made local before any GEMM is stacked, then its logits' GEMV folded into it (both
    # router ops), the gate folded into the down GEMM once gate and up are slices of one stacked GEMM, the shared
    # expert's add and then its two GEMMs into the MoE, then the router into that MoE op, the residual adds last
    # (what they read no longer changes), then each add + norm into the MoE op that reads it, or into the one stacked
    # GEMM that reads it; the cache
    # writes join the query's norm once the cache stage has folded their producers into the cached ops, then the
    # indexer's head weights join that op; then the latent query joins the stacked q_b GEMM whose query heads it
    # reads (after the norm's pass, which finds the norm through the query as a view of that GEMM), then the indexer
    # whose query is that GEMM's wq_b part joins the same op (once its keys and weights are the norm op's)
    Stage.FUSE_KERNELS: ("fuse_f32_linear", "fuse_local_experts_into_route", "fuse_f32_linear_into_route",
                         "fuse_shared_input_gemms", "fuse_cache_writes_into_q_norm", "fuse_index_weights_into_q_norm",
                         "fuse_latent_query_into_q_b", "fuse_indexer_into_q_b", "fuse_silu_mul_into_down",
                         "fuse_shared_add_into_moe", "fuse_shared_expert_into_moe",
                         "fuse_router_into_moe", "fuse_add_rms_norm", "fuse_add_rms_norm_into_moe",
                         "fuse_add_rms_norm_into_gemm"),
    # the all-reduces that may overwrite their input are marked before lower binds them the in-place body
    Stage.LOWER: ("reduce_in_place", "lower"),
}

DECLARED: dict[str, Stage] = {name: stage for stage, names in PIPELINE.items() for name in names}


def stages_of(stages) -> tuple[Stage, ...]:
    """``stages`` (Stage members or their names, any order) as Stage members in pipeline order."""
    wanted = set()
    for stage in stages:
        try:
            wanted.add(Stage(stage))
        except ValueError:
            raise ValueError(f"unknown stage {stage!r}; stages are {[s.value for s in STAGES]}") from None
    return tuple(stage for stage in STAGES if stage in wanted)
