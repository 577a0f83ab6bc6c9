"""fuse_shared_expert_into_moe on a rank's graph (tiny-tp over 2 ranks): after the fuse_kernels passes before it,
each MoE layer's shared expert (its intermediate the rank's half, gate|up stacked) folds into fxglm5::moe_fp8_shared
beside the rank's routed experts (whole experts under EP2, each expert's half at EP1), the rank's output unchanged
(the reference backend: the same chain, bitwise); the Triton op on one layer's rank weights at a decode batch runs
the shared GEMMs inside the MoE's launches with the bits of their own launches."""

import copy

import pytest
import torch
from tests.parallel.ranks import sharded

from fxglm5.parallel import Mapping
from fxglm5.passes import REGISTRY, PassContext, PassManager
from fxglm5.passes.graph_utils import get_attr_tensor, op_args
from fxglm5.passes.pipeline import PIPELINE, Stage
from tests.helpers import fake_process_group
from tests.passes.template import ops_changed

PASS = "fuse_shared_expert_into_moe"
FOLDED = {"aten.slice": -6, "aten.to": -3, "fxglm5.fp8_linear": -3, "fxglm5.silu_mul_fp8_linear": -3,
          "fxglm5.moe_fp8_add": -3, "fxglm5.moe_fp8_shared": 3}


@pytest.fixture(scope="module")
def fake_group():
    """Rank 1 of a fake world of 2: the rank's collectives run and return their input."""
    with fake_process_group(1, 2):
        yield


@pytest.fixture(scope="module", params=[2, 1], ids=["ep2", "ep1"])
def rank1(request, tiny_tp, fake_group):
    """Rank 1's graph (TP2, expert parallel over ``ep``) through the fuse_kernels passes before this one, and the
    same graph after it, with the pass's result."""
    model, graph, example = tiny_tp
    mapping = Mapping(tp=2, rank=1, ep=request.param)
    before = sharded(graph, model.config, mapping, lower=False)[0]
    manager = PassManager(PassContext(config=model.config, mapping=mapping, strict=True))
    declared = PIPELINE[Stage.FUSE_KERNELS]
    for name in declared[:declared.index(PASS)]:
        manager.run_one(before, REGISTRY[name])
    after = copy.deepcopy(before)
    return model, before, after, manager.run_one(after, REGISTRY[PASS]), example, request.param


def test_the_rank_shared_expert_joins_its_moe(rank1):
    model, before, after, result, example, ep = rank1
    cfg = model.config
    assert (result.num_matches, result.expected) == (3, 3)
    assert ops_changed(result) == FOLDED
    hidden, inter = cfg.hidden_size, cfg.moe_intermediate_size
    for node in after.graph.find_nodes(op="call_function", target=torch.ops.fxglm5.moe_fp8_shared.default):
        args = op_args(node)
        # the shared expert's rank half (gate and up stacked), the routed experts whole (EP2) or halved (EP1)
        assert args["shared_w13"].meta["val"].shape == (inter, hidden) and args["up_start"] == inter // 2
        assert args["shared_w2"].meta["val"].shape == (hidden, inter // 2)
        assert args["w13"].meta["val"].shape == (cfg.n_routed_experts // ep, 2 * inter * ep // 2, hidden)
    assert torch.equal(after(*example), before(*example))


def test_the_triton_op_on_a_rank_layer_at_decode(rank1, monkeypatch):
    """One layer's rank weights through the Triton moe_fp8_shared (interpreted) at 3 tokens, ids local with -1
    entries: the routed GEMMs' two launches (the down one combines), the bits of the shared expert's own launches,
    and the reference op's value."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from triton.runtime.interpreter import InterpretedFunction

    from fxglm5.lowering.triton import moe

    model, _, after, _, _, ep = rank1
    node = next(iter(after.graph.find_nodes(op="call_function", target=torch.ops.fxglm5.moe_fp8_shared.default)))
    args = op_args(node)
    weights = {name: get_attr_tensor(after, args[name]) for name in ("w13", "w13_scale", "w2", "w2_scale",
                                                                      "shared_w13", "shared_w13_scale", "shared_w2",
                                                                      "shared_w2_scale")}
    g = torch.Generator().manual_seed(ep)
    local = model.config.n_routed_experts // ep
    x = torch.randn(3, model.config.hidden_size, generator=g).bfloat16()
    ids = (torch.rand(3, local + 1, generator=g).topk(2).indices - 1).to(torch.int32)
    ids[0, 0] = -1
    topk = torch.rand(3, 2, generator=g)
    routed = (x, ids, topk, weights["w13"], weights["w13_scale"], weights["w2"], weights["w2_scale"], False)
    shared = moe.SharedExpert(weights["shared_w13"], weights["shared_w13_scale"], weights["shared_w2"],
                              weights["shared_w2_scale"], False, args["up_start"])
    launched, run = [], InterpretedFunction.run
    monkeypatch.setattr(InterpretedFunction, "run", lambda self, *a, **k: launched.append(self.fn.__name__)
                        or run(self, *a, **k))
    fused = moe.moe_fp8(*routed, shared=shared)
    assert launched == ["_moe_gemm_kernel", "_moe_gemm_kernel"]
    assert torch.equal(fused, moe.moe_fp8(*routed, addend=moe.shared_expert(x, shared)))
    reference = torch.ops.fxglm5.moe_fp8_shared(*routed, *shared[:4], shared.up_start)
    assert ((fused.float() - reference.float()).norm() / reference.float().norm()).item() < 2e-2
