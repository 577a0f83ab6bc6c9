"""A packed checkpoint (stacked experts: ``mlp.experts.gate_up_proj`` [E, 2I, H], as a raw state-dict dump holds
them) loaded sharded (issue 40): every rank's attributes, read through the shard plan the compile made for it, are
the bytes the per-expert (GLM-5-FP8) form of the same checkpoint gives, and the full model's part
(``Slice.apply``); at ep=1 each expert's gate and up halves are narrowed alike (rank 1 reads the second half of
each, rows and block scales), at ep=tp each rank reads its own experts, and in the mixed layout (TP4 / ep 2) its
group's experts, each narrowed to the rank's rows. Of the routed experts, both forms read
exactly the rank's bytes: a rank reads only its part of a packed tensor too."""

import operator

import pytest
import torch
from safetensors.torch import save_file
from tests.parallel.ranks import sharded

from fxglm5.compiler import compile_model
from fxglm5.model.checkpoint import CheckpointReader
from fxglm5.model.config import Glm5Config
from fxglm5.model.modeling import Glm5ForCausalLM
from fxglm5.model.tiny import make_tiny_checkpoint
from fxglm5.parallel import PLAN, Mapping
from fxglm5.passes.pipeline import Stage
from fxglm5.runtime.shard_loader import load_sharded

MOE = "model.layers.1.mlp.experts."


@pytest.fixture(scope="module")
def forms(tmp_path_factory):
    """(per-expert checkpoint, its packed dump, the full model loaded from it, the meta model and its match + fuse
    graph), float32 compute."""
    root = tmp_path_factory.mktemp("packed")
    config = Glm5Config.preset("tiny-tp").replace(num_hidden_layers=2, mlp_layer_types=None, indexer_types=None,
                                                  num_nextn_predict_layers=0)
    per_expert = make_tiny_checkpoint(root / "per_expert", config=config, seed=4)
    full = Glm5ForCausalLM.from_pretrained(per_expert, dtype=torch.float32, progress=False)
    packed = root / "packed"
    packed.mkdir()
    full.config.save(packed)
    save_file({k: v.contiguous() for k, v in full.state_dict().items()}, str(packed / "model.safetensors"))
    assert CheckpointReader(packed).packed and not CheckpointReader(per_expert).packed
    meta = Glm5ForCausalLM(full.config, dtype=torch.float32, device="meta")
    graph = compile_model(meta, stages=(Stage.MATCH, Stage.FUSE), strict=True).graph
    return per_expert, packed, full, meta, graph


def _same(a, b) -> bool:
    """Equal dtype, shape and bytes (FP8 included, where NaN-free equality is not defined)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                     b.reshape(-1).view(torch.uint8))


def _attributes(gm):
    return {t: operator.attrgetter(t)(gm) for t in dict.fromkeys(n.target for n in gm.graph.find_nodes(op="get_attr"))}


@pytest.mark.parametrize("tp, ep, rank", [(2, 1, 0), (2, 1, 1), (2, 2, 0), (2, 2, 1), (4, 2, 1), (4, 2, 2)],
                         ids=["tp2-ep1-r0", "tp2-ep1-r1", "tp2-ep2-r0", "tp2-ep2-r1", "tp4-ep2-r1", "tp4-ep2-r2"])
def test_packed_checkpoint_loads_sharded_as_the_per_expert_one(forms, tp, ep, rank):
    per_expert, packed, full, meta, graph = forms
    mapping = Mapping(tp=tp, rank=rank, ep=ep)
    loaded, reports = [], []
    for path in (per_expert, packed):
        gm, _ = sharded(graph, meta.config, mapping, lower=False)
        reports.append(load_sharded(gm, CheckpointReader(path), meta, "cpu"))
        loaded.append(_attributes(gm))
    plan = gm.meta[PLAN]
    stacked = [t for t in plan if t.startswith(MOE) and t.endswith(("gate_up_proj", "gate_up_proj_scale_inv"))]
    split_rows = tp // ep > 1
    assert len(stacked) == 2 and all(any(p.halves for p in plan[t].levels()) == split_rows for t in stacked), plan
    params = dict(full.named_parameters())
    assert loaded[0].keys() == loaded[1].keys()
    for target, want in loaded[0].items():
        assert _same(loaded[1][target], want), target
        if target in plan:
            assert _same(want, plan[target].apply(params[target])), target
    # The parts themselves: group g = rank // (tp/ep) holds experts [g E/ep, (g+1) E/ep), and the rank, at place p
    # of its group, rows [p I/(tp/ep), (p+1) I/(tp/ep)) of each of their gates and of their ups.
    gate_up = loaded[1][MOE + "gate_up_proj"]
    whole = params[MOE + "gate_up_proj"]
    (group, place), experts, half = divmod(rank, tp // ep), whole.shape[0] // ep, whole.shape[1] // 2
    share = half // (tp // ep)
    rows = [*range(place * share, (place + 1) * share), *range(half + place * share, half + (place + 1) * share)]
    assert _same(gate_up, whole[group * experts:(group + 1) * experts][:, rows])
    # Of the routed experts, each form reads exactly the rank's part (FP8 weights and float32 scales in both).
    routed = [MOE + k for k in ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv")]
    held = sum(loaded[1][k].numel() * loaded[1][k].element_size() for k in routed)
    for report in reports:
        assert sum(n for k, n in report.tensors.items() if k.startswith(MOE)) == held
    assert MOE + "gate_up_proj" in reports[1].tensors and MOE + "gate_up_proj" not in reports[0].tensors
