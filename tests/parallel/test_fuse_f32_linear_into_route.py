"""fuse_f32_linear_into_route on a rank's graph (tiny-tp, expert parallel over 2 ranks): after fuse_f32_linear and
fuse_local_experts_into_route, each router's f32_linear and moe_route_local -> fxglm5::moe_router with the rank's
expert offset; the rank's output unchanged (the reference backend: the same chain, bitwise)."""

import copy

import pytest
import torch
from tests.parallel.ranks import sharded

from fxglm5.parallel import Mapping
from fxglm5.passes import REGISTRY, PassContext, PassManager
from tests.helpers import fake_process_group
from tests.passes.template import ops_changed

LOCAL = {"fxglm5.f32_linear": -3, "fxglm5.moe_route_local": -3, "fxglm5.moe_router": 3}


@pytest.fixture(scope="module")
def fake_group():
    """Rank 1 of a fake world of 2: the rank's collectives run and return their input."""
    with fake_process_group(1, 2):
        yield


def test_the_local_router_takes_its_logits_gemv(tiny_tp, fake_group):
    model, graph, example = tiny_tp
    mapping = Mapping(tp=2, rank=1, ep=2)
    before = sharded(graph, model.config, mapping, lower=False)[0]
    manager = PassManager(PassContext(config=model.config, mapping=mapping, strict=True))
    for name in ("fuse_f32_linear", "fuse_local_experts_into_route"):
        manager.run_one(before, REGISTRY[name])
    after = copy.deepcopy(before)
    result = manager.run_one(after, REGISTRY["fuse_f32_linear_into_route"])
    assert (result.num_matches, result.expected) == (3, 3)
    assert ops_changed(result) == LOCAL
    routers = [n for n in after.graph.nodes if n.target is torch.ops.fxglm5.moe_router.default]
    assert all(n.args[8].op == "get_attr" and n.args[9] == 4 for n in routers)  # the rank's 4 of 8 experts
    assert torch.equal(after(*example), before(*example))
