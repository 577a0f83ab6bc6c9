"""fuse_fp8_linear: dequant + linear -> fxglm5::fp8_linear (tests/passes/template.py's checks, and hypothesis
properties over random sizes: exact counts, the generic ops gone, outputs kept; wrong block scales refused)."""

import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from fxglm5.model.layers import Linear, dequantize_weight
from fxglm5.passes import op_histogram
from tests.helpers import randomize_
from tests.passes.modules import exporting, tol
from tests.passes.template import PassTemplate, assert_same_output, assert_untouched, export_small, run_small, small_dims


def _linears_ops(linears: int, sliced: int) -> dict[str, int]:
    """One fused linear: its weight's dequantization (2 unsqueezes + expand + reshape of the scales to the weight's
    size, then an alias of them, or a slice where the weight's edge blocks are short; 2 casts, a mul) and the
    linear."""
    return {"aten.alias": -(linears - sliced), "aten.expand": -linears, "aten.linear": -linears, "aten.mul": -linears,
            "aten.reshape": -linears, "aten.slice": -sliced, "aten.to": -2 * linears, "aten.unsqueeze": -2 * linears,
            "fxglm5.fp8_linear": linears}


class Fp8Linears(nn.Module):
    """FP8 linears of ``sizes`` ((out, in) each) on the first features of x; ``variant`` makes a near miss: the
    block scales doubled ("doubled") or transposed ("transposed") before the dequantization."""

    def __init__(self, sizes, dtype, variant=None):
        super().__init__()
        self.layers = nn.ModuleList(Linear(k, n, True, dtype) for n, k in sizes)
        self.variant = variant

    def forward(self, x):
        out = []
        for layer in self.layers:
            scale = layer.weight_scale_inv
            if self.variant == "doubled":
                scale = scale * 2
            if self.variant == "transposed":
                scale = scale.t()
            w = dequantize_weight(layer.weight, scale, x.dtype)
            out.append(F.linear(x[..., : layer.in_features], w).sum(-1))
        return torch.stack(out, -1)


def _x(batch=2, seq=5, dtype=torch.float32):
    return torch.randn(batch, seq, 320, generator=torch.Generator().manual_seed(batch * seq)).to(dtype)


class TestFuseFp8Linear(PassTemplate):
    name = "fuse_fp8_linear"
    # per layer q_a, q_b, kv_a, o_proj (kv_b_proj is absorbed by match_sparse_mla), the indexer's wq_b and wk in a
    # layer with its own indexer, and the dense MLP's or the shared expert's 3; a bf16 checkpoint has none. 8 of
    # the 36 (6 of the 32) weights have short edge blocks
    matches = {"fp8": 36, "shared": 32, "bf16": 36, "bf16ckpt": 0}
    ops = {"fp8": _linears_ops(36, 8), "shared": _linears_ops(32, 6), "bf16ckpt": {}}
    near_misses = ("doubled", "transposed")

    def near_miss(self, case):
        module = randomize_(Fp8Linears([(256, 256), (320, 320)], torch.float32, case))
        return export_small(module, (_x(),)), module, (_x(3, 7),), None

    def reexport(self):
        module = randomize_(Fp8Linears([(192, 128), (64, 320)], torch.float32))
        return export_small(module, (_x(),)), (_x(),), small_dims((_x(),)), (_x(3, 7),), None


linear_shapes = st.fixed_dictionaries({
    "sizes": st.lists(st.tuples(st.sampled_from([64, 128, 192, 576 // 3]), st.sampled_from([128, 200, 320])), min_size=1, max_size=3),
    "batch": st.integers(1, 3), "seq": st.integers(1, 9), "dtype": st.sampled_from([torch.float32, torch.bfloat16]),
})


@exporting
@given(linear_shapes)
def test_fuse_fp8_linear_property(p):
    module = randomize_(Fp8Linears(p["sizes"], p["dtype"]))
    args = (_x(p["batch"], p["seq"], p["dtype"]),)
    gm, result = run_small("fuse_fp8_linear", module, args)
    ops = result.ops_after
    assert result.num_matches == len(p["sizes"]) and ops.get("fxglm5.fp8_linear") == result.num_matches
    assert "aten.linear" not in ops
    assert_same_output(gm(*args), module(*args), tol(p["dtype"]))


@exporting
@given(linear_shapes, st.sampled_from(["doubled", "transposed"]))
def test_fuse_fp8_linear_leaves_wrong_scales(p, variant):
    # A transposed scale is only wrong when the weight has several blocks each way: square 256 / 320.
    sizes = [(256 + 64 * (n % 2), 256 + 64 * (n % 2)) for n, _ in p["sizes"]] if variant == "transposed" else p["sizes"]
    module = randomize_(Fp8Linears(sizes, torch.float32, variant))
    args = (_x(p["batch"], p["seq"]),)
    gm = export_small(module, args)
    assert_untouched("fuse_fp8_linear", gm, module, args)
    assert op_histogram(gm)["aten.linear"] == len(sizes)
