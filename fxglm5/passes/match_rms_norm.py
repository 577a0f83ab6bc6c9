"""match_rms_norm: the RMSNorm chain -> ``fxglm5::rms_norm``.

``weight * (xf * rsqrt(mean(xf^2, -1) + eps)).to(dtype)`` with ``xf = x.float()`` is eight ATen kernels
(casts, pow, mean, add, rsqrt, two muls) and three float32 copies of the activation; as one op it is one
kernel that reads x once, and ``fuse_norm_rope_into_cache_writes`` can fold it into the latent cache write.
GLM-5 has four per layer (input, post-attention, q_a, kv_a) and the final norm (the MTP layer: enorm, hnorm and
shared_head.norm).
"""

from __future__ import annotations

import torch
from torch import fx

from fxglm5.capture.export import MTP_HEAD
from fxglm5.passes.graph_utils import (
    aten, const_float, dtype_of, float32_source, is_cast, is_op, op_args, replace_with_call, rewrite_each, shape_of,
    through,
)
from fxglm5.passes.manager import PassOutcome
from fxglm5.passes.registry import register_pass



def expected_norms(ctx) -> int:
    """Four per layer and the final norm; the MTP graph has enorm, hnorm and shared_head.norm in its place."""
    return 4 * ctx.config.num_hidden_layers + (3 if ctx.extras.get("head") == MTP_HEAD else 1)


def _operands(node: fx.Node) -> tuple:
    args = op_args(node)
    return args["self"], args["other"]


def _match(anchor: fx.Node) -> tuple | None:
    """(x, weight, eps) when ``anchor`` is the RMSNorm's final ``weight * normed``."""
    if not is_op(anchor, aten.mul.Tensor):
        return None
    for weight, normed in (_operands(anchor), _operands(anchor)[::-1]):
        if not isinstance(weight, fx.Node) or weight.op != "get_attr" or len(shape_of(weight) or ()) != 1:
            continue
        scaled = through(normed)
        if is_cast(scaled):
            scaled = through(op_args(scaled)["self"])
        if not is_op(scaled, aten.mul.Tensor):
            continue
        for xf, rsqrt in (_operands(scaled), _operands(scaled)[::-1]):
            if not is_op(rsqrt, aten.rsqrt.default) or not is_op(op_args(rsqrt)["self"], aten.add.Tensor):
                continue
            shifted = op_args(op_args(rsqrt)["self"])
            mean, eps = shifted["self"], shifted["other"]
            if const_float(eps) is None or shifted["alpha"] != 1 or not is_op(mean, aten.mean.dim):
                continue
            average = op_args(mean)
            if list(average["dim"] or ()) != [-1] or not average["keepdim"] or average["dtype"] is not None:
                continue
            square = average["self"]
            if not is_op(square, aten.pow.Tensor_Scalar) or op_args(square)["exponent"] != 2 or op_args(square)["self"] is not xf:
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

    def rewrite(node: fx.Node) -> bool:
        found = _match(node)
        if found is not None:
            replace_with_call(gm, node, op, found)
        return found is not None

    return PassOutcome(rewrite_each(gm, rewrite))
