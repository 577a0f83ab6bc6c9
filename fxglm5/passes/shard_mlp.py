"""shard_mlp: every dense MLP (``down(silu(gate(x)) * up(x))``) split over its intermediate features: gate / up by
row, down by column, then one ``fxglm5::all_reduce`` of down's partial sums.

The shared expert of a MoE layer has the same form, but its output is summed with the routed experts' before
anything reads it: shard_moe_experts splits it with the experts and reduces the two with one collective. Keeping
that in one pass means any subset of the shard passes still leaves a correct program (a shared expert split here
without the merge's all-reduce would be summed by nobody).
"""

from __future__ import annotations

import torch
from torch import fx

from fxglm5.passes.graph_utils import is_op, op_args, through_casts
from fxglm5.passes.manager import PassOutcome
from fxglm5.passes.registry import register_pass
from fxglm5.passes.sharding import gated_mlp, reduce_after, shard_each, split_mlp

aten = torch.ops.aten


def expected_dense_mlps(ctx) -> int:
    cfg = ctx.config
    return sum(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)) if ctx.mapping.world > 1 else 0


def merged_with_moe(node: fx.Node) -> bool:
    """Whether ``node`` (an MLP's output) is added to a routed-experts output (it is a shared expert)."""
    for user in node.users:
        if is_op(user, aten.add.Tensor):
            other = [a for a in (op_args(user)["self"], op_args(user)["other"]) if a is not node]
            if other and is_op(through_casts(other[0]), torch.ops.fxglm5.moe_fp8.default):
                return True
    return False


def _shard_one(gm: fx.GraphModule, node: fx.Node, mapping) -> bool:
    mlp = gated_mlp(node)
    if mlp is None or merged_with_moe(node):
        return False
    split_mlp(gm, mlp, mapping)
    reduce_after(gm, node, mapping, "shard_mlp")
    return True


@register_pass("shard", expected=expected_dense_mlps)
def shard_mlp(gm: fx.GraphModule, ctx) -> PassOutcome:
    return PassOutcome(shard_each(gm, ctx, _shard_one))
