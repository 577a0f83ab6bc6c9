"""shard_attention: the rank's heads of every MLA / sparse-MLA attention, then one all-reduce after o_proj.

From each ``fxglm5::sparse_mla`` / ``mla`` node the pass walks to the parts that carry the head dim, by node
identity (in the tiny config H*dv equals the hidden size, so values would not tell them apart):
  q_b_proj (linear) -> view [B, S, H, dn+dr] -> split -> q_nope, rope(q_pe)     -> the attention
  W_UK [H, dn, R], W_UV [H, dv, R] (absorbed from kv_b_proj)                    -> the attention
  the attention [B, S, H, dv] -> reshape [B, S, H*dv] -> o_proj (linear)
and keeps heads [H/tp*r, H/tp*(r+1)): q_b_proj's rows (and their block scales), the view's head count, W_UK /
W_UV by head, the reshape's width and o_proj's columns, whose output is then a partial sum: ``fxglm5::all_reduce``.
q_a / kv_a and their norms and the DSA indexer stay whole: every rank writes every index key and selects the same
keys (at a prefill, each rank selects for its share of the tokens and they are gathered: ``shard_indexer``).

W_UK / W_UV are constants derived from kv_b_proj: the plan gets kv_b_proj's rows of the rank's heads (and their
scales) and the constants' recipe (``graph.meta["derived_constants"]``) becomes one that derives the rank's W_UK /
W_UV from those rows, so a loader that reads only the slices derives them again.
"""

from __future__ import annotations

import functools

import torch
from torch import fx

from fxglm5.capture.by_kind import DERIVED
from fxglm5.lowering.reference.fp8 import dequantize_block_fp8
from fxglm5.parallel import Slice
from fxglm5.passes.graph_utils import get_attr_tensor, getitem_of, is_op, op_args, set_op_args
from fxglm5.passes.manager import PassOutcome
from fxglm5.passes.mla_pattern import _absorbed_part
from fxglm5.passes.registry import register_pass
from fxglm5.passes.sharding import (
    block_part, linear, mark, record, reduce_after, shard_attr, shard_each, shard_linear,
)

aten = torch.ops.aten
_RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def expected_attention(ctx) -> int:
    return ctx.config.num_hidden_layers if ctx.mapping.world > 1 else 0


def _sizes(node: fx.Node) -> list:
    """The target shape of a view / reshape node."""
    args = op_args(node)
    return list(args["size"] if "size" in args else args["shape"])


def _resize(node: fx.Node, dim: int, size: int) -> None:
    """Set the view / reshape's target size at ``dim``."""
    sizes = _sizes(node)
    sizes[dim] = size
    set_op_args(node, **{"size" if "size" in op_args(node) else "shape": sizes})
    mark(node)


def _query(q_nope: fx.Node, q_pe: fx.Node, heads: int):
    """(q_b linear, head view) behind q_nope = split(view(q_b(x)))[0], q_pe = rope(split(...)[1])."""
    split = getitem_of(q_nope, 0)
    if not is_op(split, aten.split_with_sizes.default) or not is_op(q_pe, torch.ops.fxglm5.rope_interleaved.default):
        return None
    if getitem_of(op_args(q_pe)["x"], 1) is not split:
        return None
    view = op_args(split)["self"]
    if not is_op(view, *_RESHAPES) or len(_sizes(view)) != 4 or _sizes(view)[2] != heads:
        return None
    lin = linear(op_args(view)["self"])
    return (lin, view) if lin is not None and len(lin.node.users) == 1 else None


def _output(attention: fx.Node, width: int):
    """(reshape to [B, S, H*dv], o_proj linear) after the attention node."""
    users = list(attention.users)
    if len(users) != 1 or not is_op(users[0], *_RESHAPES) or _sizes(users[0])[-1] != width:
        return None
    reshape = users[0]
    lins = [linear(u) for u in reshape.users]
    if len(lins) != 1 or lins[0] is None or lins[0].x is not reshape:
        return None
    return reshape, lins[0]


def _dequantized(dtype: torch.dtype, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """kv_b_proj's weight in the compute dtype, for any number of its rows (the graph's own dequantization,
    which match_dequant proved equal to ``dequantize_block_fp8``, is traced at the full size)."""
    return (weight if scale is None else dequantize_block_fp8(weight, scale)).to(dtype)


def _split_absorbed(gm: fx.GraphModule, consts: tuple, sources, heads: int, dn: int, dv: int, part) -> None:
    """W_UK / W_UV by head. Derived from kv_b_proj (``sources``): the plan gets kv_b_proj's rows of the heads and the
    recipe becomes one over those rows; constants of their own (an artifact's): the plan lists them."""
    h0, h1 = part
    dtype = get_attr_tensor(gm, consts[0]).dtype
    for index, const in enumerate(consts):
        shard_attr(gm, const, Slice(0, h0, h1), planned=not sources)
        if sources:
            gm.meta[DERIVED][const.target] = (sources, functools.partial(
                _absorbed_part, functools.partial(_dequantized, dtype), h1 - h0, dn, index))
    if sources:
        rows = Slice(0, h0 * (dn + dv), h1 * (dn + dv))
        record(gm, sources[0], rows)
        if len(sources) == 2:
            record(gm, sources[1], block_part(rows, heads * (dn + dv), sources[0]))


def _shard_one(gm: fx.GraphModule, node: fx.Node, mapping) -> bool:
    ops = torch.ops.fxglm5
    if not is_op(node, ops.sparse_mla.default, ops.mla.default):
        return False
    args, derived = op_args(node), gm.meta.get(DERIVED, {})
    w_uk, w_uv = args["w_uk"], args["w_uv"]
    if w_uk.op != "get_attr" or w_uv.op != "get_attr":
        return False
    heads, dn, _ = get_attr_tensor(gm, w_uk).shape
    dv = get_attr_tensor(gm, w_uv).shape[1]
    query, output = _query(args["q_nope"], args["q_pe"], heads), _output(node, heads * dv)
    sources = {derived[w.target][0] if w.target in derived else None for w in (w_uk, w_uv)}
    if query is None or output is None or len(sources) != 1:  # both derived from one kv_b_proj, or neither
        return False
    (q_b, view), (reshape, o_proj) = query, output
    h0, h1 = mapping.part(heads)
    qk = _sizes(view)[3]
    shard_linear(gm, q_b, 0, h0 * qk, h1 * qk)
    _resize(view, 2, h1 - h0)
    _split_absorbed(gm, (w_uk, w_uv), sources.pop(), heads, dn, dv, (h0, h1))
    _resize(reshape, -1, (h1 - h0) * dv)
    shard_linear(gm, o_proj, 1, h0 * dv, h1 * dv)
    reduce_after(gm, o_proj.node, mapping, "shard_attention")
    return True


@register_pass("shard", expected=expected_attention)
def shard_attention(gm: fx.GraphModule, ctx) -> PassOutcome:
    return PassOutcome(shard_each(gm, ctx, _shard_one))
