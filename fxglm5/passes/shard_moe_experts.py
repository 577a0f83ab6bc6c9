"""shard_moe_experts: the rank's routed experts and its share of the shared expert, then one all-reduce where the
two are summed.

- The routed experts in ``ep`` groups of tp / ep ranks: the rank's group holds experts [E/ep*g, E/ep*(g+1))
  (w13 / w2 and their scales by expert; at ``ep == 1`` all of them), each split along its intermediate dim over the
  group's ranks (w13's gate and up halves each by row, a ``halves`` Slice, w2 by column, the scales in blocks; at
  ``ep == tp`` whole); in the mixed layout between them each attribute's Slice is the expert range with the rows as
  its ``inner`` part.
- With ``ep > 1`` the router stays whole and its ids become local to the group's experts,
  ``where((ids - lo >= 0) & (ids - lo < E/ep), ids - lo, -1)``: the MoE kernels skip -1. ``lo`` is a constant
  tensor (``experts.expert_offset``, derived, not in the checkpoint) rather than a literal in the code, so every
  rank runs the same program text (``fxglm5.parallel.plan_hash``).
- The shared expert (``down(silu(gate(x)) * up(x))`` added to the routed output) split as a dense MLP.

The routed and shared outputs are both partial sums, so one ``fxglm5::all_reduce`` after their sum stands for
two (all_reduce(A) + all_reduce(B) == all_reduce(A + B)). The router and its correction bias are replicated.
"""

from __future__ import annotations

import functools

import torch
from torch import fx

from fxglm5.passes.graph_utils import add_constant, get_attr_tensor, is_cast, is_op, op_args, set_op_args
from fxglm5.passes.manager import PassOutcome
from fxglm5.passes.registry import register_pass
from fxglm5.passes.sharding import (
    block_part, gated_mlp, mark, reduce_after, shard_attr, shard_each, split_mlp,
)
from fxglm5.parallel import Slice, nested

aten = torch.ops.aten


def expected_moe_layers(ctx) -> int:
    cfg = ctx.config
    moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    return moe if ctx.mapping.world > 1 and cfg.n_group == 1 else 0


def _merge(moe: fx.Node):
    """(the node to reduce, the shared expert or None): the routed output (through casts) and, where it is
    summed with a gated MLP's output, that sum."""
    out = moe
    while len(out.users) == 1 and is_cast(next(iter(out.users))):
        out = next(iter(out.users))
    users = list(out.users)
    if len(users) == 1 and is_op(users[0], aten.add.Tensor):
        args = op_args(users[0])
        other = args["other"] if args["self"] is out else args["self"]
        shared = gated_mlp(other)
        if shared is not None and args["alpha"] == 1:
            return users[0], shared
    return out, None


def _expert_offset(start: int) -> torch.Tensor:
    return torch.tensor(start, dtype=torch.int32)


def _local_ids(gm: fx.GraphModule, moe: fx.Node, start: int, count: int) -> None:
    """Route the ids of experts [start, start + count) to local ids 0..count-1 and every other id to -1."""
    w13 = op_args(moe)["w13"]
    offset = add_constant(gm, w13.target.rpartition(".")[0], "expert_offset", _expert_offset(start), moe,
                          ((), functools.partial(_expert_offset, start)))
    ids = op_args(moe)["ids"]
    with gm.graph.inserting_before(moe):
        local = gm.graph.call_function(aten.sub.Tensor, (ids, offset))
        keep = gm.graph.call_function(aten.bitwise_and.Tensor, (gm.graph.call_function(aten.ge.Scalar, (local, 0)),
                                                                 gm.graph.call_function(aten.lt.Scalar, (local, count))))
        routed = gm.graph.call_function(aten.where.ScalarOther, (keep, local, -1))
    for node in (offset, local, keep, routed, *keep.args, moe):
        if "nn_module_stack" in moe.meta and node.op == "call_function":
            node.meta["nn_module_stack"] = moe.meta["nn_module_stack"]
        mark(node)
    set_op_args(moe, ids=routed)


def _split_experts(gm: fx.GraphModule, moe: fx.Node, mapping) -> None:
    """The experts of the rank's group (``Mapping.expert_part``; all of them at ep == 1), each narrowed to the
    rank's rows of its intermediate dim (``Mapping.expert_inner_part``; whole at ep == tp): w13's gate and up
    halves by row, w2 by column, the scales in blocks. A layout that keeps every expert, or every row, records no
    narrowing of that dim, so ep == 1 and ep == tp keep their one-dim plans."""
    args = op_args(moe)
    experts, two_inter = get_attr_tensor(gm, args["w13"]).shape[:2]
    inter = two_inter // 2
    start, stop = mapping.expert_part(experts)
    lo, hi = mapping.expert_inner_part(inter)
    by_expert = Slice(0, start, stop) if stop - start < experts else None
    rows = {"w13": Slice(1, lo, hi, halves=True), "w2": Slice(2, lo, hi)} if hi - lo < inter else {}
    for weight in ("w13", "w2"):
        row = rows.get(weight)
        shard_attr(gm, args[weight], nested(by_expert, row))
        if args[weight + "_scale"] is not None:
            blocks = None if row is None else block_part(row, inter, args[weight].target)
            shard_attr(gm, args[weight + "_scale"], nested(by_expert, blocks))
    if by_expert is not None:
        _local_ids(gm, moe, start, stop - start)


def _shard_one(gm: fx.GraphModule, node: fx.Node, mapping) -> bool:
    if not is_op(node, torch.ops.fxglm5.moe_fp8.default) or any(op_args(node)[w].op != "get_attr" for w in ("w13", "w2")):
        return False
    merged, shared = _merge(node)
    _split_experts(gm, node, mapping)
    if shared is not None:
        split_mlp(gm, shared, mapping)
    reduce_after(gm, merged, mapping, "shard_moe_experts")
    return True


@register_pass("shard", expected=expected_moe_layers)
def shard_moe_experts(gm: fx.GraphModule, ctx) -> PassOutcome:
    return PassOutcome(shard_each(gm, ctx, _shard_one))
