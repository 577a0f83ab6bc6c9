"""fuse_shared_add_into_moe: moe_fp8(...) + shared -> fxglm5::moe_fp8_add (tests/passes/template.py's checks; near
misses: the add scaled by alpha, the routed sum read elsewhere too, a shared output of another dtype) and the Triton
MoE's combine, interpreted, against the chain it replaces."""

import os

import pytest
import torch

from fxglm5.model.config import Glm5Config
from fxglm5.model.moe import MoE, route
from fxglm5.passes import PassContext, run_pipeline
from tests.helpers import randomize_
from tests.passes.template import PassTemplate, export_small, small_dims

THREE = {"aten.add": -3, "fxglm5.moe_fp8": -3, "fxglm5.moe_fp8_add": 3}  # the tiny models' MoE layers 1-3
CAST = {**THREE, "aten.to": -3}  # a float32 model's routed sum is cast to its own dtype before the add
CFG = Glm5Config.preset("tiny").replace(hidden_size=256, n_routed_experts=8, num_experts_per_tok=2)


class SharedMoE(MoE):
    """GLM-5's MoE block; ``variant`` makes a near miss: the shared output added with alpha 2 ("alpha"), the routed
    sum also returned summed ("read_twice"), the shared output rounded to bf16 while the routed sum is float32
    ("dtypes": the add promotes)."""

    def __init__(self, variant=None):
        super().__init__(CFG, torch.float32)
        self.variant = variant

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        logits = torch.nn.functional.linear(flat.float(), self.gate.weight.float())
        weights, ids = route(logits, self.gate.e_score_correction_bias, self.cfg)
        routed = self.experts(flat, torch.zeros_like(logits).scatter(1, ids, weights))
        shared = self.shared_experts(flat)
        if self.variant == "alpha":
            out = torch.add(routed, shared, alpha=2.0)
        elif self.variant == "dtypes":
            out = routed + shared.to(torch.bfloat16)
        else:
            out = routed + shared
        if self.variant == "read_twice":
            out = out + routed.sum(-1, keepdim=True)
        return out.view(x.shape)


def _x(batch=2, seq=5):
    return torch.randn(batch, seq, CFG.hidden_size, generator=torch.Generator().manual_seed(batch * seq))


def fused_graph(module):
    """``module``'s graph through the fuse stage (its experts one moe_fp8), as this pass receives it."""
    gm = export_small(module, (_x(),))
    run_pipeline(gm, PassContext(config=CFG), stages=("fuse",))
    return gm


class TestFuseSharedAddIntoMoe(PassTemplate):
    name = "fuse_shared_add_into_moe"
    matches = {"fp8": 3, "shared": 3, "bf16": 3, "bf16ckpt": 3}
    ops = {"fp8": CAST, "shared": CAST, "bf16": THREE, "bf16ckpt": CAST}
    near_misses = ("alpha", "read_twice", "dtypes")

    def near_miss(self, case):
        module = randomize_(SharedMoE(case))
        return fused_graph(module), module, (_x(3, 7),), CFG

    def reexport(self):
        example = (_x(),)
        return fused_graph(randomize_(SharedMoE())), example, small_dims(example), (_x(3, 7),), CFG


def test_the_triton_combine_adds_the_shared_row_at_the_chains_rounding_points(monkeypatch):
    """moe_fp8_add on the Triton kernels (interpreted) equals moe_fp8 on them followed by the add to a bf16 step (the
    routed sum rounded to bf16, then the add rounded again; the interpreter's own cast of the unfused kernel
    truncates where the fused one rounds to nearest, so bit-for-bit equality is the GPU test's:
    tests/gpu/test_gpu_fused.py), and the reference op's value."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from fxglm5.lowering.triton.moe import moe_fp8

    module = randomize_(MoE(CFG, torch.float32))
    experts = module.experts
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, CFG.hidden_size, generator=g).bfloat16()
    shared = torch.randn(5, CFG.hidden_size, generator=g).bfloat16()
    weights, ids = route(torch.randn(5, CFG.n_routed_experts, generator=g), torch.zeros(CFG.n_routed_experts), CFG)
    ids = ids.to(torch.int32)
    ids[1, 0] = -1  # an expert another rank holds
    args = (x, ids, weights, experts.gate_up_proj, experts.gate_up_proj_scale_inv, experts.down_proj,
            experts.down_proj_scale_inv, True)
    fused = moe_fp8(*args, addend=shared)
    chain = moe_fp8(*args) + shared
    torch.testing.assert_close(fused.float(), chain.float(), rtol=2**-7, atol=2**-7 * chain.abs().max().item())
    reference = torch.ops.fxglm5.moe_fp8_add(*args, shared)
    torch.testing.assert_close(fused.float(), reference.float(), rtol=2e-2, atol=2e-2 * reference.abs().max().item())
    assert os.environ["TRITON_INTERPRET"] == "1"


def test_the_reference_serves_unquantized_experts_as_moe_fp8_does():
    """A bf16 checkpoint's experts have no scales: moe_fp8_add's reference is then moe_fp8's (the plain experts)
    plus the shared row, as the unfused graph computes it (it refused them: the RTP plugin's float32 model at tp 2)."""
    from fxglm5.lowering.reference import fp8 as ref_fp8
    from fxglm5.lowering.reference import fused as ref_fused

    g = torch.Generator().manual_seed(3)
    x, shared = torch.randn(5, 64, generator=g), torch.randn(5, 64, generator=g)
    w13, w2 = torch.randn(4, 2 * 32, 64, generator=g), torch.randn(4, 64, 32, generator=g)
    ids = torch.tensor([[0, 3], [1, -1], [2, 2], [3, 0], [-1, -1]], dtype=torch.int32)
    weights = torch.rand(5, 2, generator=g)
    got = ref_fused.moe_fp8_add(x, ids, weights, w13, None, w2, None, True, shared)
    assert torch.equal(got, torch.ops.fxglm5.moe_fp8(x, ids, weights, w13, None, w2, None, True) + shared)
    assert torch.equal(got, ref_fp8.moe_plain(x, ids, weights, w13, w2) + shared)


def test_a_bad_addend_is_refused_by_name(monkeypatch):
    """An addend of another shape (reference and Triton) or dtype (Triton: its combine writes the tokens' dtype)
    is an InputError naming the addend, before any kernel runs."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from fxglm5.errors import InputError
    from fxglm5.lowering.reference import fused as ref_fused
    from fxglm5.lowering.triton.moe import moe_fp8

    experts = randomize_(MoE(CFG, torch.float32)).experts
    x = torch.randn(5, CFG.hidden_size).bfloat16()
    ids, weights = torch.zeros(5, 2, dtype=torch.int32), torch.rand(5, 2)
    args = (x, ids, weights, experts.gate_up_proj, experts.gate_up_proj_scale_inv, experts.down_proj,
            experts.down_proj_scale_inv, True)
    for bad in (x[:4], x.float()):
        with pytest.raises(InputError, match="moe_fp8 addend"):
            moe_fp8(*args, addend=bad)
    with pytest.raises(InputError, match="moe_fp8_add addend: shape"):
        ref_fused.moe_fp8_add(*args, x[:4])
