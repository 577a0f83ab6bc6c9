"""shard_moe_experts: the rank's routed experts and its share of the shared expert, then one all-reduce where the
two are summed.

- ``ep == tp``: experts [E/ep*r, E/ep*(r+1)) whole (w13 / w2 and their scales by expert); the router stays whole
  and its ids become local, ``where((ids - lo >= 0) & (ids - lo < E/ep), ids - lo, -1)``: the MoE kernels skip -1.
  ``lo`` is a constant tensor (``experts.expert_offset``, derived, not in the checkpoint) rather than a literal in
  the code, so every rank runs the same program text (``fxglm5.parallel.plan_hash``).
- ``ep == 1``: every expert split along its intermediate dim: w13's gate and up halves each by row (a ``halves``
  Slice), w2 by column, the scales in blocks.
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
from fxglm5.parallel import Slice

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
    args = op_args(moe)
    experts, two_inter = get_attr_tensor(gm, args["w13"]).shape[:2]
    if mapping.ep > 1:
        start, stop = mapping.expert_part(experts)
        for name in ("w13", "w13_scale", "w2", "w2_scale"):
            if args[name] is not None:
                shard_attr(gm, args[name], Slice(0, start, stop))
        _local_ids(gm, moe, start, stop - start)
        return
    start, stop = mapping.part(two_inter // 2)
    gate_up, down = Slice(1, start, stop, halves=True), Slice(2, start, stop)
    shard_attr(gm, args["w13"], gate_up)
    shard_attr(gm, args["w2"], down)
    if args["w13_scale"] is not None:
        shard_attr(gm, args["w13_scale"], block_part(gate_up, two_inter // 2, args["w13"].target))
        shard_attr(gm, args["w2_scale"], block_part(down, two_inter // 2, args["w2"].target))


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
