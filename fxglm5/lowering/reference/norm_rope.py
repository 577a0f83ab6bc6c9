"""Torch references for the normalizations and the rotary embedding that feed the attention ops.

The rounding points are part of the semantics, because the cached values must not depend on whether the
norm and RoPE run as their own kernels or inside a cache write:

- ``rms_norm``: float32 ``x * rsqrt(mean(x^2) + eps)``, rounded to x's dtype, then times the weight in
  x's dtype (one more rounding) -- GLM-5's (and DeepSeek's) RMSNorm.
- ``layer_norm``: ``torch.nn.functional.layer_norm`` (float32 statistics, one rounding), the indexer's key norm.
- ``rope_interleaved``: the first ``2 * cos.shape[-1]`` features are interleaved pairs ``(x[2i], x[2i+1])``
  rotated by angle i in float32 and rounded to x's dtype; the remaining features pass through unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fxglm5.errors import InputError


def validate_norm(x, weight, eps, bias=None, *, what: str = "rms_norm") -> None:
    """The arguments of an RMSNorm (``bias`` None) or a LayerNorm over x's last dim; errors name ``what``."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise InputError(f"{what} x: expected a floating-point tensor, got {getattr(x, 'dtype', type(x))}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.dim() != 1 or t.shape[0] != x.shape[-1]):
            raise InputError(f"{what} {name}: expected [{x.shape[-1]}], got {tuple(getattr(t, 'shape', ()))}")
    if not eps > 0:
        raise InputError(f"{what} eps: expected > 0, got {eps}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, in x's dtype (see the module docstring for the rounding points)."""
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight.to(x.dtype) * normed


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def validate_rope(x, cos, sin) -> None:
    """x [T, H, D] (or any [..., D] whose leading dims flatten to cos's rows), cos/sin float32 [T, R/2]."""
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() != 2:
            raise InputError(f"rope {name}: expected float32 [tokens, rope_dim / 2], got "
                             f"{getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))}")
    if cos.shape != sin.shape:
        raise InputError(f"rope sin: shape {tuple(sin.shape)} != cos's {tuple(cos.shape)}")
    if 2 * cos.shape[1] > x.shape[-1]:
        raise InputError(f"rope cos: rotates {2 * cos.shape[1]} features but x has only {x.shape[-1]}")
    if x.shape[0] != cos.shape[0]:
        raise InputError(f"rope cos: {cos.shape[0]} rows for {x.shape[0]} tokens")


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` features of x (interleaved pairs); x [T, ..., D], cos/sin [T, R/2]."""
    rot = 2 * cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.reshape(shape), sin.reshape(shape)
    xf = x[..., :rot].float()
    even, odd = xf[..., 0::2], xf[..., 1::2]
    rotated = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat([rotated, x[..., rot:]], dim=-1) if rot < x.shape[-1] else rotated


def flat_rope_args(x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The canonical [B, S, H, D] / [B, S, R/2] rope arguments as [T, H, D] / [T, R/2] (validated)."""
    if x.dim() != 4 or cos.dim() != 3 or tuple(cos.shape[:2]) != tuple(x.shape[:2]):
        raise InputError(f"rope_interleaved: expected x [B, S, H, D] and cos [B, S, R/2], got "
                         f"{tuple(x.shape)} / {tuple(cos.shape)}")
    x, cos, sin = x.flatten(0, 1), cos.flatten(0, 1), sin.flatten(0, 1)
    validate_rope(x, cos, sin)
    return x, cos, sin
