"""match_sparse_mla: DSA indexer scores + top-k + selection mask + MLA attention ->
``fxglm5::indexer_topk`` + ``fxglm5::sparse_mla``.

The generic model scores keys with the lightning indexer, takes a fixed-k top-k over the causal scores
(padded with -inf so any length works; the first k of a stable descending sort, so that the lower position
wins among equal scores, as ``indexer_topk`` defines), scatters it into a boolean selection and masks the
attention with ``causal & selection``. This pass replaces the indexer math by one ``indexer_topk`` (every scale
folded into its per-head weights) and the attention by ``sparse_mla`` over the chosen keys. A "shared"
layer that reuses an earlier selection reuses that layer's ``indexer_topk`` node.
"""

from __future__ import annotations

import torch
from torch import fx

from fxglm5.passes.graph_utils import (
    aten, const_float, fake_call, getitem_of, insert_call, is_neg_inf, is_op, shape_of, through, through_casts,
)
from fxglm5.passes.manager import PassOutcome
from fxglm5.passes.mla_pattern import absorbed_weights, is_causal_mask, match_mla_attention, replace_attention
from fxglm5.passes.registry import register_pass


def expected_sparse_layers(ctx) -> int:
    return ctx.config.num_hidden_layers


def _split_allowed(allowed) -> fx.Node | None:
    """The selection node of ``causal & selection`` (either operand order)."""
    if not is_op(allowed, aten.__and__.Tensor, aten.bitwise_and.Tensor, aten.logical_and.default):
        return None
    a, b = allowed.args
    if is_causal_mask(a):
        return b
    if is_causal_mask(b):
        return a
    return None


def _match_indexer(selection) -> tuple | None:
    """(sort node, q, k, weights, index scale, k) for the selection built from a DSA top-k, else None."""
    if not is_op(selection, aten.slice.Tensor) or selection.args[1] not in (2, -1):
        return None
    if len(selection.args) > 2 and selection.args[2] not in (None, 0):
        return None
    scatter = selection.args[0]
    if not is_op(scatter, aten.scatter.value) or scatter.args[1] not in (-1, 2) or scatter.args[3] is not True:
        return None
    if not is_op(scatter.args[0], aten.zeros_like.default):
        return None
    first_k = scatter.args[2]
    if not is_op(first_k, aten.slice.Tensor) or first_k.args[1] not in (-1, 2) or len(first_k.args) != 4:
        return None
    if first_k.args[2] not in (None, 0) or not isinstance(first_k.args[3], int):
        return None
    k = first_k.args[3]
    ranked = getitem_of(first_k.args[0], 1)  # topk_lowest_index_ties: sort(stable, descending)[1][..., :k]
    if not is_op(ranked, aten.sort.stable) or len(ranked.args) != 1:
        return None
    if ranked.kwargs.get("stable") is not True or ranked.kwargs.get("descending") is not True:
        return None
    if ranked.kwargs.get("dim", -1) not in (-1, 2):
        return None
    padded = ranked.args[0]
    if scatter.args[0].args[0] is not padded or not is_op(padded, aten.cat.default) or len(padded.args[0]) != 2:
        return None
    scores, pad = padded.args[0]
    if not is_op(pad, aten.new_full.default) or not is_neg_inf(pad.args[2]) or pad.args[1][-1] != k:
        return None
    if not is_op(scores, aten.masked_fill.Scalar) or not is_neg_inf(scores.args[2]):
        return None
    inverted = scores.args[1]
    if not is_op(inverted, aten.bitwise_not.default, aten.logical_not.default) or not is_causal_mask(inverted.args[0]):
        return None
    summed = scores.args[0]
    if not is_op(summed, aten.sum.dim_IntList) or list(summed.args[1]) not in ([2], [-2]):
        return None
    weighted = summed.args[0]
    if not is_op(weighted, aten.mul.Tensor):
        return None
    relu, w_unsq = weighted.args
    if not is_op(relu, aten.relu.default) or not is_op(w_unsq, aten.unsqueeze.default) or w_unsq.args[1] not in (3, -1):
        return None
    scaled = relu.args[0]
    scale = const_float(scaled.args[1]) if is_op(scaled, aten.mul.Tensor) else None
    if scale is None or scale <= 0:  # relu(c x) = c relu(x) only for c > 0
        return None
    logits = through(scaled.args[0])
    if not is_op(logits, aten.einsum.default) or logits.args[0].replace(" ", "") != "bshd,btd->bsht":
        return None
    q, key = logits.args[1]
    if len(shape_of(q)) != 4 or len(shape_of(key)) != 3:
        return None
    return ranked, through_casts(q), through_casts(key), w_unsq.args[0], scale, k


@register_pass("match", expected=expected_sparse_layers)
def match_sparse_mla(gm: fx.GraphModule, ctx) -> PassOutcome:
    sparse_op, topk_op = torch.ops.fxglm5.sparse_mla.default, torch.ops.fxglm5.indexer_topk.default
    indices_for: dict[fx.Node, fx.Node] = {}  # selection node -> indexer_topk node (shared layers reuse it)
    matches = 0
    for node in list(gm.graph.nodes):
        if not is_op(node, aten.softmax.int, aten._softmax.default):
            continue
        match = match_mla_attention(node, ctx)
        selection = _split_allowed(match.allowed) if match is not None else None
        if selection is None:
            continue
        if selection not in indices_for:
            found = _match_indexer(selection)
            if found is None:
                continue
            ranked, q, key, weights, scale, k = found
            scaled_w = insert_call(gm, ranked, aten.mul.Tensor, (weights, scale))
            scaled_w.meta["val"] = fake_call(aten.mul.Tensor, weights, scale)
            args = (q, key, scaled_w, k)
            indices_for[selection] = insert_call(gm, ranked, topk_op, args, fake_call(topk_op, *args))
        weights_uk_uv = absorbed_weights(gm, match, match.output)
        if weights_uk_uv is None:
            continue
        replace_attention(gm, match, sparse_op, (indices_for[selection],), weights_uk_uv)
        matches += 1
    return PassOutcome(matches, {"indexer_topk": len(indices_for), "shared_layers": matches - len(indices_for)})
