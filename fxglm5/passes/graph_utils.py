"""Small helpers the passes share: recognising ATen nodes, looking through no-op nodes, evaluating and
adding constants.

Matchers in fxglm5 are explicit walks over the ATen graph from an anchor node (softmax, linear, topk,
the expert sum): each step checks one op and its constant arguments, and any mismatch leaves the
subgraph untouched. That keeps near-misses (another scale, an extra bias, a different top-k) safe.
"""

from __future__ import annotations

import functools
import math
import operator
from typing import Any, Callable

import torch
from torch import fx

aten = torch.ops.aten

# Ops that never change values; matchers look through them.
_TRANSPARENT = {aten.alias.default, aten.clone.default, aten.contiguous.default}
_CASTS = {aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout}


def is_op(node: Any, *targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def op_args(node: fx.Node) -> dict[str, Any]:
    """The arguments of an op node (an ATen or fxglm5 OpOverload) by their schema names, whether the graph passes
    them by position or by keyword, with the schema's defaults for those it leaves out. Matchers read arguments
    by name, so an argument that export passes differently, or one a new op version adds, does not shift them."""
    args = {}
    for index, (name, kwarg_only, has_default, default) in enumerate(_signature(node.target)):
        if index < len(node.args) and not kwarg_only:
            args[name] = node.args[index]
        elif name in node.kwargs:
            args[name] = node.kwargs[name]
        elif has_default:
            args[name] = default
    return args


def set_op_args(node: fx.Node, **changes: Any) -> None:
    """Set arguments of an op node by their schema names (the write side of :func:`op_args`); the node then
    passes every positional argument of its schema by position, the keyword-only ones it sets by keyword."""
    signature = _signature(node.target)
    unknown = set(changes) - {name for name, *_ in signature}
    if unknown:
        raise TypeError(f"set_op_args: {node.target} has no argument {sorted(unknown)}")
    values = {**op_args(node), **changes}
    node.args = tuple(values[name] for name, kwarg_only, *_ in signature if not kwarg_only)
    node.kwargs = {name: values[name] for name, kwarg_only, *_ in signature
                   if kwarg_only and (name in node.kwargs or name in changes)}


def act_quant_ops(gm: fx.GraphModule) -> dict[tuple[str, bool], int]:
    """(op, its ``act_quant`` argument) -> node count of the fxglm5 ops that take one (the FP8 GEMMs and MoE),
    whether canonical or bound by the ``lower`` pass (whose targets keep the op's name and pass every argument by
    position): whether a compiled graph's FP8 GEMMs are W8A8, read from the graph itself."""
    counts: dict[tuple[str, bool], int] = {}
    for node in gm.graph.nodes:
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            op = target._opname if target.namespace == "fxglm5" else None
            args = op_args(node) if op else {}
        else:
            op = getattr(target, "op", None) if node.op == "call_function" else None
            schema = getattr(getattr(torch.ops.fxglm5, op, None), "default", None) if isinstance(op, str) else None
            args = dict(zip((name for name, *_ in _signature(schema)), node.args)) if schema is not None else {}
        if "act_quant" in args:
            key = (op, bool(args["act_quant"]))
            counts[key] = counts.get(key, 0) + 1
    return counts


@functools.lru_cache(maxsize=None)
def _signature(target) -> tuple:
    if not isinstance(target, torch._ops.OpOverload):
        raise TypeError(f"op_args: {target} is not an op with a schema")
    return tuple((a.name, a.kwarg_only, a.has_default_value(), a.default_value if a.has_default_value() else None)
                 for a in target._schema.arguments)


def val(node: fx.Node):
    """The example value export recorded for ``node`` (a FakeTensor, SymInt, ...), or None."""
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def dtype_of(node: fx.Node) -> torch.dtype | None:
    v = val(node)
    return v.dtype if isinstance(v, torch.Tensor) else None


def shape_of(node: fx.Node) -> tuple | None:
    v = val(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def is_cast(node: Any) -> bool:
    return is_op(node, *_CASTS)


def is_noop_cast(node: fx.Node) -> bool:
    return is_op(node, *_CASTS) and dtype_of(node) is not None and dtype_of(node) == dtype_of(op_args(node)["self"])


def through(node: Any) -> Any:
    """Follow aliases, clones and casts to the same dtype back to the node that made the value."""
    while isinstance(node, fx.Node) and (is_op(node, *_TRANSPARENT) or is_noop_cast(node)):
        node = op_args(node)["self"]
    return node


def through_casts(node: Any) -> Any:
    """Like ``through`` but also steps over real dtype casts (for inputs the fused op upcasts itself)."""
    while isinstance(node, fx.Node) and (is_op(node, *_TRANSPARENT) or is_op(node, *_CASTS)):
        node = op_args(node)["self"]
    return node


def float32_source(node: Any) -> fx.Node | None:
    """x for ``x.float()`` (or x itself when it is already float32): the input of a float32 computation."""
    node = through(node)
    if is_cast(node) and dtype_of(node) == torch.float32:
        return through(op_args(node)["self"])
    return node if dtype_of(node) == torch.float32 else None


def getitem_of(node: Any, index: int) -> fx.Node | None:
    """If ``node`` is ``producer[index]`` return the producer."""
    if isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem:
        if node.args[1] == index:
            return node.args[0]
    return None


def const_float(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def is_neg_inf(value: Any) -> bool:
    return isinstance(value, float) and math.isinf(value) and value < 0


def get_attr_tensor(gm: fx.GraphModule, node: fx.Node) -> torch.Tensor:
    return operator.attrgetter(node.target)(gm)


def leaves(node: fx.Node, allowed: set) -> list[fx.Node] | None:
    """The get_attr leaves of the subgraph producing ``node`` if every op on the way is in ``allowed``
    (and it reads no graph input); None otherwise."""
    found: dict[fx.Node, None] = {}
    stack, seen = [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "get_attr":
            found[n] = None
            continue
        if n.op != "call_function" or n.target not in allowed:
            return None
        stack.extend(n.all_input_nodes)
    return list(found)


def evaluate(node: fx.Node, env: dict[fx.Node, Any]) -> Any:
    """Evaluate ``node`` from values given for its leaves (memoised in ``env``)."""
    if node in env:
        return env[node]
    args = fx.node.map_arg(node.args, lambda n: evaluate(n, env))
    kwargs = fx.node.map_arg(node.kwargs, lambda n: evaluate(n, env))
    env[node] = node.target(*args, **kwargs)
    return env[node]


def add_constant(gm: fx.GraphModule, owner_path: str, name: str, tensor: torch.Tensor, before: fx.Node,
                 derived: tuple[tuple[str, ...], Callable]) -> fx.Node:
    """Register ``tensor`` as buffer ``owner_path.name`` (made unique) and return a get_attr node for it.

    ``derived = (sources, fn)``: how the constant is made from the graph's attributes, ``tensor ==
    fn(*(attribute named s for s in sources))``; recorded in ``gm.meta["derived_constants"]`` so that capture by
    layer kind can derive the same constant for every other layer of the kind from that layer's own weights."""
    owner = gm.get_submodule(owner_path) if owner_path else gm
    base, index = name, 0
    while hasattr(owner, name):
        index += 1
        name = f"{base}_{index}"
    owner.register_buffer(name, tensor, persistent=False)
    with gm.graph.inserting_before(before):
        node = gm.graph.get_attr(f"{owner_path}.{name}" if owner_path else name)
    node.meta["val"] = tensor
    gm.meta.setdefault("derived_constants", {})[node.target] = derived
    return node


def fake_index(like: fx.Node, dtype: torch.dtype = torch.int64):
    """A fake 1-D ``dtype`` tensor of a length known only at run time (an unbacked size), in the fake mode of
    ``like``'s value: the value of an index input a pass adds (the rows a step keeps), so that the nodes reading
    it get shapes and dtypes for the lower stage. None when ``like`` has no fake value."""
    example = val(like)
    mode = getattr(example, "fake_mode", None)
    if mode is None or mode.shape_env is None:
        return None
    with mode:
        return torch.empty(mode.shape_env.create_unbacked_symint(), dtype=dtype, device=example.device)


def replayable(node: fx.Node, leaves: list[fx.Node]) -> fx.GraphModule:
    """The subgraph producing ``node`` from ``leaves`` as a module of its own, ``f(*leaf values)``: the same
    computation, runnable again on other inputs after the graph's own nodes are rewritten or erased."""
    graph = fx.Graph()
    env = {leaf: graph.placeholder(f"leaf_{i}") for i, leaf in enumerate(leaves)}

    def copy(n: fx.Node) -> fx.Node:
        if n not in env:
            for arg in n.all_input_nodes:
                copy(arg)
            env[n] = graph.node_copy(n, env.__getitem__)
        return env[n]

    graph.output(copy(node))
    return fx.GraphModule(torch.nn.Module(), graph)


def insert_call(gm: fx.GraphModule, before: fx.Node, target: Callable, args: tuple, example: Any = None) -> fx.Node:
    """Insert ``target(*args)`` before ``before``; ``example`` is recorded as its meta value. The node takes
    ``before``'s module stack (the module whose computation it stands for; capture by layer kind reads it)."""
    with gm.graph.inserting_before(before):
        node = gm.graph.call_function(target, args)
    if "nn_module_stack" in before.meta:
        node.meta["nn_module_stack"] = before.meta["nn_module_stack"]
    if example is not None:
        node.meta["val"] = example
    return node


def rewrite_each(gm: fx.GraphModule, rewrite: Callable[[fx.Node], Any], target: Callable | None = None) -> int:
    """The loop of every rewriting pass: ``rewrite(node)`` (truthy where it rewrote there) on each node of the graph
    as it stands now (the ``call_function`` nodes of ``target`` when given), in graph order, so a rewrite may add
    or move nodes without the walk seeing them; returns how many rewrote (the pass's matches)."""
    nodes = gm.graph.nodes if target is None else gm.graph.find_nodes(op="call_function", target=target)
    return sum(bool(rewrite(node)) for node in list(nodes))


def replace_with_call(gm: fx.GraphModule, node: fx.Node, target: Callable, args: tuple) -> fx.Node:
    """Insert ``target(*args)`` before ``node`` (its meta value from a fake run) and move every use of ``node``
    to it; ``node`` and whatever only it read are left for dead-code elimination."""
    new = insert_call(gm, node, target, args, fake_call(target, *args))
    node.replace_all_uses_with(new)
    return new


def fake_call(target: Callable, *args) -> Any:
    """Run ``target`` on the recorded meta values of node args (to fill the new node's meta['val'])."""
    vals = fx.node.map_arg(args, lambda n: val(n))
    mode = None
    for v in torch.utils._pytree.tree_leaves(vals):
        if isinstance(v, torch._subclasses.FakeTensor):
            mode = v.fake_mode
            break
    if mode is None:
        return target(*vals)

    def fake(v):
        is_real = isinstance(v, torch.Tensor) and not isinstance(v, torch._subclasses.FakeTensor)
        return mode.from_tensor(v, static_shapes=True) if is_real else v

    with mode:
        return target(*torch.utils._pytree.tree_map(fake, vals))


def drop_unread_attributes(gm: fx.GraphModule, names=None) -> list[str]:
    """Delete the parameters and buffers (of ``names``, default all) that no node of ``gm`` reads any more, after
    erasing the get_attr nodes of theirs that nothing uses; returns the names dropped. A graph holds its weights
    alive: one a pass has replaced (kv_b_proj once absorbed into W_UK / W_UV, GEMM weights once stacked) would
    otherwise stay in memory, be taken as an input by export, and be stored or loaded for every layer."""
    names = {name for name, _ in (*gm.named_parameters(), *gm.named_buffers())} if names is None else set(names)
    for node in list(gm.graph.find_nodes(op="get_attr")):
        if node.target in names and not node.users:
            gm.graph.erase_node(node)
    read = {node.target for node in gm.graph.find_nodes(op="get_attr")}
    dropped = sorted(name for name in names - read if _has_attr(gm, name))
    for name in dropped:
        owner, _, leaf = name.rpartition(".")
        delattr(gm.get_submodule(owner) if owner else gm, leaf)
    return dropped


def _has_attr(gm: fx.GraphModule, name: str) -> bool:
    try:
        operator.attrgetter(name)(gm)
    except AttributeError:
        return False
    return True


def on_device(gm: fx.GraphModule, device: torch.device) -> fx.GraphModule:
    """The graph's weights, constants and the device arguments export recorded (``torch.arange(...,
    device=cpu)`` where it was exported, ``device=meta`` for a graph captured on the meta device) moved to
    ``device``."""
    gm.to(device)
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            owner, _, name = node.target.rpartition(".")
            module = gm.get_submodule(owner) if owner else gm
            value = getattr(module, name)
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter) and value.device != device:
                setattr(module, name, value.to(device))
        elif isinstance(node.kwargs.get("device"), torch.device):
            node.update_kwarg("device", device)
    gm.recompile()
    return gm
