"""lower: bind every fxglm5 op node to the backend implementation chosen for it, at lower time.

For each ``torch.ops.fxglm5.*`` call the backend is chosen once, from the node's metadata (the fake tensors
of its arguments: dtypes, shapes, optional arguments given or not), the target device
(``ctx.extras['device']``, default: where the graph's weights live) and what is importable, in the preference
order with ``ctx.backend`` or ``FXGLM5_BACKEND`` first (``fxglm5.lowering.backend_choice``). The node's target
becomes that implementation and ``node.meta['fxglm5_backend']`` records the choice (``runtime`` where it
reads an argument known only at run time, such as the paged index cache's dtype: that node checks per call).
Where the program's caller validates every step's forward context (``ctx.extras["inputs_validated"]``, the
compile's ``inputs_validated``), the cached ops get the bodies without their own checks, which sync with the host.
Lowering only rewrites targets, so a meta-device graph lowers too (``fxglm5 inspect --device``). The summary
gives the order tried and what runs where (``ops=fp8_linear:triton x36,moe_fp8:triton x3,...``).
"""

from __future__ import annotations

import collections

import torch
from torch import fx

from fxglm5.lowering.backend_choice import backend_order, bind
from fxglm5.passes.graph_utils import rewrite_each
from fxglm5.passes.manager import PassOutcome
from fxglm5.passes.registry import register_pass


def _graph_device(gm: fx.GraphModule) -> str:
    for tensor in list(gm.parameters()) + list(gm.buffers()):
        return tensor.device.type
    return "cpu"


def placement(gm: fx.GraphModule) -> dict[tuple[str, str], int]:
    """(op, backend) -> node count of a lowered graph, in graph order: what runs where."""
    counts: collections.Counter = collections.Counter()
    for node in gm.graph.nodes:
        if "fxglm5_backend" in node.meta:
            counts[(node.target.op, node.meta["fxglm5_backend"])] += 1
    return dict(counts)


@register_pass("lower")
def lower(gm: fx.GraphModule, ctx) -> PassOutcome:
    device = ctx.extras.get("device") or _graph_device(gm)
    order = backend_order(device, ctx.backend)
    validated = bool(ctx.extras.get("inputs_validated"))

    def bind_node(node: fx.Node) -> bool:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or target.namespace != "fxglm5":
            return False
        node.target = bind(node, target._opname, order, device, validated)
        node.meta["fxglm5_backend"] = node.target.backend
        return True

    matches = rewrite_each(gm, bind_node)
    where = ",".join(f"{op}:{backend} x{n}" for (op, backend), n in placement(gm).items())
    return PassOutcome(matches, {"device": device, "backends": "/".join(order), "ops": where})
