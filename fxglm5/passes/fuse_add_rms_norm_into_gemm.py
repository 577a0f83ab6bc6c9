"""fuse_add_rms_norm_into_gemm: ``fp8_linear(add_rms_norm(x, r)[0], W)`` -> ``fxglm5::add_rms_norm_fp8_linear(x, r, ...,
W)``, whose other outputs are the sum (the next residual) and, where another op reads them too, the normed rows.

Why: a decode layer launched ``add_rms_norm`` twice, each a kernel of a few microseconds whose output only the next
GEMM reads. Under tensor parallelism an all-reduce sits between the sum's producer (o_proj, the MLP's down GEMM) and
the add, so the add and norm cannot join their producer; they can join their consumer. At decode the GEMM reads a few
rows against megabytes of weights, so its kernel can form its A tiles as the normed rows of ``x + r`` as it loads
them (``lowering.triton.fp8_gemm.add_rms_norm_fp8_linear``: every CTA first sums its rows' squares over the whole
row, then forms each tile; one CTA column writes the sum), one launch fewer per fused norm. At prefill the lowering
runs the two kernels.

Matched: an ``fxglm5::add_rms_norm`` whose normed output is the input ``x`` of exactly one ``fxglm5::fp8_linear``: the
attention block's first GEMM (q_a | kv_a | the indexer's wk, stacked by fuse_shared_input_gemms) and a dense layer's
stacked gate|up GEMM. Other readers of the normed rows (a layer's indexer head weights, which
fuse_index_weights_into_q_norm gave the query norm's op) read the fused op's third output (``keep_normed``); readers
of the sum its second. Left alone: a norm that reads no sum (the first layer's input norm, on the embedding); normed
rows that no fp8_linear reads, which is the MoE layers' input to the router and the experts (not matched: that norm
is another fusion's, with the MoE kernels: fuse_add_rms_norm_into_moe, which runs just before this pass); normed rows two fp8_linears read (GEMMs fuse_shared_input_gemms could not
stack, such as two of another ``act_quant``: which one would take the norm is no better than the other); a GEMM whose
weights, scales or bias are computed after the sum (constants are moved up to the fused op, which stands where the
norm stood). Exact: the reference is add_rms_norm and fp8_linear as before.
Runs last in fuse_kernels: after fuse_add_rms_norm (which makes the add_rms_norm) and fuse_shared_input_gemms (which
makes the one stacked GEMM of the normed rows).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from fxglm5.passes.graph_utils import fake_call, insert_call, is_op, op_args, rewrite_each
from fxglm5.passes.manager import PassOutcome
from fxglm5.passes.registry import register_pass


def expected_fusions(ctx) -> int:
    """In an FP8 checkpoint, per layer: the attention's input norm of every layer but the first (the first reads the
    embedding, not a sum) and a dense layer's MLP norm; MoE layers' MLP norms feed the MoE, not an fp8_linear."""
    cfg = ctx.config
    if not cfg.is_fp8:
        return 0
    return sum((layer > 0) + (not cfg.is_moe_layer(layer)) for layer in range(cfg.num_hidden_layers))


def _outputs(norm: fx.Node) -> dict[int, fx.Node] | None:
    """The getitems of ``norm``'s outputs by index, or None where something else reads the tuple."""
    outputs = {}
    for user in norm.users:
        if user.target is not operator.getitem:
            return None
        outputs[user.args[1]] = user
    return outputs


def _gemm(normed: fx.Node) -> fx.Node | None:
    """The one fp8_linear whose input is ``normed`` (read by nothing else of it), or None."""
    gemms = [user for user in normed.users if is_op(user, torch.ops.fxglm5.fp8_linear.default)]
    if len(gemms) != 1:
        return None
    args = op_args(gemms[0])
    if args["x"] is not normed or any(value is normed for name, value in args.items() if name != "x"):
        return None
    return gemms[0]


def _move_up(constants: list, before: fx.Node, order: dict) -> bool:
    """Move the get_attr nodes of ``constants`` that stand after ``before`` up before it (a get_attr reads nothing:
    defining it earlier changes nothing); False, moving none, where one of them is computed after it."""
    late = [c for c in constants if isinstance(c, fx.Node) and order[c] > order[before]]
    if any(c.op != "get_attr" for c in late):
        return False
    for c in late:
        before.prepend(c)
    return True


@register_pass("fuse_kernels", expected=expected_fusions)
def fuse_add_rms_norm_into_gemm(gm: fx.GraphModule, ctx) -> PassOutcome:
    def fuse(norm: fx.Node) -> bool:
        outputs = _outputs(norm)
        if outputs is None or 0 not in outputs:
            return False
        normed = outputs[0]
        gemm = _gemm(normed)
        if gemm is None:
            return False
        g = op_args(gemm)
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        if not _move_up([g["weight"], g["weight_scale_inv"], g["bias"]], norm, order):
            return False
        keep_normed = len(normed.users) > 1
        op = torch.ops.fxglm5.add_rms_norm_fp8_linear.default
        n = op_args(norm)
        call = (n["x"], n["residual"], n["weight"], n["eps"], g["weight"], g["weight_scale_inv"], g["bias"],
                g["act_quant"], keep_normed)
        fused = insert_call(gm, norm, op, call, fake_call(op, *call))
        replaced = {0: gemm, 1: outputs.get(1), 2: normed if keep_normed else None}
        with gm.graph.inserting_before(norm):
            for index, old in replaced.items():
                if old is not None:
                    item = gm.graph.call_function(operator.getitem, (fused, index))
                    item.meta["val"] = fused.meta["val"][index]
                    old.replace_all_uses_with(item)
        for old in (gemm, normed, outputs.get(1), norm):
            if old is not None:
                gm.graph.erase_node(old)
        return True

    return PassOutcome(rewrite_each(gm, fuse, torch.ops.fxglm5.add_rms_norm.default))
