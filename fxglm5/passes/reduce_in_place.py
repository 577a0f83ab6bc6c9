"""reduce_in_place: each all-reduce whose input no other node reads sums over that input's own memory.

torch's functional all-reduce (``_c10d_functional.all_reduce``, what ``fxglm5::all_reduce`` lowers to) first copies
its input into a new tensor and reduces the copy: a copy kernel for every all-reduce, two a decoder layer of a
sharded step (after o_proj and after the MLP or MoE), 156 a GLM-5 decode step, each a launch on the critical path
between two GEMMs. The input of each of them is the fresh output of the GEMM or MoE op before it, read by the
all-reduce alone, so the sum may overwrite it: this pass marks such an all-reduce ``meta["fxglm5_in_place"]``, and
``lower`` then binds it the in-place body of the implementation it chooses (``all_reduce_c10d_in_place``:
``_c10d_functional.all_reduce_`` on the input, the same NCCL / gloo reduction).

What it proves is about buffers, not math: the input is made by an fxglm5 op (a custom op, whose outputs never
alias its inputs by the functional contract of ``torch.library.custom_op``), directly or as an item of its tuple,
and the all-reduce is its only reader. An input read by anything else, or made by a view or any other ATen op (which
may alias a live tensor), keeps the functional all-reduce.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from fxglm5.passes.graph_utils import rewrite_each
from fxglm5.passes.manager import PassOutcome
from fxglm5.passes.registry import register_pass


def expected_all_reduces(ctx) -> int:
    """Every all-reduce the shard stage emits on more than one rank: one a layer's attention, one a dense MLP's, one
    a MoE layer's (shard_moe_experts shards none under group-limited routing, n_group > 1)."""
    cfg = ctx.config
    if ctx.mapping.world == 1:
        return 0
    moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    return 2 * cfg.num_hidden_layers - (moe if cfg.n_group > 1 else 0)


def _fxglm5_op(node) -> bool:
    return (isinstance(node, fx.Node) and node.op == "call_function"
            and isinstance(node.target, torch._ops.OpOverload) and node.target.namespace == "fxglm5")


def owned(x) -> bool:
    """Whether ``x`` is a fresh output of an fxglm5 op (or an item of its tuple) that one node reads."""
    if not isinstance(x, fx.Node) or len(x.users) != 1:
        return False
    if x.op == "call_function" and x.target is operator.getitem:
        return _fxglm5_op(x.args[0])
    return _fxglm5_op(x)


@register_pass("lower", expected=expected_all_reduces)
def reduce_in_place(gm: fx.GraphModule, ctx) -> PassOutcome:
    def mark(node: fx.Node) -> bool:
        if not owned(node.args[0]):
            return False
        node.meta["fxglm5_in_place"] = True
        return True

    return PassOutcome(rewrite_each(gm, mark, torch.ops.fxglm5.all_reduce.default))
