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
