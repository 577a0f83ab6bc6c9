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
The expert sum is float32 and the model casts it back to x's dtype; ``moe_fp8`` returns exactly that cast (its
reference rounds its own float32 sum once), so those casts read ``moe_fp8`` directly: no float32 round trip of the
routed output is left for the device to copy twice.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from fxglm5.passes.dequant import match_dequant, plain_weight
from fxglm5.passes.graph_utils import (
    aten, const_float, fake_call, getitem_of, insert_call, is_cast, is_op, op_args, rewrite_each, through,
    through_casts,
)
from fxglm5.passes.manager import PassOutcome
from fxglm5.passes.registry import register_pass


def expected_moe_layers(ctx) -> int:
    cfg = ctx.config
    return sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)) if cfg.n_group == 1 else 0


def _match_router(routing) -> tuple | None:
    """(logits, bias, top_k, renormalize, scaling) for the dense routing matrix, else None."""
    if not is_op(routing, aten.scatter.src) or op_args(routing)["dim"] not in (1, -1):
        return None
    scatter = op_args(routing)
    base, ids_node, weights = scatter["self"], scatter["index"], scatter["src"]
    topk = getitem_of(ids_node, 1)
    if not is_op(base, aten.zeros_like.default) or not is_op(topk, aten.topk.default):
        return None
    ranked = op_args(topk)
    if ranked["dim"] not in (-1, 1) or ranked["largest"] is not True or not is_op(ranked["self"], aten.add.Tensor):
        return None
    biased = op_args(ranked["self"])
    sigmoid, bias = biased["self"], biased["other"]
    if not is_op(sigmoid, aten.sigmoid.default) or not isinstance(bias, fx.Node) or biased["alpha"] != 1:
        return None
    logits = op_args(sigmoid)["self"]
    if op_args(base)["self"] is not logits:
        return None
    scaling = 1.0
    if is_op(weights, aten.mul.Tensor) and const_float(op_args(weights)["other"]) is not None:
        weights, scaling = op_args(weights)["self"], const_float(op_args(weights)["other"])
    renormalize = False
    if is_op(weights, aten.div.Tensor):
        gathered, denom = op_args(weights)["self"], op_args(weights)["other"]
        if not is_op(denom, aten.add.Tensor):
            return None
        total, eps = op_args(denom)["self"], op_args(denom)["other"]
        if not is_op(total, aten.sum.dim_IntList) or op_args(total)["self"] is not gathered or const_float(eps) != 1e-20:
            return None
        weights, renormalize = gathered, True
    if not is_op(weights, aten.gather.default):
        return None
    gather = op_args(weights)
    if gather["self"] is not sigmoid or gather["index"] is not ids_node:
        return None
    return logits, bias, ranked["k"], renormalize, scaling


def _expert_weight(node, halves: bool) -> tuple | None:
    """(weight, scale | None) constants behind a stacked expert weight operand (``halves``: gate|up)."""
    deq = match_dequant(node, halves)
    if deq is not None:
        return deq.weight, deq.scale
    plain = plain_weight(node)
    return (plain, None) if plain is not None else None


def _match_experts(total) -> tuple | None:
    """(x, routing, (w13, s13), (w2, s2)) for ``sum(einsum_down * routing[..., None], 1)``, else None."""
    if not is_op(total, aten.sum.dim_IntList) or list(op_args(total)["dim"] or ()) != [1]:
        return None
    weighted = op_args(total)["self"]
    if not is_op(weighted, aten.mul.Tensor):
        return None
    down, unsq = op_args(weighted)["self"], op_args(weighted)["other"]
    down = through_casts(down)
    if not is_op(unsq, aten.unsqueeze.default) or op_args(unsq)["dim"] not in (2, -1):
        return None
    if not is_op(down, aten.einsum.default) or op_args(down)["equation"].replace(" ", "") != "tei,ehi->teh":
        return None
    act, w2 = op_args(down)["tensors"]
    if not is_op(act, aten.mul.Tensor):
        return None
    silu, up = op_args(act)["self"], op_args(act)["other"]
    if not is_op(silu, aten.silu.default):
        return None
    split = getitem_of(op_args(silu)["self"], 0)
    if split is None or getitem_of(up, 1) is not split or not is_op(split, aten.split_with_sizes.default):
        return None
    sizes = list(op_args(split)["split_sizes"])
    if len(sizes) != 2 or sizes[0] != sizes[1] or op_args(split)["dim"] not in (-1, 2):
        return None
    gate_up = op_args(split)["self"]
    if not is_op(gate_up, aten.einsum.default) or op_args(gate_up)["equation"].replace(" ", "") != "th,eih->tei":
        return None
    x, w13 = op_args(gate_up)["tensors"]
    w13_consts, w2_consts = _expert_weight(w13, halves=True), _expert_weight(w2, halves=False)
    if w13_consts is None or w2_consts is None:
        return None
    return x, op_args(unsq)["self"], w13_consts, w2_consts


@register_pass("fuse", expected=expected_moe_layers)
def fuse_fp8_moe(gm: fx.GraphModule, ctx) -> PassOutcome:
    route_op, moe_op = torch.ops.fxglm5.moe_route.default, torch.ops.fxglm5.moe_fp8.default

    def fuse(node: fx.Node) -> bool:
        experts = _match_experts(node)
        if experts is None:
            return False
        x, routing, (w13, s13), (w2, s2) = experts
        router = _match_router(routing)
        if router is None:
            return False
        logits, bias, top_k, renormalize, scaling = router
        route_args = (logits, bias, top_k, 1, 1, renormalize, scaling)
        route = insert_call(gm, node, route_op, route_args, fake_call(route_op, *route_args))
        weights = insert_call(gm, node, operator.getitem, (route, 0))
        ids = insert_call(gm, node, operator.getitem, (route, 1))
        weights.meta["val"], ids.meta["val"] = route.meta["val"]
        moe_args = (through(x), ids, weights, w13, s13, w2, s2, bool(ctx.act_quant))
        fused = insert_call(gm, node, moe_op, moe_args, fake_call(moe_op, *moe_args))
        out_dtype, fused_dtype = node.meta["val"].dtype, fused.meta["val"].dtype
        if fused_dtype != out_dtype:
            for cast in [u for u in node.users if is_cast(u) and u.meta["val"].dtype == fused_dtype]:
                cast.replace_all_uses_with(fused)
            fused = insert_call(gm, node, aten.to.dtype, (fused, out_dtype), fake_call(aten.to.dtype, fused, out_dtype))
        node.replace_all_uses_with(fused)
        return True

    return PassOutcome(rewrite_each(gm, fuse))
