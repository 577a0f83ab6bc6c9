"""The cache and lower stages after the shard stage: insert_paged_cache puts the rank-local attention on the paged
caches, and select_sampled_rows still moves the sampled-row selection above the lm_head, through the logits'
all_gather (row-wise: it gathers along the vocabulary), so a sharded prefill projects only the sampled rows."""

import torch
from tests.parallel.ranks import sharded

from fxglm5.compiler import DEVICE_STAGES, compile_graph
from fxglm5.parallel import Mapping


def test_sampled_rows_move_above_the_gathered_lm_head(tiny_tp):
    model, graph, _ = tiny_tp
    gm, _ = sharded(graph, model.config, Mapping(tp=2, rank=1, ep=2), lower=False)
    results = {r.name: r for r in compile_graph(gm, model.config, stages=DEVICE_STAGES, device="cpu", strict=True,
                                                mapping=Mapping(tp=2, rank=1, ep=2))}
    assert results["select_sampled_rows"].num_matches == 1
    assert results["select_sampled_rows"].details["ops_moved"] >= 3  # the gather, the lm_head, the final norm
    gather = next(n for n in gm.graph.nodes if getattr(n.target, "op", None) == "all_gather")
    linear = gather.args[0]
    assert linear.target is torch.ops.aten.linear.default and linear.args[1].target == "lm_head.weight"
    norm_input = linear.args[0]
    while norm_input.target is not torch.ops.aten.index_select.default:  # the final norm (lowered) runs on the rows
        norm_input = norm_input.args[0]
    assert getattr(next(iter(norm_input.users)).target, "op", None) == "rms_norm"
