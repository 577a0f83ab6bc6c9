"""fuse_shared_input_gemms: the block-FP8 GEMMs that read one activation -> one ``fp8_linear`` over their
concatenated weights, each former output a slice of the fused one (vLLM's fused qkv_a / gate_up).

Which GEMMs: every group of two or more ``fxglm5::fp8_linear`` nodes with the same input node, the same
``act_quant``, no bias and constant (``get_attr``) weights. In GLM-5 a layer has up to three such groups:
``q_a_proj`` + ``kv_a_proj_with_mqa`` (+ the indexer's ``wk``) on the attention input, ``q_b_proj`` + the
indexer's ``wq_b`` on the normalized query latent, and the dense MLP's / shared expert's ``gate_proj`` +
``up_proj``. At decode these are small GEMMs (kv_a 576 x 6144, wk 128 x 6144, wq_b 4096 x 2048) whose launch
and weight-streaming start-up cost more than their bytes; one GEMM streams the same bytes in one launch.
The indexer's ``weights_proj`` also reads the attention input, but is a float32 ``aten.linear`` on
``x.float()`` (never quantized): folding it into an e4m3 GEMM would change its answers, so it stays alone,
as does any near-miss (another input, a bias, a weight that is not a constant).

Exactness: a fused weight is the members' e4m3 rows stacked, each member but the last padded with zero rows to
a whole number of 128-row blocks, so every scale row of the stacked ``weight_scale_inv`` still covers the rows
it covered before (a short edge block, kv_a's 576 = 4.5 blocks, keeps its scale; its padding rows dequantize to
zero and are sliced off). Members whose N is a multiple of 128 come first, so a group with one short member
needs no padding. Every output column is then the same dot product over the same K (and, with ``act_quant``,
over the same 1x128-quantized activation) as before: the values are equal up to the GEMM's own reduction
order, which may depend on N (tests/passes/test_fuse_shared_input_gemms.py checks it).

Why in the fuse_kernels stage, after shard and cache: the shard stage (between fuse and cache) splits the per-layer
canonical GEMMs by their weights' rows and columns and must still see each projection as its own node; the
cache-stage passes assert counts of the canonical GEMMs' consumers and are unaffected (this pass only changes
what produces the values they read: a column slice, rows strided, which every kernel reading them takes).
The stacked weights are new constants registered with ``add_constant`` and a ``derived=`` recipe from the
members' own weight and scale attributes, so the torch.compile backend's rebind derives them again for
every layer of a kind from that layer's weights; the members' own attributes then leave the graph, which would
otherwise hold every stacked weight twice (about 84 MB per GLM-5 layer).
"""

from __future__ import annotations

import functools

import torch
from torch import fx

from fxglm5.contracts import FP8_BLOCK
from fxglm5.passes.graph_utils import (
    add_constant, aten, drop_unread_attributes, fake_call, get_attr_tensor, insert_call, is_op, op_args,
)
from fxglm5.passes.manager import PassOutcome
from fxglm5.passes.registry import register_pass


def expected_groups(ctx) -> int:
    """Per layer: the attention input's group, the query latent's (layers with their own indexer) and the
    MLP's gate / up (a dense layer, or a MoE layer's shared expert); none in a checkpoint without FP8."""
    cfg = ctx.config
    if not cfg.is_fp8:
        return 0
    return sum(1 + cfg.has_indexer(layer) + (not cfg.is_moe_layer(layer) or bool(cfg.n_shared_experts))
               for layer in range(cfg.num_hidden_layers))


def _fusable(node: fx.Node) -> bool:
    args = op_args(node)
    weight, scale = args["weight"], args["weight_scale_inv"]
    return (args["bias"] is None and isinstance(weight, fx.Node) and weight.op == "get_attr"
            and isinstance(scale, fx.Node) and scale.op == "get_attr")


def stacked_layout(sizes: list[int]) -> tuple[list[int], tuple[int, ...]]:
    """For members of ``sizes`` output rows: the order they are stacked in (those whose N is a multiple of 128
    first) and each one's rows in the stack, in that order (all but the last padded to whole 128-row blocks)."""
    order = sorted(range(len(sizes)), key=lambda i: sizes[i] % FP8_BLOCK != 0)
    rows = tuple(-(-sizes[i] // FP8_BLOCK) * FP8_BLOCK for i in order[:-1]) + (sizes[order[-1]],)
    return order, rows


def stack(rows: tuple[int, ...], *tensors: torch.Tensor) -> torch.Tensor:
    """``tensors`` stacked on dim 0, tensor i zero-padded to ``rows[i]`` rows (the weights' and scales' recipe)."""
    parts = []
    for want, t in zip(rows, tensors):
        parts.append(t)
        if want > t.shape[0]:
            parts.append(torch.zeros(want - t.shape[0], *t.shape[1:], dtype=t.dtype, device=t.device))
    return torch.cat(parts).contiguous()


def _fuse(gm: fx.GraphModule, members: list[fx.Node]) -> None:
    """Replace ``members`` (in graph order) by slices of one fp8_linear over their stacked weights."""
    first = members[0]
    order, rows = stacked_layout([op_args(n)["weight"].meta["val"].shape[0] for n in members])
    members = [members[i] for i in order]
    args = [op_args(n) for n in members]
    sizes = [a["weight"].meta["val"].shape[0] for a in args]
    owner = args[0]["weight"].target.rpartition(".")[0].rpartition(".")[0]
    constants = []
    for name, key, stacked_rows in (("fused_weight", "weight", rows),
                                    ("fused_weight_scale_inv", "weight_scale_inv", tuple(-(-r // FP8_BLOCK) for r in rows))):
        sources = tuple(a[key].target for a in args)
        derive = functools.partial(stack, stacked_rows)
        with torch.no_grad():
            tensor = derive(*(get_attr_tensor(gm, a[key]) for a in args))
        constants.append(add_constant(gm, owner, name, tensor, first, (sources, derive)))
    op = torch.ops.fxglm5.fp8_linear.default
    call = (args[0]["x"], *constants, None, args[0]["act_quant"])
    fused = insert_call(gm, first, op, call, fake_call(op, *call))
    start = 0
    for node, n, padded in zip(members, sizes, rows):
        dim = len(node.meta["val"].shape) - 1
        # the member's own value stands for its slice (same shape and dtype; a fake run per slice costs ms each)
        node.replace_all_uses_with(insert_call(gm, node, aten.slice.Tensor, (fused, dim, start, start + n), node.meta["val"]))
        gm.graph.erase_node(node)
        start += padded


@register_pass("fuse_kernels", expected=expected_groups)
def fuse_shared_input_gemms(gm: fx.GraphModule, ctx) -> PassOutcome:
    groups: dict[tuple, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if is_op(node, torch.ops.fxglm5.fp8_linear.default) and _fusable(node):
            args = op_args(node)
            groups.setdefault((args["x"], bool(args["act_quant"])), []).append(node)
    fused = [members for members in groups.values() if len(members) > 1]
    # the members' own weights: nothing reads them once stacked, and the graph would hold a second copy of each
    replaced = {op_args(n)[key].target for members in fused for n in members for key in ("weight", "weight_scale_inv")}
    for members in fused:
        _fuse(gm, members)
    drop_unread_attributes(gm, replaced)
    return PassOutcome(len(fused), {"gemms": sum(map(len, fused))})
