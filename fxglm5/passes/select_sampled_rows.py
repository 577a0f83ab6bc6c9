"""select_sampled_rows: run the final norm and the vocabulary projection only for the tokens a step samples from.

``insert_paged_cache`` keeps the rows ``logits_indices`` lists at the graph's output. Selected there, the
lm_head (6144 x 154880 for GLM-5) and the final norm still ran for every prompt token: an 8k-token prefill made
8192 x 154880 logits (2.5 GB in bf16, about 15.6 TFLOP) to keep one row per request. This pass moves the row
selection up through the row-wise ops that end the graph (casts, linear / fp8_linear, rms_norm), so that they
run on the kept rows only; the values of the kept rows do not change.
"""

from __future__ import annotations

import torch
from torch import fx

from fxglm5.passes.graph_utils import aten, is_cast, is_op
from fxglm5.passes.manager import PassOutcome
from fxglm5.passes.registry import register_pass


def expected_selections(ctx) -> int:
    return 1


def _row_wise(node) -> bool:
    """Output row r depends only on row r of ``node.args[0]`` (tokens on dim 1)."""
    ops = torch.ops.fxglm5
    return is_cast(node) or is_op(node, aten.linear.default, ops.fp8_linear.default, ops.rms_norm.default)


@register_pass("cache", expected=expected_selections)
def select_sampled_rows(gm: fx.GraphModule, ctx) -> PassOutcome:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    select = output.args[0]
    if not is_op(select, aten.index_select.default) or select.args[1] != 1:
        return PassOutcome(0)
    moved = 0
    while _row_wise(select.args[0]) and len(select.args[0].users) == 1:
        producer = select.args[0]
        with gm.graph.inserting_before(producer):
            earlier = gm.graph.call_function(aten.index_select.default, (producer.args[0], 1, select.args[2]))
        producer.args = (earlier, *producer.args[1:])
        select.replace_all_uses_with(producer)
        gm.graph.erase_node(select)
        select, moved = earlier, moved + 1
    return PassOutcome(int(moved > 0), {"ops_moved": moved})
