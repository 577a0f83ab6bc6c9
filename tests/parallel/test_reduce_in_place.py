"""reduce_in_place on a rank's lowered graph (tiny-tp over 2 ranks): every all-reduce the shard stage emitted reads
the fresh output of a GEMM or MoE op that nothing else reads, so each takes the in-place body (the exact count: one
a layer's attention, one a layer's MLP or MoE); an all-reduce whose input is read by another node too keeps the
functional one (the near miss). On two gloo ranks the in-place body sums into its input's own memory, and a
non-contiguous input takes the functional body and is left as it was."""

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tests.helpers import fake_process_group
from tests.parallel.ranks import free_port, sharded

from fxglm5.lowering.reference.collectives import all_reduce_c10d, all_reduce_c10d_in_place
from fxglm5.parallel import Mapping
from fxglm5.passes import REGISTRY, PassContext, PassManager
from fxglm5.passes.pipeline import PIPELINE, Stage

aten = torch.ops.aten


@pytest.fixture(scope="module")
def rank1(tiny_tp):
    """Rank 1's graph (TP2 / EP2) through every stage, lower included, and the config."""
    model, graph, _ = tiny_tp
    with fake_process_group(1, 2):
        lowered, results = sharded(graph, model.config, Mapping(tp=2, rank=1, ep=2))
    return model.config, lowered, results


def _all_reduces(gm):
    """The all-reduce nodes, lowered or not."""
    return [n for n in gm.graph.nodes
            if getattr(n.target, "op", None) == "all_reduce" or n.target is torch.ops.fxglm5.all_reduce.default]


def test_every_all_reduce_of_a_rank_sums_in_place(rank1):
    cfg, lowered, results = rank1
    result = next(r for r in results if r.name == "reduce_in_place")
    assert (result.name, result.num_matches, result.expected) == ("reduce_in_place", 2 * cfg.num_hidden_layers,
                                                                  2 * cfg.num_hidden_layers)
    nodes = _all_reduces(lowered)
    assert len(nodes) == 2 * cfg.num_hidden_layers
    assert all(n.target.fn is all_reduce_c10d_in_place and n.meta["fxglm5_in_place"] for n in nodes)


def test_an_input_read_twice_keeps_the_functional_all_reduce(tiny_tp):
    model, graph, _ = tiny_tp
    cfg, mapping = model.config, Mapping(tp=2, rank=1, ep=2)
    with fake_process_group(1, 2):
        gm = sharded(graph, cfg, mapping, lower=False)[0]
        manager = PassManager(PassContext(config=cfg, mapping=mapping, strict=False))
        for name in PIPELINE[Stage.FUSE_KERNELS]:
            manager.run_one(gm, REGISTRY[name])
    first = _all_reduces(gm)[0]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(output):
        also = gm.graph.call_function(aten.clone.default, (first.args[0],))  # a second reader of the input
    output.args = ((*output.args[0], also),) if isinstance(output.args[0], tuple) else ((output.args[0], also),)
    result = manager.run_one(gm, REGISTRY["reduce_in_place"])
    assert (result.num_matches, result.expected) == (2 * cfg.num_hidden_layers - 1, 2 * cfg.num_hidden_layers)
    manager.run_one(gm, REGISTRY["lower"])
    assert first.target.fn is all_reduce_c10d and "fxglm5_in_place" not in first.meta
    assert all(n.target.fn is all_reduce_c10d_in_place for n in _all_reduces(gm)[1:])


def _rank(rank, port, out_dir):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        x = torch.arange(12, dtype=torch.float32).reshape(3, 4) * (rank + 1)
        summed = all_reduce_c10d_in_place(x, "tp", 2)
        wide = torch.arange(24, dtype=torch.float32).reshape(3, 8) * (rank + 1)
        strided = wide[:, ::2]
        kept = strided.clone()
        reduced = all_reduce_c10d_in_place(strided, "tp", 2)
        torch.save(dict(summed=summed, same=summed.data_ptr() == x.data_ptr(), x=x, reduced=reduced,
                        strided_kept=torch.equal(strided, kept)), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_the_in_place_body_sums_over_gloo_into_its_input(tmp_path):
    context = mp.start_processes(_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=False, start_method="fork")
    end = time.monotonic() + 120
    while not context.join(timeout=1):
        assert time.monotonic() < end, "two gloo ranks still running after 120 s"
    expected = torch.arange(12, dtype=torch.float32).reshape(3, 4) * 3
    for rank in range(2):
        out = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.equal(out["summed"], expected) and out["same"] and torch.equal(out["x"], expected)
        assert torch.equal(out["reduced"], torch.arange(24, dtype=torch.float32).reshape(3, 8)[:, ::2] * 3)
        assert out["strided_kept"]  # the non-contiguous input: the functional body, the input untouched


def test_without_a_group_the_input_is_the_sum():
    x = torch.randn(2, 3)
    assert all_reduce_c10d_in_place(x, "tp", 1) is x


def test_a_run_time_choice_honours_the_mark_too():
    """A node whose backend is chosen per call (Dispatch) takes the in-place body when marked, as a Bound does."""
    from fxglm5.lowering.backend_choice import Dispatch

    x = torch.randn(2, 3)
    assert Dispatch("all_reduce", ["reference"], "cpu", in_place=True)(x, "tp", 1) is x
    functional = Dispatch("all_reduce", ["reference"], "cpu")(x, "tp", 1)
    assert functional is not x and torch.equal(functional, x)
