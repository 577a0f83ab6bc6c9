"""fuse_cache_writes_into_q_norm: each layer's query-latent RMSNorm and its cache writes as one
fxglm5::rms_norm_write_caches (tests/passes/template.py's checks; near misses: a query that is not projected from a
norm, a latent projected from the normed query latent, a layer whose own indexer turns its key by other tables)."""

import copy

import pytest
import torch

from fxglm5.passes import REGISTRY, PassContext, PassManager
from fxglm5.passes.graph_utils import op_args
from tests.passes.modules import canonical_graph, canonical_mla, paged_reexport, seqs
from tests.passes.template import PassTemplate, paged_args, pipeline, run_one

# per tiny model: each of the 4 layers' q_a norm becomes the fused op and the getitem of its normed latent
FOUR = {"fxglm5.rms_norm": -4, "fxglm5.rms_norm_write_caches": 4, "getitem": 4}
NEAR_MISSES = {"plain_query": {}, "cycle": {"q_norm": True, "variant": "cycle"}}


class TestFuseCacheWritesIntoQNorm(PassTemplate):
    name = "fuse_cache_writes_into_q_norm"
    matches = {"fp8": 4, "shared": 4, "bf16": 4, "bf16ckpt": 4}
    ops = {"fp8": FOUR, "shared": FOUR, "bf16": FOUR, "bf16ckpt": FOUR}
    near_misses = tuple(NEAR_MISSES)

    def near_miss(self, case):
        gm = canonical_graph(self.name, canonical_mla(**NEAR_MISSES[case]))
        return gm, copy.deepcopy(gm), paged_args(gm, seqs([6, 3]), torch.float32), None

    def reexport(self):
        return paged_reexport(self.name, canonical_mla(q_norm=True))


def _fused(gm):
    return [n for n in gm.graph.nodes if n.target is torch.ops.fxglm5.rms_norm_write_caches.default]


def test_what_each_layer_takes():
    """Every layer's latent write joins its norm, the index write too where the layer has its own indexer (all 4 of
    the fp8 model's, layers 0 and 2 of the shared model's); every attention op and indexer is then ``written``, and
    the fused op runs before the GEMM that reads the normed latent."""
    for name, indexed in (("fp8", [True] * 4), ("shared", [True, False, True, False])):
        run = pipeline(name)
        assert run.results["fuse_cache_writes_into_q_norm"].details == {"index_writes": sum(indexed)}
        gm = run.after["fuse_cache_writes_into_q_norm"]
        assert [op_args(n)["index_cache"] is not None for n in _fused(gm)] == indexed
        cached = [n for n in gm.graph.nodes if n.target in (torch.ops.fxglm5.rtp_sparse_mla.default,
                                                             torch.ops.fxglm5.rtp_indexer.default)]
        assert len(cached) == 4 + sum(indexed) and all(op_args(n)["written"] is True for n in cached)
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        assert all(order[fused] < min(order[user] for user in fused.users) for fused in _fused(gm))


def test_the_small_module_fuses_its_latent_write():
    """The near misses differ from a module whose one norm fuses only by what makes them near misses."""
    gm = canonical_graph("fuse_cache_writes_into_q_norm", canonical_mla(q_norm=True))
    result = run_one(gm, "fuse_cache_writes_into_q_norm")
    assert (result.num_matches, result.details) == (1, {"index_writes": 0})


def _other_tables(gm, indexer):
    """Layer 0's indexer turns its key by a copy of the tables (another node) than its latent's."""
    with gm.graph.inserting_before(indexer):
        other = gm.graph.call_function(torch.ops.aten.clone.default, (indexer.args[10],))
    other.meta["val"] = indexer.args[10].meta.get("val")
    indexer.args = (*indexer.args[:10], other, *indexer.args[11:])


def _cache_read_elsewhere(gm, indexer):
    """Another op reads layer 0's latent cache (an alias of it, before the attention op writes it)."""
    attention = next(iter(indexer.users))
    with gm.graph.inserting_before(attention):
        gm.graph.call_function(torch.ops.aten.alias.default, (op_args(attention)["kv_cache"],))


@pytest.mark.parametrize("change", [_other_tables, _cache_read_elsewhere], ids=["other_tables", "cache_read_elsewhere"])
def test_a_layer_that_cannot_join_whole_is_left_alone(change):
    """Layer 0's indexer turning its key by other tables than its latent's cannot share the fused op's one pair (its
    write would stay a launch of its own), and a cache another op reads could see the write moved before it: the
    layer is left whole (its norm, both ops writing), the three others fuse, and the graph computes what it did."""
    run = pipeline("fp8")
    gm = copy.deepcopy(run.before["fuse_cache_writes_into_q_norm"])
    indexer = next(n for n in gm.graph.nodes if n.target is torch.ops.fxglm5.rtp_indexer.default)
    change(gm, indexer)
    gm.recompile()
    reference = copy.deepcopy(gm)
    ctx = PassContext(config=run.config, extras={"paged": True})
    result = PassManager(ctx, stages=("fuse_kernels",)).run_one(gm, REGISTRY["fuse_cache_writes_into_q_norm"])
    assert (result.num_matches, result.details["index_writes"], result.expected) == (3, 3, 4)
    assert op_args(indexer)["written"] is False and len(_fused(gm)) == 3
    assert torch.equal(run.outputs(gm), run.outputs(reference))
