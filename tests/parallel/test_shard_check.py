"""The shard stage's invariants (fxglm5/passes/shard_check.py) on broken graphs, and the plan hash on one graph whose
plan changes (issue 40): a graph sharded with one shard pass disabled, or with one all_reduce removed, is refused in
strict mode naming what is wrong (and warned about without it); plan_hash changes with any one plan entry's shape
of the split, and only with that (not the rank's own offsets)."""

import dataclasses
import logging

import pytest
import torch
from tests.parallel.ranks import graph_copy, sharded

from fxglm5.compiler import compile_graph, compile_model
from fxglm5.errors import PassError
from fxglm5.model.config import Glm5Config
from fxglm5.parallel import PLAN, Mapping, Slice, plan_hash
from fxglm5.passes.pipeline import Stage
from fxglm5.passes.shard_check import check_sharded, sharding_problems

ALL_REDUCE = torch.ops.fxglm5.all_reduce.default


def _expected(config, disabled: str) -> list[str]:
    """What check_sharded must name when ``disabled`` did not run (the tiny-tp model: 1 dense, 3 MoE layers)."""
    layers, dense = config.num_hidden_layers, config.first_k_dense_replace
    moe = next(i for i in range(layers) if config.is_moe_layer(i))
    reduces = {"shard_attention": layers, "shard_mlp": 2 * layers - dense, "shard_moe_experts": layers + dense,
               "shard_lm_head": 2 * layers}[disabled]
    counts = [] if reduces == 2 * layers else [f"{reduces} all_reduce for {layers} layers (needs 2 per layer"]
    whole = "is neither sharded nor one that stays whole"
    return counts + {
        "shard_attention": [f"fp8_linear over model.layers.0.self_attn.q_b_proj.weight {whole}",
                            f"fp8_linear over model.layers.{layers - 1}.self_attn.o_proj.weight {whole}"],
        "shard_mlp": [f"fp8_linear over model.layers.0.mlp.gate_proj.weight {whole}",
                      f"fp8_linear over model.layers.0.mlp.down_proj.weight {whole}"],
        "shard_moe_experts": [f"moe_fp8 over model.layers.{moe}.mlp.experts.gate_up_proj is not sharded",
                              f"fp8_linear over model.layers.{moe}.mlp.shared_experts.gate_proj.weight {whole}"],
        "shard_lm_head": ["0 all_gather for the logits head"],
    }[disabled]


@pytest.mark.parametrize("ep", [2, 1])
@pytest.mark.parametrize("disabled", ["shard_attention", "shard_mlp", "shard_moe_experts", "shard_lm_head"])
def test_a_shard_pass_left_out_is_named_in_strict_mode(tiny_tp, caplog, disabled, ep):
    model, graph, _ = tiny_tp
    config, mapping = model.config, Mapping(tp=2, rank=1, ep=ep)
    expected = _expected(config, disabled)
    # Through the compile: the shard stage ends with the check.
    with pytest.raises(PassError, match=rf"shard stage \(tp=2, ep={ep}\): .*{expected[0].split(' (')[0]}"):
        compile_graph(graph_copy(graph), config, stages=(Stage.SHARD,), strict=True, mapping=mapping, head="logits",
                      disabled_passes=(disabled,))
    # The check alone, on the graph the stage left without it: every problem named, strict raises, lax warns.
    gm = graph_copy(graph)
    compile_graph(gm, config, stages=(Stage.SHARD,), strict=False, mapping=mapping, head="logits",
                  disabled_passes=(disabled,))
    with pytest.raises(PassError) as raised:
        check_sharded(gm, config, mapping, "logits", strict=True)
    assert str(raised.value).endswith("(strict mode)")
    for problem in expected:
        assert problem in str(raised.value), (problem, str(raised.value))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fxglm5.passes.shard_check"):
        check_sharded(gm, config, mapping, "logits", strict=False)
    assert all(any(problem in r.getMessage() for r in caplog.records) for problem in expected), caplog.text


def test_a_shard_pass_left_out_of_the_per_kind_compile_is_named(tiny_tp):
    """compile_model shards per layer kind and checks the stitched graph: the runner's path, not compile_graph's."""
    model, _, _ = tiny_tp
    expected = _expected(model.config, "shard_mlp")
    with pytest.raises(PassError) as raised:
        compile_model(model, stages=(Stage.MATCH, Stage.FUSE, Stage.SHARD), strict=True,
                      mapping=Mapping(tp=2, rank=0, ep=2), disabled_passes=("shard_mlp",))
    assert str(raised.value).startswith("shard stage (tp=2, ep=2): ")
    for problem in expected:
        assert problem in str(raised.value), (problem, str(raised.value))


@pytest.fixture(scope="module")
def whole_shard(tiny_tp):
    model, graph, _ = tiny_tp
    mapping = Mapping(tp=2, rank=0, ep=2)
    gm, _ = sharded(graph, model.config, mapping, lower=False)
    return model.config, mapping, gm


def test_a_complete_shard_has_no_problem(whole_shard):
    config, mapping, gm = whole_shard
    assert sharding_problems(gm, config, mapping, "logits") == []
    check_sharded(gm, config, mapping, "logits", strict=True)


@pytest.mark.parametrize("which", [0, -1])
def test_one_all_reduce_removed_is_named_in_strict_mode(whole_shard, caplog, which):
    config, mapping, gm = whole_shard
    gm = graph_copy(gm)
    reduces = [n for n in gm.graph.nodes if n.target is ALL_REDUCE]
    assert len(reduces) == 2 * config.num_hidden_layers
    node = reduces[which]
    node.replace_all_uses_with(node.args[0])
    gm.graph.erase_node(node)
    gm.recompile()
    count = 2 * config.num_hidden_layers - 1
    with pytest.raises(PassError, match=rf"shard stage \(tp=2, ep=2\): {count} all_reduce for "
                                        rf"{config.num_hidden_layers} layers \(needs 2 per layer"):
        check_sharded(gm, config, mapping, "logits", strict=True)
    with caplog.at_level(logging.WARNING, logger="fxglm5.passes.shard_check"):
        check_sharded(gm, config, mapping, "logits", strict=False)
    assert f"{count} all_reduce for {config.num_hidden_layers} layers" in caplog.text


def test_plan_hash_changes_with_one_plan_entry(whole_shard):
    """One graph, its code unchanged: any one entry's dim, length or halves, or the entry's presence, changes the
    hash; the rank's own offset (start, padded) does not (every rank holds another part of the same split)."""
    _, mapping, gm = whole_shard
    gm = graph_copy(gm)
    plan = dict(gm.meta[PLAN])
    base = plan_hash(gm, mapping)
    code = gm.code
    for target in ("model.layers.1.mlp.shared_experts.gate_proj.weight", "model.layers.2.mlp.experts.gate_up_proj",
                   "lm_head.weight"):
        part = plan[target]
        changes = dict(dim=dataclasses.replace(part, dim=part.dim + 1),
                       length=dataclasses.replace(part, stop=part.stop - 1),
                       halves=dataclasses.replace(part, halves=not part.halves))
        for what, changed in changes.items():
            gm.meta[PLAN] = {**plan, target: changed}
            assert plan_hash(gm, mapping) != base, (target, what)
        gm.meta[PLAN] = {k: v for k, v in plan.items() if k != target}
        assert plan_hash(gm, mapping) != base, (target, "dropped")
        shifted = dataclasses.replace(part, start=part.start + 1, stop=part.stop + 1, padded=not part.padded)
        gm.meta[PLAN] = {**plan, target: shifted}
        assert plan_hash(gm, mapping) == base, (target, "the rank's own offset")
    gm.meta[PLAN] = plan
    assert plan_hash(gm, mapping) == base and gm.code == code
    # the mapping without the rank
    assert plan_hash(gm, dataclasses.replace(mapping, rank=1)) == base
    assert plan_hash(gm, dataclasses.replace(mapping, ep=1)) != base


# ---- the MTP graph and the logits+hidden head at tp = 2, compiled strictly (issue 48 item 4) -------------------
# Speculative decoding at tp > 1 compiles both; the Runner compiles without strict, where a broken invariant would
# only be logged. Here every rank's graph is compiled strictly on the meta device (as the ranks compile it): it must
# pass the shard check, and a shard pass left out must fail it, naming what is missing.

def _mtp_model(layout):
    from fxglm5.model.layout import MtpLayout
    from fxglm5.model.modeling import Glm5ForCausalLM

    config = Glm5Config.preset("tiny-tp").replace(num_hidden_layers=2, mlp_layer_types=None, indexer_types=None,
                                                  vocab_size=509)  # tp 2 pads the head's vocabulary
    return Glm5ForCausalLM(config, dtype=torch.float32, device="meta", mtp=MtpLayout(**layout))


MTP_LAYOUTS = {"glm5": {}, "fp8_eh_proj_own_head": {"eh_proj_fp8": True, "own_head": True}}


@pytest.mark.parametrize("layout", MTP_LAYOUTS)
@pytest.mark.parametrize("ep", [2, 1])
def test_the_mtp_graph_compiles_strictly_at_tp2(layout, ep):
    from fxglm5.capture.export import MTP_HEAD
    from fxglm5.compiler import compile_mtp, mtp_graph_config

    model = _mtp_model(MTP_LAYOUTS[layout])
    head = "mtp.head.weight"
    for rank in (0, 1):
        mapping = Mapping(tp=2, rank=rank, ep=ep)
        compiled = compile_mtp(model, mapping=mapping, strict=True, stages=(Stage.MATCH, Stage.FUSE, Stage.SHARD))
        gm = compiled.graph
        assert sharding_problems(gm, mtp_graph_config(model.config), mapping, MTP_HEAD) == []
        ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        assert ops.count(ALL_REDUCE) == 2 and ops.count(torch.ops.fxglm5.all_gather.default) == 1
        plan = gm.meta[PLAN]
        assert plan[head] == Slice(0, 255 * rank, 255 * (rank + 1), padded=rank == 1)  # its own head or the model's
        assert "mtp.eh_proj.weight" not in plan  # every rank computes the same input to its decoder layer
        assert any(name.startswith("mtp.layer.self_attn.q_b_proj") for name in plan)
    with pytest.raises(PassError, match=r"shard stage \(tp=2, ep=%d\): 0 all_gather for the mtp head" % ep):
        compile_mtp(model, mapping=Mapping(tp=2, rank=1, ep=ep), strict=True, disabled_passes=("shard_lm_head",),
                    stages=(Stage.MATCH, Stage.FUSE, Stage.SHARD))
    with pytest.raises(PassError, match=r"fp8_linear over mtp\.layer\.self_attn\.q_b_proj\.weight is neither sharded"):
        compile_mtp(model, mapping=Mapping(tp=2, rank=0, ep=ep), strict=True, disabled_passes=("shard_attention",),
                    stages=(Stage.MATCH, Stage.FUSE, Stage.SHARD))


def test_the_logits_and_hidden_head_compiles_strictly_at_tp2():
    """Speculative decoding's target: its logits gathered (one all_gather), its hidden output whole."""
    model = _mtp_model({})
    for rank in (0, 1):
        mapping = Mapping(tp=2, rank=rank, ep=2)
        compiled = compile_model(model, head="logits+hidden", mapping=mapping, strict=True,
                                 stages=(Stage.MATCH, Stage.FUSE, Stage.SHARD))
        assert sharding_problems(compiled.graph, model.config, mapping, "logits+hidden") == []
        ops = [n.target for n in compiled.graph.graph.nodes if n.op == "call_function"]
        assert ops.count(ALL_REDUCE) == 4 and ops.count(torch.ops.fxglm5.all_gather.default) == 1
        assert compiled.graph.meta[PLAN]["lm_head.weight"] == Slice(0, 255 * rank, 255 * (rank + 1), padded=rank == 1)
    with pytest.raises(PassError, match=r"0 all_gather for the logits\+hidden head"):
        compile_model(model, head="logits+hidden", mapping=Mapping(tp=2, rank=0, ep=2), strict=True,
                      disabled_passes=("shard_lm_head",), stages=(Stage.MATCH, Stage.FUSE, Stage.SHARD))
