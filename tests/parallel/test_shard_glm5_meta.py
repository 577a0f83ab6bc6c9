"""The shard stage at GLM-5's widths, in one process on the meta device (6 layers: 3 dense, 3 MoE; the per-kind
capture exports 5 and copies layer 4 to layer 5): every rank-local shape, the collectives, whole 128-blocks for
every FP8 shard, strict counts, the per-kind stitch equal to sharding the whole graph, and the plan hash; the mixed
expert layout TP8 / ep 2 (ranks 0-3: experts 0-127, ranks 4-7: 128-255, each split 4 ways along its 2048 rows)."""

import dataclasses

import pytest
import torch
from tests.parallel.ranks import sharded

from fxglm5.capture.by_kind import DERIVED, truncated_config
from fxglm5.compiler import KIND_STAGES, compile_model
from fxglm5.errors import PassError
from fxglm5.model.config import Glm5Config
from fxglm5.model.modeling import Glm5ForCausalLM
from fxglm5.parallel import BLOCK, PLAN, Mapping, Slice, nested, plan_hash
from fxglm5.passes.graph_utils import get_attr_tensor
from fxglm5.passes.pipeline import Stage
from fxglm5.passes.sharding import check_shapes

LAYERS = 6
L = "model.layers"


@pytest.fixture(scope="module")
def glm5():
    model = Glm5ForCausalLM(truncated_config(Glm5Config.preset("glm5"), LAYERS), device="meta")
    return model, compile_model(model, stages=(Stage.MATCH, Stage.FUSE), strict=True).graph


@pytest.fixture(scope="module")
def tp8(glm5):
    model, graph = glm5
    return {rank: sharded(graph, model.config, Mapping(tp=8, rank=rank, ep=8), lower=False) for rank in (0, 7)}


@pytest.fixture(scope="module")
def tp8_ep2(glm5):
    model, graph = glm5
    return {rank: sharded(graph, model.config, Mapping(tp=8, rank=rank, ep=2), lower=False) for rank in (0, 3, 4, 7)}


def _attrs(gm) -> dict:
    return {n.target: get_attr_tensor(gm, n) for n in gm.graph.nodes if n.op == "get_attr"}


def _collectives(gm) -> dict:
    ops = torch.ops.fxglm5
    return {name: sum(n.target is op for n in gm.graph.nodes)
            for name, op in (("all_reduce", ops.all_reduce.default), ("all_gather", ops.all_gather.default))}


def test_tp8_ep8_local_shapes(tp8):
    for rank, (gm, results) in tp8.items():
        shapes = {t: tuple(v.shape) for t, v in _attrs(gm).items()}
        attn, moe, dense = f"{L}.5.self_attn", f"{L}.5.mlp", f"{L}.0.mlp"
        assert shapes[f"{attn}.q_b_proj.weight"] == (2048, 2048) and shapes[f"{attn}.q_b_proj.weight_scale_inv"] == (16, 16)
        assert shapes[f"{attn}.o_proj.weight"] == (6144, 2048) and shapes[f"{attn}.o_proj.weight_scale_inv"] == (48, 16)
        assert shapes[f"{attn}.kv_b_proj.w_uk"] == (8, 192, 512) and shapes[f"{attn}.kv_b_proj.w_uv"] == (8, 256, 512)
        assert shapes[f"{attn}.q_a_proj.weight"] == (2048, 6144)  # replicated
        assert shapes[f"{attn}.indexer.wq_b.weight"] == (4096, 2048)  # the whole indexer replicated
        assert shapes[f"{moe}.experts.gate_up_proj"] == (32, 4096, 6144)
        assert shapes[f"{moe}.experts.gate_up_proj_scale_inv"] == (32, 32, 48)
        assert shapes[f"{moe}.experts.down_proj"] == (32, 6144, 2048)
        assert shapes[f"{moe}.shared_experts.gate_proj.weight"] == (256, 6144)
        assert shapes[f"{moe}.shared_experts.down_proj.weight"] == (6144, 256)
        assert shapes[f"{moe}.gate.weight"] == (256, 6144)  # the router replicated
        assert shapes[f"{dense}.gate_proj.weight"] == (1536, 6144) and shapes[f"{dense}.down_proj.weight"] == (6144, 1536)
        assert shapes["lm_head.weight"] == (19360, 6144)
        plan = gm.meta[PLAN]
        assert plan[f"{attn}.kv_b_proj.weight"].start == rank * 8 * 448  # the source rows of the rank's W_UK / W_UV
        assert plan[f"{moe}.experts.gate_up_proj"].start == rank * 32
        assert plan["lm_head.weight"].start == rank * 19360
        assert _collectives(gm) == {"all_reduce": 2 * LAYERS, "all_gather": 1}
        assert [(r.name, r.num_matches, r.expected) for r in results] == [
            ("shard_attention", 6, 6), ("shard_indexer", 6, 6), ("shard_mlp", 3, 3), ("shard_moe_experts", 3, 3),
            ("shard_lm_head", 1, 1)]


@pytest.mark.parametrize("tp, ep", [(2, 2), (4, 4), (8, 1)])
def test_every_fp8_shard_is_whole_blocks_and_counts_hold(glm5, tp, ep):
    model, graph = glm5
    for rank in (0, tp - 1):
        gm, results = sharded(graph, model.config, Mapping(tp=tp, rank=rank, ep=ep), lower=False)
        attrs = _attrs(gm)
        assert _collectives(gm) == {"all_reduce": 2 * LAYERS, "all_gather": 1}
        assert all(r.num_matches == r.expected for r in results)
        for target, part in gm.meta[PLAN].items():
            if target in attrs and attrs[target].dtype == torch.float8_e4m3fn:
                if part.dim >= attrs[target].dim() - 2:  # rows or columns (not whole experts)
                    assert part.start % BLOCK == 0 and (part.stop - part.start) % BLOCK == 0, (target, part)
                scale = attrs.get(target + "_scale_inv", attrs.get(target.replace(".weight", ".weight_scale_inv")))
                lead = attrs[target].shape[:-2]
                rows, cols = attrs[target].shape[-2:]
                row_blocks = 2 * -(-(rows // 2) // BLOCK) if part.halves else -(-rows // BLOCK)
                assert tuple(scale.shape) == (*lead, row_blocks, -(-cols // BLOCK)), target
        if ep == 1:
            assert tuple(attrs[f"{L}.5.mlp.experts.gate_up_proj"].shape) == (256, 2 * 2048 // tp, 6144)
            assert gm.meta[PLAN][f"{L}.5.mlp.experts.gate_up_proj"].halves


def test_per_kind_stitch_equals_sharding_the_whole_graph(glm5, tp8):
    """compile_model with a mapping shards the 5-layer prefix and copies it: node for node, plan entry for plan entry
    and shape for shape the graph that sharding the stitched 6-layer graph gives; each layer's recipes name its own
    kv_b_proj."""
    model, _ = glm5
    mapping = Mapping(tp=8, rank=7, ep=8)
    compiled = compile_model(model, stages=KIND_STAGES, strict=True, mapping=mapping)
    whole, _ = tp8[7]
    stitched = compiled.graph
    assert [(n.op, str(n.target)) for n in stitched.graph.nodes] == [(n.op, str(n.target)) for n in whole.graph.nodes]
    assert stitched.meta[PLAN] == whole.meta[PLAN]
    assert {t: v.shape for t, v in _attrs(stitched).items()} == {t: v.shape for t, v in _attrs(whole).items()}
    sources, _ = stitched.meta[DERIVED][f"{L}.5.self_attn.kv_b_proj.w_uk"]
    assert sources == (f"{L}.5.self_attn.kv_b_proj.weight", f"{L}.5.self_attn.kv_b_proj.weight_scale_inv")
    results = {r.name: (r.num_matches, r.expected) for r in compiled.results}
    assert results["shard_attention"] == (6, 6) and results["shard_moe_experts"] == (3, 3)


def test_plan_hash_agrees_across_ranks_only(glm5, tp8):
    model, graph = glm5
    hashes = {rank: plan_hash(gm, Mapping(tp=8, rank=rank, ep=8)) for rank, (gm, _) in tp8.items()}
    assert hashes[0] == hashes[7]
    assert tp8[0][0].code == tp8[7][0].code  # the rank is in the tensors (and the expert offset), not the program
    ep1, _ = sharded(graph, model.config, Mapping(tp=8, rank=0, ep=1), lower=False)
    assert plan_hash(ep1, Mapping(tp=8, rank=0, ep=1)) != hashes[0]


def test_a_head_count_left_behind_fails_the_shape_check(tp8):
    gm, _ = tp8[0]
    view = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.view.default
                and len(n.args[1]) == 4 and n.args[1][2] == 8)
    check_shapes(gm)
    view.args = (view.args[0], [*view.args[1][:2], 64, view.args[1][3]])
    try:
        with pytest.raises(PassError, match=f"node {view.name} .* fails on the rank-local shapes"):
            check_shapes(gm)
    finally:
        view.args = (view.args[0], [*view.args[1][:2], 8, view.args[1][3]])


def test_world_one_is_a_no_op(glm5):
    model, graph = glm5
    gm, results = sharded(graph, model.config, Mapping(), lower=False)
    assert gm.code == graph.code and PLAN not in gm.meta
    assert [r.num_matches for r in results] == [r.expected for r in results] == [0, 0, 0, 0, 0]


def test_tp8_ep2_groups_hold_half_the_experts_each_split_four_ways(tp8_ep2):
    """Group g = rank // 4 holds experts [128 g, 128 (g+1)) and its ranks each 512 of every expert's 2048 rows (4
    blocks): gate and up rows, down columns, the block scales with them; the router's ids local to the group (the
    expert offset 128 g); the rest of the layer (attention, shared expert, dense MLPs, lm_head) as at ep 8."""
    moe = f"{L}.5.mlp"
    for rank, (gm, results) in tp8_ep2.items():
        group, place = divmod(rank, 4)
        shapes = {t: tuple(v.shape) for t, v in _attrs(gm).items()}
        assert shapes[f"{moe}.experts.gate_up_proj"] == (128, 1024, 6144)
        assert shapes[f"{moe}.experts.gate_up_proj_scale_inv"] == (128, 8, 48)
        assert shapes[f"{moe}.experts.down_proj"] == (128, 6144, 512)
        assert shapes[f"{moe}.experts.down_proj_scale_inv"] == (128, 48, 4)
        assert shapes[f"{moe}.shared_experts.gate_proj.weight"] == (256, 6144)
        assert shapes[f"{L}.5.self_attn.q_b_proj.weight"] == (2048, 2048) and shapes["lm_head.weight"] == (19360, 6144)
        experts, rows, blocks = Slice(0, 128 * group, 128 * (group + 1)), (512 * place, 512 * (place + 1)), (
            4 * place, 4 * (place + 1))
        plan = gm.meta[PLAN]
        assert plan[f"{moe}.experts.gate_up_proj"] == nested(experts, Slice(1, *rows, halves=True))
        assert plan[f"{moe}.experts.gate_up_proj_scale_inv"] == nested(experts, Slice(1, *blocks, halves=True))
        assert plan[f"{moe}.experts.down_proj"] == nested(experts, Slice(2, *rows))
        assert plan[f"{moe}.experts.down_proj_scale_inv"] == nested(experts, Slice(2, *blocks))
        assert int(_attrs(gm)[f"{moe}.experts.expert_offset"]) == 128 * group
        assert _collectives(gm) == {"all_reduce": 2 * LAYERS, "all_gather": 1}
        assert [(r.name, r.num_matches, r.expected) for r in results] == [
            ("shard_attention", 6, 6), ("shard_indexer", 6, 6), ("shard_mlp", 3, 3), ("shard_moe_experts", 3, 3),
            ("shard_lm_head", 1, 1)]


def test_ep1_and_ep8_keep_one_dim_plans(tp8, glm5):
    """The layouts at the mixed one's two ends record no second level: ep 8 whole experts, ep 1 rows of all."""
    model, graph = glm5
    target = f"{L}.5.mlp.experts.gate_up_proj"
    assert tp8[7][0].meta[PLAN][target] == Slice(0, 224, 256)
    ep1, _ = sharded(graph, model.config, Mapping(tp=8, rank=7, ep=1), lower=False)
    assert ep1.meta[PLAN][target] == Slice(1, 1792, 2048, halves=True)


def test_the_plan_hash_tells_the_layouts_and_the_inner_slice_apart(glm5, tp8, tp8_ep2):
    """Equal on the ranks of one layout (both groups), unequal across ep 8 / 2 / 1; dropping or resizing the inner
    part of one entry changes it, moving it (another rank's rows) does not."""
    model, graph = glm5
    hashes = {rank: plan_hash(gm, Mapping(tp=8, rank=rank, ep=2)) for rank, (gm, _) in tp8_ep2.items()}
    assert len(set(hashes.values())) == 1
    ep1, _ = sharded(graph, model.config, Mapping(tp=8, rank=0, ep=1), lower=False)
    others = {plan_hash(tp8[0][0], Mapping(tp=8, rank=0, ep=8)), plan_hash(ep1, Mapping(tp=8, rank=0, ep=1))}
    assert hashes[0] not in others and len(others) == 2
    gm, mapping = tp8_ep2[0][0], Mapping(tp=8, rank=0, ep=2)
    assert plan_hash(gm, dataclasses.replace(mapping, ep=4)) != hashes[0]
    plan, target = dict(gm.meta[PLAN]), f"{L}.5.mlp.experts.down_proj"
    part = plan[target]
    try:
        for changed, same in ((dataclasses.replace(part, inner=None), False),
                              (dataclasses.replace(part, inner=dataclasses.replace(part.inner, stop=1000)), False),
                              (dataclasses.replace(part, inner=Slice(2, 1536, 2048)), True)):
            gm.meta[PLAN] = {**plan, target: changed}
            assert (plan_hash(gm, mapping) == hashes[0]) is same, changed
    finally:
        gm.meta[PLAN] = plan
