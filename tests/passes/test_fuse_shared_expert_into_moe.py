"""fuse_shared_expert_into_moe: moe_fp8_add(x, ..., silu_mul_fp8_linear(slices of fp8_linear(x))) ->
fxglm5::moe_fp8_shared (tests/passes/template.py's checks; near misses: no shared expert, a shared expert of other
tokens, its gate read elsewhere too, its output read elsewhere too, its GEMMs W8A8 where the routed experts' are
not), the op's reference against the chain, and halves that do not fit refused by name (the Triton op against the
shared expert's own launches: tests/kernels/test_kernels_fused.py)."""

import copy

import pytest
import torch
import torch.nn.functional as F

from fxglm5.errors import InputError
from fxglm5.model.config import Glm5Config
from fxglm5.model.moe import MoE, route
from fxglm5.passes import REGISTRY, PassContext, PassManager, run_pipeline
from fxglm5.passes.graph_utils import is_op, set_op_args
from tests.helpers import randomize_
from tests.passes.template import PassTemplate, export_small, small_dims

# the tiny models' MoE layers 1-3: each shared expert's stacked gate|up GEMM, its two slices and its gated down GEMM
# fold into the MoE op
THREE = {"aten.slice": -6, "fxglm5.fp8_linear": -3, "fxglm5.silu_mul_fp8_linear": -3, "fxglm5.moe_fp8_add": -3,
         "fxglm5.moe_fp8_shared": 3}
CAST = {**THREE, "aten.to": -3}  # a float32 model's shared expert read its tokens through a cast to their own dtype
CFG = Glm5Config.preset("tiny").replace(hidden_size=256, n_routed_experts=8, num_experts_per_tok=2)
BEFORE = ("fuse_shared_input_gemms", "fuse_silu_mul_into_down", "fuse_shared_add_into_moe")


class SharedMoE(MoE):
    """GLM-5's MoE block with its shared expert written out; ``variant`` makes a near miss: the routed sum plus the
    tokens themselves ("no_shared"), the shared expert of the tokens doubled ("other_tokens"), its gate also summed
    into the output ("gate_read_twice"), its output also summed into it ("shared_read_twice")."""

    def __init__(self, variant=None):
        super().__init__(CFG, torch.float32)
        self.variant = variant

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        logits = torch.nn.functional.linear(flat.float(), self.gate.weight.float())
        weights, ids = route(logits, self.gate.e_score_correction_bias, self.cfg)
        routed = self.experts(flat, torch.zeros_like(logits).scatter(1, ids, weights))
        mlp = self.shared_experts
        tokens = flat * 2 if self.variant == "other_tokens" else flat
        gate = mlp.gate_proj(tokens)
        shared = mlp.down_proj(F.silu(gate) * mlp.up_proj(tokens))
        out = routed + (flat if self.variant == "no_shared" else shared)
        if self.variant == "gate_read_twice":
            out = out + gate.sum(-1, keepdim=True)
        if self.variant == "shared_read_twice":
            out = out + shared.sum(-1, keepdim=True)
        return out.view(x.shape)


def _x(batch=2, seq=5):
    return torch.randn(batch, seq, CFG.hidden_size, generator=torch.Generator().manual_seed(batch * seq))


def fused_graph(module):
    """``module``'s graph as this pass receives it: through the fuse stage (its experts one moe_fp8, its linears FP8
    GEMMs) and the fuse_kernels passes before this one (gate|up stacked, the gate in the down GEMM, the add in the
    MoE)."""
    gm = export_small(module, (_x(),))
    run_pipeline(gm, PassContext(config=CFG), stages=("fuse",))
    manager = PassManager(PassContext(config=CFG), stages=("fuse_kernels",))
    for name in BEFORE:
        manager.run_one(gm, REGISTRY[name])
    return gm


class TestFuseSharedExpertIntoMoe(PassTemplate):
    name = "fuse_shared_expert_into_moe"
    matches = {"fp8": 3, "shared": 3, "bf16": 3, "bf16ckpt": 0}
    ops = {"fp8": CAST, "shared": CAST, "bf16": THREE, "bf16ckpt": {}}
    near_misses = ("no_shared", "other_tokens", "gate_read_twice", "shared_read_twice", "act_quant")

    def near_miss(self, case):
        if case == "act_quant":  # the shared expert's GEMMs W8A8, the routed experts' not: the graph is the reference
            gm = fused_graph(randomize_(SharedMoE()))
            for node in gm.graph.nodes:
                if is_op(node, torch.ops.fxglm5.fp8_linear.default, torch.ops.fxglm5.silu_mul_fp8_linear.default):
                    set_op_args(node, act_quant=True)
            return gm, copy.deepcopy(gm), (_x(3, 7),), CFG
        module = randomize_(SharedMoE(case))
        gm = fused_graph(module)
        ops = {n.target for n in gm.graph.nodes}  # what the passes before this one make of it: the near pattern
        assert torch.ops.fxglm5.moe_fp8_add.default in ops
        assert (torch.ops.fxglm5.silu_mul_fp8_linear.default in ops) == (case != "no_shared")
        return gm, module, (_x(3, 7),), CFG

    def reexport(self):
        example = (_x(),)
        return fused_graph(randomize_(SharedMoE())), example, small_dims(example), (_x(3, 7),), CFG


def _layer(seed=3, tokens=5, dtype=torch.bfloat16):
    """A tiny MoE layer's routed and shared FP8 weights as the op takes them (the shared gate|up stacked, the gate
    padded to whole 128-row blocks: up_start 128 past an intermediate of 96), and tokens routed with -1 entries."""
    from fxglm5.passes.fuse_shared_input_gemms import stack, stacked_layout

    g = torch.Generator().manual_seed(seed)
    experts = randomize_(MoE(CFG, torch.float32)).experts
    inter, hidden = 96, CFG.hidden_size

    def fp8(n, k):
        return ((torch.randn(n, k, generator=g) * 0.5).to(torch.float8_e4m3fn),
                torch.rand(-(-n // 128), -(-k // 128), generator=g) * 0.02 + 0.005)

    (gw, gs), (uw, us), (dw, ds) = fp8(inter, hidden), fp8(inter, hidden), fp8(hidden, inter)
    _, rows = stacked_layout([inter, inter])
    w13, s13 = stack(rows, gw, uw), stack(tuple(-(-r // 128) for r in rows), gs, us)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    weights, ids = route(torch.randn(tokens, CFG.n_routed_experts, generator=g), torch.zeros(CFG.n_routed_experts),
                         CFG)
    ids = ids.to(torch.int32)
    ids[1, 0] = -1  # an expert another rank holds
    routed = (x, ids, weights, experts.gate_up_proj, experts.gate_up_proj_scale_inv, experts.down_proj,
              experts.down_proj_scale_inv)
    return routed, (w13, s13, dw, ds), rows[0]


@pytest.mark.parametrize("act_quant", [False, True])
def test_the_reference_is_the_chain_it_replaces(act_quant):
    """moe_fp8_shared's reference: the stacked gate|up fp8_linear, silu_mul_fp8_linear of its halves, moe_fp8_add,
    the ops of the graph before the pass, bit for bit."""
    routed, (w13, s13, w2, s2), up_start = _layer()
    x = routed[0]
    gate_up = torch.ops.fxglm5.fp8_linear(x, w13, s13, None, act_quant)
    shared = torch.ops.fxglm5.silu_mul_fp8_linear(gate_up[:, :96], gate_up[:, up_start:up_start + 96], w2, s2, None,
                                                  act_quant)
    chain = torch.ops.fxglm5.moe_fp8_add(*routed, act_quant, shared)
    fused = torch.ops.fxglm5.moe_fp8_shared(*routed, act_quant, w13, s13, w2, s2, up_start)
    assert torch.equal(fused, chain)


@pytest.mark.parametrize("up_start", [95, 160])
def test_halves_that_do_not_fit_apart_are_refused_by_name(monkeypatch, up_start):
    """An up half that overlaps the gate (95 < 96) or runs past the gate|up output (160 + 96 > 224) is an InputError
    naming up_start, on the reference and on the Triton kernels (before any launch)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from fxglm5.lowering.triton.moe import SharedExpert, moe_fp8

    routed, (w13, s13, w2, s2), _ = _layer()
    with pytest.raises(InputError, match="moe_fp8_shared up_start"):
        torch.ops.fxglm5.moe_fp8_shared(*routed, True, w13, s13, w2, s2, up_start)
    with pytest.raises(InputError, match="moe_fp8_shared up_start"):
        moe_fp8(*routed, True, shared=SharedExpert(w13, s13, w2, s2, True, up_start))
