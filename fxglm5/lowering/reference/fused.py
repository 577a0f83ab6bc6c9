"""Torch references of the fused ops (``fxglm5.ops.fused``): each is the composition of the ops it replaces, in
the same order and at the same rounding points, so a graph after a fusion pass computes on the reference backend
exactly what it computed before, and every kernel of a fused op is checked against this composition.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from fxglm5.contracts import INDEX_DIM, KV_LORA_RANK, ROPE_DIM
from fxglm5.errors import InputError
from fxglm5.lowering.reference import fp8 as ref_fp8
from fxglm5.lowering.reference import norm_rope as ref_norm_rope


def validate_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> None:
    if not isinstance(residual, Tensor) or residual.shape != getattr(x, "shape", None):
        raise InputError(f"add_rms_norm residual: shape {tuple(getattr(residual, 'shape', ()))} does not match x's "
                         f"{tuple(getattr(x, 'shape', ()))}")
    ref_norm_rope.validate_norm(x, weight, eps, what="add_rms_norm")
    ref_norm_rope.validate_norm(residual, weight, eps, what="add_rms_norm")


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(rms_norm(x + residual), x + residual): the residual stream's add and the next block's RMSNorm."""
    validate_add_rms_norm(x, residual, weight, eps)
    total = x + residual
    return ref_norm_rope.rms_norm(total, weight, eps), total


def add_rms_norm_fp8_linear(x: Tensor, residual: Tensor, norm_weight: Tensor, eps: float, weight: Tensor,
                            weight_scale_inv: Tensor, bias: Optional[Tensor], act_quant: bool,
                            keep_normed: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The residual add, the next block's RMSNorm and the block-FP8 GEMM that reads it: ``(fp8_linear(normed, weight,
    ...), total, normed)`` of ``normed, total = add_rms_norm(x, residual, norm_weight, eps)``, the chain it replaces;
    ``normed`` is returned where ``keep_normed`` (another op reads it too), else an empty [..., 0]."""
    normed, total = add_rms_norm(x, residual, norm_weight, eps)
    out = ref_fp8.fp8_linear(normed, weight, weight_scale_inv, bias, act_quant)
    return out, total, normed if keep_normed else normed.new_empty(*normed.shape[:-1], 0)


def validate_f32_linear(x: Tensor, weight: Tensor, scales: Sequence[float], max_scales: int | None = None) -> None:
    if not isinstance(x, Tensor) or not x.is_floating_point() or x.dim() < 1:
        raise InputError(f"f32_linear x: expected a floating-point tensor, got {getattr(x, 'dtype', type(x))}")
    if not isinstance(weight, Tensor) or weight.dtype != torch.float32 or weight.dim() != 2 \
            or x.shape[-1] != weight.shape[1]:
        raise InputError(f"f32_linear weight: expected float32 [N, {x.shape[-1]}], got "
                         f"{getattr(weight, 'dtype', type(weight))} {tuple(getattr(weight, 'shape', ()))}")
    if weight.device != x.device:
        raise InputError(f"f32_linear weight: on {weight.device}, x on {x.device}")
    if max_scales is not None and len(scales) > max_scales:
        raise InputError(f"f32_linear scales: {len(scales)} given, the kernel applies at most {max_scales}")


def f32_linear(x: Tensor, weight: Tensor, scales: Sequence[float]) -> Tensor:
    """``x.float() @ weight.T`` in float32, then times each of ``scales`` in turn (one rounding each, as the chain
    of scalar multiplies it replaces): the MoE router's logits and the indexer's head weights."""
    validate_f32_linear(x, weight, scales)
    y = F.linear(x.float(), weight)
    for s in scales:
        y = y * s
    return y


def local_expert_ids(ids: Tensor, expert_offset: Tensor, num_local: int) -> Tensor:
    """Global expert ids -> this rank's ids 0..num_local-1 (experts [offset, offset + num_local)), -1 elsewhere."""
    local = ids - expert_offset
    return torch.where((local >= 0) & (local < num_local), local, -1)


def moe_route_local(logits: Tensor, correction_bias: Tensor, top_k: int, n_group: int, topk_group: int,
                    renormalize: bool, scaling: float, expert_offset: Tensor, num_local: int) -> tuple[Tensor, Tensor]:
    """``moe_route``, its ids then made local to the rank's experts (expert parallelism): the router runs whole on
    every rank, each rank computes only the experts it holds."""
    weights, ids = ref_fp8.moe_route(logits, correction_bias, top_k, n_group, topk_group, renormalize, scaling)
    return weights, local_expert_ids(ids, expert_offset, num_local)


def moe_router(x: Tensor, weight: Tensor, correction_bias: Tensor, top_k: int, n_group: int, topk_group: int,
               renormalize: bool, scaling: float, expert_offset: Optional[Tensor],
               num_local: int) -> tuple[Tensor, Tensor]:
    """The router whole: its float32 logits ``f32_linear(x, weight, [])``, routed by ``moe_route``, the ids made
    local to the rank's experts where ``expert_offset`` is given (``moe_route_local``): the chain it replaces."""
    logits = f32_linear(x, weight, [])
    if expert_offset is None:
        return ref_fp8.moe_route(logits, correction_bias, top_k, n_group, topk_group, renormalize, scaling)
    return moe_route_local(logits, correction_bias, top_k, n_group, topk_group, renormalize, scaling, expert_offset,
                           num_local)


def moe_fp8_add(x: Tensor, ids: Tensor, weights: Tensor, w13: Tensor, w13_scale: Optional[Tensor], w2: Tensor,
                w2_scale: Optional[Tensor], act_quant: bool, addend: Tensor) -> Tensor:
    """The routed experts' output plus ``addend`` (the shared expert's): ``moe_fp8(...) + addend``, the routed sum
    rounded to x's dtype first, as the unfused graph has it."""
    if addend.shape != x.shape:
        raise InputError(f"moe_fp8_add addend: shape {tuple(addend.shape)}, the tokens' is {tuple(x.shape)}")
    return ref_fp8.moe_any(x, ids, weights, w13, w13_scale, w2, w2_scale, act_quant) + addend


def shared_halves(gate_up: Tensor, inter: int, up_start: int) -> tuple[Tensor, Tensor]:
    """(gate, up) of a shared expert's stacked gate|up output: its first ``inter`` columns and the ``inter`` from
    ``up_start`` (``fuse_shared_input_gemms`` pads the gate to whole 128-row weight blocks before the up half)."""
    if not 0 < inter <= up_start or up_start + inter > gate_up.shape[-1]:
        raise InputError(f"moe_fp8_shared up_start: the halves [0, {inter}) and [{up_start}, {up_start + inter}) do "
                         f"not fit apart in the gate|up GEMM's {gate_up.shape[-1]} output columns")
    return gate_up[..., :inter], gate_up[..., up_start:up_start + inter]


def moe_fp8_shared(x: Tensor, ids: Tensor, weights: Tensor, w13: Tensor, w13_scale: Optional[Tensor], w2: Tensor,
                   w2_scale: Optional[Tensor], act_quant: bool, shared_w13: Tensor, shared_w13_scale: Tensor,
                   shared_w2: Tensor, shared_w2_scale: Tensor, up_start: int) -> Tensor:
    """The MoE layer whole, as the chain it replaces computes it: the shared expert's stacked gate|up GEMM, its down
    GEMM of ``silu(gate) * up`` (:func:`shared_halves`; both GEMMs with ``act_quant``, as the routed experts), and
    ``moe_fp8_add`` of the routed experts with that output as the addend."""
    gate, up = shared_halves(ref_fp8.fp8_linear(x, shared_w13, shared_w13_scale, None, act_quant),
                             shared_w2.shape[-1], up_start)
    shared = silu_mul_fp8_linear(gate, up, shared_w2, shared_w2_scale, None, act_quant)
    return moe_fp8_add(x, ids, weights, w13, w13_scale, w2, w2_scale, act_quant, shared)


def moe_router_fp8_shared(x: Tensor, router_weight: Tensor, correction_bias: Tensor, top_k: int, n_group: int,
                          topk_group: int, renormalize: bool, scaling: float, expert_offset: Optional[Tensor],
                          num_local: int, w13: Tensor, w13_scale: Optional[Tensor], w2: Tensor,
                          w2_scale: Optional[Tensor], act_quant: bool, shared_w13: Tensor, shared_w13_scale: Tensor,
                          shared_w2: Tensor, shared_w2_scale: Tensor, up_start: int) -> Tensor:
    """The MoE layer whole, its router included, as the chain it replaces computes it: ``moe_router`` of x, then
    ``moe_fp8_shared`` of x with those ids and weights."""
    weights, ids = moe_router(x, router_weight, correction_bias, top_k, n_group, topk_group, renormalize, scaling,
                              expert_offset, num_local)
    return moe_fp8_shared(x, ids, weights, w13, w13_scale, w2, w2_scale, act_quant, shared_w13, shared_w13_scale,
                          shared_w2, shared_w2_scale, up_start)


def add_rms_norm_moe_router_fp8_shared(x: Tensor, residual: Tensor, norm_weight: Tensor, eps: float,
                                       router_weight: Tensor, correction_bias: Tensor, top_k: int, n_group: int,
                                       topk_group: int, renormalize: bool, scaling: float,
                                       expert_offset: Optional[Tensor], num_local: int, w13: Tensor,
                                       w13_scale: Optional[Tensor], w2: Tensor, w2_scale: Optional[Tensor],
                                       act_quant: bool, shared_w13: Tensor, shared_w13_scale: Tensor, shared_w2: Tensor,
                                       shared_w2_scale: Tensor, up_start: int) -> tuple[Tensor, Tensor]:
    """The residual add, the post-attention RMSNorm and the MoE layer that reads it, as the chain it replaces computes
    them: ``(moe_router_fp8_shared(normed.reshape(-1, H), ...), total)`` of ``normed, total = add_rms_norm(x,
    residual, norm_weight, eps)``."""
    normed, total = add_rms_norm(x, residual, norm_weight, eps)
    out = moe_router_fp8_shared(normed.reshape(-1, normed.shape[-1]), router_weight, correction_bias, top_k, n_group,
                                topk_group, renormalize, scaling, expert_offset, num_local, w13, w13_scale, w2,
                                w2_scale, act_quant, shared_w13, shared_w13_scale, shared_w2, shared_w2_scale, up_start)
    return out, total


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up`` as the unfused graph computes it: silu rounded to gate's dtype, then the product."""
    return F.silu(gate) * up


def silu_mul_fp8_linear(gate: Tensor, up: Tensor, weight: Tensor, weight_scale_inv: Tensor, bias: Optional[Tensor],
                        act_quant: bool) -> Tensor:
    """The gated MLP's down projection with its gate folded in: ``fp8_linear(silu(gate) * up, weight, ...)``."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise InputError(f"silu_mul_fp8_linear up: {up.dtype} {tuple(up.shape)} does not match gate's "
                         f"{gate.dtype} {tuple(gate.shape)}")
    return ref_fp8.fp8_linear(silu_mul(gate, up), weight, weight_scale_inv, bias, act_quant)


def query_heads(out: Tensor, q_start: int, heads: int, nope: int, rope_dim: int) -> tuple[Tensor, Tensor]:
    """(q_nope [..., H, nope], q_pe [..., H, rope_dim]): the query heads of a GEMM's output ``out`` [..., N] from
    column ``q_start`` (each head ``nope + rope_dim`` columns, q_nope first), as the graph takes them (a slice of the
    last dim, a view into heads, a split): views of ``out``."""
    q = out[..., q_start:q_start + heads * (nope + rope_dim)]
    q_nope, q_pe = q.view(*q.shape[:-1], heads, nope + rope_dim).split([nope, rope_dim], dim=-1)
    return q_nope, q_pe


def index_query(out: Tensor, index_start: int, heads: int, dim: int) -> Tensor:
    """The indexer's query [..., heads, dim] in a GEMM's output ``out`` [..., N] from column ``index_start`` (the
    stacked q_b | wq_b GEMM's wq_b part), as the graph takes it (a slice of the last dim, a view into heads)."""
    return out[..., index_start:index_start + heads * dim].view(*out.shape[:-1], heads, dim)


def validate_index_query(x: Tensor, weight: Tensor, index_start: int, heads: int, dim: int) -> None:
    """The indexer's query heads in the GEMM's output (``fp8_linear_latent_query_indexer``): x [N, S, K] (the
    indexer's tokens), ``heads`` heads of ``dim`` <= INDEX_DIM columns from ``index_start``, inside the output."""
    if not isinstance(x, Tensor) or x.dim() != 3:
        raise InputError(f"fp8_linear_latent_query_indexer x: expected [N, S, K] (the indexer's tokens), got "
                         f"{tuple(getattr(x, 'shape', ()))}")
    if heads <= 0 or not 0 < dim <= INDEX_DIM or dim % 2:
        raise InputError(f"fp8_linear_latent_query_indexer index_heads / index_dim: {heads} heads of {dim}, expected "
                         f"heads of an even width in (0, {INDEX_DIM}]")
    if index_start < 0 or index_start + heads * dim > weight.shape[0]:
        raise InputError(f"fp8_linear_latent_query_indexer index_start: the indexer's {heads} heads of {dim} columns "
                         f"from column {index_start} do not fit in the GEMM's {weight.shape[0]} output columns")


def validate_fp8_linear_latent_query(x: Tensor, weight: Tensor, weight_scale_inv: Tensor, bias: Optional[Tensor],
                                     w_uk: Tensor, q_start: int, rope_dim: int, rope_cos: Optional[Tensor],
                                     rope_sin: Optional[Tensor]) -> None:
    """The GEMM's inputs as ``fp8_linear`` checks them, then the query heads' layout in its output, W_UK and the RoPE
    tables as the cached attention ops check them (``paged_steps``), each error naming its argument."""
    ref_fp8.check_linear_inputs(x, weight, weight_scale_inv, bias)
    if not isinstance(w_uk, Tensor) or w_uk.dim() != 3 or not w_uk.is_floating_point() or w_uk.device != x.device:
        raise InputError(f"fp8_linear_latent_query w_uk: expected a floating-point [H, nope, R] tensor on x's device, "
                         f"got {getattr(w_uk, 'dtype', type(w_uk))} {tuple(getattr(w_uk, 'shape', ()))}")
    heads, nope, rank = w_uk.shape
    if rank > KV_LORA_RANK:
        raise InputError(f"fp8_linear_latent_query w_uk: {rank} latent columns exceed the cache layout's "
                         f"{KV_LORA_RANK}")
    if not 0 < rope_dim <= ROPE_DIM or rope_dim % 2:
        raise InputError(f"fp8_linear_latent_query rope_dim: {rope_dim}, expected an even width in (0, {ROPE_DIM}]")
    n = weight.shape[0]
    if q_start < 0 or q_start + heads * (nope + rope_dim) > n:
        raise InputError(f"fp8_linear_latent_query q_start: the {heads} query heads of {nope} + {rope_dim} columns "
                         f"from column {q_start} do not fit in the GEMM's {n} output columns")
    if (rope_cos is None) != (rope_sin is None):
        raise InputError("fp8_linear_latent_query rope_cos / rope_sin: give both or neither")
    if rope_cos is not None:
        for name, t in (("rope_cos", rope_cos), ("rope_sin", rope_sin)):
            if (not isinstance(t, Tensor) or t.dtype != torch.float32 or t.device != x.device
                    or tuple(t.shape) != (*x.shape[:-1], rope_dim // 2)):
                raise InputError(f"fp8_linear_latent_query {name}: expected float32 {(*x.shape[:-1], rope_dim // 2)} "
                                 f"on x's device (the tokens', half of rope_dim), got "
                                 f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}")


def pad_last(x: Tensor, width: int) -> Tensor:
    """``x`` zero-padded on its last dim to ``width``."""
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def latent_query(q_nope, w_uk, q_pe, rope=None) -> torch.Tensor:
    """``[q_nope . W_UK | q_pe]`` [T, H, 576] per head in q_nope's dtype: q_nope [T, H, D] times W_UK [H, D, <=512],
    q_pe [T, H, <=64] rotated (``rope`` = (cos, sin) [T, DR/2]), each part zero-padded to 512 / 64.

    The product runs in the model's dtype, not float32: a bf16 model's MLA kernels take bf16 queries (the Hopper
    kernel only those), as every MLA serving kernel does (float32 accumulation, one rounding: a batched GEMM on
    tensor cores, the constant W_UK never converted per call); float32 models stay exact."""
    q_abs = torch.einsum("thd,hdr->thr", q_nope, w_uk.to(q_nope.dtype))
    if rope is not None:
        q_pe = ref_norm_rope.rope_interleaved(q_pe, *rope)
    return torch.cat([pad_last(q_abs, KV_LORA_RANK), pad_last(q_pe.to(q_abs.dtype), ROPE_DIM)], dim=-1)


def fp8_linear_latent_query(x: Tensor, weight: Tensor, weight_scale_inv: Tensor, bias: Optional[Tensor],
                            act_quant: bool, w_uk: Tensor, q_start: int, rope_dim: int,
                            rope_cos: Optional[Tensor] = None, rope_sin: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """The q_b (| wq_b) GEMM and the latent query of its query heads, as the chain it replaces computes them:
    ``out = fp8_linear(x, weight, ...)`` (contiguous, as the op returns it), then the cached attention ops' latent
    query ``[q_nope . W_UK | rope(q_pe)]`` of :func:`query_heads` of it (:func:`latent_query` over the tokens
    flattened, as ``paged_steps`` flattens them). Returns (out [..., N], the latent query [..., H, 576])."""
    validate_fp8_linear_latent_query(x, weight, weight_scale_inv, bias, w_uk, q_start, rope_dim, rope_cos, rope_sin)
    out = ref_fp8.fp8_linear(x, weight, weight_scale_inv, bias, act_quant).contiguous()
    q_nope, q_pe = query_heads(out, q_start, w_uk.shape[0], w_uk.shape[1], rope_dim)
    lead = q_nope.shape[:-2]
    tokens = q_nope.shape[:-2].numel()
    rope = None if rope_cos is None else (rope_cos.reshape(tokens, -1), rope_sin.reshape(tokens, -1))
    q = latent_query(q_nope.reshape(tokens, *q_nope.shape[-2:]), w_uk, q_pe.reshape(tokens, *q_pe.shape[-2:]),
                           rope)
    return out, q.view(*lead, *q.shape[1:])
