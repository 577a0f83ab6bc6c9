"""fuse_add_rms_norm_into_moe: moe_router_fp8_shared(add_rms_norm(x, r)[0].reshape(-1, H)) ->
fxglm5::add_rms_norm_moe_router_fp8_shared (tests/passes/template.py's checks; near misses: normed rows read by
something else too, a MoE of other tokens, a MoE layer without its shared expert), the sum's readers moved to the
fused op, the op's reference against the chain, and the expected count on a paged and an unpaged graph (the Triton op
against its separate launches: tests/kernels/test_kernels_fused.py, tests/gpu/test_gpu_fused.py)."""

import copy

import pytest
import torch
from torch import nn

from fxglm5.compiler import compile_model
from fxglm5.model.config import Glm5Config
from fxglm5.model.modeling import Glm5ForCausalLM
from fxglm5.model.moe import MoE
from fxglm5.passes import PIPELINE, REGISTRY, PassContext, PassManager, Stage, run_pipeline
from fxglm5.passes.graph_utils import is_op
from tests.helpers import randomize_
from tests.passes.template import PassTemplate, export_small, small_dims

PASS = "fuse_add_rms_norm_into_moe"
# per tiny FP8 model: the MLP norm of the MoE layers 1-3 with the reshape that flattens its rows for the MoE; the
# norm's two items become the fused op's two (as many getitems)
THREE = {"fxglm5.add_rms_norm": -3, "fxglm5.moe_router_fp8_shared": -3, "fxglm5.add_rms_norm_moe_router_fp8_shared": 3,
         "aten.reshape": -3}
CFG = Glm5Config.preset("tiny").replace(hidden_size=256, n_routed_experts=8, num_experts_per_tok=2)
BEFORE = PIPELINE[Stage.FUSE_KERNELS][:PIPELINE[Stage.FUSE_KERNELS].index(PASS)]


class NormedMoE(nn.Module):
    """``h = x + y`` normalized and read by GLM-5's MoE block (its router, shared expert and experts: one
    moe_router_fp8_shared after the passes before this one), ``h`` (the residual) added to its output; ``variant``
    makes a near miss: the normed rows also summed into the output ("normed_read_twice"), the MoE fed the normed rows
    in another order ("other_tokens"), a MoE without a shared expert ("no_shared")."""

    def __init__(self, variant=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(CFG.hidden_size), requires_grad=False)
        cfg = CFG.replace(n_shared_experts=0) if variant == "no_shared" else CFG
        self.moe = MoE(cfg, torch.float32)
        self.variant = variant

    def forward(self, x, y):
        h = x + y
        normed = torch.ops.fxglm5.rms_norm(h, self.weight, 1e-6)
        if self.variant == "other_tokens":
            return self.moe(normed.flip(1)) + h
        out = self.moe(normed) + h
        return out + normed.sum(-1, keepdim=True) if self.variant == "normed_read_twice" else out


def _xy(batch=2, seq=5):
    gen = torch.Generator().manual_seed(batch * seq)
    return tuple(torch.randn(batch, seq, CFG.hidden_size, generator=gen) for _ in range(2))


def fused_graph(module):
    """``module``'s graph as this pass receives it: through the fuse stage and the fuse_kernels passes before this
    one (the router, the shared expert and its add in the MoE op; the add and norm one op)."""
    gm = export_small(module, _xy())
    run_pipeline(gm, PassContext(config=CFG), stages=("fuse",))
    manager = PassManager(PassContext(config=CFG), stages=("fuse_kernels",))
    for name in BEFORE:
        manager.run_one(gm, REGISTRY[name])
    return gm


class TestFuseAddRmsNormIntoMoe(PassTemplate):
    name = PASS
    matches = {"fp8": 3, "shared": 3, "bf16": 3, "bf16ckpt": 0}
    ops = {"fp8": THREE, "shared": THREE, "bf16": THREE, "bf16ckpt": {}}
    near_misses = ("normed_read_twice", "other_tokens", "no_shared")

    def near_miss(self, case):
        module = randomize_(NormedMoE(case))
        gm = fused_graph(module)
        ops = {n.target for n in gm.graph.nodes}  # what the passes before this one make of it: the near pattern
        assert torch.ops.fxglm5.add_rms_norm.default in ops
        assert (torch.ops.fxglm5.moe_router_fp8_shared.default in ops) == (case != "no_shared")
        return gm, module, _xy(3, 7), CFG

    def reexport(self):
        example = _xy()
        return fused_graph(randomize_(NormedMoE())), example, small_dims(example), _xy(3, 7), CFG


def test_the_sum_is_read_from_the_fused_op():
    """The residual's reader (the add after the MoE) reads the fused op's second output, the MoE's reader its first;
    nothing of the chain is left, and the fused op stands where the norm stood (before every reader of the sum)."""
    gm = fused_graph(randomize_(NormedMoE()))
    manager = PassManager(PassContext(config=CFG), stages=("fuse_kernels",))
    assert manager.run_one(gm, REGISTRY[PASS]).num_matches == 1
    fused = next(n for n in gm.graph.nodes if is_op(n, torch.ops.fxglm5.add_rms_norm_moe_router_fp8_shared.default))
    outputs = {user.args[1]: user for user in fused.users}
    assert sorted(outputs) == [0, 1]
    assert all(user.target is torch.ops.aten.add.Tensor for user in outputs[1].users)
    assert not any(is_op(n, torch.ops.fxglm5.add_rms_norm.default, torch.ops.fxglm5.moe_router_fp8_shared.default)
                   for n in gm.graph.nodes)
    gm.graph.lint()


@pytest.mark.parametrize("offset", [None, 4])
@pytest.mark.parametrize("act_quant", [False, True])
def test_the_reference_is_the_chain_it_replaces(offset, act_quant):
    """add_rms_norm_moe_router_fp8_shared's reference: add_rms_norm, then moe_router_fp8_shared of its normed rows
    flattened to [N, H], the ops of the graph before the pass, bit for bit, and the sum."""
    from tests.passes.test_fuse_shared_expert_into_moe import _layer

    routed, shared, up_start = _layer()
    h = routed[0].shape[1]
    g = torch.Generator().manual_seed(5)
    x, r = (torch.randn(2, 3, h, generator=g) for _ in range(2))
    nw = 1 + 0.1 * torch.randn(h, generator=g)
    router = (torch.randn(CFG.n_routed_experts, h, generator=g) / 16, torch.zeros(CFG.n_routed_experts), 2, 1, 1, True,
              2.5, None if offset is None else torch.tensor(offset, dtype=torch.int32), 4)
    experts = (routed[3], routed[4], routed[5], routed[6], act_quant)
    normed, total = torch.ops.fxglm5.add_rms_norm(x, r, nw, 1e-6)
    chain = torch.ops.fxglm5.moe_router_fp8_shared(normed.reshape(-1, h), *router, *experts, *shared, up_start)
    out, fused_total = torch.ops.fxglm5.add_rms_norm_moe_router_fp8_shared(x, r, nw, 1e-6, *router, *experts, *shared,
                                                                           up_start)
    assert torch.equal(out, chain) and torch.equal(fused_total, total) and out.shape == (6, h)


def test_expected_on_the_paged_and_the_unpaged_graph():
    """Strict compiles agree with the model's count, paged or not: the 3 MoE layers of the tiny model; none in a bf16
    checkpoint (its MoE keeps no moe_router_fp8_shared)."""
    for cfg, want in ((Glm5Config.preset("tiny"), 3), (Glm5Config.preset("tiny").replace(quantization_config=None), 0)):
        model = Glm5ForCausalLM(cfg, dtype=torch.bfloat16, device="meta")
        for stages in (None, ("match", "fuse", "fuse_kernels")):
            options = {} if stages is None else dict(stages=stages)
            results = compile_model(model, strict=True, device="cpu", **options).results
            assert [(r.num_matches, r.expected) for r in results if r.name == PASS] == [(want, want)]
