"""Recognising a block-FP8 weight dequantization in the graph (shared by fuse_fp8_linear / fuse_fp8_moe
and match_*_mla, which fold kv_b_proj's dequantized weight into W_UK / W_UV).

A candidate is any weight subgraph built only from casts, multiplies and view ops over exactly two
constants: an e4m3 weight [.., N, K] and a float32 scale [.., ceil(N/128), ceil(K/128)] (``halves``: the
MoE's stacked gate|up weight [.., 2I, K], each half blocked on its own, [.., 2 * ceil(I/128), ceil(K/128)]).
Its meaning is then *checked*, not assumed: the subgraph is evaluated on probe values and must equal
``dequantize_block_fp8`` (``dequantize_gate_up``) exactly. A different block size, a transposed or doubled
scale, halves read as one weight (or the reverse, where I is not a multiple of 128) are rejected.
Verdicts are cached per subgraph structure, so 78 identical layers cost one probe. Weights too large to
probe (GLM-5's stacked experts: 6.4 G values) are accepted only if their structure, with sizes left out,
is one already verified, e.g. that of the model's own ``dequantize_weight`` (``dequantize_gate_up``)
traced at a small size of the same rank and the same 128-divisibility.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import fx

from fxglm5.lowering.reference.fp8 import dequantize_block_fp8, dequantize_gate_up
from fxglm5.contracts import scale_shape
from fxglm5.passes.graph_utils import aten, evaluate, leaves, op_args

_DEQUANT_OPS = {
    aten.to.dtype, aten._to_copy.default, aten.mul.Tensor, aten.unsqueeze.default, aten.expand.default,
    aten.reshape.default, aten.view.default, aten._unsafe_view.default, aten.alias.default, aten.slice.Tensor,
    aten.clone.default, aten.contiguous.default, aten.repeat_interleave.self_int,
}
_verdicts: dict[tuple, bool] = {}
_verified_shapes_free: set[tuple] = set()
PROBE_LIMIT = 1 << 22  # elements (4 M: probing costs a full-size evaluation); larger weights are judged by their size-free structure


@dataclasses.dataclass(frozen=True)
class Dequant:
    weight: fx.Node  # get_attr of the e4m3 weight
    scale: fx.Node  # get_attr of the float32 weight_scale_inv


def _structure_key(node: fx.Node, w: fx.Node, s: fx.Node, with_sizes: bool = True) -> tuple:
    """The ops and constant arguments from ``node`` back to (w, s); ``with_sizes=False`` blanks ints."""
    order, stack, seen = [], [node], set()

    def norm(a):
        if isinstance(a, bool) or with_sizes:
            return a
        return "#" if isinstance(a, int) else a

    while stack:
        n = stack.pop()
        if n in seen or n.op == "get_attr":
            continue
        seen.add(n)
        args = fx.node.map_arg((n.args, n.kwargs), lambda a: "W" if a is w else "S" if a is s else "n")
        args = torch.utils._pytree.tree_map(norm, args)
        order.append((str(n.target), repr(args)))
        stack.extend(n.all_input_nodes)
    return (tuple(order), tuple(w.meta["val"].shape) if with_sizes else len(w.meta["val"].shape))


def _analogue_key(shape: tuple, out_dtype: torch.dtype, halves: bool) -> tuple | None:
    """Size-free structure of the model's own dequantize_weight (dequantize_gate_up), traced and
    probe-verified at a small shape with the same rank and the same divisibility by 128 as ``shape``
    (of each half's rows)."""
    from fxglm5.model import layers  # the model's own dequantization (the probe's reference is the kernels')

    *lead, n, k = shape
    rows = n // 2 if halves else n
    small_rows = 128 if rows % 128 == 0 else 100
    small = (*[2] * len(lead), 2 * small_rows if halves else small_rows, 256 if k % 128 == 0 else 200)
    dequantize = layers.dequantize_gate_up if halves else layers.dequantize_weight

    class Analogue(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.empty(small, dtype=torch.float8_e4m3fn), requires_grad=False)
            self.s = torch.nn.Parameter(torch.ones(scale_shape(small, halves)), requires_grad=False)

        def forward(self, x):
            return dequantize(self.w, self.s, out_dtype) + x

    gm = torch.export.export(Analogue(), (torch.zeros((), dtype=out_dtype),), strict=False).module()
    (total,) = next(n for n in gm.graph.nodes if n.op == "output").args[0]  # dequantize(w, s) + x
    out = op_args(total)["self"]
    found = leaves(out, _DEQUANT_OPS | {aten._assert_tensor_metadata.default})
    w = next(n for n in found if n.meta["val"].dtype == torch.float8_e4m3fn)
    s = next(n for n in found if n.meta["val"].dtype == torch.float32)
    return _structure_key(out, w, s, with_sizes=False) if _probe(out, w, s, halves) else None


def _probe(node: fx.Node, w: fx.Node, s: fx.Node, halves: bool) -> bool:
    gen = torch.Generator().manual_seed(0)
    wshape, sshape = tuple(w.meta["val"].shape), tuple(s.meta["val"].shape)
    w_probe = (torch.randn(wshape, generator=gen) * 64).to(torch.float8_e4m3fn)
    s_probe = torch.rand(sshape, generator=gen) + 0.5
    try:
        got = evaluate(node, {w: w_probe, s: s_probe})
    except Exception:  # noqa: BLE001 - anything that does not evaluate is simply not a dequantization
        return False
    want = (dequantize_gate_up if halves else dequantize_block_fp8)(w_probe, s_probe).to(node.meta["val"].dtype)
    return isinstance(got, torch.Tensor) and got.shape == want.shape and torch.equal(got, want)


def match_dequant(node: fx.Node, halves: bool = False) -> Dequant | None:
    """The (weight, scale) constants if ``node`` computes their block dequantization (``halves``: that of
    a stacked gate|up weight), else None."""
    if not isinstance(node, fx.Node) or not isinstance(node.meta.get("val"), torch.Tensor):
        return None
    found = leaves(node, _DEQUANT_OPS)
    if found is None or len(found) != 2:
        return None
    by_dtype = {n.meta["val"].dtype: n for n in found if isinstance(n.meta.get("val"), torch.Tensor)}
    w, s = by_dtype.get(torch.float8_e4m3fn), by_dtype.get(torch.float32)
    if w is None or s is None:
        return None
    wshape = tuple(w.meta["val"].shape)
    if halves and (len(wshape) < 2 or wshape[-2] % 2):
        return None
    if tuple(s.meta["val"].shape) != scale_shape(wshape, halves) or tuple(node.meta["val"].shape) != wshape:
        return None
    key = (halves, _structure_key(node, w, s))
    if key not in _verdicts:
        free = (halves, _structure_key(node, w, s, with_sizes=False))
        if w.meta["val"].numel() <= PROBE_LIMIT:
            _verdicts[key] = _probe(node, w, s, halves)
        else:
            if free not in _verified_shapes_free:
                analogue = _analogue_key(wshape, node.meta["val"].dtype, halves)
                if analogue is not None:
                    _verified_shapes_free.add((halves, analogue))
            _verdicts[key] = free in _verified_shapes_free
        if _verdicts[key]:
            _verified_shapes_free.add(free)
    return Dequant(w, s) if _verdicts[key] else None


def plain_weight(node: fx.Node) -> fx.Node | None:
    """An unquantized weight: a get_attr, possibly cast to the compute dtype."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in (aten.to.dtype, aten._to_copy.default, aten.alias.default):
        node = op_args(node)["self"]
    return node if isinstance(node, fx.Node) and node.op == "get_attr" else None
