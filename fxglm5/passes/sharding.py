"""What the shard passes share: narrowing a weight attribute to the rank's part (and recording it in the shard
plan), recognising the linears they split, inserting the collectives, and re-deriving every node's example
value from the rank-local tensors.

A linear here is ``fxglm5::fp8_linear(x, W e4m3, scale)`` or ``aten.linear(x, W)`` over a plain weight (the bf16
lm_head, bf16 checkpoints). Splitting an FP8 weight's rows or columns splits its block scales with it, in block
units; a split that does not fall on a block edge is a PassError (``Mapping.check`` refuses such configs first).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import fx
from torch._dispatch.python import enable_python_dispatcher

from fxglm5.capture.by_kind import MATCH_ANCHOR
from fxglm5.errors import PassError
from fxglm5.parallel import BLOCK, PLAN, Mapping, Slice
from fxglm5.passes.dequant import plain_weight
from fxglm5.passes.graph_utils import aten, get_attr_tensor, is_op, op_args, rewrite_each

_DIRTY = "fxglm5_shard_dirty"  # node.meta key of the nodes a shard pass changed (see refresh)


@dataclasses.dataclass(frozen=True)
class Linear:
    node: fx.Node  # the fp8_linear / aten.linear call
    x: fx.Node
    weight: fx.Node  # get_attr [N, K]
    scale: fx.Node | None  # get_attr [ceil(N/128), ceil(K/128)] of an FP8 weight


def linear(node) -> Linear | None:
    """The parts of a bias-free fp8_linear / linear call over weight constants, else None."""
    if is_op(node, torch.ops.fxglm5.fp8_linear.default):
        args = op_args(node)
        ok = args["bias"] is None and all(a.op == "get_attr" for a in (args["weight"], args["weight_scale_inv"]))
        return Linear(node, args["x"], args["weight"], args["weight_scale_inv"]) if ok else None
    if is_op(node, aten.linear.default) and op_args(node)["bias"] is None:
        weight = plain_weight(op_args(node)["weight"])
        return Linear(node, op_args(node)["input"], weight, None) if weight is not None else None
    return None


def plan(gm: fx.GraphModule) -> dict[str, Slice]:
    return gm.meta.setdefault(PLAN, {})


def shard_attr(gm: fx.GraphModule, node: fx.Node, part: Slice, planned: bool = True) -> None:
    """Replace attribute ``node.target`` by its ``part`` (the rank-local tensor) and record it in the plan
    (``planned=False``: a derived constant, which the plan does not list: it is derived from its sliced sources)."""
    if node.target in plan(gm):  # another node reading an attribute already narrowed
        if plan(gm)[node.target] != part:
            raise PassError(f"shard stage: {node.target} is split two ways ({plan(gm)[node.target]} and {part})")
        node.meta["val"] = get_attr_tensor(gm, node)
        return
    owner_path, _, name = node.target.rpartition(".")
    owner = gm.get_submodule(owner_path) if owner_path else gm
    full = get_attr_tensor(gm, node)
    local = part.apply(full)
    if name in owner._parameters:
        owner.register_parameter(name, torch.nn.Parameter(local, requires_grad=False))
    elif name in owner._buffers:
        owner.register_buffer(name, local, persistent=name not in owner._non_persistent_buffers_set)
    else:  # a plain tensor attribute (a GraphModule built over another's attributes)
        setattr(owner, name, local)
    node.meta["val"] = local
    mark(node)
    if planned:
        plan(gm)[node.target] = part


def record(gm: fx.GraphModule, target: str, part: Slice) -> None:
    """A plan entry for an attribute the graph no longer reads (the source of a derived constant)."""
    plan(gm)[target] = part


def block_part(part: Slice, size: int, what: str) -> Slice:
    """``part`` of a dim of ``size`` in 128-block units (for the scales): its edges must be block edges."""
    if part.start % BLOCK or (part.stop % BLOCK and part.stop != size):
        raise PassError(f"{what}: rows/columns [{part.start}, {part.stop}) are not whole {BLOCK}-blocks of the FP8 "
                        "weight (Mapping.check should have refused this mapping)")
    return Slice(part.dim, part.start // BLOCK, -(-part.stop // BLOCK), part.halves)


def shard_linear(gm: fx.GraphModule, lin: Linear, dim: int, start: int, stop: int, halves: bool = False,
                 padded: bool = False) -> None:
    """Keep rows (``dim`` 0: output features) or columns (``dim`` 1: input features) [start, stop) of the linear's
    weight, its block scales with it (``padded``: rows past the weight's end are zeros, see ``Slice``)."""
    part = Slice(dim, start, stop, halves, padded)
    size = get_attr_tensor(gm, lin.weight).shape[dim]
    if lin.scale is not None:
        shard_attr(gm, lin.scale, block_part(part, size // 2 if halves else size, lin.weight.target))
    shard_attr(gm, lin.weight, part)


def anchor(node: fx.Node, name: str) -> fx.Node:
    """Mark ``node`` as the one node its pass adds per match (capture by layer kind counts the whole model's)."""
    node.meta[MATCH_ANCHOR] = name
    return node


def insert_after(gm: fx.GraphModule, node: fx.Node, target, args: tuple) -> fx.Node:
    """``target(*args)`` right after ``node``, in ``node``'s module (its module stack)."""
    with gm.graph.inserting_after(node):
        new = gm.graph.call_function(target, args)
    if "nn_module_stack" in node.meta:
        new.meta["nn_module_stack"] = node.meta["nn_module_stack"]
    return mark(new)


def reduce_after(gm: fx.GraphModule, node: fx.Node, mapping: Mapping, pass_name: str) -> fx.Node:
    """Sum ``node`` (a partial result) over the ranks: every user of ``node`` reads the all_reduce instead."""
    total = insert_after(gm, node, torch.ops.fxglm5.all_reduce.default, (node, mapping.group, mapping.world))
    node.replace_all_uses_with(total, delete_user_cb=lambda user: user is not total)
    return anchor(total, pass_name)


def gather_after(gm: fx.GraphModule, node: fx.Node, dim: int, mapping: Mapping, pass_name: str) -> fx.Node:
    """The ranks' ``node`` concatenated along ``dim``: every user of ``node`` reads the all_gather instead."""
    whole = insert_after(gm, node, torch.ops.fxglm5.all_gather.default, (node, dim, mapping.group, mapping.world))
    node.replace_all_uses_with(whole, delete_user_cb=lambda user: user is not whole)
    return anchor(whole, pass_name)


def shard_each(gm: fx.GraphModule, ctx, rewrite) -> int:
    """Run ``rewrite(gm, node, mapping) -> bool`` (did it shard a block there) on every node as the graph stood,
    then refresh the example values of what changed; the matches. Nothing to do at world size 1."""
    if ctx.mapping.world == 1:
        return 0
    matches = rewrite_each(gm, lambda node: rewrite(gm, node, ctx.mapping))
    if matches:
        refresh(gm)
    return matches


def mark(node: fx.Node) -> fx.Node:
    """Note that a shard pass changed or inserted ``node`` (its example value is recomputed by :func:`refresh`)."""
    node.meta[_DIRTY] = True
    return node


def refresh(gm: fx.GraphModule) -> None:
    """Recompute the example value (``meta["val"]``, export's symbolic shapes) of the nodes a shard pass marked and
    of every node downstream whose value they change (the chain from a split weight to the collective that makes
    the value whole again).

    The nodes run under the Python dispatcher, as export ran them: a composite op (``aten.linear`` over the bf16
    lm_head) then decomposes through the SymInt-aware Python decompositions (``aten.matmul``'s), where torch 2.11's
    C++ ``matmul`` calls ``numel()`` on the symbolic token dim and raises "Cannot call numel() on tensor with
    symbolic sizes/strides" (torch 2.13's does not)."""
    mode = _fake_mode(gm)
    dirty = {n for n in gm.graph.nodes if n.meta.pop(_DIRTY, False)}
    changed = set()

    def fake(value):
        if isinstance(value, torch.Tensor) and not isinstance(value, torch._subclasses.FakeTensor):
            return mode.from_tensor(value, static_shapes=True)
        return value

    for node in gm.graph.nodes:
        if node.op == "get_attr" and node in dirty:
            changed.add(node)
        if node.op != "call_function" or not (node in dirty or any(a in changed for a in node.all_input_nodes)):
            continue
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: fake(a.meta.get("val")))
        old = node.meta.get("val")
        with mode, enable_python_dispatcher():
            node.meta["val"] = node.target(*args, **kwargs)
        if node in dirty or _signature(old) != _signature(node.meta["val"]):
            changed.add(node)


def _signature(value) -> str:
    return repr(torch.utils._pytree.tree_map(
        lambda v: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v, value))


def check_shapes(gm: fx.GraphModule) -> None:
    """Run every node on fake tensors of the graph's (rank-local) attributes, with the example sizes of the inputs:
    a size the shard passes left at its unsharded value (a literal head count in a view) fails, naming the node."""
    mode = torch._subclasses.FakeTensorMode(allow_non_fake_inputs=True)
    env: dict[fx.Node, object] = {}
    with mode:
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                value = node.meta["val"]
                sizes = [d if isinstance(d, int) else (d.node.hint or 2) for d in value.shape]
                env[node] = torch.empty(sizes, dtype=value.dtype, device=value.device)
            elif node.op == "get_attr":
                env[node] = mode.from_tensor(get_attr_tensor(gm, node), static_shapes=True)
            elif node.op == "call_function":
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
                try:
                    env[node] = node.target(*args, **kwargs)
                except Exception as err:  # noqa: BLE001 - any failure is a shape the sharding broke
                    raise PassError(f"shard stage: node {node.name} ({node.format_node()}) fails on the rank-local "
                                    f"shapes: {type(err).__name__}: {err}") from None
            else:  # call_module (export's guard function) and the output
                env[node] = None


def _fake_mode(gm: fx.GraphModule):
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        if isinstance(value, torch._subclasses.FakeTensor):
            return value.fake_mode
    return torch._subclasses.FakeTensorMode(allow_non_fake_inputs=True)


@dataclasses.dataclass(frozen=True)
class GatedMLP:
    gate: Linear
    up: Linear
    down: Linear


def gated_mlp(node) -> GatedMLP | None:
    """``down(silu(gate(x)) * up(x))`` ending at ``node`` (the down projection), else None."""
    down = linear(node)
    if down is None or not is_op(down.x, aten.mul.Tensor):
        return None
    silu, up_out = op_args(down.x)["self"], op_args(down.x)["other"]
    if not is_op(silu, aten.silu.default):
        return None
    gate, up = linear(op_args(silu)["self"]), linear(up_out)
    if gate is None or up is None or gate.x is not up.x:
        return None
    return GatedMLP(gate, up, down)


def split_mlp(gm: fx.GraphModule, mlp: GatedMLP, mapping: Mapping) -> None:
    """The rank's share of the intermediate features: gate / up rows, down columns (down's output is then a
    partial sum)."""
    start, stop = mapping.part(get_attr_tensor(gm, mlp.gate.weight).shape[0])
    shard_linear(gm, mlp.gate, 0, start, stop)
    shard_linear(gm, mlp.up, 0, start, stop)
    shard_linear(gm, mlp.down, 1, start, stop)
