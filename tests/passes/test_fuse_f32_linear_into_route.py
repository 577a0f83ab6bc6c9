"""fuse_f32_linear_into_route: the router's float32 logits (``f32_linear``) and the ``moe_route`` reading them ->
fxglm5::moe_router (tests/passes/template.py's checks; near misses: logits scaled, logits read by something else
too, logits of an aten linear). Under expert parallelism the ``moe_route_local`` router:
tests/parallel/test_fuse_f32_linear_into_route.py."""

import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import randomize_
from tests.passes.template import PassTemplate, export_small, run_one, small_dims

# per tiny model: 3 MoE layers, each router's f32_linear and moe_route -> one moe_router
THREE = {"fxglm5.f32_linear": -3, "fxglm5.moe_route": -3, "fxglm5.moe_router": 3}


class Router(nn.Module):
    """GLM-5's router: float32 logits of x.float(), then ``fxglm5::moe_route``; ``variant`` makes a near miss: the
    logits scaled by 0.5 ("scaled": an f32_linear with a scale), the logits' row sums added to the output
    ("read_twice"). One output: the weights times (ids + 1)."""

    def __init__(self, hidden=64, experts=16, variant=None):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(experts, hidden), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(experts), requires_grad=False)
        self.variant = variant

    def forward(self, x):
        logits = F.linear(x.reshape(-1, x.shape[-1]).float(), self.weight)
        if self.variant == "scaled":
            logits = logits * 0.5
        weights, ids = torch.ops.fxglm5.moe_route(logits, self.bias, 2, 1, 1, True, 2.5)
        out = weights * (ids + 1)
        return out + logits.sum(-1, keepdim=True) if self.variant == "read_twice" else out


def _x(batch=2, seq=5, dtype=torch.float32):
    return torch.randn(batch, seq, 64, generator=torch.Generator().manual_seed(batch * seq)).to(dtype)


def _with_f32_linear(module, example):
    """``module``'s graph as this pass receives it: its router GEMV already an f32_linear. The "read_twice" variant
    is built from the plain router's (fuse_f32_linear leaves logits with another reader alone): the f32_linear's
    row sums added to the output afterwards."""
    read_twice = module.variant == "read_twice"
    if read_twice:
        module.variant = None
    gm = export_small(module, example)
    assert run_one(gm, "fuse_f32_linear").num_matches == 1
    if read_twice:
        module.variant = "read_twice"
        linear = next(n for n in gm.graph.nodes if n.target is torch.ops.fxglm5.f32_linear.default)
        output = gm.graph.output_node()
        out = output.args[0][0]
        with gm.graph.inserting_before(output):
            total = gm.graph.call_function(torch.ops.aten.sum.dim_IntList, (linear, [-1], True))
            both = gm.graph.call_function(torch.ops.aten.add.Tensor, (out, total))
        output.args = ((both, *output.args[0][1:]),)
        gm.recompile()
    return gm


class TestFuseF32LinearIntoRoute(PassTemplate):
    name = "fuse_f32_linear_into_route"
    matches = {"fp8": 3, "shared": 3, "bf16": 3, "bf16ckpt": 3}
    ops = {"fp8": THREE, "shared": THREE, "bf16": THREE, "bf16ckpt": THREE}
    near_misses = ("scaled", "read_twice", "aten_linear")

    def near_miss(self, case):
        """The variants of :class:`Router`, and "aten_linear": logits the graph's own cast and linear compute
        (fuse_f32_linear has not run), no f32_linear."""
        module = randomize_(Router(variant=None if case == "aten_linear" else case))
        gm = export_small(module, (_x(),)) if case == "aten_linear" else _with_f32_linear(module, (_x(),))
        return gm, module, (_x(3, 7),), None

    def reexport(self):
        example = (_x(dtype=torch.bfloat16),)
        other = (_x(3, 7, torch.bfloat16),)
        return _with_f32_linear(randomize_(Router()), example), example, small_dims(example), other, None

