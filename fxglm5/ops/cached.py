"""Cached RTP attention ops: what ``insert_paged_cache`` turns the canonical attention ops into.

Each op first writes this step's new tokens into a paged per-layer cache (mutated in place, declared in
``mutates_args``), then attends over the request's cached history, so one graph serves prefill (many
tokens per request, behind a reused prefix) and decode (one token per request) alike. Tokens are flat,
as in RTP: ``T`` tokens of ``B`` requests, token ``t`` belongs to request ``req_idx[t]`` at ``positions[t]``.

Forward-context arguments (shared by every op; see ``fxglm5.runtime.forward_context``):
- ``slot_mapping`` int [T]: flat cache slot of each new token, ``block_table[r, p // bs] * bs + p % bs``
  (``bs`` = ``cache.shape[1]``, the kernel block size); -1 = padding token, not written.
- ``block_table`` int [B, max_blocks]: kernel-granularity block ids, padded with 0 (block 0 is reserved).
- ``req_idx`` int [T], ``positions`` int [T]; ``max_positions``: the model's max_position_embeddings.

Signatures (q/k/kv tensors have leading dims [N, S] with N * S = T; the graph uses N = 1):
- ``rtp_indexer(q [N,S,HI,D], k [N,S,D], weights f32 [N,S,HI], topk, index_cache, slot_mapping,
  block_table, req_idx, positions, max_positions) -> int32 [N,S,topk]``: writes k, then each token's top-k
  cached positions (0..positions[t]) by score sum_h weights * relu(q . k), the lower position first among
  equal scores (as ``fxglm5::indexer_topk``); -1 pads a shorter window.
- ``rtp_sparse_mla(q_nope [N,S,H,dn], q_pe [N,S,H,dr], kv_c [N,S,R], k_pe [N,S,dr], w_uk [H,dn,R],
  w_uv [H,dv,R], topk_pos int32 [N,S,K], scale, kv_cache, slot_mapping, block_table, req_idx, positions,
  max_positions) -> [N,S,H,dv]``: writes rows ``[kv_c | k_pe]``, then absorbed attention
  ``q = [q_nope . W_UK | q_pe]`` over the listed positions, ``o = o_lat . W_UV^T``.
- ``rtp_mla(...)``: the same without ``topk_pos``, attending to every cached position 0..positions[t].

Optional trailing arguments fold the producers of the cached values into the ops (see the pass
``fuse_norm_rope_into_cache_writes``), so a Triton backend computes them inside the cache write and the
query assembly instead of as separate kernels; absent, the inputs are taken as final:
- ``rope_cos`` / ``rope_sin`` f32 [N,S,dr/2]: q_pe and k_pe (rtp_*mla) or the first dr features of k
  (rtp_indexer) arrive un-rotated; interleaved RoPE is applied to them.
- ``kv_norm_weight`` [R], ``kv_norm_eps`` (rtp_*mla): kv_c arrives before its RMSNorm.
- ``k_norm_weight`` / ``k_norm_bias`` [D], ``k_norm_eps`` (rtp_indexer): k arrives before its LayerNorm.
- ``rope_q`` (rtp_indexer, with ``rope_cos`` / ``rope_sin``): q's first dr features of every head arrive un-rotated
  too and turn by the same tables (the query and the key sit at the same positions), inside the selection's
  logits kernel (the pass ``fuse_rope_into_indexer_query``).

``group`` / ``world`` (rtp_indexer, from ``indexer_topk``'s: the pass ``shard_indexer``): the tensor-parallel group
over whose ranks a prefill-sized step's top-k is split; every rank still writes every key (``paged_steps``).

``q_latent`` (rtp_sparse_mla / rtp_mla) [N, S, H, 576]: the latent query ``[q_nope . W_UK | q_pe]`` (q_pe rotated by
``rope_cos`` / ``rope_sin`` where given) made already, by ``fxglm5::fp8_linear_latent_query`` with the GEMM that
produced q_nope and q_pe (``fxglm5.ops.fused``, the pass ``fuse_latent_query_into_q_b``), so the op makes none and
attends with it; q_nope, q_pe and w_uk still name what it was made from (their shapes are still validated).

``written`` (every op): this step's rows are in the cache already, written (and validated) by
``fxglm5::rms_norm_write_caches`` (``fxglm5.ops.fused``, the pass ``fuse_cache_writes_into_q_norm``), so the op
writes nothing and only attends; its write arguments still name what was written. The write precedes the op: the
op's query is computed from that op's output.

Cache layouts are RTP's (``fxglm5.lowering.reference.paged``): latent rows of 576 in the compute dtype or
656-byte FP8 "ds_mla" rows, an indexer cache of 132 bytes per token (block-major: a block's e4m3 keys, then
their fp32 scales). An indexer cache may instead
hold the keys in the compute dtype ([blocks, bs, 128]): then the top-k is exact, which is what makes the
paged runtime bit-comparable to the cache-less model. Models with smaller attention widths (the tiny test
config) use the same rows zero-padded: padding changes no dot product, amax or softmax, so the layout and
the kernels stay those of GLM-5.

Validation (shapes, dtypes, block ids, slots, positions, causal top-k) runs before any cache write and
raises :class:`fxglm5.errors.InputError` naming the field; the bodies and their validation switch live in
``fxglm5.lowering.reference.paged_steps`` (this module holds the schemas only).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from fxglm5.lowering.reference import paged
from fxglm5.lowering.reference.paged_steps import indexer_step, mla_step, sparse_mla_step


@torch.library.custom_op("fxglm5::rtp_indexer", mutates_args=("index_cache",))
def rtp_indexer(q: Tensor, k: Tensor, weights: Tensor, topk: int, index_cache: Tensor, slot_mapping: Tensor,
                block_table: Tensor, req_idx: Tensor, positions: Tensor, max_positions: int,
                rope_cos: Optional[Tensor] = None, rope_sin: Optional[Tensor] = None,
                k_norm_weight: Optional[Tensor] = None, k_norm_bias: Optional[Tensor] = None,
                k_norm_eps: float = 0.0, group: Optional[str] = None, world: int = 1, rope_q: bool = False,
                written: bool = False) -> Tensor:
    return indexer_step(paged, q, k, weights, topk, index_cache, slot_mapping, block_table, req_idx, positions,
                        max_positions, rope_cos, rope_sin, k_norm_weight, k_norm_bias, k_norm_eps, group, world,
                        rope_q, written)


@rtp_indexer.register_fake
def _(q, k, weights, topk, index_cache, slot_mapping, block_table, req_idx, positions, max_positions, *folded):
    return q.new_empty(q.shape[0], q.shape[1], topk, dtype=torch.int32)


@torch.library.custom_op("fxglm5::rtp_sparse_mla", mutates_args=("kv_cache",))
def rtp_sparse_mla(q_nope: Tensor, q_pe: Tensor, kv_c: Tensor, k_pe: Tensor, w_uk: Tensor, w_uv: Tensor,
                   topk_pos: Tensor, scale: float, kv_cache: Tensor, slot_mapping: Tensor, block_table: Tensor,
                   req_idx: Tensor, positions: Tensor, max_positions: int, rope_cos: Optional[Tensor] = None,
                   rope_sin: Optional[Tensor] = None, kv_norm_weight: Optional[Tensor] = None,
                   kv_norm_eps: float = 0.0, written: bool = False,
                   q_latent: Optional[Tensor] = None) -> Tensor:
    return sparse_mla_step(paged, q_nope, q_pe, kv_c, k_pe, w_uk, w_uv, topk_pos, scale, kv_cache, slot_mapping,
                           block_table, req_idx, positions, max_positions, rope_cos, rope_sin, kv_norm_weight,
                           kv_norm_eps, written, q_latent)


@rtp_sparse_mla.register_fake
def _(q_nope, q_pe, kv_c, k_pe, w_uk, w_uv, topk_pos, scale, kv_cache, slot_mapping, block_table, req_idx,
      positions, max_positions, *folded):
    return q_nope.new_empty(*q_nope.shape[:3], w_uv.shape[1])



@torch.library.custom_op("fxglm5::rtp_mla", mutates_args=("kv_cache",))
def rtp_mla(q_nope: Tensor, q_pe: Tensor, kv_c: Tensor, k_pe: Tensor, w_uk: Tensor, w_uv: Tensor, scale: float,
            kv_cache: Tensor, slot_mapping: Tensor, block_table: Tensor, req_idx: Tensor, positions: Tensor,
            max_positions: int, rope_cos: Optional[Tensor] = None, rope_sin: Optional[Tensor] = None,
            kv_norm_weight: Optional[Tensor] = None, kv_norm_eps: float = 0.0, written: bool = False,
            q_latent: Optional[Tensor] = None) -> Tensor:
    return mla_step(paged, q_nope, q_pe, kv_c, k_pe, w_uk, w_uv, scale, kv_cache, slot_mapping, block_table, req_idx,
                    positions, max_positions, rope_cos, rope_sin, kv_norm_weight, kv_norm_eps, written, q_latent)


@rtp_mla.register_fake
def _(q_nope, q_pe, kv_c, k_pe, w_uk, w_uv, scale, kv_cache, slot_mapping, block_table, req_idx, positions,
      max_positions, *folded):
    return q_nope.new_empty(*q_nope.shape[:3], w_uv.shape[1])
