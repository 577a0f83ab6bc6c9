"""fuse_index_weights_into_q_norm: a layer's indexer head weights (``f32_linear``) -> the second output of its
``fxglm5::rms_norm_write_caches``.

Why: after fuse_cache_writes_into_q_norm a decode attention layer still launched the indexer's head weights on their
own: f32_linear's float32 GEMV of the layer's normed hidden state (32 heads of 6144 features in GLM-5), a launch of
a few microseconds beside the query latent's norm and cache writes, which read the same stacked GEMM and run before
the indexer that reads the weights. Given the GEMV's operands, the fused op's Triton kernel runs it as programs of
its own launch at decode (``paged_cache.rms_norm_write_caches``: f32_linear's GEMV helpers over its grid, so the
weights are its bits), one launch fewer per indexed layer; prefill-sized steps still launch f32_linear's GEMM.

Matched, per rms_norm_write_caches node with an index cache and no head weights yet: the layer's own indexer (the
``rtp_indexer`` that reads the op's index cache) takes its ``weights`` from an ``f32_linear`` read by that indexer only,
of an input computed before the op and not from it. Exact: the op's reference computes that f32_linear as it was.

Left alone: a layer whose indexer's weights are not an f32_linear (fuse_f32_linear left them an aten linear), weights
another op reads too (they would have to be returned to it; the GEMV is no cheaper where it is), a GEMV of a value the
op's own outputs compute (the op would have to run before its input). Shared-indexer layers have no weights GEMV:
their op writes no index cache and takes none. Past the op's position, the weights' readers come after it: the op is
placed after the GEMV's input where that comes later, the readers in between moved after it
(``fuse_cache_writes_into_q_norm.insert_fused``, the placement that pass makes).

Why a pass of its own after fuse_cache_writes_into_q_norm (not a case of it): its count is the layers with an
indexer, not the attention layers, and ``disabled_passes`` can turn this one launch off alone (an A/B of what it buys).
"""

from __future__ import annotations

import torch
from torch import fx

from fxglm5.passes.fuse_cache_writes_into_q_norm import insert_fused, reads
from fxglm5.passes.graph_utils import is_op, op_args, rewrite_each
from fxglm5.passes.manager import PassOutcome
from fxglm5.passes.registry import register_pass


def expected_weights(ctx) -> int | None:
    """One per layer with its own indexer in a paged graph (fuse_f32_linear made each one's weights an
    f32_linear), none in a graph without the cache stage. None where the context does not say whether it is paged."""
    paged = ctx.extras.get("paged")
    if paged is None:
        return None
    return sum(ctx.config.has_indexer(i) for i in range(ctx.config.num_hidden_layers)) if paged else 0


def _fuse(gm: fx.GraphModule, fused: fx.Node, order: dict) -> bool:
    args = op_args(fused)
    cache = args["index_cache"]
    if cache is None or args["weights_proj"] is not None:
        return False
    indexers = [user for user in cache.users if is_op(user, torch.ops.fxglm5.rtp_indexer.default)]
    if len(indexers) != 1:
        return False
    linear = op_args(indexers[0])["weights"]
    if not is_op(linear, torch.ops.fxglm5.f32_linear.default) or set(linear.users) != set(indexers):
        return False
    gemv = op_args(linear)
    if reads(gemv["x"], fused, order) or order[indexers[0]] < order[fused]:
        return False
    normed = [user for user in fused.users if user.args[1:] == (0,)]  # the normed latent's getitem
    if len(normed) != 1:
        return False
    call = dict(args, weights_x=gemv["x"], weights_proj=gemv["weight"], weights_scales=list(gemv["scales"]))
    inputs = [value for value in call.values() if isinstance(value, fx.Node)]
    insert_fused(gm, fused, [*normed, linear], inputs, order, call)
    for node in (*normed, fused):
        gm.graph.erase_node(node)
    return True


@register_pass("fuse_kernels", expected=expected_weights)
def fuse_index_weights_into_q_norm(gm: fx.GraphModule, ctx) -> PassOutcome:
    return PassOutcome(rewrite_each(gm, lambda fused: _fuse(gm, fused, {n: i for i, n in enumerate(gm.graph.nodes)}),
                                    torch.ops.fxglm5.rms_norm_write_caches.default))
