"""Which implementation runs each fxglm5 op on each backend (imported once by the registry).

``reference`` is always the op's own torch implementation (the custom op's default kernel), so every
op has one. Triton and aiter entries carry a ``supports`` check that names why a call is refused.
"""

from __future__ import annotations

import torch

from fxglm5.lowering import registry
from fxglm5.lowering.registry import register


def _cuda_or_interpreted(*tensors) -> str | None:
    import os

    if all(t.is_cuda for t in tensors if isinstance(t, torch.Tensor)) or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return "tensors are not on a CUDA device"


# ---- Triton: block-FP8 GEMM and fused MoE -------------------------------------------------------------
def _fp8_linear_supported(x, weight, scale, bias, act_quant):
    if weight.dtype != torch.float8_e4m3fn:
        return "weight is not e4m3"
    return _cuda_or_interpreted(x, weight)


@register("fp8_linear", "triton", _fp8_linear_supported)
def _fp8_linear_triton(x, weight, scale, bias, act_quant):
    from fxglm5.lowering.triton.fp8_gemm import fp8_linear

    return fp8_linear(x, weight, scale, bias, act_quant)


@register("moe_route", "triton", lambda logits, *rest: _cuda_or_interpreted(logits))
def _moe_route_triton(logits, bias, top_k, n_group, topk_group, renormalize, scaling):
    from fxglm5.lowering.triton.moe import moe_route

    return moe_route(logits, bias, top_k, n_group, topk_group, renormalize, scaling)


def _moe_supported(x, ids, weights, w13, w13_scale, w2, w2_scale, act_quant):
    if w13_scale is None or w2_scale is None:
        return "unquantized expert weights (bf16 checkpoint)"
    return _cuda_or_interpreted(x, w13)


@register("moe_fp8", "triton", _moe_supported)
def _moe_fp8_triton(x, ids, weights, w13, w13_scale, w2, w2_scale, act_quant):
    from fxglm5.lowering.triton.moe import moe_fp8

    return moe_fp8(x, ids, weights, w13, w13_scale, w2, w2_scale, act_quant)


# ---- aiter (ROCm): only where it is importable ------------------------------------------------------
def _aiter_fp8_linear_supported(x, weight, scale, bias, act_quant):
    if not registry.aiter_available():
        return "aiter is not importable"
    if bias is not None or not act_quant:
        return "aiter's block-scale GEMM is W8A8 without bias"
    return None


@register("fp8_linear", "aiter", _aiter_fp8_linear_supported)
def _fp8_linear_aiter(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias, act_quant: bool) -> torch.Tensor:
    """aiter's W8A8 block-scale GEMM: activations quantized 1x128 (our kernel), weights as stored."""
    from aiter.ops.triton.gemm_a8w8_blockscale import gemm_a8w8_blockscale

    from fxglm5.lowering.triton.fp8_gemm import quantize_act_1x128

    lead, k = x.shape[:-1], x.shape[-1]
    xq, xs = quantize_act_1x128(x.reshape(-1, k))
    out = gemm_a8w8_blockscale(xq, weight, xs, scale, dtype=x.dtype)
    return out.view(*lead, weight.shape[0])


# ---- Triton: RMSNorm and RoPE -------------------------------------------------------------------------
def _norm_supported(x, weight, eps):
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"x is {x.dtype}"
    return _cuda_or_interpreted(x, weight)


@register("rms_norm", "triton", _norm_supported)
def _rms_norm_triton(x, weight, eps):
    from fxglm5.lowering.triton.norm_rope import rms_norm

    return rms_norm(x, weight, eps)


def _rope_supported(x, cos, sin):
    if x.shape[-1] % 2:
        return f"an odd feature count ({x.shape[-1]})"
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"x is {x.dtype}"
    return _cuda_or_interpreted(x, cos, sin)


@register("rope_interleaved", "triton", _rope_supported)
def _rope_triton(x, cos, sin):
    from fxglm5.lowering.triton.norm_rope import rope_interleaved
    from fxglm5.lowering.reference.norm_rope import flat_rope_args

    return rope_interleaved(*flat_rope_args(x, cos, sin), validate=False).view(x.shape)


# ---- Triton: the cached RTP attention ops (paged caches) -------------------------------------------
def _paged_supported(cache_arg: int):
    def check(*args):
        cache = args[cache_arg]
        return _cuda_or_interpreted(cache)

    return check


def _indexer_supported(q, k, weights, topk, index_cache, *rest):
    if index_cache.dtype != torch.uint8:
        return "the indexer cache holds compute-dtype keys (exact mode); the Triton indexer reads FP8 rows"
    return _cuda_or_interpreted(index_cache)


@register("rtp_indexer", "triton", _indexer_supported)
def _rtp_indexer_triton(*args):
    from fxglm5.lowering.triton import paged_ops
    from fxglm5.lowering.reference.paged_steps import indexer_step

    return indexer_step(paged_ops, *args)


@register("rtp_sparse_mla", "triton", _paged_supported(8))
def _rtp_sparse_mla_triton(*args):
    from fxglm5.lowering.triton import paged_ops
    from fxglm5.lowering.reference.paged_steps import sparse_mla_step

    return sparse_mla_step(paged_ops, *args)


@register("rtp_mla", "triton", _paged_supported(7))
def _rtp_mla_triton(*args):
    from fxglm5.lowering.triton import paged_ops
    from fxglm5.lowering.reference.paged_steps import mla_step

    return mla_step(paged_ops, *args)
