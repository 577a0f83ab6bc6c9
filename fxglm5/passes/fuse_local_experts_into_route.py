"""fuse_local_experts_into_route: the expert-parallel id glue after ``moe_route`` -> ``fxglm5::moe_route_local``.

Why: under expert parallelism ``shard_moe_experts`` makes the router's ids local to the rank's experts with five
elementwise ops (``where((ids - lo >= 0) & (ids - lo < n), ids - lo, -1)``), five kernels per MoE layer on tensors
of 8 ids per token. The router's own kernel writes the ids, so it can write them local.

Matched: ``where.ScalarOther(bitwise_and(ge(d, 0), lt(d, n)), d, -1)`` with ``d = sub(ids, lo)``, ``ids`` the
ids output of an ``fxglm5::moe_route`` read by that ``sub`` only and ``lo`` a constant. Left alone: another bound
or fill value, ids read elsewhere too. Exact: the reference is moe_route followed by the same glue.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from fxglm5.passes.graph_utils import aten, fake_call, getitem_of, insert_call, is_op, op_args, rewrite_each
from fxglm5.passes.manager import PassOutcome
from fxglm5.passes.registry import register_pass


def expected_routes(ctx) -> int:
    """Each MoE layer when the experts are split by expert over several ranks (``shard_moe_experts``)."""
    cfg, mapping = ctx.config, ctx.mapping
    if mapping.world == 1 or mapping.ep == 1 or cfg.n_group != 1:
        return 0
    return sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))


def _glue(where: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node, int] | None:
    """(the moe_route node, its ids getitem, the offset constant, the local expert count) of the glue ending at
    ``where``, else None."""
    args = op_args(where)
    keep, local = args["condition"], args["self"]
    if args["other"] != -1 or not is_op(keep, aten.bitwise_and.Tensor) or not is_op(local, aten.sub.Tensor):
        return None
    low, high = op_args(keep)["self"], op_args(keep)["other"]
    if not (is_op(low, aten.ge.Scalar) and is_op(high, aten.lt.Scalar)):
        return None
    if op_args(low)["self"] is not local or op_args(high)["self"] is not local or op_args(low)["other"] != 0:
        return None
    count, ids, offset = op_args(high)["other"], op_args(local)["self"], op_args(local)["other"]
    route = getitem_of(ids, 1)
    if (not is_op(route, torch.ops.fxglm5.moe_route.default) or len(ids.users) != 1 or op_args(local)["alpha"] != 1
            or not isinstance(offset, fx.Node) or offset.op != "get_attr" or not isinstance(count, int)):
        return None
    return route, ids, offset, count


@register_pass("fuse_kernels", expected=expected_routes)
def fuse_local_experts_into_route(gm: fx.GraphModule, ctx) -> PassOutcome:
    op = torch.ops.fxglm5.moe_route_local.default

    def fuse(where: fx.Node) -> bool:
        glue = _glue(where)
        if glue is None:
            return False
        route, ids, offset, count = glue
        args = (*op_args(route).values(), offset, count)
        fused = insert_call(gm, where, op, args, fake_call(op, *args))  # after the offset, which follows the router
        weights, local = (insert_call(gm, where, operator.getitem, (fused, i), fused.meta["val"][i]) for i in (0, 1))
        where.replace_all_uses_with(local)
        for user in list(route.users):
            if user is not ids:
                user.replace_all_uses_with(weights)
        return True

    return PassOutcome(rewrite_each(gm, fuse, aten.where.ScalarOther))
