"""shard_lm_head: the rank's rows of the vocabulary projection, then ``fxglm5::all_gather`` of the logits along
the vocabulary (last) dim, so every rank returns the whole logits (the Runner samples from them).

Only a graph whose output is the lm_head's linear matches (head "logits"); a hidden-state graph (head "hidden",
the RTP plugin's) has no lm_head: the engine applies its own vocabulary shard. The all_gather works row by row,
so select_sampled_rows (cache stage) still moves the sampled-row selection above it and the lm_head.
"""

from __future__ import annotations

from torch import fx

from fxglm5.passes.graph_utils import get_attr_tensor
from fxglm5.passes.manager import PassOutcome
from fxglm5.passes.registry import register_pass
from fxglm5.passes.sharding import gather_after, linear, shard_each, shard_linear


def expected_lm_head(ctx):
    if ctx.mapping.world == 1:
        return 0
    head = ctx.extras.get("head")
    return None if head is None else int(head == "logits")


def _shard_one(gm: fx.GraphModule, node: fx.Node, mapping) -> bool:
    """The graph's one output, when it is a linear (the lm_head)."""
    if node.op != "output" or len(node.all_input_nodes) != 1:
        return False
    lin = linear(node.all_input_nodes[0])
    if lin is None or len(lin.node.users) != 1:
        return False
    start, stop = mapping.part(get_attr_tensor(gm, lin.weight).shape[0])
    shard_linear(gm, lin, 0, start, stop)
    gather_after(gm, lin.node, -1, mapping, "shard_lm_head")
    return True


@register_pass("shard", expected=expected_lm_head)
def shard_lm_head(gm: fx.GraphModule, ctx) -> PassOutcome:
    return PassOutcome(shard_each(gm, ctx, _shard_one))
