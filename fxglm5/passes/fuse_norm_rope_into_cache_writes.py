"""fuse_norm_rope_into_cache_writes: fold the RMSNorm and RoPE that produce the cached values into the cached ops.

In GLM-5 the normalized latent ``kv_a_layernorm(c_kv)`` and the rotated key ``rope(k_pe)`` exist only to be
stored in the latent cache, and the indexer's ``rope(k_norm(k))`` only to be stored in the index cache: nothing
else reads them. Passed to the cached ops un-normalized and un-rotated (with the norm's weight and the RoPE
tables), they are computed inside the cache-write kernel, which reads the raw rows once and writes the cache
once; the query's RoPE moves into the kernel that assembles the 576-wide latent query. Per MLA layer that
removes the norm and both RoPE kernels, per indexer layer the LayerNorm and the key's RoPE (see
``fxglm5.ops.cached`` for the extra arguments). Runs after ``insert_paged_cache``; a value with another reader
is left alone. The indexer query's RoPE is folded next, by ``fuse_rope_into_indexer_query``, which reuses the
tables this pass gives rtp_indexer for its key.
"""

from __future__ import annotations

import torch
from torch import fx

from fxglm5.passes.graph_utils import aten, fake_call, insert_call, is_op, op_args, rewrite_each, set_op_args, shape_of
from fxglm5.passes.manager import PassOutcome
from fxglm5.passes.registry import register_pass

_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


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
    x, cos, sin = (op_args(node)[name] for name in ("x", "cos", "sin"))
    return (x, cos, sin) if shape_of(x)[-1] == 2 * shape_of(cos)[-1] else None


def _squeezed_rope(k_pe):
    """``_full_rope`` of the x that ``k_pe = x.squeeze(2)`` squeezes, if nothing else reads k_pe."""
    if not is_op(k_pe, aten.squeeze.dim) or op_args(k_pe)["dim"] != 2 or not _sole_use(k_pe):
        return None
    return _full_rope(op_args(k_pe)["self"])


def _fold_mla(gm: fx.GraphModule, node: fx.Node) -> tuple[int, int]:
    """Fold the key/query RoPE and the latent RMSNorm into one rtp_*mla node; returns (norms, ropes) folded."""
    args = op_args(node)
    q_rope, k_rope, kv_c = _full_rope(args["q_pe"]), _squeezed_rope(args["k_pe"]), args["kv_c"]
    changes = {}
    if q_rope and k_rope and q_rope[1:] == k_rope[1:] and shape_of(k_rope[0])[2] == 1:
        squeeze = insert_call(gm, node, aten.squeeze.dim, (k_rope[0], 2), fake_call(aten.squeeze.dim, k_rope[0], 2))
        changes.update(q_pe=q_rope[0], k_pe=squeeze, rope_cos=q_rope[1], rope_sin=q_rope[2])
    if is_op(kv_c, torch.ops.fxglm5.rms_norm.default) and _sole_use(kv_c):
        norm = op_args(kv_c)
        changes.update(kv_c=norm["x"], kv_norm_weight=norm["weight"], kv_norm_eps=norm["eps"])
    if changes:
        set_op_args(node, **changes)
    return int("kv_c" in changes), 2 * ("rope_cos" in changes)


def _layer_norm(node):
    """(x, weight, bias, eps) for a last-dim LayerNorm with weight and bias that nothing else reads."""
    if not is_op(node, aten.layer_norm.default) or not _sole_use(node):
        return None
    norm = op_args(node)
    x, weight, bias = norm["input"], norm["weight"], norm["bias"]
    if list(norm["normalized_shape"]) != [shape_of(x)[-1]] or weight is None or bias is None:
        return None
    return x, weight, bias, norm["eps"]


def _fold_indexer(node: fx.Node) -> tuple[int, int]:
    """Fold the key's LayerNorm + RoPE (``view(rope(view(layer_norm(k))))``) into an rtp_indexer node."""
    k = op_args(node)["k"]
    if not is_op(k, *_VIEWS) or not _sole_use(k):
        return 0, 0
    rope = op_args(k)["self"]
    if not is_op(rope, torch.ops.fxglm5.rope_interleaved.default) or not _sole_use(rope):
        return 0, 0
    x4, cos, sin = (op_args(rope)[name] for name in ("x", "cos", "sin"))
    if not is_op(x4, *_VIEWS) or not _sole_use(x4):
        return 0, 0
    norm = _layer_norm(op_args(x4)["self"])
    if norm is None or shape_of(norm[0]) != shape_of(k):
        return 0, 0
    x, weight, bias, eps = norm
    set_op_args(node, k=x, rope_cos=cos, rope_sin=sin, k_norm_weight=weight, k_norm_bias=bias, k_norm_eps=eps)
    return 1, 1


def _unfolded(node: fx.Node, *optional: str) -> bool:
    """No fold has set these optional arguments of ``node`` yet."""
    args = op_args(node)
    return all(args[name] is None for name in optional)


@register_pass("cache", expected=expected_folds)
def fuse_norm_rope_into_cache_writes(gm: fx.GraphModule, ctx) -> PassOutcome:
    ops = torch.ops.fxglm5
    folded = {"norms": 0, "ropes": 0}

    def fold(node: fx.Node) -> bool:
        if is_op(node, ops.rtp_sparse_mla.default, ops.rtp_mla.default) and _unfolded(node, "rope_cos", "kv_norm_weight"):
            n, r = _fold_mla(gm, node)
        elif is_op(node, ops.rtp_indexer.default) and _unfolded(node, "rope_cos", "k_norm_weight"):
            n, r = _fold_indexer(node)
        else:
            return False
        folded["norms"], folded["ropes"] = folded["norms"] + n, folded["ropes"] + r
        return bool(n or r)

    matches = rewrite_each(gm, fold)
    return PassOutcome(matches, folded)
