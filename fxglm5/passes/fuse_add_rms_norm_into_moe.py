"""fuse_add_rms_norm_into_moe: ``moe_router_fp8_shared(add_rms_norm(x, r)[0].reshape(-1, H), ...)`` ->
``fxglm5::add_rms_norm_moe_router_fp8_shared(x, r, ..., the MoE's arguments)``, whose second output (the sum) is the
next residual.

Why: a decode MoE layer launched its post-attention residual add and RMSNorm as a kernel of its own before the MoE's
first launch (issue 45, item 5: a decode MoE layer in fewer launches). That launch is already a launch of tasks (the
router's tiles, then the shared and routed experts' gate|up tiles that wait for the routing:
``lowering.triton.tasks``), so the add and norm become its first tasks, a token row each, writing the sum and the
normed rows and signalling; the router's and the shared expert's tiles wait for that signal, the routed tiles for
the routing (which comes after it), and all read the normed rows from L2 (``lowering.triton.moe
.add_rms_norm_moe_router_fp8``). One producer per row is cheaper here than forming the norm in every CTA's A loads
(fuse_add_rms_norm_into_gemm's way for a GEMM, whose CTAs wait for nothing): the experts wait for the router
anyway. The row function is ``add_rms_norm``'s kernel's, so the bits are its. Past 16 tokens the op runs the norm's
kernel and then the MoE's launches, as before.

Matched: an ``fxglm5::add_rms_norm`` read only through its items, whose normed rows (item 0) are the tokens ``x`` of
one ``fxglm5::moe_router_fp8_shared`` and nothing else's, directly or through aliases, casts to their own dtype and
reshapes / views that keep the last dim (the MoE block flattens [B, S, H] to [B*S, H]: the same rows, in order), each
read once; the sum (item 1) keeps its readers (the next layer's input norm, the residual of the block after).
Left alone: normed rows read elsewhere too (they must be written), a MoE of other tokens (a slice, a reordering, any
other op between the norm and the MoE), a MoE whose arguments are computed after the norm (constants are moved up to
the fused op, which stands where the norm stood), a MoE op without its router or shared expert (the prefill-shaped
graphs where fuse_router_into_moe did not match have none at decode either). Exact: the reference is add_rms_norm and
moe_router_fp8_shared as before.
Runs after fuse_router_into_moe (the MoE with its router one op) and fuse_add_rms_norm (the add and norm one op).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from fxglm5.passes import fuse_router_into_moe
from fxglm5.passes.fuse_add_rms_norm_into_gemm import _move_up, _outputs
from fxglm5.passes.graph_utils import _TRANSPARENT, aten, fake_call, insert_call, is_noop_cast, is_op, op_args, \
    rewrite_each, shape_of
from fxglm5.passes.manager import PassOutcome
from fxglm5.passes.registry import register_pass

_ROW_VIEWS = {aten.reshape.default, aten.view.default, aten._unsafe_view.default}


def expected_fusions(ctx) -> int:
    """Each MoE layer fuse_router_into_moe fused: its tokens are its post-attention norm's rows, the norm of a
    residual sum in every decoder layer (the first's too: embedding + attention)."""
    return fuse_router_into_moe.expected_fusions(ctx)


def _moe_of(normed: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
    """(the moe_router_fp8_shared whose tokens are ``normed``'s rows, the nodes in between) where ``normed`` reaches
    its ``x`` through single-reader aliases, same-dtype casts and row views alone, and it reads nothing else of it."""
    width, chain, node = shape_of(normed), [], normed
    while True:
        if len(node.users) != 1:
            return None
        user = next(iter(node.users))
        if is_op(user, torch.ops.fxglm5.moe_router_fp8_shared.default):
            args = op_args(user)
            if args["x"] is not node or any(value is node for name, value in args.items() if name != "x"):
                return None
            return user, chain
        keeps_rows = is_op(user, *_ROW_VIEWS) and shape_of(user) is not None and width is not None \
            and shape_of(user)[-1] == width[-1] and op_args(user)["self"] is node
        if not (keeps_rows or (is_op(user, *_TRANSPARENT) or is_noop_cast(user)) and op_args(user)["self"] is node):
            return None
        chain.append(user)
        node = user


@register_pass("fuse_kernels", expected=expected_fusions)
def fuse_add_rms_norm_into_moe(gm: fx.GraphModule, ctx) -> PassOutcome:
    def fuse(norm: fx.Node) -> bool:
        outputs = _outputs(norm)
        if outputs is None or 0 not in outputs:
            return False
        found = _moe_of(outputs[0])
        if found is None:
            return False
        moe, chain = found
        experts = {name: value for name, value in op_args(moe).items() if name != "x"}
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        if not _move_up(list(experts.values()), norm, order):
            return False
        n = op_args(norm)
        op = torch.ops.fxglm5.add_rms_norm_moe_router_fp8_shared.default
        call = (n["x"], n["residual"], n["weight"], n["eps"], *experts.values())
        fused = insert_call(gm, norm, op, call, fake_call(op, *call))
        with gm.graph.inserting_before(norm):
            for index, old in ((0, moe), (1, outputs.get(1))):
                if old is not None:
                    item = gm.graph.call_function(operator.getitem, (fused, index))
                    item.meta["val"] = fused.meta["val"][index]
                    old.replace_all_uses_with(item)
        for old in (moe, *reversed(chain), outputs[0], outputs.get(1), norm):
            if old is not None:
                gm.graph.erase_node(old)
        return True

    return PassOutcome(rewrite_each(gm, fuse, torch.ops.fxglm5.add_rms_norm.default))
