"""match_rope: interleaved RoPE, whole or on the first features -> fxglm5::rope_interleaved (tests/passes/template.py's
checks)."""

import torch
from torch import nn

from fxglm5.model.layers import apply_rope_interleaved, rope_cos_sin
from tests.passes.template import PassTemplate, export_small, small_dims


def _ropes_ops(ropes: int, partial: int) -> dict[str, int]:
    """One whole RoPE: 2 strided slices, 2 unsqueezes (cos, sin), 4 muls, sub, add, stack, flatten, 2 casts; a
    partial one (the indexer's) also splits off and concatenates the features it does not rotate."""
    return {"aten.add": -ropes, "aten.cat": -partial, "aten.flatten": -ropes, "aten.mul": -4 * ropes,
            "aten.slice": -2 * ropes, "aten.split_with_sizes": -partial, "aten.stack": -ropes, "aten.sub": -ropes,
            "aten.to": -2 * ropes, "aten.unsqueeze": -2 * ropes, "fxglm5.rope_interleaved": ropes,
            "getitem": -2 * partial}


class NearMissRope(nn.Module):
    """RoPE in another layout: "half_split" rotates (x[i], x[i + d/2]) (the rotate-half layout of
    ``rope_interleave: false``); "inverse" turns the interleaved pairs by minus the angle."""

    def __init__(self, variant):
        super().__init__()
        self.variant = variant

    def forward(self, x, cos, sin):
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
        xf = x.to(torch.float32)
        if self.variant == "half_split":
            x1, x2 = xf.chunk(2, dim=-1)
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        return torch.stack((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1).flatten(-2).to(x.dtype)


class Rope(nn.Module):
    def forward(self, x, cos, sin):
        return apply_rope_interleaved(x, cos, sin)


def _args(batch=2, seq=5, heads=3, dim=16):
    gen = torch.Generator().manual_seed(batch * seq)
    cos, sin = rope_cos_sin(torch.arange(seq)[None].expand(batch, seq) + 2, dim, 10000.0)
    return torch.randn(batch, seq, heads, dim, generator=gen), cos, sin


class TestMatchRope(PassTemplate):
    name = "match_rope"
    # q and k of MLA in each of the 4 layers, and of each layer's own indexer (whose rotation is partial)
    matches = {"fp8": 16, "shared": 12, "bf16": 16}
    ops = {"fp8": _ropes_ops(16, 8), "shared": _ropes_ops(12, 4)}
    near_misses = ("half_split", "inverse")

    def near_miss(self, case):
        module = NearMissRope(case)
        return export_small(module, _args()), module, _args(3, 7), None

    def reexport(self):
        return export_small(Rope(), _args()), _args(), small_dims(_args()), _args(3, 7), None
