"""fuse_rope_into_indexer_query: fold the indexer query's RoPE into the rtp_indexer that scores it.

The DSA indexer rotates the first qk_rope_head_dim features of each head of its query (``rope_interleaved`` on
q_b's [N, S, HI, 128] indexer heads) only for rtp_indexer to read it. Given the un-rotated query and
``rope_q=True``, the op's selection rotates it as it loads it (the Triton logits kernel, once per program, with
the standalone RoPE's arithmetic and rounding), so a decode layer launches no RoPE kernel for the indexer.

The op has one pair of tables, ``rope_cos`` / ``rope_sin``, which ``fuse_norm_rope_into_cache_writes`` (run just
before) sets when it folds the key's RoPE: the query is folded only where its RoPE turns by those same tables (the
query and the key of a token sit at the same position), so an indexer whose key was not folded, a query rotated by
other tables, or a rotated query with another reader is left alone.
"""

from __future__ import annotations

import torch
from torch import fx

from fxglm5.passes.graph_utils import is_op, op_args, rewrite_each, set_op_args
from fxglm5.passes.manager import PassOutcome
from fxglm5.passes.registry import register_pass


def expected_folds(ctx) -> int:
    """One per layer with its own indexer (a layer that reuses the previous top-k runs none)."""
    cfg = ctx.config
    return sum(cfg.has_indexer(i) for i in range(cfg.num_hidden_layers))


def _fold(node: fx.Node) -> bool:
    args = op_args(node)
    rope, cos = args["q"], args["rope_cos"]
    if args["rope_q"] or cos is None or not is_op(rope, torch.ops.fxglm5.rope_interleaved.default):
        return False
    if len(rope.users) != 1 or (op_args(rope)["cos"], op_args(rope)["sin"]) != (cos, args["rope_sin"]):
        return False
    set_op_args(node, q=op_args(rope)["x"], rope_q=True)
    return True


@register_pass("cache", expected=expected_folds)
def fuse_rope_into_indexer_query(gm: fx.GraphModule, ctx) -> PassOutcome:
    return PassOutcome(rewrite_each(gm, _fold, torch.ops.fxglm5.rtp_indexer.default))
