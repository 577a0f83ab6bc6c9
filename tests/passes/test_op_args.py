"""Passes read the arguments of the ops they consume by schema name (graph_utils.op_args / set_op_args): the same
values whether the graph passes an argument by position or by keyword or leaves it at its default."""

import pytest
import torch
from torch import fx

import fxglm5.passes  # noqa: F401  (registers the passes and the ops)
from fxglm5.passes.graph_utils import op_args, set_op_args
from fxglm5.passes.manager import PassContext, PassManager
from fxglm5.passes.registry import REGISTRY

aten = torch.ops.aten


def test_op_args_by_position_keyword_and_default():
    g = fx.Graph()
    x = g.placeholder("x")
    positional = g.call_function(aten.slice.Tensor, (x, 2, 0, 8))
    keywords = g.call_function(aten.slice.Tensor, (x,), {"end": 8, "dim": 2, "start": 0})
    assert op_args(positional) == op_args(keywords) == {"self": x, "dim": 2, "start": 0, "end": 8, "step": 1}
    ranked = g.call_function(aten.sort.stable, (x,), {"stable": True, "descending": True})
    assert op_args(ranked) == {"self": x, "stable": True, "dim": -1, "descending": True}
    with pytest.raises(TypeError, match="not an op with a schema"):
        op_args(g.call_function(torch.add, (x, x)))


def test_set_op_args_writes_by_name():
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    node = g.call_function(aten.sort.stable, (x,), {"stable": True})
    set_op_args(node, self=y, descending=True)
    assert node.args == (y,) and node.kwargs == {"stable": True, "descending": True}
    sliced = g.call_function(aten.slice.Tensor, (x, 1))
    set_op_args(sliced, end=4)
    assert sliced.args == (x, 1, None, 4, 1) and op_args(sliced)["end"] == 4
    with pytest.raises(TypeError, match=r"no argument \['stride'\]"):
        set_op_args(sliced, stride=2)


def test_a_pass_reads_a_keyword_argument():
    """select_sampled_rows on ``index_select(linear(h, w), dim=1, index=rows)`` written with keywords: the selection
    moves above the lm_head (reading ``node.args[1]`` found no dim there)."""
    g = fx.Graph()
    h, w, rows = g.placeholder("h"), g.placeholder("w"), g.placeholder("rows")
    logits = g.call_function(aten.linear.default, (h, w))
    g.output(g.call_function(aten.index_select.default, (logits,), {"dim": 1, "index": rows}))
    gm = fx.GraphModule(torch.nn.Module(), g)
    result = PassManager(PassContext(), stages=("cache",)).run_one(gm, REGISTRY["select_sampled_rows"])
    assert result.details == {"ops_moved": 1}
    hs, ws, idx = torch.randn(2, 5, 4), torch.randn(3, 4), torch.tensor([1, 4])
    torch.testing.assert_close(gm(hs, ws, idx), torch.nn.functional.linear(hs, ws).index_select(1, idx))
    (linear,) = [n for n in gm.graph.nodes if n.target is aten.linear.default]
    assert op_args(linear)["input"].target is aten.index_select.default
