"""fuse_silu_mul_into_down: ``fp8_linear(silu(gate) * up, W_down)`` -> ``fxglm5::silu_mul_fp8_linear(gate, up, W)``.

Why: the dense MLPs and the shared expert computed ``silu(gate) * up`` as two elementwise kernels between their two
GEMMs. At decode the down GEMM's activation operand is a few rows, so its kernel can read gate and up (the two
halves of the stacked gate|up GEMM's output, after ``fuse_shared_input_gemms``) and apply the gate as it loads
them: two kernels and a round trip of the activation fewer. At prefill the lowering runs one fused elementwise
kernel before the GEMM instead of two.

Matched: an ``fxglm5::fp8_linear`` whose input is ``aten.mul.Tensor(aten.silu(gate), up)`` with gate and up of one
shape and dtype, neither the silu nor the product read by anything else. Left alone: another activation, a
product read elsewhere too, operands that broadcast. Exact: the reference is silu, multiply and GEMM as before.
"""

from __future__ import annotations

import torch
from torch import fx

from fxglm5.passes.graph_utils import aten, dtype_of, is_op, op_args, replace_with_call, rewrite_each, shape_of
from fxglm5.passes.manager import PassOutcome
from fxglm5.passes.registry import register_pass


def expected_fusions(ctx) -> int:
    """Each dense MLP and each MoE layer's shared expert, in an FP8 checkpoint (a bf16 one has no fp8_linear)."""
    cfg = ctx.config
    if not cfg.is_fp8:
        return 0
    return sum(not cfg.is_moe_layer(i) or bool(cfg.n_shared_experts) for i in range(cfg.num_hidden_layers))


def _gate_up(down: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    product = op_args(down)["x"]
    if not is_op(product, aten.mul.Tensor) or len(product.users) != 1:
        return None
    silu, up = op_args(product)["self"], op_args(product)["other"]
    if not is_op(silu, aten.silu.default) or len(silu.users) != 1 or not isinstance(up, fx.Node):
        return None
    gate = op_args(silu)["self"]
    same = shape_of(gate) is not None and shape_of(gate) == shape_of(up) and dtype_of(gate) == dtype_of(up)
    return (gate, up) if same else None


@register_pass("fuse_kernels", expected=expected_fusions)
def fuse_silu_mul_into_down(gm: fx.GraphModule, ctx) -> PassOutcome:
    def fuse(down: fx.Node) -> bool:
        operands = _gate_up(down)
        if operands is None:
            return False
        args = op_args(down)
        replace_with_call(gm, down, torch.ops.fxglm5.silu_mul_fp8_linear.default,
                          (*operands, args["weight"], args["weight_scale_inv"], args["bias"], args["act_quant"]))
        return True

    return PassOutcome(rewrite_each(gm, fuse, torch.ops.fxglm5.fp8_linear.default))
