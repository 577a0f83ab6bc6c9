"""match_mla: generic causal MLA attention -> ``fxglm5::mla`` with W_UK / W_UV absorbed from kv_b_proj.

Matches the naive attention (per-head keys and values expanded from the latent by kv_b_proj) whose mask
is exactly causal. Attention masked by a DSA selection is match_sparse_mla's; other masks are left alone.
"""

from __future__ import annotations

import torch
from torch import fx

from fxglm5.passes.graph_utils import aten, is_op, rewrite_each
from fxglm5.passes.manager import PassOutcome
from fxglm5.passes.mla_pattern import absorbed_weights, is_causal_mask, match_mla_attention, replace_attention
from fxglm5.passes.registry import register_pass


def expected_dense_mla(ctx) -> int:
    """GLM-5 layers all carry a DSA selection (their own or a shared one), so none is dense MLA."""
    return 0


@register_pass("match", expected=expected_dense_mla)
def match_mla(gm: fx.GraphModule, ctx) -> PassOutcome:
    def rewrite(node: fx.Node) -> bool:
        if not is_op(node, aten.softmax.int, aten._softmax.default):
            return False
        match = match_mla_attention(node, ctx)
        if match is None or not is_causal_mask(match.allowed):
            return False
        weights = absorbed_weights(gm, match, match.output)
        if weights is None:
            return False
        replace_attention(gm, match, torch.ops.fxglm5.mla.default, (), weights)
        return True

    return PassOutcome(rewrite_each(gm, rewrite))
