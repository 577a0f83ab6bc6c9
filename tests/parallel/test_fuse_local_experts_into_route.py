"""fuse_local_experts_into_route on a rank's graph (tiny-tp, expert parallel over 2 ranks): the five ops of expert-id
glue shard_moe_experts adds after each router -> fxglm5::moe_route_local; the rank's output unchanged (collectives
run on the fake process group, so one rank's graph runs alone); none under ep=1; near misses left alone."""

import copy

import pytest
import torch
from tests.parallel.ranks import sharded

from fxglm5.parallel import Mapping
from fxglm5.passes import REGISTRY, PassContext, PassManager
from fxglm5.passes.manager import cleanup
from tests.helpers import fake_process_group
from tests.passes.template import ops_changed

PASS = "fuse_local_experts_into_route"
GLUE = {"aten.bitwise_and": -3, "aten.ge": -3, "aten.lt": -3, "aten.sub": -3, "aten.where": -3,
        "fxglm5.moe_route": -3, "fxglm5.moe_route_local": 3}


def _run(gm, config, mapping):
    return PassManager(PassContext(config=config, mapping=mapping, strict=True)).run_one(gm, REGISTRY[PASS])


@pytest.fixture(scope="module")
def fake_group():
    """Rank 1 of a fake world of 2: the rank's collectives run and return their input."""
    with fake_process_group(1, 2):
        yield


@pytest.fixture(scope="module")
def rank1(tiny_tp, fake_group):
    model, graph, example = tiny_tp
    mapping = Mapping(tp=2, rank=1, ep=2)
    return model, sharded(graph, model.config, mapping, lower=False)[0], example, mapping


def test_the_glue_becomes_the_routers_ids(rank1):
    model, before, example, mapping = rank1
    after = copy.deepcopy(before)
    result = _run(after, model.config, mapping)
    assert (result.num_matches, result.expected) == (3, 3)
    assert ops_changed(result) == GLUE
    assert torch.equal(after(*example), before(*example))  # the reference backend: the same glue, bitwise


def test_no_glue_without_expert_parallelism(tiny_tp):
    model, graph, _ = tiny_tp
    mapping = Mapping(tp=2, rank=0, ep=1)
    gm = sharded(graph, model.config, mapping, lower=False)[0]
    assert (lambda r: (r.num_matches, r.expected))(_run(gm, model.config, mapping)) == (0, 0)


@pytest.mark.parametrize("variant", ["fill", "lower_bound", "ids_read_twice"])
def test_near_misses_are_left_alone(rank1, variant):
    """Other experts filled with 0 instead of -1, local ids from 1 instead of 0, or global ids read by something else
    too (here ``minimum(local, ids)``): not the router's local ids (every variant keeps ids the MoE kernels accept)."""
    model, before, example, _ = rank1
    gm = copy.deepcopy(before)
    where = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.where.ScalarOther)
    if variant == "fill":
        where.args = (*where.args[:2], 0)
    elif variant == "lower_bound":
        ge = where.args[0].args[0]
        ge.args = (ge.args[0], 1)
    else:
        ids = where.args[1].args[0]
        with gm.graph.inserting_after(where):
            both = gm.graph.call_function(torch.ops.aten.minimum.default, (where, ids))
        where.replace_all_uses_with(both, delete_user_cb=lambda user: user is not both)
    cleanup(gm)
    code, out = gm.code, gm(*example)
    result = PassManager(PassContext(config=model.config)).run_one(gm, REGISTRY[PASS])
    assert result.num_matches == 2
    assert torch.equal(gm(*example), out)
    assert code != gm.code  # the two untouched layers were rewritten, the altered one was not
    assert sum(n.target is torch.ops.aten.where.ScalarOther for n in gm.graph.nodes) == 1
