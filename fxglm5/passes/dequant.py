"""Recognising a block-FP8 weight dequantization in the graph (shared by fuse_fp8_linear / fuse_fp8_moe
and match_*_mla, which fold kv_b_proj's dequantized weight into W_UK / W_UV).

A candidate is any weight subgraph built only from casts, multiplies and view ops over exactly two
constants: an e4m3 weight [.., N, K] and a float32 scale [.., ceil(N/128), ceil(K/128)]. Its meaning is
then *checked*, not assumed: the subgraph is evaluated on probe values and must equal
``dequantize_block_fp8`` exactly. A different block size, a transposed or doubled scale is rejected.
Verdicts are cached per subgraph structure, so 78 identical layers cost one probe.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import fx

from fxglm5.lowering.reference.fp8 import dequantize_block_fp8
from fxglm5.passes.graph_utils import aten, evaluate, leaves

_DEQUANT_OPS = {
    aten.to.dtype, aten._to_copy.default, aten.mul.Tensor, aten.unsqueeze.default, aten.expand.default,
    aten.reshape.default, aten.view.default, aten._unsafe_view.default, aten.alias.default, aten.slice.Tensor,
    aten.clone.default, aten.contiguous.default, aten.repeat_interleave.self_int,
}
_verdicts: dict[tuple, bool] = {}


@dataclasses.dataclass(frozen=True)
class Dequant:
    weight: fx.Node  # get_attr of the e4m3 weight
    scale: fx.Node  # get_attr of the float32 weight_scale_inv


def _block_scale_shape(shape) -> tuple:
    *lead, n, k = shape
    return (*lead, -(-n // 128), -(-k // 128))


def _structure_key(node: fx.Node, w: fx.Node, s: fx.Node) -> tuple:
    order, stack, seen = [], [node], set()
    while stack:
        n = stack.pop()
        if n in seen or n.op == "get_attr":
            continue
        seen.add(n)
        args = fx.node.map_arg((n.args, n.kwargs), lambda a: "W" if a is w else "S" if a is s else "n")
        order.append((str(n.target), repr(args)))
        stack.extend(n.all_input_nodes)
    return (tuple(order), tuple(w.meta["val"].shape))


def _probe(node: fx.Node, w: fx.Node, s: fx.Node) -> bool:
    gen = torch.Generator().manual_seed(0)
    wshape, sshape = tuple(w.meta["val"].shape), tuple(s.meta["val"].shape)
    w_probe = (torch.randn(wshape, generator=gen) * 64).to(torch.float8_e4m3fn)
    s_probe = torch.rand(sshape, generator=gen) + 0.5
    try:
        got = evaluate(node, {w: w_probe, s: s_probe})
    except Exception:  # noqa: BLE001 - anything that does not evaluate is simply not a dequantization
        return False
    want = dequantize_block_fp8(w_probe, s_probe).to(node.meta["val"].dtype)
    return isinstance(got, torch.Tensor) and got.shape == want.shape and torch.equal(got, want)


def match_dequant(node: fx.Node) -> Dequant | None:
    """The (weight, scale) constants if ``node`` computes their block dequantization, else None."""
    if not isinstance(node, fx.Node) or not isinstance(node.meta.get("val"), torch.Tensor):
        return None
    found = leaves(node, _DEQUANT_OPS)
    if found is None or len(found) != 2:
        return None
    by_dtype = {n.meta["val"].dtype: n for n in found if isinstance(n.meta.get("val"), torch.Tensor)}
    w, s = by_dtype.get(torch.float8_e4m3fn), by_dtype.get(torch.float32)
    if w is None or s is None or tuple(s.meta["val"].shape) != _block_scale_shape(w.meta["val"].shape):
        return None
    if tuple(node.meta["val"].shape) != tuple(w.meta["val"].shape):
        return None
    key = _structure_key(node, w, s)
    if key not in _verdicts:
        _verdicts[key] = _probe(node, w, s)
    return Dequant(w, s) if _verdicts[key] else None


def plain_weight(node: fx.Node) -> fx.Node | None:
    """An unquantized weight: a get_attr, possibly cast to the compute dtype."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in (aten.to.dtype, aten._to_copy.default, aten.alias.default):
        node = node.args[0]
    return node if isinstance(node, fx.Node) and node.op == "get_attr" else None
