"""fuse_fp8_linear: ``linear(x, dequantize(W_fp8, scale))`` -> ``fxglm5::fp8_linear(x, W_fp8, scale)``.

The generic model dequantizes each FP8 weight to the compute dtype on every call; the fused op reads
the e4m3 weight and its 128x128 block scales directly (and, with ``act_quant``, quantizes activations
per 1x128 group for an FP8 tensor-core GEMM).
"""

from __future__ import annotations

import torch
from torch import fx

from fxglm5.capture.export import MTP_HEAD
from fxglm5.passes.dequant import match_dequant
from fxglm5.passes.graph_utils import aten, op_args, replace_with_call, rewrite_each
from fxglm5.passes.manager import PassOutcome
from fxglm5.passes.registry import register_pass


def expected_fp8_linears(ctx) -> int:
    """FP8 linears left after match_*_mla absorbed kv_b_proj: q_a, q_b, kv_a, o_proj, indexer wq_b/wk,
    and the dense MLP or the shared expert (3 each); the MTP graph's eh_proj where it is stored in FP8
    (``extras["eh_proj_fp8"]``; GLM-5-FP8 keeps it in bf16)."""
    cfg = ctx.config
    if not cfg.is_fp8:
        return 0
    total = int(ctx.extras.get("head") == MTP_HEAD and bool(ctx.extras.get("eh_proj_fp8")))
    for layer in range(cfg.num_hidden_layers):
        total += 4 + (2 if cfg.has_indexer(layer) else 0)
        total += 3 if (not cfg.is_moe_layer(layer) or cfg.n_shared_experts) else 0
    return total


@register_pass("fuse", expected=expected_fp8_linears)
def fuse_fp8_linear(gm: fx.GraphModule, ctx) -> PassOutcome:
    op = torch.ops.fxglm5.fp8_linear.default

    def fuse(node: fx.Node) -> bool:
        linear = op_args(node)
        x, bias = linear["input"], linear["bias"]
        deq = match_dequant(linear["weight"])
        if deq is None:
            return False
        args = (x, deq.weight, deq.scale, bias, bool(ctx.act_quant))
        replace_with_call(gm, node, op, args)
        gm.graph.erase_node(node)
        return True

    return PassOutcome(rewrite_each(gm, fuse, aten.linear.default))
