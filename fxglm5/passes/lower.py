"""lower: bind every fxglm5 op node to a backend implementation for the target device.

Each ``torch.ops.fxglm5.*`` call becomes a ``Dispatch`` over the backends in preference order for
``ctx.extras['device']`` (default: where the graph's weights live), with ``ctx.backend`` or
``FXGLM5_BACKEND`` first. The choice per call is still checked at run time (a shape or dtype a kernel
does not take falls back, logged once), so a lowered graph is always correct. The summary names the backend
each op kind is bound to first (``ops=fp8_linear:triton,...``).
"""

from __future__ import annotations

import torch
from torch import fx

from fxglm5.lowering.registry import Dispatch, backend_order
from fxglm5.passes.manager import PassOutcome
from fxglm5.passes.registry import register_pass


def _graph_device(gm: fx.GraphModule) -> str:
    for tensor in list(gm.parameters()) + list(gm.buffers()):
        return tensor.device.type
    return "cpu"


@register_pass("lower")
def lower(gm: fx.GraphModule, ctx) -> PassOutcome:
    device = ctx.extras.get("device") or _graph_device(gm)
    order = backend_order(device, ctx.backend)
    dispatches: dict[str, Dispatch] = {}
    matches = 0
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or target.namespace != "fxglm5":
            continue
        name = target._opname
        if name not in dispatches:
            dispatches[name] = Dispatch(name, order)
        node.target = dispatches[name]
        matches += 1
    bound = ",".join(f"{name}:{dispatch.candidates[0][0]}" for name, dispatch in dispatches.items())
    return PassOutcome(matches, {"backends": "/".join(order), "ops": bound})
