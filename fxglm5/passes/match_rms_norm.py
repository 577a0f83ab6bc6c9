"""match_rms_norm: the RMSNorm chain -> ``fxglm5::rms_norm``.

``weight * (xf * rsqrt(mean(xf^2, -1) + eps)).to(dtype)`` with ``xf = x.float()`` is eight ATen kernels
(casts, pow, mean, add, rsqrt, two muls) and three float32 copies of the activation; as one op it is one
kernel that reads x once, and ``fuse_norm_rope_into_cache_writes`` can fold it into the latent cache write.
GLM-5 has four per layer (input, post-attention, q_a, kv_a) and the final norm.
"""

from __future__ import annotations

import torch
from torch import fx

from fxglm5.passes.graph_utils import (
    aten, const_float, dtype_of, float32_source, is_cast, is_op, replace_with_call, shape_of, through,
)
from fxglm5.passes.manager import PassOutcome
from fxglm5.passes.registry import register_pass



def expected_norms(ctx) -> int:
    return 4 * ctx.config.num_hidden_layers + 1


def _match(anchor: fx.Node) -> tuple | None:
    """(x, weight, eps) when ``anchor`` is the RMSNorm's final ``weight * normed``."""
    if not is_op(anchor, aten.mul.Tensor) or len(anchor.args) != 2:
        return None
    for weight, normed in (anchor.args, anchor.args[::-1]):
        if not isinstance(weight, fx.Node) or weight.op != "get_attr" or len(shape_of(weight) or ()) != 1:
            continue
        scaled = through(normed)
        if is_cast(scaled):
            scaled = through(scaled.args[0])
        if not is_op(scaled, aten.mul.Tensor):
            continue
        for xf, rsqrt in (scaled.args, scaled.args[::-1]):
            if not is_op(rsqrt, aten.rsqrt.default) or not is_op(rsqrt.args[0], aten.add.Tensor):
                continue
            mean, eps = rsqrt.args[0].args
            if const_float(eps) is None or not is_op(mean, aten.mean.dim) or list(mean.args[1]) not in ([-1],):
                continue
            keepdim = mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)
            square = mean.args[0]
            if not keepdim or not is_op(square, aten.pow.Tensor_Scalar) or square.args[1] != 2 or square.args[0] is not xf:
                continue
            x = float32_source(xf)
            if x is None or dtype_of(x) != dtype_of(anchor) or dtype_of(weight) != dtype_of(anchor):
                continue
            if shape_of(weight)[0] != shape_of(x)[-1]:
                continue
            return x, weight, const_float(eps)
    return None


@register_pass("match", expected=expected_norms)
def match_rms_norm(gm: fx.GraphModule, ctx) -> PassOutcome:
    op = torch.ops.fxglm5.rms_norm.default
    matches = 0
    for node in list(gm.graph.nodes):
        found = _match(node)
        if found is None:
            continue
        replace_with_call(gm, node, op, found)
        matches += 1
    return PassOutcome(matches)
