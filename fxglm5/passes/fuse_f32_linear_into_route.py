"""fuse_f32_linear_into_route: the router's float32 logits and their routing -> ``fxglm5::moe_router``.

Why: a decode MoE layer ran its router as two kernels, the float32 GEMV of ``f32_linear`` and the route kernel of
``moe_route`` (``moe_route_local`` under expert parallelism) over the [T, E] logits the GEMV wrote. One op lets
the GEMV's last CTA route the rows it has just finished (``lowering.triton.moe.moe_router``): one launch and its
gap fewer per MoE layer at decode.

Matched: ``moe_route(f32_linear(x, W, []), ...)`` or ``moe_route_local(f32_linear(x, W, []), ...)``, the logits
read by that router only. Left alone: logits read by anything else too (they would have to be written anyway),
logits scaled in the f32_linear (no router's). Exact: the reference is f32_linear followed by the same router.
Runs after fuse_f32_linear (which makes the f32_linear) and fuse_local_experts_into_route (which makes the
moe_route_local this pass folds as well).
"""

from __future__ import annotations

import torch
from torch import fx

from fxglm5.passes.graph_utils import is_op, op_args, replace_with_call, rewrite_each
from fxglm5.passes.manager import PassOutcome
from fxglm5.passes.registry import register_pass


def expected_routers(ctx) -> int:
    """Each MoE layer's router, where fuse_f32_linear made its logits an f32_linear (n_group 1)."""
    cfg = ctx.config
    return sum(cfg.is_moe_layer(i) and cfg.n_group == 1 for i in range(cfg.num_hidden_layers))


@register_pass("fuse_kernels", expected=expected_routers)
def fuse_f32_linear_into_route(gm: fx.GraphModule, ctx) -> PassOutcome:
    def fuse(route: fx.Node) -> bool:
        args = op_args(route)
        logits = args["logits"]
        if not is_op(logits, torch.ops.fxglm5.f32_linear.default) or len(logits.users) != 1:
            return False
        linear = op_args(logits)
        if linear["scales"]:
            return False
        replace_with_call(gm, route, torch.ops.fxglm5.moe_router.default,
                          (linear["x"], linear["weight"], args["correction_bias"], args["top_k"], args["n_group"],
                           args["topk_group"], args["renormalize"], args["scaling"], args.get("expert_offset"),
                           args.get("num_local", 0)))
        return True

    return PassOutcome(sum(rewrite_each(gm, fuse, op.default)
                           for op in (torch.ops.fxglm5.moe_route, torch.ops.fxglm5.moe_route_local)))
