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
    aten, const_float, fake_call, getitem_of, insert_call, is_neg_inf, is_op, op_args, rewrite_each, shape_of,
    through, through_casts,
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
    a, b = op_args(allowed)["self"], op_args(allowed)["other"]
    if is_causal_mask(a):
        return b
    if is_causal_mask(b):
        return a
    return None


def _match_indexer(selection) -> tuple | None:
    """(sort node, q, k, weights, index scale, k) for the selection built from a DSA top-k, else None."""
    if not is_op(selection, aten.slice.Tensor) or op_args(selection)["dim"] not in (2, -1):
        return None
    if op_args(selection)["start"] not in (None, 0):
        return None
    scatter = op_args(selection)["self"]
    if not is_op(scatter, aten.scatter.value):
        return None
    scattered = op_args(scatter)
    if scattered["dim"] not in (-1, 2) or scattered["value"] is not True or not is_op(scattered["self"], aten.zeros_like.default):
        return None
    first_k = scattered["index"]
    if not is_op(first_k, aten.slice.Tensor):
        return None
    head = op_args(first_k)
    if head["dim"] not in (-1, 2) or head["start"] not in (None, 0) or not isinstance(head["end"], int) or head["step"] != 1:
        return None
    k = head["end"]
    ranked = getitem_of(head["self"], 1)  # topk_lowest_index_ties: sort(stable, descending)[1][..., :k]
    if not is_op(ranked, aten.sort.stable):
        return None
    order = op_args(ranked)
    if order["stable"] is not True or order["descending"] is not True or order["dim"] not in (-1, 2):
        return None
    padded = order["self"]
    if op_args(scattered["self"])["self"] is not padded or not is_op(padded, aten.cat.default):
        return None
    if len(op_args(padded)["tensors"]) != 2:
        return None
    scores, pad = op_args(padded)["tensors"]
    if not is_op(pad, aten.new_full.default) or not is_neg_inf(op_args(pad)["fill_value"]) or op_args(pad)["size"][-1] != k:
        return None
    if not is_op(scores, aten.masked_fill.Scalar) or not is_neg_inf(op_args(scores)["value"]):
        return None
    inverted = op_args(scores)["mask"]
    if not is_op(inverted, aten.bitwise_not.default, aten.logical_not.default) or not is_causal_mask(op_args(inverted)["self"]):
        return None
    summed = op_args(scores)["self"]
    if not is_op(summed, aten.sum.dim_IntList) or list(op_args(summed)["dim"] or ()) not in ([2], [-2]):
        return None
    weighted = op_args(summed)["self"]
    if not is_op(weighted, aten.mul.Tensor):
        return None
    relu, w_unsq = op_args(weighted)["self"], op_args(weighted)["other"]
    if not is_op(relu, aten.relu.default) or not is_op(w_unsq, aten.unsqueeze.default) or op_args(w_unsq)["dim"] not in (3, -1):
        return None
    scaled = op_args(relu)["self"]
    scale = const_float(op_args(scaled)["other"]) if is_op(scaled, aten.mul.Tensor) else None
    if scale is None or scale <= 0:  # relu(c x) = c relu(x) only for c > 0
        return None
    logits = through(op_args(scaled)["self"])
    if not is_op(logits, aten.einsum.default) or op_args(logits)["equation"].replace(" ", "") != "bshd,btd->bsht":
        return None
    q, key = op_args(logits)["tensors"]
    if len(shape_of(q)) != 4 or len(shape_of(key)) != 3:
        return None
    return ranked, through_casts(q), through_casts(key), op_args(w_unsq)["self"], scale, k


@register_pass("match", expected=expected_sparse_layers)
def match_sparse_mla(gm: fx.GraphModule, ctx) -> PassOutcome:
    sparse_op, topk_op = torch.ops.fxglm5.sparse_mla.default, torch.ops.fxglm5.indexer_topk.default
    indices_for: dict[fx.Node, fx.Node] = {}  # selection node -> indexer_topk node (shared layers reuse it)

    def rewrite(node: fx.Node) -> bool:
        if not is_op(node, aten.softmax.int, aten._softmax.default):
            return False
        match = match_mla_attention(node, ctx)
        selection = _split_allowed(match.allowed) if match is not None else None
        if selection is None:
            return False
        if selection not in indices_for:
            found = _match_indexer(selection)
            if found is None:
                return False
            ranked, q, key, weights, scale, k = found
            scaled_w = insert_call(gm, ranked, aten.mul.Tensor, (weights, scale))
            scaled_w.meta["val"] = fake_call(aten.mul.Tensor, weights, scale)
            args = (q, key, scaled_w, k)
            indices_for[selection] = insert_call(gm, ranked, topk_op, args, fake_call(topk_op, *args))
        weights_uk_uv = absorbed_weights(gm, match, match.output)
        if weights_uk_uv is None:
            return False
        replace_attention(gm, match, sparse_op, (indices_for[selection],), weights_uk_uv)
        return True

    matches = rewrite_each(gm, rewrite)
    return PassOutcome(matches, {"indexer_topk": len(indices_for), "shared_layers": matches - len(indices_for)})
