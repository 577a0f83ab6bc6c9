"""The building blocks of GLM-5 in plain, export-friendly PyTorch.

Everything here is written as ordinary tensor math with no data-dependent Python control flow: this
generic form is what torch.export captures and what the passes in ``fxglm5.passes`` recognise and rewrite.
FP8 weights stay float8_e4m3fn tensors with a float32 ``weight_scale_inv`` per 128x128 block and are
dequantized inside ``forward``: the compiler later folds that dequantization into its GEMMs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fxglm5.contracts import FP8_BLOCK

FP8_DTYPE = torch.float8_e4m3fn


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def dequantize_weight(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """W = weight * scale_inv per 128x128 block (leading batch dims allowed), in ``dtype``.

    Written as broadcast-multiply over a [.., nb, 128, kb, 128] view of the padded weight so the
    captured graph is a short, recognisable chain (to_copy, mul, view/slice) for fuse_fp8_* to match.
    """
    *lead, n, k = weight.shape
    nb, kb = scale_inv.shape[-2], scale_inv.shape[-1]
    scale = scale_inv[..., :, None, :, None].expand(*lead, nb, FP8_BLOCK, kb, FP8_BLOCK)
    scale = scale.reshape(*lead, nb * FP8_BLOCK, kb * FP8_BLOCK)[..., :n, :k]
    return (weight.to(torch.float32) * scale).to(dtype)


def dequantize_gate_up(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A stacked gate|up weight [.., 2I, K] whose halves are blocked on their own (scales
    [.., 2 * ceil(I/128), kb], see ``fxglm5.model.layout.scale_shape``): each half dequantized as one
    weight. When I is not a multiple of 128 a block never spans the gate / up boundary."""
    *lead, two_i, k = weight.shape
    halves = dequantize_weight(weight.reshape(*lead, 2, two_i // 2, k),
                               scale_inv.reshape(*lead, 2, scale_inv.shape[-2] // 2, scale_inv.shape[-1]), dtype)
    return halves.reshape(weight.shape)


class Linear(nn.Module):
    """A bias-free linear layer, FP8 block-quantized (weight + weight_scale_inv) or plain."""

    def __init__(self, in_features: int, out_features: int, fp8: bool, dtype: torch.dtype, device=None):
        super().__init__()
        self.in_features, self.out_features, self.fp8 = in_features, out_features, fp8
        if fp8:
            self.weight = nn.Parameter(
                torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device), requires_grad=False
            )
            self.weight_scale_inv = nn.Parameter(
                torch.empty(ceil_div(out_features, FP8_BLOCK), ceil_div(in_features, FP8_BLOCK), dtype=torch.float32, device=device),
                requires_grad=False,
            )
        else:
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device), requires_grad=False)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        if self.fp8:
            return dequantize_weight(self.weight, self.weight_scale_inv, dtype)
        return self.weight.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized_weight(x.dtype))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_cos_sin(position_ids: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [B, S, dim/2] in float32 for the default (non-YaRN) RoPE."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=position_ids.device) / dim))
    angles = position_ids.to(torch.float32)[..., None] * inv_freq
    return angles.cos(), angles.sin()


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) by angle i; x [B, S, heads, d], cos/sin [B, S, d/2].

    The output keeps the interleaved layout (unlike transformers, which de-interleaves; dot products
    are identical), so the cached k_pe and the query use one layout end to end.
    """
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    xf = x.to(torch.float32)
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.flatten(-2).to(x.dtype)


class MLP(nn.Module):
    """SiLU-gated MLP: down(silu(gate(x)) * up(x)); dense layers and the shared expert."""

    def __init__(self, hidden: int, inter: int, fp8: bool, dtype: torch.dtype, device=None):
        super().__init__()
        self.gate_proj = Linear(hidden, inter, fp8, dtype, device)
        self.up_proj = Linear(hidden, inter, fp8, dtype, device)
        self.down_proj = Linear(inter, hidden, fp8, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
