"""fuse_shared_add_into_moe: ``moe_fp8(...) + shared`` -> ``fxglm5::moe_fp8_add(..., addend=shared)``.

Why: GLM-5's MoE block adds the shared expert's output to the routed experts' sum. As an ATen add that is one more
kernel per MoE layer, the only torch kernel left inside a decoder layer's chain, and one that takes no part in
programmatic dependent launch, so it breaks the overlap of its neighbours (issue 45, item 3). The MoE's combine
kernel writes the routed sum row by row; it adds the shared row there.

Matched: ``aten.add.Tensor(a, b)`` (alpha 1) where one operand is an ``fxglm5::moe_fp8`` read by that add only
(through aliases and casts to its own dtype, each read once: a float32 model's ``.to(x.dtype)``) and the other a
tensor of the same shape and dtype (the shared expert's down projection). Left alone: an add that
broadcasts, one scaled by ``alpha``, one of another dtype (the model's dtype is the MoE's), a routed sum read
elsewhere too. Exact: the reference is ``moe_fp8`` and the add, the routed sum rounded to its dtype before the add.
Under tensor parallelism the add sits before the all-reduce that sums both partial outputs (``shard_moe_experts``),
so the fused op's output is what the all-reduce reads.
"""

from __future__ import annotations

import torch
from torch import fx

from fxglm5.passes.graph_utils import aten, dtype_of, is_op, op_args, replace_with_call, rewrite_each, shape_of, through
from fxglm5.passes.manager import PassOutcome
from fxglm5.passes.registry import register_pass


def expected_fusions(ctx) -> int:
    """Each MoE layer the fuse stage turned into ``moe_fp8`` (group-limited routing is not), when the model has a
    shared expert."""
    cfg = ctx.config
    if not cfg.n_shared_experts or cfg.n_group != 1:
        return 0
    return sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))


def _routed_and_shared(add: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    args = op_args(add)
    a, b = args["self"], args["other"]
    if args["alpha"] != 1 or not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
        return None
    moe_op = torch.ops.fxglm5.moe_fp8.default
    for operand, shared in ((a, b), (b, a)):
        routed = through(operand)
        if is_op(routed, moe_op) and _read_once(operand, routed) and through(shared) is not routed:
            break
    else:
        return None
    if shape_of(shared) is None or shape_of(shared) != shape_of(routed) or dtype_of(shared) != dtype_of(routed):
        return None
    return routed, shared


def _read_once(node: fx.Node, source: fx.Node) -> bool:
    """Every node from ``source`` to ``node`` (the aliases and casts ``through`` steps over) has one reader."""
    while True:
        if len(node.users) != 1:
            return False
        if node is source:
            return True
        node = op_args(node)["self"]


@register_pass("fuse_kernels", expected=expected_fusions)
def fuse_shared_add_into_moe(gm: fx.GraphModule, ctx) -> PassOutcome:
    op = torch.ops.fxglm5.moe_fp8_add.default

    def fuse(add: fx.Node) -> bool:
        pair = _routed_and_shared(add)
        if pair is None:
            return False
        routed, shared = pair
        replace_with_call(gm, add, op, (*op_args(routed).values(), shared))  # where the add was: both exist there
        return True

    return PassOutcome(rewrite_each(gm, fuse, aten.add.Tensor))
