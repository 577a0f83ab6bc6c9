"""match_rms_norm: the RMSNorm chain -> fxglm5::rms_norm (tests/passes/template.py's checks)."""

import torch

from fxglm5.model.layers import RMSNorm
from tests.helpers import randomize_
from tests.passes.template import PassTemplate, export_small, small_dims

# one norm: x.float(), pow, mean, add eps, rsqrt, mul, .to(dtype), mul by the weight; export keeps 26 of the 34
# casts of the 17 float32 norms (4 a layer + the final one)
NORMS_OPS = {"aten.add": -17, "aten.mean": -17, "aten.mul": -34, "aten.pow": -17, "aten.rsqrt": -17, "aten.to": -26,
             "fxglm5.rms_norm": 17}


class NearMissNorm(RMSNorm):
    """RMSNorm's chain but for one thing: Gemma's ``(1 + weight)`` scale ("gemma"), or the mean over the tokens
    instead of the features ("token_axis")."""

    def __init__(self, dim, variant):
        super().__init__(dim, 1e-6, torch.float32)
        self.variant = variant

    def forward(self, x):
        xf = x.to(torch.float32)
        axis = 1 if self.variant == "token_axis" else -1
        xf = xf * torch.rsqrt(xf.pow(2).mean(axis, keepdim=True) + self.eps)
        weight = 1 + self.weight if self.variant == "gemma" else self.weight
        return weight * xf.to(x.dtype)


def _x(batch=2, seq=5):
    return torch.randn(batch, seq, 64, generator=torch.Generator().manual_seed(batch * seq))


class TestMatchRmsNorm(PassTemplate):
    name = "match_rms_norm"
    matches = {"fp8": 17, "shared": 17, "bf16": 17}
    ops = {"fp8": NORMS_OPS, "shared": NORMS_OPS}
    near_misses = ("gemma", "token_axis")

    def near_miss(self, case):
        module = randomize_(NearMissNorm(64, case))
        return export_small(module, (_x(),)), module, (_x(3, 7),), None

    def reexport(self):
        example = (_x(),)
        return export_small(randomize_(RMSNorm(64, 1e-6, torch.float32)), example), example, small_dims(example), \
            (_x(3, 7),), None
