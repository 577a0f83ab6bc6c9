"""fuse_add_rms_norm: ``rms_norm(a + b)`` -> ``fxglm5::add_rms_norm(a, b)``, whose second output (the sum) is the
residual stream every other reader of ``a + b`` gets.

Why: a decoder layer adds each block's output to the residual and normalizes the sum for the next block, twice per
layer; as an add and a norm that is two kernels and a round trip of the sum through memory, fused it is one kernel
that reads both operands once and writes the sum and the normed row (vLLM's fused_add_rms_norm; TensorRT-LLM fuses
the all-reduce in front as well).

Matched: an ``fxglm5::rms_norm`` whose input is ``aten.add.Tensor(a, b)`` (alpha 1) of two tensors of one shape, or a
cast of it to its own dtype (a float32 model's RMSNorm reads ``x.float()``, which a re-exported program keeps).
Left alone: an add that broadcasts, one scaled by ``alpha``, a norm of anything else (the first layer's input norm
reads the embedding; a paged graph's final norm reads the sampled rows, ``index_select`` of the last sum).
Exact: the reference is ``rms_norm(a + b)`` and ``a + b`` themselves, the same rounding points.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from fxglm5.passes.graph_utils import aten, fake_call, is_op, op_args, rewrite_each, shape_of, through
from fxglm5.passes.manager import PassOutcome
from fxglm5.passes.registry import register_pass


def expected_fusions(ctx) -> int | None:
    """Two per decoder layer (the attention's sum before the post-attention norm, the MLP's before the next layer's
    input norm) but the first layer's input norm; the final norm too where it reads the last sum directly (a graph
    without the cache stage's row selection). None where the context does not say whether the graph is paged."""
    paged = ctx.extras.get("paged")
    if paged is None:
        return None
    return 2 * ctx.config.num_hidden_layers - (1 if paged else 0)


def _sum(norm: fx.Node):
    """The node ``norm`` normalizes, looked through aliases and casts to its own dtype."""
    return through(op_args(norm)["x"])


def _summands(norm: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    add = _sum(norm)
    if not is_op(add, aten.add.Tensor):
        return None
    args = op_args(add)
    a, b = args["self"], args["other"]
    if args["alpha"] != 1 or not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
        return None
    return (a, b) if shape_of(a) is not None and shape_of(a) == shape_of(b) else None


def _insert_after_sum(gm: fx.GraphModule, add: fx.Node, norm: fx.Node, args: tuple) -> fx.Node | None:
    """The fused call placed right after ``add``, where every other reader of the sum can read it (they may come
    before the norm); its weight, a constant, is moved up beside it. None where the weight is computed after ``add``."""
    weight, order = args[2], {n: i for i, n in enumerate(gm.graph.nodes)}
    if isinstance(weight, fx.Node) and order[weight] > order[add]:
        if weight.op != "get_attr":
            return None
        add.append(weight)  # a get_attr reads nothing: defining it earlier changes nothing
    op = torch.ops.fxglm5.add_rms_norm.default
    with gm.graph.inserting_after(weight if isinstance(weight, fx.Node) and add.next is weight else add):
        fused = gm.graph.call_function(op, args)
    fused.meta.update(val=fake_call(op, *args), **{k: v for k, v in norm.meta.items() if k == "nn_module_stack"})
    return fused


@register_pass("fuse_kernels", expected=expected_fusions)
def fuse_add_rms_norm(gm: fx.GraphModule, ctx) -> PassOutcome:
    def fuse(norm: fx.Node) -> bool:
        summands = _summands(norm)
        if summands is None:
            return False
        add = _sum(norm)
        fused = _insert_after_sum(gm, add, norm, (*summands, op_args(norm)["weight"], op_args(norm)["eps"]))
        if fused is None:
            return False
        with gm.graph.inserting_after(fused):
            total = gm.graph.call_function(operator.getitem, (fused, 1))
            normed = gm.graph.call_function(operator.getitem, (fused, 0))
        normed.meta["val"], total.meta["val"] = fused.meta["val"]
        norm.replace_all_uses_with(normed)
        add.replace_all_uses_with(total)
        return True

    return PassOutcome(rewrite_each(gm, fuse, torch.ops.fxglm5.rms_norm.default))
