"""fuse_silu_mul_into_down: fp8_linear(silu(gate) * up) -> fxglm5::silu_mul_fp8_linear (tests/passes/template.py's
checks; near misses: another activation, a product read twice, operands that broadcast, gate and up of different
dtypes)."""

import torch
import torch.nn.functional as F
from torch import nn

from fxglm5.model.layers import Linear
from fxglm5.passes import PassContext, run_pipeline
from tests.helpers import randomize_
from tests.passes.template import PassTemplate, export_small, small_dims

# per tiny FP8 model: the dense MLP of layer 0 and the shared experts of layers 1-3
FOUR = {"aten.mul": -4, "aten.silu": -4, "fxglm5.fp8_linear": -4, "fxglm5.silu_mul_fp8_linear": 4}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) over FP8 weights; ``variant`` makes a near miss: gelu instead of silu ("gelu"), the
    product also returned ("read_twice"), up of one feature broadcast over the gate's ("broadcast"), the gate rounded
    to bf16 while up stays float32 ("dtypes": the product promotes, which the fused kernel's one operand dtype cannot
    say)."""

    def __init__(self, hidden=256, inter=128, variant=None):
        super().__init__()
        self.gate, self.down = Linear(hidden, inter, True, torch.float32), Linear(inter, hidden, True, torch.float32)
        self.up = Linear(hidden, 1 if variant == "broadcast" else inter, True, torch.float32)
        self.variant = variant

    def forward(self, x):
        act = F.gelu if self.variant == "gelu" else F.silu
        gate = self.gate(x)
        h = act(gate.to(torch.bfloat16) if self.variant == "dtypes" else gate) * self.up(x)
        out = self.down(h)
        return out + h.sum(-1, keepdim=True) if self.variant == "read_twice" else out


def _x(batch=2, seq=5):
    return torch.randn(batch, seq, 256, generator=torch.Generator().manual_seed(batch * seq))


def fused_graph(module):
    """``module``'s graph through the fuse stage (its linears FP8 GEMMs), as this pass receives it."""
    gm = export_small(module, (_x(),))
    run_pipeline(gm, PassContext(), stages=("fuse",))
    return gm


class TestFuseSiluMulIntoDown(PassTemplate):
    name = "fuse_silu_mul_into_down"
    matches = {"fp8": 4, "shared": 4, "bf16": 4, "bf16ckpt": 0}
    ops = {"fp8": FOUR, "shared": FOUR, "bf16": FOUR, "bf16ckpt": {}}
    near_misses = ("gelu", "read_twice", "broadcast", "dtypes")

    def near_miss(self, case):
        module = randomize_(GatedMLP(variant=case))
        return fused_graph(module), module, (_x(3, 7),), None

    def reexport(self):
        example = (_x(),)
        return fused_graph(randomize_(GatedMLP())), example, small_dims(example), (_x(3, 7),), None
