"""Capture once per layer kind (fxglm5.capture.by_kind): a 9-layer FP8 model with dense and MoE layers and full
and shared indexer layers gives, from a 6-layer export, the graph the whole-model capture + passes give, node for
node with every layer's own constants, and the same logits; what cannot be proven the same kind is not.

9 layers are the 6-layer prefix plus one copy of each of its three copied contexts (MoE full after full, shared
after full, full after shared): every way a layer is bound to its kind's graph, without the whole-model export of
a deeper model (it grows faster than linearly with depth)."""

import logging

import pytest
import torch
from tests.helpers import random_model, rel_err

from fxglm5.capture import capture
from fxglm5.capture.by_kind import capture_rewritten
from fxglm5.capture.layer_kinds import Unprovable, layer_key, model_plan
from fxglm5.model.config import Glm5Config
from fxglm5.model.modeling import Glm5ForCausalLM
from fxglm5.passes import PassContext, run_pipeline
from fxglm5.passes.by_kind import captured_histogram, match_and_fuse
from fxglm5.passes.graph_utils import get_attr_tensor
from fxglm5.passes.manager import op_histogram

LAYERS = 9


def _config(layers: int = LAYERS) -> Glm5Config:
    """Dense layers 0-1 then MoE; indexers full, shared, full, full, shared, ... (no shared after shared)."""
    return Glm5Config.preset("tiny").replace(
        num_hidden_layers=layers, first_k_dense_replace=2, mlp_layer_types=None,
        indexer_types=(["full", "shared", "full"] * layers)[:layers])


def _structure(gm) -> tuple[list, dict]:
    """The computation node by node (get_attrs named by target, other nodes by position) and each target's tensor."""
    index = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op != "get_attr")}

    def ref(n):
        return ("attr", n.target) if n.op == "get_attr" else ("node", index[n])

    nodes = [(n.op, str(n.target), repr(torch.fx.node.map_arg((n.args, n.kwargs), ref)))
             for n in gm.graph.nodes if n.op != "get_attr"]
    attrs = {n.target: get_attr_tensor(gm, n) for n in gm.graph.nodes if n.op == "get_attr"}
    return nodes, attrs


@pytest.fixture(scope="module")
def graphs():
    model = random_model(_config(), torch.float32)
    whole = capture(model)
    captured = op_histogram(whole)
    whole_results = run_pipeline(whole, PassContext(config=model.config, strict=True))
    stitched, results = match_and_fuse(model, strict=True)
    return model, whole, (captured, whole_results), stitched, results


def test_glm5_plan_is_five_layers():
    plan = model_plan(Glm5ForCausalLM(Glm5Config.preset("glm5"), device="meta"))
    assert plan.prefix == 5 and plan.kinds[:5] == (0, 0, 0, 1, 1) and set(plan.kinds[5:]) == {1}
    assert plan.source[:5] == (0, 1, 1, 3, 4) and set(plan.source[5:]) == {4}  # layer 2 copies 1


def test_plan_of_the_test_config_exports_six_layers():
    plan = model_plan(Glm5ForCausalLM(_config(), device="meta"))
    assert plan.prefix == 6 and len(set(plan.kinds)) == 4
    assert plan.source[6:9] == (3, 4, 5)  # MoE full after full, shared after full, full after shared


def test_stitched_graph_equals_whole_model_capture(graphs):
    model, whole, (captured, whole_results), stitched, results = graphs
    nodes_w, attrs_w = _structure(whole)
    nodes_s, attrs_s = _structure(stitched)
    assert nodes_s == nodes_w
    assert attrs_s.keys() == attrs_w.keys()
    derived = [t for t in attrs_w if t.endswith(("w_uk", "w_uv"))]
    assert len(derived) == 2 * LAYERS
    for target, tensor in attrs_w.items():
        assert attrs_s[target].dtype == tensor.dtype and torch.equal(attrs_s[target].float(), tensor.float()), target
    # Each layer's absorbed weights are its own (layer 6 copies layer 3's graph, not its W_UK).
    assert not torch.equal(attrs_s["model.layers.6.self_attn.kv_b_proj.w_uk"],
                           attrs_s["model.layers.3.self_attn.kv_b_proj.w_uk"])
    assert [(r.name, r.num_matches, r.expected) for r in results] == \
        [(r.name, r.num_matches, r.expected) for r in whole_results]
    assert captured_histogram(stitched) == captured


def test_stitched_graph_logits(graphs):
    model, whole, _, stitched, _ = graphs
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (2, 19), generator=gen)
    pos = (torch.arange(19) + 3)[None].expand(2, 19)
    out = stitched(ids, pos)
    assert torch.equal(out, whole(ids, pos))
    assert rel_err(out, model(ids, pos)) < 1e-4


def test_layer_with_a_hook_is_unprovable_and_falls_back(caplog):
    cfg = _config(2)
    model = Glm5ForCausalLM(cfg, device="meta")
    model.model.layers[1].mlp.register_forward_hook(lambda *args: None)
    with pytest.raises(Unprovable, match=r"model\.layers\.1\.mlp has a forward or backward hook"):
        layer_key(model.model.layers[1], "model.layers.1")
    seen = []

    def rewrite(graph, config):
        seen.append(config.num_hidden_layers)
        return []

    with caplog.at_level(logging.INFO, logger="fxglm5.capture.by_kind"):
        graph, _ = capture_rewritten(model, rewrite)
    assert seen == [2] and "capturing the whole model: model.layers.1.mlp has a forward or backward hook" in caplog.text
    assert any(n.op == "get_attr" and n.target.startswith("model.layers.1.mlp.") for n in graph.graph.nodes)


def test_layers_that_differ_are_other_kinds():
    model = Glm5ForCausalLM(_config(6), device="meta")
    layers = model.model.layers
    assert layer_key(layers[3], "a") == layer_key(layers[5], "b")  # MoE, full indexer
    bigger = layers[5].post_attention_layernorm
    bigger.weight = torch.nn.Parameter(torch.empty(bigger.weight.shape[0] + 1, device="meta"), requires_grad=False)
    assert layer_key(layers[3], "a") != layer_key(layers[5], "b")
    plan = model_plan(model)
    assert plan.kinds[5] not in plan.kinds[:5] and plan.source[5] == 5
    # A plain attribute (the softmax scale) is compared by value: two layers of one model, which hold the very same
    # config (layers of two model instances hold two configs, and differ by identity whatever the value).
    layers = Glm5ForCausalLM(_config(6), device="meta").model.layers
    layers[5].self_attn.scale = layers[3].self_attn.scale * 0.5
    assert layer_key(layers[3], "a") != layer_key(layers[5], "b")


def test_inspect_config_file_on_meta(tmp_path, capsys):
    from fxglm5.cli import main

    _config(3).save(tmp_path)  # dense full, dense shared, MoE full
    assert main(["inspect", "--config", str(tmp_path / "config.json")]) == 0
    out = capsys.readouterr().out
    assert "match_sparse_mla       matches=3 (expected 3)" in out
    assert "fuse_fp8_moe           matches=1 (expected 1)" in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith(("aten.", "fxglm5."))}
    assert rows["fxglm5.sparse_mla"] == ["0", "3"] and rows["aten.softmax"][1] == "0"
