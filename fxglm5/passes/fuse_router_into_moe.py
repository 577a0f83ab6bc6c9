"""fuse_router_into_moe: ``moe_fp8_shared(x, ids, weights, ...)`` whose ids and weights are ``moe_router(x, ...)``'s
-> ``fxglm5::moe_router_fp8_shared(x, router's arguments, experts' arguments)``.

Why: a decode MoE layer ran its router as one launch and its experts as two (gate|up with the shared expert's
gate|up as extra CTAs, then down with the shared down and the combine): three launches and two gaps where issue 45
(item 4) asks for at most two. The gate|up GEMMs cannot start before the routing says which experts they stream,
so the two meet in one launch only with a dependency inside it: the Triton op (``lowering.triton.moe
.moe_router_fp8``) runs the router's tiles, the shared expert's gate|up and the routed gate|up as tasks of one
launch, the routed ones waiting for the routing (``lowering.triton.tasks``), each with its own launch's tile
function, so its bits. Past the router's one-launch rows (prefill) or with group-limited routing the op runs the
router's launches and then the MoE's, as before.

Matched: an ``fxglm5::moe_fp8_shared`` whose ids are item 1 and weights item 0 of one ``fxglm5::moe_router`` of the
MoE's own tokens (the same node through aliases and casts to its own dtype), those items read by that MoE only and
the router's output by those items only. Left alone: routing read elsewhere too (it must be written anyway), a
router of other tokens, ids and weights of two routers, a MoE without a shared expert. Exact: the reference is the
chain it replaces.
Runs after fuse_f32_linear_into_route (the router one op) and fuse_shared_expert_into_moe (the MoE one op).
"""

from __future__ import annotations

import torch
from torch import fx

from fxglm5.passes import fuse_shared_expert_into_moe
from fxglm5.passes.graph_utils import getitem_of, is_op, op_args, replace_with_call, rewrite_each, through
from fxglm5.passes.manager import PassOutcome
from fxglm5.passes.registry import register_pass


def expected_fusions(ctx) -> int:
    """Each MoE layer fuse_shared_expert_into_moe fused: its router is a moe_router there (n_group 1)."""
    return fuse_shared_expert_into_moe.expected_fusions(ctx)


def _router(moe: fx.Node) -> fx.Node | None:
    """The moe_router whose outputs are ``moe``'s ids and weights and nothing else's, routing ``moe``'s tokens."""
    args = op_args(moe)
    router = getitem_of(args["ids"], 1)
    if (router is None or router is not getitem_of(args["weights"], 0)
            or not is_op(router, torch.ops.fxglm5.moe_router.default)):
        return None
    if set(router.users) != {args["ids"], args["weights"]} or any(set(item.users) != {moe} for item in router.users):
        return None
    return router if through(op_args(router)["x"]) is through(args["x"]) else None


@register_pass("fuse_kernels", expected=expected_fusions)
def fuse_router_into_moe(gm: fx.GraphModule, ctx) -> PassOutcome:
    def fuse(moe: fx.Node) -> bool:
        router = _router(moe)
        if router is None:
            return False
        experts = {name: value for name, value in op_args(moe).items() if name not in ("ids", "weights")}
        routing = {name: value for name, value in op_args(router).items() if name != "x"}
        x = experts.pop("x")
        replace_with_call(gm, moe, torch.ops.fxglm5.moe_router_fp8_shared.default,
                          (x, *routing.values(), *experts.values()))
        return True

    return PassOutcome(rewrite_each(gm, fuse, torch.ops.fxglm5.moe_fp8_shared.default))
