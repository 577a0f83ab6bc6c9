"""fuse_shared_expert_into_moe: ``moe_fp8_add(x, ..., addend=silu_mul_fp8_linear(gate, up, W_down))``, gate and up
two slices of ``fp8_linear(x, W_gate_up)`` -> ``fxglm5::moe_fp8_shared(x, ..., W_gate_up, W_down, up_start)``.

Why: a decode MoE layer launched the shared expert's two GEMMs (its stacked gate|up, then its down with the gate
folded in) beside the routed experts' two grouped GEMMs: two launches and their gaps more for GEMMs a few rows tall
whose weights are a fraction of one routed expert's (issue 45, item 4: the MoE at small batch in at most two
launches). With both in one op the Triton MoE runs the shared expert's tiles as extra CTAs of the routed GEMMs'
launches (horizontal fusion, ``lowering.triton.moe.moe_fp8``): the gate|up launch also computes the shared
expert's gate|up row(s), the down launch its down row(s), with the shared GEMMs' own tile function, tiles and K
splits, so their bits; a decode MoE layer is then the router, gate|up, down and the combine. Above the routed GEMMs'
scan size (prefill) the shared expert keeps its own launches.

Matched: an ``fxglm5::moe_fp8_add`` whose addend is a ``silu_mul_fp8_linear`` without bias read by it only, whose gate
and up are step-1 slices of the last dim of one ``fp8_linear`` (without bias, of the MoE's own tokens: the same node
through aliases and casts to its own dtype) that nothing else reads: the gate its first columns, the up half as many
from a column past them, both as wide as the down weight's input; both GEMMs with the MoE's ``act_quant`` (the
shared role's A mode is its GEMMs'). The shared expert's weights keep their own shapes (under tensor parallelism
its intermediate is the rank's slice, while expert-parallel experts are whole). Left alone: no shared expert, a
shared expert of other tokens, a gate|up output, a gate or up slice or a shared output read elsewhere too (it must
be written), halves that overlap or are not the down GEMM's width, another act_quant. Exact: the reference is the
chain it replaces.
Runs after fuse_shared_input_gemms (gate and up one stacked GEMM), fuse_silu_mul_into_down (the gate in the down
GEMM) and fuse_shared_add_into_moe (the add in the MoE).
"""

from __future__ import annotations

import torch
from torch import fx

from fxglm5.passes import fuse_shared_add_into_moe
from fxglm5.passes.graph_utils import aten, is_op, op_args, replace_with_call, rewrite_each, shape_of, through
from fxglm5.passes.manager import PassOutcome
from fxglm5.passes.registry import register_pass


def expected_fusions(ctx) -> int:
    """Each MoE layer fuse_shared_add_into_moe fused, in an FP8 checkpoint (a bf16 one has no FP8 shared GEMMs)."""
    return fuse_shared_add_into_moe.expected_fusions(ctx) if ctx.config.is_fp8 else 0


def _columns(part: fx.Node, whole: fx.Node) -> tuple[int, int] | None:
    """(start, end) of ``part`` where it is a step-1 slice of ``whole``'s last dim read once, else None."""
    if not is_op(part, aten.slice.Tensor) or len(part.users) != 1:
        return None
    args, shape = op_args(part), shape_of(whole)
    if args["self"] is not whole or shape is None or args["step"] != 1 or args["dim"] % len(shape) != len(shape) - 1:
        return None
    start, end = args["start"] or 0, args["end"]
    if not (isinstance(start, int) and isinstance(end, int) and 0 <= start and isinstance(shape[-1], int)):
        return None
    return start, min(end, shape[-1])


def _shared_expert(moe: fx.Node) -> tuple | None:
    """The shared expert's (gate|up weight, its scales, down weight, its scales, up_start) where the
    addend of ``moe`` (a moe_fp8_add) is one as matched (see the module doc)."""
    down = op_args(moe)["addend"]
    if not is_op(down, torch.ops.fxglm5.silu_mul_fp8_linear.default) or len(down.users) != 1:
        return None
    d = op_args(down)
    gate_up = d["gate"].args[0] if is_op(d["gate"], aten.slice.Tensor) else None
    if d["bias"] is not None or not is_op(gate_up, torch.ops.fxglm5.fp8_linear.default):
        return None
    g = op_args(gate_up)
    routed = op_args(moe)
    if (through(g["x"]) is not through(routed["x"]) or g["bias"] is not None
            or not g["act_quant"] == d["act_quant"] == routed["act_quant"] or set(gate_up.users) != {d["gate"], d["up"]}):
        return None
    gate, up, inter = _columns(d["gate"], gate_up), _columns(d["up"], gate_up), shape_of(d["weight"])[-1]
    if gate != (0, inter) or up is None or up[1] - up[0] != inter or up[0] < inter:
        return None
    return g["weight"], g["weight_scale_inv"], d["weight"], d["weight_scale_inv"], up[0]


@register_pass("fuse_kernels", expected=expected_fusions)
def fuse_shared_expert_into_moe(gm: fx.GraphModule, ctx) -> PassOutcome:
    def fuse(moe: fx.Node) -> bool:
        shared = _shared_expert(moe)
        if shared is None:
            return False
        routed = {name: value for name, value in op_args(moe).items() if name != "addend"}
        replace_with_call(gm, moe, torch.ops.fxglm5.moe_fp8_shared.default, (*routed.values(), *shared))
        return True

    return PassOutcome(rewrite_each(gm, fuse, torch.ops.fxglm5.moe_fp8_add.default))
