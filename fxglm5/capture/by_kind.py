"""Capture once per layer kind: export the shortest leading run of decoder layers that shows every layer kind in
its every context (``layer_kinds``), rewrite that, and copy each rewritten layer to every position of its kind.

GLM-5's 78 layers are two kinds (dense, MoE) in four contexts, all present in its first 5 layers, so the export
and the match / fuse passes run over 5 layers instead of 78; the stitched graph is node for node the one the
whole-model capture and passes give (``tests/capture/test_by_kind.py``). A copy of layer p at position j reads
layer j's own parameters; constants a pass derived from layer p's weights (the absorbed MLA W_UK / W_UV) are
derived again from layer j's, through the recipe the pass recorded in ``graph.meta[DERIVED]``
(``passes.graph_utils.add_constant``). A shard plan (``graph.meta[PLAN]``, the shard stage's rank-local slices) is
applied the same way: layer j's tensors (and the sources of its derived constants) are narrowed as layer p's were,
and the whole graph's plan and recipes name every layer's own attributes. Whenever that cannot be proven (a hook,
layers of one kind whose rewritten graphs differ, a constant without a recipe, a node that does not belong to one layer), the whole model is
captured instead and the reason logged.

The stitcher reads the other layers' tensors from a mapping of names to tensors: the model's
(:func:`module_tensors`) when compiling, an exported artifact's (``fxglm5.artifact``) when one is loaded; a
graph deserialized from the file has no recipes, and its stored constants are read by name like any weight.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import logging
import operator
import re
from typing import Callable, Mapping

import torch
from torch import fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from fxglm5.capture.export import capture
from fxglm5.capture.layer_kinds import KindPlan, Unprovable, decoder_layers, layer_key, plan_kinds
from fxglm5.parallel import PLAN

log = logging.getLogger(__name__)

LAYERS = "model.layers"
DERIVED = "derived_constants"  # graph.meta key: target -> (source targets, fn(*source tensors) -> tensor)
CAPTURED_OPS = "captured_op_counts"  # graph.meta key: call_function target -> count in the captured whole model
PREFIX = "kind_prefix"  # graph.meta key: (rewritten prefix graph, KindPlan), what an exported artifact stores
MATCH_ANCHOR = "fxglm5_match_of"  # node.meta key: the pass that added this node once per match (see scale_result)
PRE, POST = "pre", "post"


def capture_rewritten(model: torch.nn.Module, rewrite: Callable, *, max_batch: int = 1024, max_seq: int | None = None,
                      head: str = "logits") -> tuple[fx.GraphModule, list]:
    """``capture(model)`` followed by ``rewrite(graph, config) -> list[PassResult]`` (the match / fuse passes),
    run on the layer-kind prefix and stitched to the whole model (else on the whole model). Returns the whole
    model's rewritten graph and the results, whose ``num_matches`` count the whole model's matches;
    ``graph.meta[CAPTURED_OPS]`` holds the op counts of the captured (not yet rewritten) whole model, and, when
    it was captured per kind, ``graph.meta[PREFIX]`` the rewritten prefix graph and its plan."""
    options = dict(max_batch=max_batch, max_seq=max_seq, head=head)
    try:
        keys = [layer_key(layer, f"{LAYERS}.{i}") for i, layer in enumerate(decoder_layers(model, LAYERS))]
        plan = plan_kinds(keys)
        while plan.prefix < len(keys):
            prefix_model = shallow_prefix(model, plan.prefix)
            gm = capture(prefix_model, **options)
            counts = captured_counts(gm, plan)
            results = rewrite(gm, prefix_model.config)
            needed = context_depth(gm, plan)
            if needed <= plan.depth:
                whole = stitch(gm, module_tensors(model), plan)
                whole.meta[CAPTURED_OPS] = counts
                whole.meta[PREFIX] = (gm, plan)
                log.info("captured %d of %d layers (%d kinds, context depth %d)", plan.prefix, len(keys),
                         len(set(plan.kinds)), plan.depth)
                return whole, [scale_result(r, gm, whole) for r in results]
            plan = plan_kinds(keys, needed)
        reason = "every layer is a kind of its own"
    except Unprovable as why:
        reason = str(why)
    log.info("capturing the whole model: %s", reason)
    gm = capture(model, **options)
    gm.meta[CAPTURED_OPS] = dict(collections.Counter(n.target for n in _calls(gm)))
    return gm, rewrite(gm, model.config)


# ---- the prefix model ---------------------------------------------------------------------------------------
def _shallow(module: torch.nn.Module, **children) -> torch.nn.Module:
    """A new module object sharing ``module``'s attributes and submodules, with ``children`` replaced."""
    new = copy.copy(module)
    new.__dict__ = dict(module.__dict__)
    new._modules = {**module._modules, **children}
    return new


def truncated_config(config, layers: int):
    """``config`` for the first ``layers`` layers: per-layer lists cut, ``num_hidden_layers`` set."""
    if not dataclasses.is_dataclass(config):
        raise Unprovable(f"the config ({type(config).__name__}) is not a dataclass that can be cut to {layers} layers")
    total = config.num_hidden_layers
    changes = {f.name: getattr(config, f.name)[:layers] for f in dataclasses.fields(config)
               if isinstance(getattr(config, f.name), list) and len(getattr(config, f.name)) == total}
    if hasattr(config, "first_k_dense_replace"):
        changes["first_k_dense_replace"] = min(config.first_k_dense_replace, layers)
    return dataclasses.replace(config, num_hidden_layers=layers, **changes)


def shallow_prefix(model: torch.nn.Module, layers: int) -> torch.nn.Module:
    """The causal LM with only its first ``layers`` decoder layers (the same module objects, so the same
    parameter names ``model.layers.{i}...``) and its config cut to match."""
    config = truncated_config(model.config, layers)
    inner = _shallow(model.model, layers=torch.nn.ModuleList(list(model.model.layers)[:layers]))
    inner.config = config
    outer = _shallow(model, model=inner)
    outer.config = config
    return outer


# ---- segments: which layer each node belongs to -------------------------------------------------------------
_LAYER_PATH = re.compile(rf"^{re.escape(LAYERS)}\.(\d+)(?:\.|$)")


def _layer_of_target(target: str):
    match = _LAYER_PATH.match(target)
    return int(match.group(1)) if match else None


def _layer_of_stack(node: fx.Node):
    """The layer index in the node's nn_module_stack, PRE/POST-neutral None for an outer module, or ... when the
    node has no stack (a node a pass inserted: it belongs where it stands)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ...
    found = {_layer_of_target(path) for path, _ in stack.values()} - {None}
    if len(found) > 1:
        raise Unprovable(f"node {node.name} belongs to layers {sorted(found)}")
    return found.pop() if found else None


def segments(gm: fx.GraphModule, layers: int) -> dict[fx.Node, object]:
    """Owner of every node: PRE (inputs, embedding, rope tables, masks), a layer index, or POST (final norm,
    head, output). get_attrs go by their target, nodes by their module stack; a node a pass inserted (no stack)
    belongs to the latest layer among the one it stands in and those of its inputs (an RMSNorm fused from the
    next layer's norm may stand before that layer's first node)."""
    owner: dict[fx.Node, object] = {}
    current: object = PRE
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            layer = _layer_of_target(node.target)
            owner[node] = PRE if layer is None else layer
            continue
        layer = POST if node.op == "output" else _layer_of_stack(node)
        if layer is ...:
            found = [owner[a] for a in node.all_input_nodes if isinstance(owner[a], int)]
            if isinstance(current, int):
                found.append(current)
            owner[node] = max(found) if found and current != POST else current
            continue
        if layer is None:  # an outer module: before the first layer or after the last
            layer = PRE if current == PRE else POST
        if current == POST and layer != POST or isinstance(layer, int) and isinstance(current, int) and layer < current:
            raise Unprovable(f"node {node.name} of {layer} stands after {current}'s nodes")
        owner[node] = current = layer
    if set(owner.values()) - {PRE, POST} != set(range(layers)):
        raise Unprovable("the graph's nodes do not cover every exported layer")
    return owner


def _members(gm: fx.GraphModule, owner: dict, segment) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if owner[n] == segment]


def captured_counts(gm: fx.GraphModule, plan: KindPlan) -> dict:
    """Op counts (by target) of the whole model's capture, from the prefix's: each layer counts as the prefix
    position it copies."""
    owner = segments(gm, plan.prefix)
    counts: collections.Counter = collections.Counter()
    for node in _calls(gm):
        segment = owner[node]
        counts[node.target] += plan.multiplicity(segment) if isinstance(segment, int) else 1
    return dict(counts)


def context_depth(gm: fx.GraphModule, plan: KindPlan) -> int:
    """How many layers back any node reads (1: only the previous layer); the final part counts from the end."""
    owner = segments(gm, plan.prefix)
    depth = 0
    for node in gm.graph.nodes:
        here = plan.prefix if owner[node] == POST else owner[node]
        for arg in node.all_input_nodes:
            if not isinstance(owner[arg], int):
                continue
            if here == PRE or here < owner[arg]:
                raise Unprovable(f"node {node.name} of {owner[node]} reads {arg.name} of the later layer {owner[arg]}")
            depth = max(depth, here - owner[arg])
    return depth


# ---- stitching ----------------------------------------------------------------------------------------------
def _rename(target: str, src: int, dst: int) -> str:
    return f"{LAYERS}.{dst}{target[len(f'{LAYERS}.{src}'):]}" if src != dst else target


def _signature(nodes: list[fx.Node], owner: dict, layer: int) -> list:
    """A layer's rewritten graph with targets relative to the layer and reads from outside it blanked."""
    index = {n: i for i, n in enumerate(nodes)}

    def ref(n):
        return ("in", index[n]) if owner[n] == layer else ("ext",)

    out = []
    for n in nodes:
        target = _rename(n.target, layer, -1) if n.op == "get_attr" else n.target
        out.append((n.op, target, repr(fx.node.map_arg((n.args, n.kwargs), ref))))
    return out


class _Stitcher:
    """Builds the whole model's graph from the rewritten prefix graph ``gm`` (see the module docstring)."""

    def __init__(self, gm: fx.GraphModule, tensors: Mapping[str, torch.Tensor], plan: KindPlan):
        self.gm, self.tensors, self.plan = gm, tensors, plan
        self.owner = segments(gm, plan.prefix)
        self.layer_nodes = [_members(gm, self.owner, p) for p in range(plan.prefix)]
        self.index = {n: i for nodes in self.layer_nodes for i, n in enumerate(nodes)}
        self.derived = gm.meta.get(DERIVED, {})
        self.shard_plan = gm.meta.get(PLAN, {})
        self.graph = fx.Graph()
        self.graph._codegen = copy.deepcopy(gm.graph._codegen)
        self.attrs: dict[str, object] = {}
        self.derived_targets: set[str] = set()
        self.pre: dict[fx.Node, fx.Node] = {}
        self.copies: list[list[fx.Node]] = []
        self._check_kinds()

    def _check_kinds(self) -> None:
        seen: dict[int, tuple[int, list]] = {}
        for p, nodes in enumerate(self.layer_nodes):
            signature = _signature(nodes, self.owner, p)
            first = seen.setdefault(self.plan.kinds[p], (p, signature))
            if first[1] != signature:
                raise Unprovable(f"layers {first[0]} and {p} are one kind but their rewritten graphs differ")

    def _external(self, node: fx.Node, here: int) -> fx.Node:
        """The copy, in the whole graph, of ``node`` that the copy at layer ``here`` reads from outside itself."""
        segment = self.owner[node]
        if segment == PRE:
            return self.pre[node]
        offset = (self.plan.prefix if here == POST else self.plan.source[here]) - segment
        position = (len(self.plan.kinds) if here == POST else here) - offset
        return self.copies[position][self.index[node]]

    def _get_attr(self, node: fx.Node, src: int, dst: int) -> fx.Node:
        target = _rename(node.target, src, dst)
        if node.target in self.derived:
            self.derived_targets.add(target)
        if target not in self.attrs:
            self.attrs[target] = self._tensor(node.target, target, src == dst)
        new = self.graph.get_attr(target)
        new.meta = dict(node.meta)
        if isinstance(new.meta.get("val"), torch.Tensor):
            new.meta["val"] = self.attrs[target]
        return new

    def _tensor(self, prefix_target: str, target: str, own: bool):
        if own or _layer_of_target(prefix_target) is None:
            return operator.attrgetter(prefix_target)(self.gm)
        src, dst = _layer_of_target(prefix_target), _layer_of_target(target)
        try:
            if prefix_target in self.derived:
                sources, derive = self.derived[prefix_target]
                with torch.no_grad():
                    return derive(*(self._local(s, self.tensors[_rename(s, src, dst)]) for s in sources))
            return self._local(prefix_target, self.tensors[target])
        except KeyError as missing:
            raise Unprovable(f"{prefix_target}: no tensor {missing} for layer {dst}'s copy, "
                             "and no pass recorded how it was derived") from None

    def _local(self, prefix_target: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (another layer's copy of ``prefix_target``) narrowed as the shard plan narrowed the prefix's."""
        part = self.shard_plan.get(prefix_target)
        return tensor if part is None else part.apply(tensor)

    def _per_layer(self, table: dict, entry: Callable) -> dict:
        """``table`` (keyed by prefix targets) for the whole model: each layer's entries under its own names."""
        out = {}
        for target, value in table.items():
            src = _layer_of_target(target)
            for dst in ([None] if src is None else [j for j, p in enumerate(self.plan.source) if p == src]):
                out[target if dst is None else _rename(target, src, dst)] = entry(value, src, dst)
        return out

    def _copy(self, node: fx.Node, read: Callable, src, dst) -> fx.Node:
        if node.op == "get_attr":
            return self._get_attr(node, src, dst) if isinstance(src, int) else self._get_attr(node, 0, 0)
        new = self.graph.node_copy(node, read)
        stack = node.meta.get("nn_module_stack")
        if stack and isinstance(src, int) and src != dst:
            new.meta["nn_module_stack"] = {k: (_rename(path, src, dst) if _layer_of_target(path) == src else path, cls)
                                           for k, (path, cls) in stack.items()}
        return new

    def build(self) -> fx.GraphModule:
        for node in _members(self.gm, self.owner, PRE):
            self.pre[node] = self._copy(node, self.pre.__getitem__, PRE, PRE)
        for j, p in enumerate(self.plan.source):
            local: dict[fx.Node, fx.Node] = {}

            def read(n, j=j, p=p, local=local):
                return local[n] if self.owner[n] == p else self._external(n, j)

            for node in self.layer_nodes[p]:
                local[node] = self._copy(node, read, p, j)
            self.copies.append([local[n] for n in self.layer_nodes[p]])
        local = {}
        for node in _members(self.gm, self.owner, POST):
            local[node] = self._copy(node, lambda n: local[n] if self.owner[n] == POST else self._external(n, POST),
                                     POST, POST)
        for node in self.graph.find_nodes(op="call_module"):
            self.attrs[node.target] = self.gm.get_submodule(node.target)
        # lazy: its Python code (a third of a second for GLM-5's 6754 nodes) is generated when first called or
        # read, after the later stages have rewritten the graph, not here
        whole = _LazyGraphModule(self.attrs, self.graph)
        for target in self.derived_targets:  # non-persistent, as add_constant registers them
            owner_path, _, name = target.rpartition(".")
            whole.get_submodule(owner_path)._non_persistent_buffers_set.add(name)
        whole.meta.update({k: v for k, v in self.gm.meta.items() if k not in (DERIVED, PLAN)})
        # every layer's recipes (as a whole-model capture's graph has them) and the rank's slices, under its own names
        whole.meta[DERIVED] = self._per_layer(self.derived, lambda recipe, src, dst: (
            tuple(s if dst is None else _rename(s, src, dst) for s in recipe[0]), recipe[1]))
        if self.shard_plan:
            whole.meta[PLAN] = self._per_layer(self.shard_plan, lambda part, src, dst: part)
        for key, value in vars(self.gm).items():  # export's shape_env, range_constraints, ...
            if not key.startswith("_") and key not in vars(whole) and not callable(value):
                setattr(whole, key, value)
        return whole


def stitch(gm: fx.GraphModule, tensors: Mapping[str, torch.Tensor], plan: KindPlan) -> fx.GraphModule:
    """The whole model's rewritten graph from the rewritten prefix ``gm``, each copied layer reading its own
    tensors from ``tensors`` (by name; raises Unprovable where it cannot)."""
    return _Stitcher(gm, tensors, plan).build()


def module_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` by its name (tied ones under each of their names)."""
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}


def layer_copies(target: str, plan: KindPlan) -> list[tuple[int, str]]:
    """``(j, name)`` for each other layer j whose stitched graph reads its own counterpart ``name`` of the
    prefix tensor ``target`` (none for a tensor outside the layers)."""
    src = _layer_of_target(target)
    if src is None:
        return []
    return [(j, _rename(target, src, j)) for j, p in enumerate(plan.source) if p == src and j != src]


def scale_result(result, gm: fx.GraphModule, whole: fx.GraphModule):
    """``result`` (a PassResult on the prefix) with ``num_matches`` counted over the whole model: the whole
    model's count of an fxglm5 op the pass added once per match (one whose count in the rewritten prefix equals
    the pass's matches: sparse_mla for match_sparse_mla, whose indexer_topk only full-indexer layers have)."""
    if not result.num_matches:
        return result
    anchors = [n for n in _calls(gm) if n.meta.get(MATCH_ANCHOR) == result.name]
    if anchors:  # the pass marked one node per match (the shard passes: one collective each)
        if len(anchors) != result.num_matches:
            raise Unprovable(f"pass {result.name}: {len(anchors)} marked nodes for {result.num_matches} matches")
        return dataclasses.replace(result, num_matches=sum(n.meta.get(MATCH_ANCHOR) == result.name for n in _calls(whole)))
    added = [name for name, count in result.ops_after.items() if count > result.ops_before.get(name, 0)
             and name.startswith("fxglm5.")]
    totals = {_count(whole, name) for name in added if _count(gm, name) == result.num_matches}
    if len(totals) != 1:
        raise Unprovable(f"pass {result.name}: no fxglm5 op it added ({sorted(added)}) counts its "
                         f"{result.num_matches} matches in the prefix and one number in the whole model")
    return dataclasses.replace(result, num_matches=totals.pop())


def _count(gm: fx.GraphModule, name: str) -> int:
    return sum(1 for n in _calls(gm) if isinstance(n.target, torch._ops.OpOverload)
               and f"{n.target.namespace}.{n.target._opname}" == name)


def _calls(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function"]
