"""The canonical fxglm5 op vocabulary: what the match_* / fuse_* passes produce.

Each op is a ``torch.library.custom_op`` with a fake (meta) implementation for tracing and a torch
reference implementation (``fxglm5.lowering.reference``) that runs on any device. Kernel choice is a
separate, later step: the ``lower`` pass binds each op node to a backend implementation.

Signatures (B = batch, S = sequence, H = heads, R = kv_lora_rank, dn/dr/dv = nope/rope/value dims):

- ``fp8_linear(x [..., K], weight e4m3 [N, K], weight_scale_inv f32 [ceil(N/128), ceil(K/128)],
  bias [N]?, act_quant) -> [..., N]``: y = x W^T with W dequantized per 128x128 block; with act_quant
  the activation is quantized per token in groups of 128 (W8A8, as the serving kernels do).
- ``moe_route(logits f32 [T, E], correction_bias f32 [E], top_k, n_group, topk_group, renormalize,
  scaling) -> (weights f32 [T, top_k], ids int32 [T, top_k])``: GLM-5's noaux_tc sigmoid router.
- ``moe_fp8(x [T, Hd], ids [T, k], weights f32 [T, k], w13 [E, 2I, Hd], w13_scale?, w2 [E, Hd, I],
  w2_scale?, act_quant) -> [T, Hd]``: routed SiLU-gated experts; w13/w2 are e4m3 with block scales (w13's
  gate and up halves blocked on their own: [E, 2*ceil(I/128), ceil(Hd/128)]), or (scales None) plain
  weights in the compute dtype for bf16 checkpoints.
- ``mla(q_nope [B,S,H,dn], q_pe [B,S,H,dr], kv_c [B,S,R], k_pe [B,S,dr], w_uk [H,dn,R], w_uv [H,dv,R],
  scale) -> [B,S,H,dv]``: causal multi-head latent attention in the absorbed form (RoPE already applied).
- ``indexer_topk(q [B,S,HI,D], k [B,S,D], weights f32 [B,S,HI], topk) -> int32 [B,S,topk]``: the DSA
  lightning indexer, score = sum_h weights * relu(q . k) with every scale folded into weights; -1 pads.
  Tie rule, for every implementation (reference, cached ops, kernels, sharded ranks): among equal scores
  (``-0.0 == 0.0``) the lower token position wins, so every path selects the same set. The selection is a
  set (sparse attention does not depend on its order): the reference lists it by descending score, then
  position; kernels may list it in any order. Optional ``group`` / ``world`` (set by the shard pass
  ``shard_indexer``): the tensor-parallel group over whose ranks a long enough step's queries are split, each rank
  selecting for its share, one all_gather rebuilding the whole [B,S,topk] on every rank
  (``fxglm5.lowering.reference.collectives.gather_split_rows``); the cached ``rtp_indexer`` carries them on.
- ``sparse_mla(q_nope, q_pe, kv_c, k_pe, w_uk, w_uv, topk_indices int32 [B,S,K], scale) -> [B,S,H,dv]``:
  ``mla`` restricted to the selected keys.
- ``rms_norm(x [..., D], weight [D], eps) -> [..., D]``: RMSNorm in x's dtype (float32 statistics).
- ``rope_interleaved(x [B,S,H,D], cos f32 [B,S,R/2], sin) -> [B,S,H,D]``: RoPE on the first R features
  (interleaved pairs), the rest passed through.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from fxglm5.lowering.reference import attention as ref_attn
from fxglm5.lowering.reference import fp8 as ref_fp8
from fxglm5.lowering.reference import norm_rope as ref_norm_rope


@torch.library.custom_op("fxglm5::fp8_linear", mutates_args=())
def fp8_linear(x: Tensor, weight: Tensor, weight_scale_inv: Tensor, bias: Optional[Tensor], act_quant: bool) -> Tensor:
    return ref_fp8.fp8_linear(x, weight, weight_scale_inv, bias, act_quant).contiguous()


@fp8_linear.register_fake
def _(x, weight, weight_scale_inv, bias, act_quant):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("fxglm5::moe_route", mutates_args=())
def moe_route(
    logits: Tensor, correction_bias: Tensor, top_k: int, n_group: int, topk_group: int, renormalize: bool, scaling: float
) -> tuple[Tensor, Tensor]:
    return ref_fp8.moe_route(logits, correction_bias, top_k, n_group, topk_group, renormalize, scaling)


@moe_route.register_fake
def _(logits, correction_bias, top_k, n_group, topk_group, renormalize, scaling):
    t = logits.shape[0]
    return logits.new_empty(t, top_k, dtype=torch.float32), logits.new_empty(t, top_k, dtype=torch.int32)


@torch.library.custom_op("fxglm5::moe_fp8", mutates_args=())
def moe_fp8(
    x: Tensor, ids: Tensor, weights: Tensor, w13: Tensor, w13_scale: Optional[Tensor], w2: Tensor,
    w2_scale: Optional[Tensor], act_quant: bool,
) -> Tensor:
    return ref_fp8.moe_any(x, ids, weights, w13, w13_scale, w2, w2_scale, act_quant)


@moe_fp8.register_fake
def _(x, ids, weights, w13, w13_scale, w2, w2_scale, act_quant):
    return torch.empty_like(x)


@torch.library.custom_op("fxglm5::mla", mutates_args=())
def mla(q_nope: Tensor, q_pe: Tensor, kv_c: Tensor, k_pe: Tensor, w_uk: Tensor, w_uv: Tensor, scale: float) -> Tensor:
    return ref_attn.mla(q_nope, q_pe, kv_c, k_pe, w_uk, w_uv, scale).contiguous()


@mla.register_fake
def _(q_nope, q_pe, kv_c, k_pe, w_uk, w_uv, scale):
    return q_nope.new_empty(*q_nope.shape[:3], w_uv.shape[1])


@torch.library.custom_op("fxglm5::indexer_topk", mutates_args=())
def indexer_topk(q: Tensor, k: Tensor, weights: Tensor, topk: int, group: Optional[str] = None,
                 world: int = 1) -> Tensor:
    return ref_attn.indexer_topk(q, k, weights, topk, group, world).contiguous()


@indexer_topk.register_fake
def _(q, k, weights, topk, group=None, world=1):
    return q.new_empty(q.shape[0], q.shape[1], topk, dtype=torch.int32)


@torch.library.custom_op("fxglm5::sparse_mla", mutates_args=())
def sparse_mla(
    q_nope: Tensor, q_pe: Tensor, kv_c: Tensor, k_pe: Tensor, w_uk: Tensor, w_uv: Tensor, topk_indices: Tensor, scale: float
) -> Tensor:
    return ref_attn.sparse_mla(q_nope, q_pe, kv_c, k_pe, w_uk, w_uv, topk_indices, scale).contiguous()


@sparse_mla.register_fake
def _(q_nope, q_pe, kv_c, k_pe, w_uk, w_uv, topk_indices, scale):
    return q_nope.new_empty(*q_nope.shape[:3], w_uv.shape[1])


@torch.library.custom_op("fxglm5::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    ref_norm_rope.validate_norm(x, weight, eps)
    return ref_norm_rope.rms_norm(x, weight, eps).contiguous()


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("fxglm5::rope_interleaved", mutates_args=())
def rope_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    flat = ref_norm_rope.flat_rope_args(x, cos, sin)
    return ref_norm_rope.rope_interleaved(*flat).view(x.shape)


@rope_interleaved.register_fake
def _(x, cos, sin):
    return torch.empty_like(x, memory_format=torch.contiguous_format)
