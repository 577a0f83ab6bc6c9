"""fuse_router_into_moe: moe_fp8_shared(x, ids, weights, ...) with ids and weights of moe_router(x, ...) ->
fxglm5::moe_router_fp8_shared (tests/passes/template.py's checks; near misses: the routing read elsewhere too, a
router of other tokens, a MoE op without a shared expert), and the op's reference against the chain (the Triton op
against the separate launches: tests/kernels/test_kernels_fused.py)."""

import copy

import pytest
import torch
import torch.nn.functional as F

from fxglm5.model.config import Glm5Config
from fxglm5.model.moe import MoE, route
from fxglm5.passes import REGISTRY, PassContext, PassManager, run_pipeline
from tests.helpers import randomize_
from tests.passes.template import PassTemplate, export_small, small_dims

# the tiny models' MoE layers 1-3: each router's op and its two items (weights, ids) fold into the MoE op
THREE = {"fxglm5.moe_router": -3, "fxglm5.moe_fp8_shared": -3, "fxglm5.moe_router_fp8_shared": 3, "getitem": -6}
CFG = Glm5Config.preset("tiny").replace(hidden_size=256, n_routed_experts=8, num_experts_per_tok=2)
BEFORE = ("fuse_f32_linear", "fuse_f32_linear_into_route", "fuse_shared_input_gemms", "fuse_silu_mul_into_down",
          "fuse_shared_add_into_moe", "fuse_shared_expert_into_moe")


class RoutedMoE(MoE):
    """GLM-5's MoE block, router and shared expert written out; ``variant`` makes a near miss: the router fed the
    tokens doubled ("other_tokens"), no shared expert, the tokens added instead ("no_shared")."""

    def __init__(self, variant=None):
        super().__init__(CFG, torch.float32)
        self.variant = variant

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        routed_tokens = flat * 2 if self.variant == "other_tokens" else flat
        logits = F.linear(routed_tokens.float(), self.gate.weight.float())
        weights, ids = route(logits, self.gate.e_score_correction_bias, self.cfg)
        routed = self.experts(flat, torch.zeros_like(logits).scatter(1, ids, weights))
        mlp = self.shared_experts
        shared = mlp.down_proj(F.silu(mlp.gate_proj(flat)) * mlp.up_proj(flat))
        out = routed + (flat if self.variant == "no_shared" else shared)
        return out.view(x.shape)


def _x(batch=2, seq=5):
    return torch.randn(batch, seq, CFG.hidden_size, generator=torch.Generator().manual_seed(batch * seq))


def fused_graph(module):
    """``module``'s graph as this pass receives it: through the fuse stage and the fuse_kernels passes before this
    one (the router one op, the shared expert inside the MoE op)."""
    gm = export_small(module, (_x(),))
    run_pipeline(gm, PassContext(config=CFG), stages=("fuse",))
    manager = PassManager(PassContext(config=CFG), stages=("fuse_kernels",))
    for name in BEFORE:
        manager.run_one(gm, REGISTRY[name])
    return gm


class TestFuseRouterIntoMoe(PassTemplate):
    name = "fuse_router_into_moe"
    matches = {"fp8": 3, "shared": 3, "bf16": 3, "bf16ckpt": 0}
    ops = {"fp8": THREE, "shared": THREE, "bf16": THREE, "bf16ckpt": {}}
    near_misses = ("routing_read_twice", "other_tokens", "no_shared")

    def near_miss(self, case):
        """The variants of :class:`RoutedMoE`, and "routing_read_twice": the sum of the plain block's routing weights
        (moe_router's item 0) also added to the output (a graph edit: a second reader in the model itself would keep
        its router from becoming a moe_router)."""
        if case == "routing_read_twice":
            gm = fused_graph(randomize_(RoutedMoE()))
            router = next(n for n in gm.graph.nodes if n.target is torch.ops.fxglm5.moe_router.default)
            weights = next(item for item in router.users if item.args[1] == 0)
            output = gm.graph.output_node()
            out = output.args[0][0]
            with gm.graph.inserting_before(output):
                total = gm.graph.call_function(torch.ops.aten.sum.default, (weights,))
                both = gm.graph.call_function(torch.ops.aten.add.Tensor, (out, total))
            output.args = ((both, *output.args[0][1:]),)
            gm.recompile()
            return gm, copy.deepcopy(gm), (_x(3, 7),), CFG
        module = randomize_(RoutedMoE(case))
        gm = fused_graph(module)
        ops = {n.target for n in gm.graph.nodes}  # what the passes before this one make of it: the near pattern
        assert torch.ops.fxglm5.moe_router.default in ops
        assert (torch.ops.fxglm5.moe_fp8_shared.default in ops) == (case != "no_shared")
        return gm, module, (_x(3, 7),), CFG

    def reexport(self):
        example = (_x(),)
        return fused_graph(randomize_(RoutedMoE())), example, small_dims(example), (_x(3, 7),), CFG


@pytest.mark.parametrize("offset", [None, 4])
@pytest.mark.parametrize("act_quant", [False, True])
def test_the_reference_is_the_chain_it_replaces(offset, act_quant):
    """moe_router_fp8_shared's reference: moe_router, then moe_fp8_shared with its ids and weights, the ops of the
    graph before the pass, bit for bit (ids global, or local to experts [4, 8) with -1 for the others)."""
    from tests.passes.test_fuse_shared_expert_into_moe import _layer

    routed, shared, up_start = _layer()
    x = routed[0]
    g = torch.Generator().manual_seed(4)
    router = (torch.randn(CFG.n_routed_experts, x.shape[1], generator=g) / 16, torch.zeros(CFG.n_routed_experts), 2,
              1, 1, True, 2.5, None if offset is None else torch.tensor(offset, dtype=torch.int32), 4)
    weights, ids = torch.ops.fxglm5.moe_router(x, *router)
    experts = (routed[3], routed[4], routed[5], routed[6], act_quant)
    chain = torch.ops.fxglm5.moe_fp8_shared(x, ids, weights, *experts, *shared, up_start)
    fused = torch.ops.fxglm5.moe_router_fp8_shared(x, *router, *experts, *shared, up_start)
    assert torch.equal(fused, chain)
