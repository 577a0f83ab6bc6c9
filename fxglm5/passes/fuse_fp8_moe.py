"""fuse_fp8_moe: the generic MoE (sigmoid router + dense-over-experts compute with dequantized stacked
weights) -> ``fxglm5::moe_route`` + ``fxglm5::moe_fp8`` over the selected experts only.

Recognised, from the expert sum outward:
  route:   ids = topk(sigmoid(logits) + bias, k).indices; w = gather(sigmoid, ids) [/ (sum + 1e-20)] * c
           routing = zeros_like(logits).scatter(1, ids, w)
  experts: gu = einsum('th,eih->tei', x, W13); a = silu(gu[..:I]) * gu[I:]; y = einsum('tei,ehi->teh', a, W2)
           out = sum(y * routing[..., None], 1)
with W13 / W2 either block-FP8 dequantizations (checked by probe, see dequant.py; W13's halves each blocked
on their own) or plain weights.
Group-limited routing (n_group > 1) is not matched: it stays generic (correct, not fused).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from fxglm5.passes.dequant import match_dequant, plain_weight
from fxglm5.passes.graph_utils import (
    aten, const_float, fake_call, getitem_of, insert_call, is_op, through, through_casts,
)
from fxglm5.passes.manager import PassOutcome
from fxglm5.passes.registry import register_pass


def expected_moe_layers(ctx) -> int:
    cfg = ctx.config
    return sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)) if cfg.n_group == 1 else 0


def _match_router(routing) -> tuple | None:
    """(logits, bias, top_k, renormalize, scaling) for the dense routing matrix, else None."""
    if not is_op(routing, aten.scatter.src) or routing.args[1] not in (1, -1):
        return None
    base, ids_node, weights = routing.args[0], routing.args[2], routing.args[3]
    topk = getitem_of(ids_node, 1)
    if not is_op(base, aten.zeros_like.default) or not is_op(topk, aten.topk.default):
        return None
    if len(topk.args) > 2 and topk.args[2] not in (-1, 1) or len(topk.args) > 3 and topk.args[3] is not True:
        return None
    biased = topk.args[0]
    if not is_op(biased, aten.add.Tensor):
        return None
    sigmoid, bias = biased.args
    if not is_op(sigmoid, aten.sigmoid.default) or not isinstance(bias, fx.Node) or base.args[0] is not sigmoid.args[0]:
        return None
    scaling = 1.0
    if is_op(weights, aten.mul.Tensor) and const_float(weights.args[1]) is not None:
        weights, scaling = weights.args[0], const_float(weights.args[1])
    renormalize = False
    if is_op(weights, aten.div.Tensor):
        gathered, denom = weights.args
        if not (is_op(denom, aten.add.Tensor) and is_op(denom.args[0], aten.sum.dim_IntList) and denom.args[0].args[0] is gathered):
            return None
        if const_float(denom.args[1]) != 1e-20:
            return None
        weights, renormalize = gathered, True
    if not (is_op(weights, aten.gather.default) and weights.args[0] is sigmoid and weights.args[2] is ids_node):
        return None
    return sigmoid.args[0], bias, topk.args[1], renormalize, scaling


def _expert_weight(node, halves: bool) -> tuple | None:
    """(weight, scale | None) constants behind a stacked expert weight operand (``halves``: gate|up)."""
    deq = match_dequant(node, halves)
    if deq is not None:
        return deq.weight, deq.scale
    plain = plain_weight(node)
    return (plain, None) if plain is not None else None


def _match_experts(total) -> tuple | None:
    """(x, routing, (w13, s13), (w2, s2)) for ``sum(einsum_down * routing[..., None], 1)``, else None."""
    if not is_op(total, aten.sum.dim_IntList) or list(total.args[1]) != [1]:
        return None
    weighted = total.args[0]
    if not is_op(weighted, aten.mul.Tensor):
        return None
    down, unsq = weighted.args
    down = through_casts(down)
    if not is_op(unsq, aten.unsqueeze.default) or unsq.args[1] not in (2, -1):
        return None
    if not is_op(down, aten.einsum.default) or down.args[0].replace(" ", "") != "tei,ehi->teh":
        return None
    act, w2 = down.args[1]
    if not is_op(act, aten.mul.Tensor):
        return None
    silu, up = act.args
    if not is_op(silu, aten.silu.default):
        return None
    split = getitem_of(silu.args[0], 0)
    if split is None or getitem_of(up, 1) is not split or not is_op(split, aten.split_with_sizes.default):
        return None
    sizes = list(split.args[1])
    if len(sizes) != 2 or sizes[0] != sizes[1] or split.args[2] not in (-1, 2):
        return None
    gate_up = split.args[0]
    if not is_op(gate_up, aten.einsum.default) or gate_up.args[0].replace(" ", "") != "th,eih->tei":
        return None
    x, w13 = gate_up.args[1]
    w13_consts, w2_consts = _expert_weight(w13, halves=True), _expert_weight(w2, halves=False)
    if w13_consts is None or w2_consts is None:
        return None
    return x, unsq.args[0], w13_consts, w2_consts


@register_pass("fuse", expected=expected_moe_layers)
def fuse_fp8_moe(gm: fx.GraphModule, ctx) -> PassOutcome:
    route_op, moe_op = torch.ops.fxglm5.moe_route.default, torch.ops.fxglm5.moe_fp8.default
    matches = 0
    for node in list(gm.graph.nodes):
        experts = _match_experts(node)
        if experts is None:
            continue
        x, routing, (w13, s13), (w2, s2) = experts
        router = _match_router(routing)
        if router is None:
            continue
        logits, bias, top_k, renormalize, scaling = router
        route_args = (logits, bias, top_k, 1, 1, renormalize, scaling)
        route = insert_call(gm, node, route_op, route_args, fake_call(route_op, *route_args))
        weights = insert_call(gm, node, operator.getitem, (route, 0))
        ids = insert_call(gm, node, operator.getitem, (route, 1))
        weights.meta["val"], ids.meta["val"] = route.meta["val"]
        moe_args = (through(x), ids, weights, w13, s13, w2, s2, bool(ctx.act_quant))
        fused = insert_call(gm, node, moe_op, moe_args, fake_call(moe_op, *moe_args))
        out_dtype = node.meta["val"].dtype
        if fused.meta["val"].dtype != out_dtype:
            fused = insert_call(gm, node, aten.to.dtype, (fused, out_dtype), fake_call(aten.to.dtype, fused, out_dtype))
        node.replace_all_uses_with(fused)
        matches += 1
    return PassOutcome(matches)
