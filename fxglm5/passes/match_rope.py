"""match_rope: interleaved RoPE -> ``fxglm5::rope_interleaved``.

The generic form rotates the pairs ``(x[2i], x[2i+1])`` with strided slices, four muls, a sub, an add, a
stack and two casts (about nine kernels and four float32 temporaries per call); the indexer's partial form
also splits off and re-concatenates the features it does not rotate. Both become one op (one kernel), which
``fuse_norm_rope_into_cache_writes`` can then fold into the attention ops. GLM-5 applies RoPE to the MLA
query and key in every layer and to the indexer's query and key in every layer that runs an indexer.
"""

from __future__ import annotations

import torch
from torch import fx

from fxglm5.passes.graph_utils import (
    aten, dtype_of, float32_source, getitem_of, is_cast, is_op, op_args, replace_with_call, rewrite_each, shape_of,
)
from fxglm5.passes.manager import PassOutcome
from fxglm5.passes.registry import register_pass

_END = 2**63 - 1


def expected_ropes(ctx) -> int:
    cfg = ctx.config
    return 2 * cfg.num_hidden_layers + 2 * sum(cfg.has_indexer(i) for i in range(cfg.num_hidden_layers))


def _operands(node: fx.Node) -> tuple:
    args = op_args(node)
    return args["self"], args["other"]


def _strided_half(node, start: int):
    """xf for ``xf[..., start::2]`` over the last of 4 dims."""
    if not is_op(node, aten.slice.Tensor):
        return None
    sliced = op_args(node)
    if sliced["dim"] not in (3, -1) or sliced["start"] != start or sliced["end"] not in (_END, None) or sliced["step"] != 2:
        return None
    return sliced["self"]


def _unsqueezed(node):
    if not is_op(node, aten.unsqueeze.default):
        return None
    unsq = op_args(node)
    return unsq["self"] if unsq["dim"] == 2 and len(shape_of(unsq["self"]) or ()) == 3 else None


def _match(flat: fx.Node) -> tuple | None:
    """(result node, x, cos, sin) when ``flat`` is the flatten of the rotated pairs."""
    if not is_op(flat, aten.flatten.using_ints) or (op_args(flat)["start_dim"], op_args(flat)["end_dim"]) != (-2, -1):
        return None
    stack = op_args(flat)["self"]
    if not is_op(stack, aten.stack.default) or op_args(stack)["dim"] != -1 or len(op_args(stack)["tensors"]) != 2:
        return None
    sub, add = op_args(stack)["tensors"]
    if not is_op(sub, aten.sub.Tensor) or not is_op(add, aten.add.Tensor) or op_args(sub)["alpha"] != 1 or op_args(add)["alpha"] != 1:
        return None
    if not all(is_op(m, aten.mul.Tensor) for m in (*_operands(sub), *_operands(add))):
        return None
    x_cos, x_sin = _operands(sub)  # even*cos - odd*sin
    for even, c in (_operands(x_cos), _operands(x_cos)[::-1]):
        xf = _strided_half(even, 0)
        cos = _unsqueezed(c)
        if xf is None or cos is None:
            continue
        for odd, s in (_operands(x_sin), _operands(x_sin)[::-1]):
            sin = _unsqueezed(s)
            if _strided_half(odd, 1) is not xf or sin is None:
                continue
            odd_cos, even_sin = _operands(add)
            if set(_operands(odd_cos)) != {odd, c} or set(_operands(even_sin)) != {even, s}:
                continue
            x = float32_source(xf)
            if x is None or shape_of(x)[-1] != 2 * shape_of(cos)[-1] or dtype_of(cos) != torch.float32:
                continue
            result = flat
            users = list(flat.users)
            if len(users) == 1 and is_cast(users[0]) and dtype_of(users[0]) == dtype_of(x):
                result = users[0]
            if dtype_of(result) != dtype_of(x):
                continue
            return result, x, cos, sin
    return None


def _partial(cat: fx.Node, op) -> tuple | None:
    """(x, cos, sin) for ``cat([rope(x[..., :r]), x[..., r:]], -1)`` (the indexer's split-rotate-concat)."""
    if not is_op(cat, aten.cat.default) or len(op_args(cat)["tensors"]) != 2 or op_args(cat)["dim"] not in (-1, 3):
        return None
    rotated, rest = op_args(cat)["tensors"]
    if not is_op(rotated, op):
        return None
    rope = op_args(rotated)
    split = getitem_of(rope["x"], 0)
    if split is None or getitem_of(rest, 1) is not split or not is_op(split, aten.split_with_sizes.default):
        return None
    if len(op_args(split)["split_sizes"]) != 2 or op_args(split)["dim"] not in (-1, 3):
        return None
    if len(rotated.users) != 1 or dtype_of(cat) != dtype_of(op_args(split)["self"]):
        return None
    return op_args(split)["self"], rope["cos"], rope["sin"]


@register_pass("match", expected=expected_ropes)
def match_rope(gm: fx.GraphModule, ctx) -> PassOutcome:
    op = torch.ops.fxglm5.rope_interleaved.default

    def whole(node: fx.Node) -> bool:
        found = _match(node)
        if found is not None:
            result, *args = found
            replace_with_call(gm, result, op, tuple(args))
        return found is not None

    def partial(node: fx.Node) -> bool:
        found = _partial(node, op)
        if found is not None:
            replace_with_call(gm, node, op, found)
        return found is not None

    matches = rewrite_each(gm, whole)
    return PassOutcome(matches, {"partial": rewrite_each(gm, partial)})
