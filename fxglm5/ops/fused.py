"""The fused op vocabulary: what the ``fuse_kernels`` stage's passes produce from canonical, cached and ATen ops.

Each op stands for a short chain the decode step ran as several kernels; its reference (``fxglm5.lowering.reference
.fused``) is that chain, so the rewrite changes no value on the reference backend, and a kernel of the op is checked
against it. Signatures:

- ``add_rms_norm(x [..., D], residual [..., D], weight [D], eps) -> (normed [..., D], x + residual)``: the residual
  add and the RMSNorm that reads it (both outputs: the sum is the next residual).
- ``add_rms_norm_fp8_linear(x [..., D], residual [..., D], norm_weight [D], eps, weight e4m3 [N, D],
  weight_scale_inv, bias?, act_quant, keep_normed) -> (out [..., N], x + residual, normed [..., D] or [..., 0])``:
  ``add_rms_norm`` and the block-FP8 GEMM of its normed rows, ``fp8_linear(normed, weight, ...)``; the normed rows
  themselves are returned where ``keep_normed`` (another op reads them too), else an empty [..., 0] (an op returns a
  fixed tuple of tensors).
- ``f32_linear(x [..., K], weight f32 [N, K], scales: float[]) -> f32 [..., N]``: ``x.float() @ weight.T`` times each
  scale in turn (the MoE router's logits; the DSA indexer's head weights, ``weights_proj(x.float()) * a * b``).
- ``moe_route_local(logits, correction_bias, top_k, n_group, topk_group, renormalize, scaling, expert_offset int32
  [], num_local) -> (weights f32 [T, k], ids int32 [T, k])``: ``moe_route`` with its ids local to the experts
  ``[offset, offset + num_local)`` a rank holds, -1 for the others (expert parallelism).
- ``moe_router(x [T, H], weight f32 [E, H], correction_bias, top_k, n_group, topk_group, renormalize, scaling,
  expert_offset int32 []?, num_local) -> (weights f32 [T, k], ids int32 [T, k])``: the router whole, ``moe_route``
  (``moe_route_local`` with ``expert_offset``) of ``f32_linear(x, weight, [])``: the GEMV and the routing in one
  kernel at decode.
- ``moe_fp8_add(x [T, H], ids, weights, w13, w13_scale?, w2, w2_scale?, act_quant, addend [T, H]) -> [T, H]``:
  ``moe_fp8(...) + addend``, the routed experts' sum and the shared expert's output added where the routed sum is
  written.
- ``moe_fp8_shared(x [T, H], ids, weights, w13, w13_scale?, w2, w2_scale?, act_quant, shared_w13 e4m3 [R, H],
  shared_w13_scale, shared_w2 e4m3 [H, I], shared_w2_scale, up_start) -> [T, H]``: ``moe_fp8_add`` with the shared
  expert's output as the addend, computed from x: its stacked gate|up GEMM, whose output's first I columns are the
  gate and the I from ``up_start`` the up half, and ``silu_mul_fp8_linear`` of the two by its down weight, both
  with ``act_quant``: at decode the shared expert's GEMMs run inside the MoE's grouped GEMM launches.
- ``moe_router_fp8_shared(x [T, H], router_weight f32 [E, H], correction_bias, top_k, n_group, topk_group,
  renormalize, scaling, expert_offset int32 []?, num_local, w13, w13_scale?, w2, w2_scale?, act_quant, shared_w13,
  shared_w13_scale, shared_w2, shared_w2_scale, up_start) -> [T, H]``: ``moe_fp8_shared`` of x with the ids and
  weights of ``moe_router`` of x: the MoE layer with its router, at decode two launches (the router's tiles beside
  the expert GEMMs' gate|up, which wait for the routing; the down GEMMs with the combine).
- ``add_rms_norm_moe_router_fp8_shared(x [..., H], residual [..., H], norm_weight [H], eps, the router's and the
  experts' arguments of moe_router_fp8_shared) -> (out [N, H], x + residual)``: ``add_rms_norm`` and
  ``moe_router_fp8_shared`` of its normed rows flattened to [N, H] (N the rows of x): the post-attention residual
  add and RMSNorm with the MoE layer that alone reads the normed rows; at decode the add and norm are the first
  tasks of the MoE's first launch.
- ``fp8_linear_latent_query(x [..., K], weight e4m3 [N, K], weight_scale_inv, bias?, act_quant, w_uk [H, nope, R],
  q_start, rope_dim, rope_cos?, rope_sin?) -> (out [..., N], q [..., H, 576])``: ``fp8_linear(x, weight, ...)`` and
  the latent query of the H query heads its output holds from column ``q_start`` (each ``nope`` q_nope columns,
  then ``rope_dim`` q_pe columns): ``[q_nope . W_UK | q_pe]`` per head, q_pe rotated by the [..., rope_dim / 2]
  tables where given, as the cached attention ops make it (``fxglm5.ops.cached``), which then take it as their
  ``q_latent``: the q_b | wq_b GEMM with its latent query, at decode one launch.
- ``fp8_linear_latent_query_indexer(x [N, S, K], weight e4m3 [n, K], weight_scale_inv, bias?, act_quant, w_uk,
  q_start, rope_dim, rope_cos?, rope_sin?, index_start, index_heads, index_dim, weights f32 [N, S, HI], topk,
  index_cache, slot_mapping, block_table, req_idx, positions, max_positions, rope_q, group?, world) -> (out [N, S, n],
  q [N, S, H, 576], int32 [N, S, topk])``: ``fp8_linear_latent_query`` and the DSA indexer's top-k as ``rtp_indexer``
  returns it for the query of ``index_heads`` heads of ``index_dim`` columns from ``index_start`` in the GEMM's output
  (the stacked wq_b's part, each head zero-padded to 128; turned by the RoPE tables where ``rope_q``), its head
  ``weights``, over ``index_cache`` (this step's keys already written: ``rms_norm_write_caches`` wrote them, so the op
  only reads the cache), ``group`` / ``world`` as rtp_indexer's: the q_b | wq_b GEMM with the latent query and the
  indexer, at decode one launch. The body is ``paged_steps.latent_query_indexer_step``; it validates the indexer's
  context as rtp_indexer does.
- ``silu_mul_fp8_linear(gate [..., I], up [..., I], weight e4m3 [N, I], weight_scale_inv, bias?, act_quant) ->
  [..., N]``: ``fp8_linear(silu(gate) * up, ...)``, the gated MLP's down projection with its activation.
- ``rms_norm_write_caches(x [N, S, Q], weight [Q], eps, kv_c [N, S, R], k_pe [N, S, dr], kv_cache, k [N, S, D]?,
  index_cache?, slot_mapping, block_table, req_idx, positions, max_positions, rope_cos?, rope_sin?, kv_norm_weight?,
  kv_norm_eps, k_norm_weight?, k_norm_bias?, k_norm_eps, weights_x [N, S, H]?, weights_proj f32 [n, H]?,
  weights_scales?) -> ([N, S, Q], f32 [N, S, n])``: ``rms_norm(x, weight, eps)``, the query latent's RMSNorm, and
  this step's cache writes of the layer's attention ops: the latent rows ``[kv_c | k_pe]`` into ``kv_cache`` as
  ``rtp_*mla`` writes them, the indexer keys ``k`` into ``index_cache`` (given) as ``rtp_indexer`` does, with their
  folded norms and one pair of RoPE tables (``fxglm5.ops.cached``); given ``weights_proj``, the layer's indexer
  head weights ``f32_linear(weights_x, weights_proj, weights_scales)`` too (at decode in the same launch), else
  n = 0 (a mutating custom op returns a fixed tuple of tensors: no list, no optional output). Both caches are
  mutated; the ops then run with ``written=True``. Its forward-context arguments and its validation (before any
  write, naming the field) are the cached ops'; its body is ``paged_steps.norm_write_caches_step``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from fxglm5.lowering.reference import fused as ref
from fxglm5.lowering.reference import paged
from fxglm5.lowering.reference.paged_steps import latent_query_indexer_step, norm_write_caches_step


@torch.library.custom_op("fxglm5::add_rms_norm", mutates_args=())
def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    normed, total = ref.add_rms_norm(x, residual, weight, eps)
    return normed.contiguous(), total.contiguous()


@add_rms_norm.register_fake
def _(x, residual, weight, eps):
    total = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    return torch.empty_like(total), total


@torch.library.custom_op("fxglm5::add_rms_norm_fp8_linear", mutates_args=())
def add_rms_norm_fp8_linear(x: Tensor, residual: Tensor, norm_weight: Tensor, eps: float, weight: Tensor,
                            weight_scale_inv: Tensor, bias: Optional[Tensor], act_quant: bool,
                            keep_normed: bool) -> tuple[Tensor, Tensor, Tensor]:
    out, total, normed = ref.add_rms_norm_fp8_linear(x, residual, norm_weight, eps, weight, weight_scale_inv, bias,
                                                     act_quant, keep_normed)
    return out.contiguous(), total.contiguous(), normed.contiguous()


@add_rms_norm_fp8_linear.register_fake
def _(x, residual, norm_weight, eps, weight, weight_scale_inv, bias, act_quant, keep_normed):
    total = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    normed = torch.empty_like(total) if keep_normed else total.new_empty(*x.shape[:-1], 0)
    return total.new_empty(*x.shape[:-1], weight.shape[0]), total, normed


@torch.library.custom_op("fxglm5::f32_linear", mutates_args=())
def f32_linear(x: Tensor, weight: Tensor, scales: list[float]) -> Tensor:
    return ref.f32_linear(x, weight, scales)


@f32_linear.register_fake
def _(x, weight, scales):
    return x.new_empty(*x.shape[:-1], weight.shape[0], dtype=torch.float32)


@torch.library.custom_op("fxglm5::moe_route_local", mutates_args=())
def moe_route_local(logits: Tensor, correction_bias: Tensor, top_k: int, n_group: int, topk_group: int,
                    renormalize: bool, scaling: float, expert_offset: Tensor, num_local: int) -> tuple[Tensor, Tensor]:
    return ref.moe_route_local(logits, correction_bias, top_k, n_group, topk_group, renormalize, scaling,
                               expert_offset, num_local)


@moe_route_local.register_fake
def _(logits, correction_bias, top_k, n_group, topk_group, renormalize, scaling, expert_offset, num_local):
    t = logits.shape[0]
    return logits.new_empty(t, top_k, dtype=torch.float32), logits.new_empty(t, top_k, dtype=torch.int32)


@torch.library.custom_op("fxglm5::moe_router", mutates_args=())
def moe_router(x: Tensor, weight: Tensor, correction_bias: Tensor, top_k: int, n_group: int, topk_group: int,
               renormalize: bool, scaling: float, expert_offset: Optional[Tensor],
               num_local: int) -> tuple[Tensor, Tensor]:
    return ref.moe_router(x, weight, correction_bias, top_k, n_group, topk_group, renormalize, scaling,
                          expert_offset, num_local)


@moe_router.register_fake
def _(x, weight, correction_bias, top_k, n_group, topk_group, renormalize, scaling, expert_offset, num_local):
    t = x.shape[0]
    return x.new_empty(t, top_k, dtype=torch.float32), x.new_empty(t, top_k, dtype=torch.int32)


@torch.library.custom_op("fxglm5::fp8_linear_latent_query", mutates_args=())
def fp8_linear_latent_query(x: Tensor, weight: Tensor, weight_scale_inv: Tensor, bias: Optional[Tensor],
                            act_quant: bool, w_uk: Tensor, q_start: int, rope_dim: int,
                            rope_cos: Optional[Tensor] = None,
                            rope_sin: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    out, q = ref.fp8_linear_latent_query(x, weight, weight_scale_inv, bias, act_quant, w_uk, q_start, rope_dim,
                                         rope_cos, rope_sin)
    return out.contiguous(), q.contiguous()


@fp8_linear_latent_query.register_fake
def _(x, weight, weight_scale_inv, bias, act_quant, w_uk, q_start, rope_dim, rope_cos=None, rope_sin=None):
    out = x.new_empty(*x.shape[:-1], weight.shape[0])
    return out, x.new_empty(*x.shape[:-1], w_uk.shape[0], paged.LATENT_DIM)


@torch.library.custom_op("fxglm5::fp8_linear_latent_query_indexer", mutates_args=())
def fp8_linear_latent_query_indexer(x: Tensor, weight: Tensor, weight_scale_inv: Tensor, bias: Optional[Tensor],
                                    act_quant: bool, w_uk: Tensor, q_start: int, rope_dim: int,
                                    rope_cos: Optional[Tensor], rope_sin: Optional[Tensor], index_start: int,
                                    index_heads: int, index_dim: int, weights: Tensor, topk: int, index_cache: Tensor,
                                    slot_mapping: Tensor, block_table: Tensor, req_idx: Tensor, positions: Tensor,
                                    max_positions: int, rope_q: bool = False, group: Optional[str] = None,
                                    world: int = 1) -> tuple[Tensor, Tensor, Tensor]:
    out, q, top = latent_query_indexer_step(
        paged, x, weight, weight_scale_inv, bias, act_quant, w_uk, q_start, rope_dim, rope_cos, rope_sin, index_start,
        index_heads, index_dim, weights, topk, index_cache, slot_mapping, block_table, req_idx, positions,
        max_positions, rope_q, group, world)
    return out.contiguous(), q.contiguous(), top.contiguous()


@fp8_linear_latent_query_indexer.register_fake
def _(x, weight, weight_scale_inv, bias, act_quant, w_uk, q_start, rope_dim, rope_cos, rope_sin, index_start,
      index_heads, index_dim, weights, topk, *context):
    lead = x.shape[:-1]
    return (x.new_empty(*lead, weight.shape[0]), x.new_empty(*lead, w_uk.shape[0], paged.LATENT_DIM),
            x.new_empty(*lead, topk, dtype=torch.int32))


@torch.library.custom_op("fxglm5::silu_mul_fp8_linear", mutates_args=())
def silu_mul_fp8_linear(gate: Tensor, up: Tensor, weight: Tensor, weight_scale_inv: Tensor, bias: Optional[Tensor],
                        act_quant: bool) -> Tensor:
    return ref.silu_mul_fp8_linear(gate, up, weight, weight_scale_inv, bias, act_quant).contiguous()


@silu_mul_fp8_linear.register_fake
def _(gate, up, weight, weight_scale_inv, bias, act_quant):
    return gate.new_empty(*gate.shape[:-1], weight.shape[0])


@torch.library.custom_op("fxglm5::moe_fp8_add", mutates_args=())
def moe_fp8_add(x: Tensor, ids: Tensor, weights: Tensor, w13: Tensor, w13_scale: Optional[Tensor], w2: Tensor,
                w2_scale: Optional[Tensor], act_quant: bool, addend: Tensor) -> Tensor:
    return ref.moe_fp8_add(x, ids, weights, w13, w13_scale, w2, w2_scale, act_quant, addend)


@moe_fp8_add.register_fake
def _(x, ids, weights, w13, w13_scale, w2, w2_scale, act_quant, addend):
    return torch.empty(x.shape, dtype=torch.promote_types(x.dtype, addend.dtype), device=x.device)


@torch.library.custom_op("fxglm5::moe_fp8_shared", mutates_args=())
def moe_fp8_shared(x: Tensor, ids: Tensor, weights: Tensor, w13: Tensor, w13_scale: Optional[Tensor], w2: Tensor,
                   w2_scale: Optional[Tensor], act_quant: bool, shared_w13: Tensor, shared_w13_scale: Tensor,
                   shared_w2: Tensor, shared_w2_scale: Tensor, up_start: int) -> Tensor:
    return ref.moe_fp8_shared(x, ids, weights, w13, w13_scale, w2, w2_scale, act_quant, shared_w13, shared_w13_scale,
                              shared_w2, shared_w2_scale, up_start)


@moe_fp8_shared.register_fake
def _(x, ids, weights, w13, w13_scale, w2, w2_scale, act_quant, shared_w13, shared_w13_scale, shared_w2,
      shared_w2_scale, up_start):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("fxglm5::moe_router_fp8_shared", mutates_args=())
def moe_router_fp8_shared(x: Tensor, router_weight: Tensor, correction_bias: Tensor, top_k: int, n_group: int,
                          topk_group: int, renormalize: bool, scaling: float, expert_offset: Optional[Tensor],
                          num_local: int, w13: Tensor, w13_scale: Optional[Tensor], w2: Tensor,
                          w2_scale: Optional[Tensor], act_quant: bool, shared_w13: Tensor, shared_w13_scale: Tensor,
                          shared_w2: Tensor, shared_w2_scale: Tensor, up_start: int) -> Tensor:
    return ref.moe_router_fp8_shared(x, router_weight, correction_bias, top_k, n_group, topk_group, renormalize,
                                     scaling, expert_offset, num_local, w13, w13_scale, w2, w2_scale, act_quant,
                                     shared_w13, shared_w13_scale, shared_w2, shared_w2_scale, up_start)


@moe_router_fp8_shared.register_fake
def _(x, router_weight, correction_bias, top_k, n_group, topk_group, renormalize, scaling, expert_offset, num_local,
      w13, w13_scale, w2, w2_scale, act_quant, shared_w13, shared_w13_scale, shared_w2, shared_w2_scale, up_start):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("fxglm5::add_rms_norm_moe_router_fp8_shared", mutates_args=())
def add_rms_norm_moe_router_fp8_shared(x: Tensor, residual: Tensor, norm_weight: Tensor, eps: float,
                                       router_weight: Tensor, correction_bias: Tensor, top_k: int, n_group: int,
                                       topk_group: int, renormalize: bool, scaling: float,
                                       expert_offset: Optional[Tensor], num_local: int, w13: Tensor,
                                       w13_scale: Optional[Tensor], w2: Tensor, w2_scale: Optional[Tensor],
                                       act_quant: bool, shared_w13: Tensor, shared_w13_scale: Tensor, shared_w2: Tensor,
                                       shared_w2_scale: Tensor, up_start: int) -> tuple[Tensor, Tensor]:
    out, total = ref.add_rms_norm_moe_router_fp8_shared(
        x, residual, norm_weight, eps, router_weight, correction_bias, top_k, n_group, topk_group, renormalize,
        scaling, expert_offset, num_local, w13, w13_scale, w2, w2_scale, act_quant, shared_w13, shared_w13_scale,
        shared_w2, shared_w2_scale, up_start)
    return out.contiguous(), total.contiguous()


@add_rms_norm_moe_router_fp8_shared.register_fake
def _(x, residual, norm_weight, eps, router_weight, correction_bias, top_k, n_group, topk_group, renormalize, scaling,
      expert_offset, num_local, w13, w13_scale, w2, w2_scale, act_quant, shared_w13, shared_w13_scale, shared_w2,
      shared_w2_scale, up_start):
    total = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    return total.new_empty(total.numel() // x.shape[-1], x.shape[-1]), total


@torch.library.custom_op("fxglm5::rms_norm_write_caches", mutates_args=("kv_cache", "index_cache"))
def rms_norm_write_caches(x: Tensor, weight: Tensor, eps: float, kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor,
                          k: Optional[Tensor], index_cache: Optional[Tensor], slot_mapping: Tensor, block_table: Tensor,
                          req_idx: Tensor, positions: Tensor, max_positions: int, rope_cos: Optional[Tensor] = None,
                          rope_sin: Optional[Tensor] = None, kv_norm_weight: Optional[Tensor] = None,
                          kv_norm_eps: float = 0.0, k_norm_weight: Optional[Tensor] = None,
                          k_norm_bias: Optional[Tensor] = None, k_norm_eps: float = 0.0,
                          weights_x: Optional[Tensor] = None, weights_proj: Optional[Tensor] = None,
                          weights_scales: Optional[list[float]] = None) -> tuple[Tensor, Tensor]:
    normed, weights = norm_write_caches_step(
        paged, x, weight, eps, kv_c, k_pe, kv_cache, k, index_cache, slot_mapping, block_table, req_idx, positions,
        max_positions, rope_cos, rope_sin, kv_norm_weight, kv_norm_eps, k_norm_weight, k_norm_bias, k_norm_eps,
        weights_x, weights_proj, weights_scales)
    return normed.contiguous(), weights.contiguous()


@rms_norm_write_caches.register_fake
def _(x, weight, eps, kv_c, k_pe, kv_cache, k, index_cache, slot_mapping, block_table, req_idx, positions,
      max_positions, rope_cos=None, rope_sin=None, kv_norm_weight=None, kv_norm_eps=0.0, k_norm_weight=None,
      k_norm_bias=None, k_norm_eps=0.0, weights_x=None, weights_proj=None, weights_scales=None):
    normed = torch.empty_like(x, memory_format=torch.contiguous_format)
    return normed, x.new_empty(*x.shape[:-1], 0 if weights_proj is None else weights_proj.shape[0],
                               dtype=torch.float32)
