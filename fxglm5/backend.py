"""The torch.compile front door: ``torch.compile(model, backend="fxglm5", options={...})``.

Dynamo hands over a torch-level FX graph whose parameters arrive as graph inputs. The backend freezes
those inputs back into constants (so weights are ``get_attr`` nodes, as the passes expect), exports the
graph to ATen with torch.export (dynamic where Dynamo's graph is: one export serves every size Dynamo's
guards let through), runs the match, fuse, fuse_kernels and lower stages for the device of the inputs and returns the
lowered graph. Registered through the ``torch_dynamo_backends`` entry point, so ``"fxglm5"`` is listed
after install.

Regional compilation (``for layer in model.model.layers: layer.compile(backend="fxglm5")``, PyTorch's recipe
for repeated blocks) compiles each decoder-layer kind once: Dynamo reuses one compiled graph for every layer of
a kind and passes that layer's own parameters as the graph's inputs. The lowered graph is therefore bound to
the weights it is called with: the first set is the one it was compiled for; another set (another layer of the
kind) gets the same lowered graph over its own tensors, with the constants the passes derived from weights
(the absorbed MLA projections) derived again from that layer's (``graph.meta["derived_constants"]``). Scalar
attributes the passes fold in (an eps, a softmax scale) must be the same across the layers of a kind.
"""

from __future__ import annotations

import logging
import operator

import torch
from torch import fx, nn
from torch.export import Dim

from fxglm5.capture import export_graph
from fxglm5.compiler import Stage, compile_graph
from fxglm5.errors import ConfigError, InputError
from fxglm5.lowering.backend_choice import BACKENDS
from fxglm5.model.config import Glm5Config

log = logging.getLogger(__name__)
OPTIONS = ("config", "act_quant", "strict", "backend", "disabled_passes", "dump_dir")
# no cache stage: Dynamo's graph has no paged caches to run on
STAGES = (Stage.MATCH, Stage.FUSE, Stage.FUSE_KERNELS, Stage.LOWER)


def compile_options(options: dict, device: str) -> dict:
    """:func:`fxglm5.compiler.compile_graph`'s keywords from ``torch.compile(..., options=...)``; a key or value it
    does not know is an error."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ConfigError(f"torch.compile(backend='fxglm5'): unknown option {unknown[0]!r}; options are {OPTIONS}")
    config, backend = options.get("config"), options.get("backend")
    if config is not None and not isinstance(config, Glm5Config):
        raise ConfigError(f"torch.compile(backend='fxglm5'): option 'config' must be a Glm5Config, got {type(config).__name__}")
    if backend is not None and backend not in BACKENDS:
        raise ConfigError(f"torch.compile(backend='fxglm5'): option 'backend' must be one of {BACKENDS}, got {backend!r}")
    disabled = options.get("disabled_passes", ())
    if isinstance(disabled, str) or not all(isinstance(name, str) for name in disabled):
        raise ConfigError(f"torch.compile(backend='fxglm5'): option 'disabled_passes' must be a list of pass names, got {disabled!r}")
    return dict(config=config, act_quant=bool(options.get("act_quant", False)), strict=bool(options.get("strict", False)),
                backend=backend, disabled_passes=tuple(disabled), dump_dir=options.get("dump_dir"), device=device)


def _is_constant(node: fx.Node, value) -> bool:
    """Dynamo lifts module parameters/buffers to inputs named after their module path."""
    return isinstance(value, nn.Parameter) or "_parameters_" in node.name or "_buffers_" in node.name


def _inline_scalar(node: fx.Node, value: torch.Tensor) -> None:
    """Under ``dynamic=True`` Dynamo passes a module's float attributes (an eps, a softmax scale) as 0-dim tensors
    read with ``.item()``; put the number back, so the passes see the constant the model has."""
    for use in list(node.users):
        if use.op == "call_method" and use.target == "item":
            use.replace_all_uses_with(value.item())
            node.graph.erase_node(use)


class _Frozen(nn.Module):
    """Dynamo's graph as a module of its tensor inputs: parameter inputs stored as buffers, symbolic sizes
    (Dynamo's SymInt inputs) read from the input dimension they are the size of."""

    def __init__(self, gm: fx.GraphModule, example_inputs):
        super().__init__()
        self.gm = gm
        pairs = list(zip(gm.graph.find_nodes(op="placeholder"), example_inputs))
        constant = [isinstance(v, torch.Tensor) and (_is_constant(n, v) or getattr(n.meta.get("grapharg"), "pass_arg_as_tensor", False))
                    for n, v in pairs]
        self.inputs = [i for i, (_, v) in enumerate(pairs) if isinstance(v, torch.Tensor) and not constant[i]]
        self.shapes = [pairs[i][0].meta["example_value"].shape for i in self.inputs]
        dims = {str(s): (j, d) for j in reversed(range(len(self.inputs)))
                for d, s in enumerate(self.shapes[j]) if isinstance(s, torch.SymInt)}
        self.slots = []  # per placeholder: ("input", j) | ("const", buffer name) | ("size", (j, dim))
        for i, (node, value) in enumerate(pairs):
            if i in self.inputs:
                self.slots.append(("input", self.inputs.index(i)))
            elif constant[i]:
                _inline_scalar(node, value)
                self.register_buffer(f"c{i}", value.detach(), persistent=False)
                self.slots.append(("const", f"c{i}"))
            elif str(node.meta.get("example_value")) in dims:
                self.slots.append(("size", dims[str(node.meta["example_value"])]))
            else:
                raise InputError(f"torch.compile(backend='fxglm5'): graph input {node.name} ({value!r}) is neither a tensor "
                                 "nor the size of one; pass it as a tensor, or compile with dynamic=False")
        gm.recompile()

    def dynamic_shapes(self) -> tuple | None:
        """For torch.export: every tensor dimension Dynamo made symbolic stays dynamic."""
        shapes = [{d: Dim.AUTO for d, s in enumerate(shape) if isinstance(s, torch.SymInt)} or None for shape in self.shapes]
        return (tuple(shapes),) if any(shapes) else None

    def forward(self, *inputs):
        args = []
        for kind, key in self.slots:
            if kind == "const":
                args.append(getattr(self, key))
            elif kind == "input":
                args.append(inputs[key])
            else:
                args.append(inputs[key[0]].shape[key[1]])
        return self.gm(*args)


def _device(tensors) -> str:
    return next((t.device.type for t in tensors), "cpu")


def fxglm5_backend(gm: fx.GraphModule, example_inputs, options: dict | None = None, **_):
    """Compile ``gm``: export to ATen, run the fxglm5 match, fuse, fuse_kernels and lower stages for the inputs'
    device.
    ``options``: ``config`` (a Glm5Config: expected scales and strict counts), ``act_quant``, ``strict``,
    ``backend`` (the kernel backend tried first), ``disabled_passes`` (pass names to skip) and ``dump_dir``
    (each pass's graph before and after, written there).

    The export runs at the first call, outside Dynamo's compilation of the frame: exporting a dynamic graph
    inside it would add export's shape guards to the frame's own."""
    frozen = _Frozen(gm, example_inputs)
    user_inputs = [example_inputs[i] for i in frozen.inputs]
    settings = compile_options(dict(options or {}), _device(user_inputs) if user_inputs else _device(frozen.buffers()))
    weights = [(i, key) for i, (kind, key) in enumerate(frozen.slots) if kind == "const"]
    compiled_for = tuple(example_inputs[i] for i, _ in weights)
    bound: dict[tuple, tuple] = {}  # id of each weight -> (the weights, kept alive so ids stay theirs; graph)

    def compiled(*args):
        inputs = tuple(args[i] for i in frozen.inputs)
        if not bound:
            graph = export_graph(frozen, inputs, frozen.dynamic_shapes())
            for result in compile_graph(graph, stages=STAGES, **settings):
                log.info("fxglm5: %s", result.summary())
            bound[tuple(map(id, compiled_for))] = (compiled_for, graph)
        given = tuple(args[i] for i, _ in weights)
        key = tuple(map(id, given))
        if key not in bound:
            graph = next(iter(bound.values()))[1]
            bound[key] = (given, rebind(graph, {name: _scalar_checked(name, value, frozen)
                                                for (_, name), value in zip(weights, given)}))
        return bound[key][1](*inputs)

    return compiled


def _scalar_checked(name: str, value: torch.Tensor, frozen: _Frozen) -> torch.Tensor:
    """A weight for :func:`rebind`; a 0-dim attribute the passes may have folded in must equal the compiled one."""
    if value.dim() == 0 and not torch.equal(value.detach().cpu(), getattr(frozen, name).detach().cpu()):
        raise InputError(f"torch.compile(backend='fxglm5'): scalar attribute {name} is {value.item()} here and "
                         f"{getattr(frozen, name).item()} in the module this graph was compiled for; compile these "
                         "modules separately (they are not one kind)")
    return value.detach()


def rebind(graph: fx.GraphModule, weights: dict[str, torch.Tensor]) -> fx.GraphModule:
    """The lowered ``graph`` (a copy of its nodes) over other ``weights`` (attribute name -> tensor); the constants
    the passes derived from weights are derived again from these. Everything else is shared with ``graph``."""
    derived = graph.meta.get("derived_constants", {})
    nodes = fx.Graph()
    nodes.output(nodes.graph_copy(graph.graph, {}))
    new = fx.GraphModule(graph, nodes)
    values = {}
    for node in graph.graph.find_nodes(op="get_attr"):
        if node.target in weights:
            values[node.target] = weights[node.target]
    for target, (sources, derive) in derived.items():
        with torch.no_grad():
            values[target] = derive(*(weights[s] if s in weights else operator.attrgetter(s)(graph) for s in sources))
    for target, value in values.items():
        owner, _, name = target.rpartition(".")
        (new.get_submodule(owner) if owner else new).register_buffer(name, value, persistent=False)
    new.meta.update(graph.meta)
    return new

