"""select_sampled_rows: run the final norm and the vocabulary projection only for the tokens a step samples from.

``insert_paged_cache`` keeps the rows ``logits_indices`` lists at the graph's output. Selected there, the
lm_head (6144 x 154880 for GLM-5) and the final norm still ran for every prompt token: an 8k-token prefill made
8192 x 154880 logits (2.5 GB in bf16, about 15.6 TFLOP) to keep one row per request. This pass moves the row
selection up through the row-wise ops that end the graph (casts, linear / fp8_linear, rms_norm), so that they
run on the kept rows only; the values of the kept rows do not change. On a sharded graph the logits are gathered
over the ranks along the vocabulary: that gather is row-wise too, and the selection moves above it.
"""

from __future__ import annotations

import torch
from torch import fx

from fxglm5.passes.graph_utils import aten, fake_call, is_cast, is_op, op_args
from fxglm5.passes.manager import PassOutcome
from fxglm5.passes.registry import register_pass


def expected_selections(ctx) -> int:
    return 1


def _rows_input(node) -> fx.Node | None:
    """The input whose row r alone makes row r of ``node`` (tokens on dim 1), if ``node`` is such a row-wise op."""
    if is_cast(node):
        return op_args(node)["self"]
    ops = torch.ops.fxglm5
    if is_op(node, ops.all_gather.default) and op_args(node)["dim"] not in (0, 1):  # a sharded lm_head's logits
        return op_args(node)["x"]
    if is_op(node, aten.slice.Tensor) and op_args(node)["dim"] in (-1, len(node.meta["val"].shape) - 1):
        return op_args(node)["self"]  # a column range (a padded vocabulary's logits cut back to the vocabulary)
    rows = {aten.linear.default: "input", ops.fp8_linear.default: "x", ops.rms_norm.default: "x"}
    return op_args(node)[rows[node.target]] if is_op(node, *rows) else None


def _merge_twin(gm: fx.GraphModule, select: fx.Node) -> fx.Node:
    """``select`` after merging the other selection of the same rows of the same tensor into it (where two
    outputs meet: the lm_head's input is the hidden output too), so the moving can go on above them."""
    for twin in list(op_args(select)["self"].users):
        if twin is not select and is_op(twin, aten.index_select.default) and twin.args[1:] == select.args[1:]:
            twin.replace_all_uses_with(select)
            gm.graph.erase_node(twin)
    return select


@register_pass("cache", expected=expected_selections)
def select_sampled_rows(gm: fx.GraphModule, ctx) -> PassOutcome:
    """One selection per graph moved up: the first output's (the logits; a second output, the hidden states of
    head "logits+hidden" or the MTP's, shares the rows its selection meets)."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    (result,) = output.args
    select = result[0] if isinstance(result, (tuple, list)) else result
    if not is_op(select, aten.index_select.default) or op_args(select)["dim"] != 1:
        return PassOutcome(0)
    moved = 0
    while _rows_input(op_args(select)["self"]) is not None and len(_merge_twin(gm, select).args[0].users) == 1:
        producer = op_args(select)["self"]
        rows = _rows_input(producer)
        with gm.graph.inserting_before(producer):
            earlier = gm.graph.call_function(aten.index_select.default, (rows, 1, op_args(select)["index"]))
        producer.replace_input_with(rows, earlier)
        # the value the lower stage reads to bind the op above (dtype, width); the moved ops keep theirs, whose row
        # count is now the kept rows' (re-running a GEMM's fake over a lifted weight fails on torch 2.11)
        if "val" in op_args(select)["index"].meta and "val" in rows.meta:
            earlier.meta["val"] = fake_call(aten.index_select.default, rows, 1, op_args(select)["index"])
        select.replace_all_uses_with(producer)
        gm.graph.erase_node(select)
        select, moved = earlier, moved + 1
    return PassOutcome(int(moved > 0), {"ops_moved": moved})
