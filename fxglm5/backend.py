"""The torch.compile front door: ``torch.compile(model, backend="fxglm5")``.

Dynamo hands over a torch-level FX graph whose parameters arrive as graph inputs. The backend freezes
those inputs back into constants (so weights are ``get_attr`` nodes, as the passes expect), exports the
graph to ATen with torch.export, runs the match + fuse pipeline and returns the rewritten graph.
Registered through the ``torch_dynamo_backends`` entry point, so ``"fxglm5"`` is listed after install.
"""

from __future__ import annotations

import logging

import torch
from torch import fx, nn

from fxglm5.capture import export_graph
from fxglm5.passes import PassContext, run_pipeline

log = logging.getLogger(__name__)


def _is_constant(node: fx.Node, value) -> bool:
    """Dynamo lifts module parameters/buffers to inputs named after their module path."""
    return isinstance(value, nn.Parameter) or "_parameters_" in node.name or "_buffers_" in node.name


class _Frozen(nn.Module):
    """Dynamo's graph with its parameter inputs stored as buffers; only real inputs stay arguments."""

    def __init__(self, gm: fx.GraphModule, example_inputs):
        super().__init__()
        self.gm = gm
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.const_slots, self.input_slots = [], []
        for i, (node, value) in enumerate(zip(placeholders, example_inputs)):
            if isinstance(value, torch.Tensor) and _is_constant(node, value):
                self.register_buffer(f"c{i}", value.detach(), persistent=False)
                self.const_slots.append(i)
            else:
                self.input_slots.append(i)
        self.n_args = len(placeholders)

    def forward(self, *inputs):
        args = [None] * self.n_args
        for slot in self.const_slots:
            args[slot] = getattr(self, f"c{slot}")
        for slot, value in zip(self.input_slots, inputs):
            args[slot] = value
        return self.gm(*args)


def fxglm5_backend(gm: fx.GraphModule, example_inputs, options: dict | None = None, **_):
    """Compile ``gm``: export to ATen, run the fxglm5 passes; ``options`` may carry ``config``
    (a Glm5Config, for expected scales and strict counts), ``act_quant`` and ``strict``."""
    options = dict(options or {})
    frozen = _Frozen(gm, example_inputs)
    user_inputs = tuple(example_inputs[i] for i in frozen.input_slots)
    graph = export_graph(frozen, user_inputs, None)
    ctx = PassContext(config=options.get("config"), act_quant=options.get("act_quant", False), strict=options.get("strict", False))
    for result in run_pipeline(graph, ctx):
        log.info("fxglm5: %s", result.summary())

    def compiled(*args):
        return graph(*(args[i] for i in frozen.input_slots))

    return compiled
