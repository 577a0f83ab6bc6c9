"""shard_indexer (fxglm5/passes/shard_indexer.py) on the tiny-TP model: at tp 2 and 4 it gives each layer's
``indexer_topk`` the mapping's group and world, exactly one match per layer with its own indexer (a "shared" layer
reuses its owner's node), the same graph code on every rank; insert_paged_cache carries both to ``rtp_indexer``.
Left alone: an indexer already split (the strict count then names the short match), any graph at world 1."""

import pytest
import torch
from tests.helpers import random_model
from tests.parallel.ranks import graph_copy, sharded

from fxglm5.compiler import DEVICE_STAGES, compile_graph, compile_model
from fxglm5.errors import PassError
from fxglm5.model.config import Glm5Config
from fxglm5.parallel import Mapping, plan_hash
from fxglm5.passes.graph_utils import op_args, set_op_args
from fxglm5.passes.pipeline import Stage

ops = torch.ops.fxglm5


def indexers(gm, op=ops.indexer_topk.default):
    return [n for n in gm.graph.nodes if n.target is op]


def split_of(node) -> tuple:
    return op_args(node)["group"], op_args(node)["world"]


@pytest.mark.parametrize("tp", [2, 4])
def test_each_layers_indexer_takes_the_group_on_every_rank(tiny_tp, tp):
    model, graph, _ = tiny_tp
    config, hashes = model.config, set()
    for rank in range(tp):
        mapping = Mapping(tp=tp, rank=rank, ep=tp)
        gm, results = sharded(graph, config, mapping, lower=False)
        result = next(r for r in results if r.name == "shard_indexer")
        assert result.num_matches == result.expected == config.num_hidden_layers == 4
        assert [split_of(n) for n in indexers(gm)] == [("tp", tp)] * 4
        hashes.add(plan_hash(gm, mapping))
    assert len(hashes) == 1  # the rank is read when the op runs, not written into the graph
    compile_graph(gm, config, stages=DEVICE_STAGES[:1], device="cpu", strict=True, mapping=mapping)
    assert not indexers(gm)
    assert [split_of(n) for n in indexers(gm, ops.rtp_indexer.default)] == [("tp", tp)] * 4


def test_world_1_is_untouched(tiny_tp):
    model, graph, _ = tiny_tp
    gm = graph_copy(graph)
    code = gm.code
    results = compile_graph(gm, model.config, stages=(Stage.SHARD,), strict=True, mapping=Mapping())
    assert [(r.num_matches, r.expected) for r in results if r.name == "shard_indexer"] == [(0, 0)]
    assert gm.code == code and [split_of(n) for n in indexers(gm)] == [(None, 1)] * 4
    compile_graph(gm, model.config, stages=DEVICE_STAGES[:1], device="cpu", strict=True)
    assert [split_of(n) for n in indexers(gm, ops.rtp_indexer.default)] == [(None, 1)] * 4


def test_an_indexer_already_split_is_left_alone_and_the_strict_count_names_it(tiny_tp):
    model, graph, _ = tiny_tp
    gm = graph_copy(graph)
    first = indexers(gm)[0]
    set_op_args(first, group="other", world=4)
    gm.recompile()
    mapping = Mapping(tp=2, rank=0, ep=2)
    with pytest.raises(PassError, match=r"pass shard_indexer: found 3 matches, the model needs 4 \(strict mode\)"):
        compile_graph(graph_copy(gm), model.config, stages=(Stage.SHARD,), strict=True, mapping=mapping)
    results = compile_graph(gm, model.config, stages=(Stage.SHARD,), strict=False, mapping=mapping)
    assert next(r.num_matches for r in results if r.name == "shard_indexer") == 3
    assert [split_of(n) for n in indexers(gm)] == [("other", 4)] + [("tp", 2)] * 3


def test_shared_indexer_layers_count_their_owner_once():
    """Layers 1 and 3 reuse layers 0's and 2's top-k: two nodes, two matches, through the per-kind compile."""
    config = Glm5Config.preset("tiny-tp").replace(indexer_types=["full", "shared", "full", "shared"])
    results = compile_model(random_model(config, torch.float32), stages=(Stage.MATCH, Stage.FUSE, Stage.SHARD),
                            strict=True, mapping=Mapping(tp=2, rank=1, ep=2))
    result = next(r for r in results.results if r.name == "shard_indexer")
    assert result.num_matches == result.expected == 2
    assert [split_of(n) for n in indexers(results.graph)] == [("tp", 2)] * 2
