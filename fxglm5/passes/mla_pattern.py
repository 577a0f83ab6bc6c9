"""The generic (naive) MLA attention subgraph, recognised from its softmax; shared by match_mla and
match_sparse_mla, which differ only in the mask they accept.

The walk checks, from the softmax outward:
  scores = matmul(cat([q_nope, q_pe]).T12, cat([k_nope, expand(k_pe)]).T12.T23) * scale
  probs  = softmax(masked_fill(scores, ~unsqueeze(allowed, 1), -inf), -1)
  out    = matmul(probs, v.T12).T12        with k_nope | v = split(view(linear(c_kv, W_kv_b)))
and that ``scale`` is the model's softmax scale (1/sqrt(qk_head_dim) unless the config says other).
Anything else (an added bias, another scale, a mask applied differently) is not a match.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
from torch import fx

from fxglm5.passes.dequant import match_dequant, plain_weight
from fxglm5.passes.graph_utils import (
    add_constant, aten, const_float, fake_call, get_attr_tensor, getitem_of, insert_call, is_neg_inf, is_op,
    op_args, replayable, shape_of, through,
)


@dataclasses.dataclass
class MLAMatch:
    q_nope: fx.Node  # [B, S, H, dn]
    q_pe: fx.Node  # [B, S, H, dr], roped
    kv_c: fx.Node  # [B, S, R], normed latent
    k_pe: fx.Node  # [B, S, 1, dr], roped
    kv_b_weight: fx.Node  # the (dequantized) kv_b_proj weight [H*(dn+dv), R]
    allowed: fx.Node  # bool mask [B|1, S, S], True = attend
    output: fx.Node  # [B, S, H, dv] (the transpose after P.V)
    scale: float
    heads: int
    dn: int
    dv: int


def _is_transpose(node, d0, d1) -> bool:
    if not is_op(node, aten.transpose.int):
        return False
    ndim = len(shape_of(node) or ())
    dims = sorted(op_args(node)[d] % ndim for d in ("dim0", "dim1")) if ndim else []
    return dims == sorted((d0, d1))


def _cat_last(node) -> list | None:
    if not is_op(node, aten.cat.default) or len(op_args(node)["tensors"]) != 2:
        return None
    cat = op_args(node)
    return list(cat["tensors"]) if cat["dim"] in (-1, len(shape_of(node)) - 1) else None


def _split_parts(node) -> tuple[fx.Node, fx.Node, list] | None:
    """(linear, view, sizes) for ``split_with_sizes(view(linear(...)), sizes, -1)``."""
    if not is_op(node, aten.split_with_sizes.default):
        return None
    split = op_args(node)
    view = split["self"]
    if split["dim"] not in (-1, 3) or not is_op(view, aten.view.default, aten.reshape.default, aten._unsafe_view.default):
        return None
    linear = through(op_args(view)["self"])
    if not is_op(linear, aten.linear.default) or op_args(linear)["bias"] is not None:
        return None
    return linear, view, list(split["split_sizes"])


def expected_scale(ctx, head_dim: int) -> float:
    cfg = getattr(ctx, "config", None)
    return cfg.softmax_scale if cfg is not None else head_dim**-0.5


def match_mla_attention(softmax: fx.Node, ctx) -> MLAMatch | None:
    if not is_op(softmax, aten.softmax.int, aten._softmax.default) or op_args(softmax)["dim"] not in (-1, 3):
        return None
    masked = through(op_args(softmax)["self"])
    if is_op(masked, aten.to.dtype, aten._to_copy.default):  # softmax computed in float32
        masked = through(op_args(masked)["self"])
    if not is_op(masked, aten.masked_fill.Scalar) or not is_neg_inf(op_args(masked)["value"]):
        return None
    inverted = op_args(masked)["mask"]
    if not is_op(inverted, aten.bitwise_not.default, aten.logical_not.default):
        return None
    unsq = op_args(inverted)["self"]
    if not is_op(unsq, aten.unsqueeze.default) or op_args(unsq)["dim"] != 1:
        return None
    allowed = op_args(unsq)["self"]

    scaled = through(op_args(masked)["self"])
    if not is_op(scaled, aten.mul.Tensor) or const_float(op_args(scaled)["other"]) is None:
        return None
    scale = const_float(op_args(scaled)["other"])
    qk = through(op_args(scaled)["self"])
    if not is_op(qk, aten.matmul.default):
        return None
    query, key_t = op_args(qk)["self"], op_args(qk)["other"]
    if not _is_transpose(query, 1, 2) or not _is_transpose(key_t, 2, 3):
        return None
    key = op_args(key_t)["self"]
    if not _is_transpose(key, 1, 2):
        return None
    q_parts, k_parts = _cat_last(op_args(query)["self"]), _cat_last(op_args(key)["self"])
    if q_parts is None or k_parts is None:
        return None
    q_nope, q_pe = q_parts
    k_nope, k_pe_expanded = k_parts
    if not is_op(k_pe_expanded, aten.expand.default):
        return None
    k_pe = op_args(k_pe_expanded)["self"]

    split = getitem_of(k_nope, 0)
    parts = _split_parts(split) if split is not None else None
    if parts is None:
        return None
    linear, view, sizes = parts
    if len(sizes) != 2:
        return None
    dn, dv = sizes
    heads = shape_of(view)[2]
    head_dim = shape_of(query)[-1]
    if not math.isclose(scale, expected_scale(ctx, head_dim), rel_tol=1e-6):
        return None

    # Output side: probs (maybe cast back) @ v.T12, then .T12 -> [B, S, H, dv].
    users = list(softmax.users)
    probs = users[0] if len(users) == 1 and is_op(users[0], aten.to.dtype, aten._to_copy.default) else softmax
    pv_users = [u for u in probs.users if is_op(u, aten.matmul.default) and op_args(u)["self"] is probs]
    if len(pv_users) != 1 or len(probs.users) != 1:
        return None
    pv = pv_users[0]
    v_t = op_args(pv)["other"]
    if not _is_transpose(v_t, 1, 2) or getitem_of(op_args(v_t)["self"], 1) is not split:
        return None
    out_users = list(pv.users)
    if len(out_users) != 1 or not _is_transpose(out_users[0], 1, 2):
        return None
    projection = op_args(linear)
    return MLAMatch(q_nope, q_pe, projection["input"], k_pe, projection["weight"], allowed, out_users[0], scale, heads, dn, dv)


def absorbed_weights(gm: fx.GraphModule, match: MLAMatch, before: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """W_UK [H, dn, R] and W_UV [H, dv, R] split from kv_b_proj's weight, registered as constants.

    The weight is dequantized once, here, to the compute dtype (as serving engines do at load time);
    on the meta device this stays a meta tensor. Returns None if the weight is not a constant. Each constant
    records how it is derived from the weight (and scale) attributes, for capture by layer kind.
    """
    deq = match_dequant(match.kv_b_weight)
    if deq is not None:
        leaves = [deq.weight, deq.scale]
    else:
        source = plain_weight(match.kv_b_weight)
        if source is None:
            return None
        leaves = [source]
    sources = tuple(leaf.target for leaf in leaves)
    weight_fn = replayable(match.kv_b_weight, leaves)
    owner = leaves[0].target.rpartition(".")[0]
    parts = {}
    for index, name in enumerate(("w_uk", "w_uv")):
        derive = functools.partial(_absorbed_part, weight_fn, match.heads, match.dn, index)
        with torch.no_grad():
            tensor = derive(*(get_attr_tensor(gm, leaf) for leaf in leaves))
        parts[name] = add_constant(gm, owner, name, tensor, before, (sources, derive))
    return parts["w_uk"], parts["w_uv"]


def _absorbed_part(weight_fn, heads: int, dn: int, index: int, *sources) -> torch.Tensor:
    """W_UK (index 0) or W_UV (index 1) [H, d, R] of the kv_b_proj weight ``weight_fn(*sources)`` [H*(dn+dv), R]."""
    weight = weight_fn(*sources)
    per_head = weight.reshape(heads, -1, weight.shape[-1])
    return (per_head[:, :dn] if index == 0 else per_head[:, dn:]).contiguous()


def is_causal_mask(node) -> bool:
    """``unsqueeze(le(arange(S)[None, :], arange(S)[:, None]), 0)``: True where key <= query."""
    if is_op(node, aten.unsqueeze.default) and op_args(node)["dim"] == 0:
        node = op_args(node)["self"]
    if not is_op(node, aten.le.Tensor, aten.ge.Tensor):
        return False
    lhs, rhs = op_args(node)["self"], op_args(node)["other"]
    if node.target is aten.ge.Tensor:
        lhs, rhs = rhs, lhs
    return _unsqueezed_arange(lhs, 0) is not None and _unsqueezed_arange(lhs, 0) is _unsqueezed_arange(rhs, 1)


def _unsqueezed_arange(node, dim: int) -> fx.Node | None:
    """The ``arange`` node of ``arange(...).unsqueeze(dim)``, else None."""
    if not is_op(node, aten.unsqueeze.default) or op_args(node)["dim"] != dim:
        return None
    source = op_args(node)["self"]
    return source if is_op(source, aten.arange.default, aten.arange.start) else None


def replace_attention(gm: fx.GraphModule, match: MLAMatch, op, extra_args: tuple, weights) -> fx.Node:
    """Insert ``op(q_nope, q_pe, kv_c, k_pe[:, :, 0], w_uk, w_uv, *extra_args, scale)`` for the match."""
    k_pe = insert_call(gm, match.output, aten.squeeze.dim, (match.k_pe, 2))
    k_pe.meta["val"] = fake_call(aten.squeeze.dim, match.k_pe, 2)
    args = (match.q_nope, match.q_pe, match.kv_c, k_pe, *weights, *extra_args, match.scale)
    new = insert_call(gm, match.output, op, args, fake_call(op, *args))
    match.output.replace_all_uses_with(new)
    return new
