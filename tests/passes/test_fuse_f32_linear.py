"""fuse_f32_linear: the router's and the indexer head weights' float32 GEMV with its scalar multiplies ->
fxglm5::f32_linear (tests/passes/template.py's checks; near misses: a bias, an input not cast to float32, a tensor
scale, logits read by something other than the router)."""

import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import randomize_
from tests.passes.template import PassTemplate, export_small, small_dims

# per tiny model (4 indexed layers, 3 MoE): 7 GEMVs; their casts (x and the weight) and the head weights' 2 scales
SEVEN = {"aten.linear": -7, "aten.mul": -8, "aten.to": -11, "fxglm5.f32_linear": 7}
SHARED = {"aten.linear": -5, "aten.mul": -4, "aten.to": -7, "fxglm5.f32_linear": 5}  # layers 1 and 3: no indexer


class Router(nn.Module):
    """GLM-5's router: float32 logits of x.float() scaled twice, then ``fxglm5::moe_route``; ``variant`` makes a near
    miss: a bias ("bias"), x used as it comes ("uncast"), scaled by a tensor ("tensor_scale"), the logits returned
    too ("read_twice"). One output: the weights times (ids + 1)."""

    def __init__(self, hidden=64, experts=16, variant=None):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, hidden), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(experts), requires_grad=False)
        self.scale = nn.Parameter(torch.full((1,), 0.5), requires_grad=False)
        self.variant = variant

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        flat = flat if self.variant == "uncast" else flat.float()
        logits = F.linear(flat, self.weight, self.bias if self.variant == "bias" else None) * 0.5
        logits = logits * (self.scale if self.variant == "tensor_scale" else 0.25)
        weights, ids = torch.ops.fxglm5.moe_route(logits, self.bias, 2, 1, 1, True, 2.5)
        out = weights * (ids + 1)
        return out + logits[:, :2] if self.variant == "read_twice" else out


def _x(batch=2, seq=5, dtype=torch.float32):
    return torch.randn(batch, seq, 64, generator=torch.Generator().manual_seed(batch * seq)).to(dtype)


class TestFuseF32Linear(PassTemplate):
    name = "fuse_f32_linear"
    matches = {"fp8": 7, "shared": 5, "bf16": 7, "bf16ckpt": 7}
    ops = {"fp8": SEVEN, "shared": SHARED, "bf16ckpt": SEVEN}
    near_misses = ("bias", "uncast", "tensor_scale", "read_twice")

    def near_miss(self, case):
        module = randomize_(Router(variant=case))
        return export_small(module, (_x(),)), module, (_x(3, 7),), None

    def reexport(self):
        example = (_x(dtype=torch.bfloat16),)
        other = (_x(3, 7, torch.bfloat16),)
        return export_small(randomize_(Router()), example), example, small_dims(example), other, None
