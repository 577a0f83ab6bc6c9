"""fuse_norm_rope_into_cache_writes: fold the RMSNorm and RoPE that produce the cached values into the cached ops.

In GLM-5 the normalized latent ``kv_a_layernorm(c_kv)`` and the rotated key ``rope(k_pe)`` exist only to be
stored in the latent cache, and the indexer's ``rope(k_norm(k))`` only to be stored in the index cache: nothing
else reads them. Passed to the cached ops un-normalized and un-rotated (with the norm's weight and the RoPE
tables), they are computed inside the cache-write kernel, which reads the raw rows once and writes the cache
once; the query's RoPE moves into the kernel that assembles the 576-wide latent query. Per MLA layer that
removes the norm and both RoPE kernels, per indexer layer the LayerNorm and the key's RoPE (see
``fxglm5.ops.cached`` for the extra arguments). Runs after ``insert_paged_cache``; a value with another reader
is left alone.
"""

from __future__ import annotations

import torch
from torch import fx

from fxglm5.passes.graph_utils import aten, fake_call, insert_call, is_op, shape_of
from fxglm5.passes.manager import PassOutcome
from fxglm5.passes.registry import register_pass

_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
_MLA_ARGS = {"rtp_sparse_mla": 14, "rtp_mla": 13}
_INDEXER_ARGS = 10


def expected_folds(ctx) -> int:
    cfg = ctx.config
    return cfg.num_hidden_layers + sum(cfg.has_indexer(i) for i in range(cfg.num_hidden_layers))


def _sole_use(node) -> bool:
    return isinstance(node, fx.Node) and len(node.users) == 1


def _full_rope(node):
    """(x, cos, sin) when ``node`` is a RoPE over all of x's features that nothing else reads."""
    rope = torch.ops.fxglm5.rope_interleaved.default
    if not is_op(node, rope) or not _sole_use(node):
        return None
    x, cos, sin = node.args
    return (x, cos, sin) if shape_of(x)[-1] == 2 * shape_of(cos)[-1] else None


def _fold_mla(gm: fx.GraphModule, node: fx.Node) -> tuple[int, int]:
    """Fold the key/query RoPE and the latent RMSNorm into one rtp_*mla node; returns (norms, ropes) folded."""
    args = list(node.args)
    q_pe, kv_c, k_pe = args[1], args[2], args[3]
    q_rope = _full_rope(q_pe)
    k_rope = _full_rope(k_pe.args[0]) if is_op(k_pe, aten.squeeze.dim) and k_pe.args[1] == 2 and _sole_use(k_pe) else None
    cos_sin, ropes = (None, None), 0
    if q_rope and k_rope and q_rope[1:] == k_rope[1:] and shape_of(k_rope[0])[2] == 1:
        squeeze = insert_call(gm, node, aten.squeeze.dim, (k_rope[0], 2), fake_call(aten.squeeze.dim, k_rope[0], 2))
        args[1], args[3], cos_sin, ropes = q_rope[0], squeeze, q_rope[1:], 2
    norm, norms = (None, 0.0), 0
    if is_op(kv_c, torch.ops.fxglm5.rms_norm.default) and _sole_use(kv_c):
        args[2], norm, norms = kv_c.args[0], kv_c.args[1:], 1
    if norms or ropes:
        node.args = (*args, *cos_sin, *norm)
    return norms, ropes


def _layer_norm(node):
    """(x, weight, bias, eps) for a last-dim LayerNorm with weight and bias that nothing else reads."""
    if not is_op(node, aten.layer_norm.default) or not _sole_use(node):
        return None
    x, shape, weight, bias = node.args[:4]
    eps = node.args[4] if len(node.args) > 4 else 1e-5
    if list(shape) != [shape_of(x)[-1]] or weight is None or bias is None:
        return None
    return x, weight, bias, eps


def _fold_indexer(node: fx.Node) -> tuple[int, int]:
    """Fold the key's LayerNorm + RoPE (``view(rope(view(layer_norm(k))))``) into an rtp_indexer node."""
    k = node.args[1]
    if not is_op(k, *_VIEWS) or not _sole_use(k):
        return 0, 0
    rope = k.args[0]
    if not is_op(rope, torch.ops.fxglm5.rope_interleaved.default) or not _sole_use(rope):
        return 0, 0
    x4, cos, sin = rope.args
    if not is_op(x4, *_VIEWS) or not _sole_use(x4):
        return 0, 0
    norm = _layer_norm(x4.args[0])
    if norm is None or shape_of(norm[0]) != shape_of(k):
        return 0, 0
    args = list(node.args)
    args[1] = norm[0]
    node.args = (*args, cos, sin, *norm[1:])
    return 1, 1


@register_pass("cache", expected=expected_folds)
def fuse_norm_rope_into_cache_writes(gm: fx.GraphModule, ctx) -> PassOutcome:
    norms = ropes = matches = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        name = node.target._opname if node.target.namespace == "fxglm5" else None
        if name in _MLA_ARGS and len(node.args) == _MLA_ARGS[name]:
            n, r = _fold_mla(gm, node)
        elif name == "rtp_indexer" and len(node.args) == _INDEXER_ARGS:
            n, r = _fold_indexer(node)
        else:
            continue
        norms, ropes, matches = norms + n, ropes + r, matches + bool(n or r)
    return PassOutcome(matches, {"norms": norms, "ropes": ropes})
