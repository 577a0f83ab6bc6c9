"""fuse_f32_linear: ``linear(x.float(), W) * s1 * s2 ...`` over a float32 weight constant -> ``fxglm5::f32_linear``.

Why: the MoE router (``F.linear(x.float(), gate.weight.float())``) and the DSA indexer's head weights
(``weights_proj(x.float()) * n_heads**-0.5 * softmax_scale``) ran as a cast kernel, a cuBLAS float32 GEMV (SIMT
SGEMM at batch 64: 117 us per 8 layers on an H200) and one kernel per scalar multiply. One op reads x in its own
dtype, computes the float32 products and applies the scales in the kernel's epilogue.

Matched: ``aten.linear(cast(x, float32), W, bias=None)`` with W a float32 constant (through no-op casts), and the
chain of ``aten.mul.Tensor(., python scalar)`` that is its only use, scale by scale, where the result is read by the
router (``moe_route``) or the indexer (``rtp_indexer`` / ``indexer_topk``) only. Left alone: a linear with a bias,
over a weight that is not a constant, over an input the graph did not cast to float32 (the bf16 lm_head), or read by
anything else (a float32 model's other GEMMs, which are no GEMVs at prefill). Exact: the reference is the same cast,
linear and multiplies, in the same order.
"""

from __future__ import annotations

import torch
from torch import fx

from fxglm5.passes.graph_utils import (
    aten, const_float, dtype_of, is_cast, is_op, op_args, replace_with_call, rewrite_each, through,
)
from fxglm5.passes.manager import PassOutcome
from fxglm5.passes.registry import register_pass


READERS = ("moe_route", "rtp_indexer", "indexer_topk")  # the fxglm5 ops the router logits / head weights feed


def expected_linears(ctx) -> int:
    """Each layer's router (a MoE layer whose router fuse_fp8_moe fused: n_group 1) and indexer head weights (a
    layer with its own indexer)."""
    cfg = ctx.config
    return sum((cfg.is_moe_layer(i) and cfg.n_group == 1) + cfg.has_indexer(i) for i in range(cfg.num_hidden_layers))


def _read_by_router_or_indexer(node: fx.Node) -> bool:
    readers = [getattr(torch.ops.fxglm5, name).default for name in READERS]
    return bool(node.users) and all(is_op(user, *readers) for user in node.users)


def _scales(linear: fx.Node) -> tuple[fx.Node, list[float]]:
    """The last node of the scalar multiplies that are ``linear``'s only use, one after the other, and their
    scalars."""
    end, scales = linear, []
    while len(end.users) == 1:
        user = next(iter(end.users))
        scale = const_float(op_args(user)["other"]) if is_op(user, aten.mul.Tensor) else None
        if scale is None or op_args(user)["self"] is not end:
            break
        end, scales = user, scales + [scale]
    return end, scales


@register_pass("fuse_kernels", expected=expected_linears)
def fuse_f32_linear(gm: fx.GraphModule, ctx) -> PassOutcome:
    def fuse(linear: fx.Node) -> bool:
        args = op_args(linear)
        cast, weight = args["input"], through(args["weight"])
        if (args["bias"] is not None or not is_cast(cast) or dtype_of(cast) != torch.float32
                or not isinstance(weight, fx.Node) or weight.op != "get_attr" or dtype_of(weight) != torch.float32):
            return False
        end, scales = _scales(linear)
        if not _read_by_router_or_indexer(end):
            return False
        replace_with_call(gm, end, torch.ops.fxglm5.f32_linear.default, (op_args(cast)["self"], weight, scales))
        return True

    return PassOutcome(rewrite_each(gm, fuse, aten.linear.default))
