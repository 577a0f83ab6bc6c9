"""One rank of a TP8 / EP8 deployment in one process, the way bench/rank_at_depth.py measures one: torch's fake
process group at world 8 (its collectives return without communicating) and random weights from RandomReader,
on a tiny config whose widths split over 8 ranks into whole 128-blocks (16 heads, dense and shared-expert widths
1024, 16 experts: 2 per rank).

- RandomReader gives each attribute the sharded graph reads exactly its plan part's shape and dtype, with values a
  model can run on (finite, positive block scales), the same for the same seed; a ``like`` of another shape than
  the part, a part outside the parameter and a name the config has not are refused.
- ``Runner(reader, tp=8, ep=8)`` and ``ep=2`` (the mixed layout) on the CPU compile, load and generate tokens in the
  vocabulary, the same tokens for the same seed (the weights are drawn anew by each runner's reader); a loaded model
  is still refused.
- ``bench/rank_at_depth.py --tiny`` (``--ep 2`` too) runs its whole flow (collective probe, TTFT, synthetic-context
  TPOT, profiles) and writes its results with their provenance, each point's collectives priced (the indexer's
  top-k all_gather of a split prefill included).
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from fxglm5.errors import CheckpointError, InputError
from fxglm5.model.config import Glm5Config
from fxglm5.model.modeling import Glm5ForCausalLM
from fxglm5.model.random_reader import RandomReader
from fxglm5.parallel import Slice, nested
from fxglm5.runtime.runner import Runner
from tests.helpers import fake_process_group

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = Glm5Config.preset("tiny-tp").replace(
    num_attention_heads=16, num_key_value_heads=16, intermediate_size=1024, moe_intermediate_size=1024,
    n_routed_experts=16, num_nextn_predict_layers=0)
PROMPTS = [[5, 9, 2, 33, 7, 1, 8, 21], [3, 4]]
OPTIONS = dict(tp=8, ep=8, kv_cache="fp8", block_size=16, max_cache_tokens=256, keep_logits=True)


@pytest.fixture(scope="module")
def fake_group():
    """Rank 0 of a fake world of 8 for this file."""
    with fake_process_group(0, 8):
        yield


@pytest.fixture(scope="module", params=[8, 2], ids=["ep8", "ep2"])
def served(fake_group, request):
    """Rank 0's runner at ep 8 (2 whole experts) and at the mixed ep 2 (group 0: experts 0-7, 256 of each one's
    1024 rows), and its outputs."""
    options = dict(OPTIONS, ep=request.param)
    runner = Runner(RandomReader(CONFIG, seed=0), **options)
    return runner, runner.run(PROMPTS, 4), options


def test_runner_generates_in_vocabulary_tokens_the_same_for_a_seed(served):
    runner, seqs, options = served
    assert [len(s.output) for s in seqs] == [4, 4]
    assert all(0 <= t < CONFIG.vocab_size for s in seqs for t in s.output)
    assert all(torch.isfinite(torch.stack(s.logits)).all() for s in seqs)
    assert runner.load_report.bytes_read == sum(runner.load_report.tensors.values()) > 0
    again = Runner(RandomReader(CONFIG, seed=0), **options).run(PROMPTS, 4)
    assert [s.output for s in again] == [s.output for s in seqs]
    for a, b in zip(again, seqs):
        assert torch.equal(torch.stack(a.logits), torch.stack(b.logits))


def test_reader_gives_each_part_of_the_plan_its_shape_and_dtype(served):
    runner, _, options = served
    plan = runner.program.graph.meta["shard_plan"]
    assert any(part.dim == 0 and ".mlp.experts." in name for name, part in plan.items())  # EP: experts by rank
    if options["ep"] == 2:  # and each expert's rows by the rank's place in its group
        assert plan["model.layers.1.mlp.experts.down_proj"] == nested(Slice(0, 0, 8), Slice(2, 0, 256))
    meta = dict(Glm5ForCausalLM(CONFIG, dtype=torch.bfloat16, device="meta").named_parameters())
    reader, other = RandomReader(CONFIG, seed=0), RandomReader(CONFIG, seed=1)
    expected = 0
    for name, full in meta.items():
        part = plan.get(name)
        like = full if part is None else part.apply(full)
        got = reader.param(name, like, "cpu", part)
        assert got.shape == like.shape and got.dtype == like.dtype and got.device.type == "cpu", name
        values = got.float()  # (e4m3 has no torch.equal on the CPU)
        assert torch.isfinite(values).all(), name
        if name.endswith("_scale_inv"):
            assert (values > 0).all() and values.max() <= 1, name
        assert torch.equal(values, reader.param(name, like, "cpu", part).float()), name  # (seed, name, part)
        assert not torch.equal(values, other.param(name, like, "cpu", part).float()), name
        expected += 2 * like.numel() * like.element_size()  # ``reader`` drew it twice
    assert sum(reader.bytes_read.values()) == expected


def test_reader_refuses_a_shape_a_part_or_a_name_the_config_does_not_give():
    reader = RandomReader(CONFIG)
    name = "model.layers.1.mlp.experts.down_proj"  # [16, 256, 1024] e4m3
    full = torch.empty(16, 256, 1024, dtype=torch.float8_e4m3fn, device="meta")
    assert reader.param(name, full[2:4], "cpu", Slice(0, 2, 4)).shape == (2, 256, 1024)
    with pytest.raises(CheckpointError, match=r"part Slice\(dim=0, start=2, stop=4.* has shape \[2, 256, 1024\], "
                                              r"the model expects \[3, 256, 1024\]"):
        reader.param(name, full[2:5], "cpu", Slice(0, 2, 4))
    with pytest.raises(CheckpointError, match="has shape"):
        reader.param(name, full[2:4], "cpu")  # the whole parameter is asked for
    with pytest.raises(CheckpointError, match="has no part"):
        reader.param(name, full[2:4], "cpu", Slice(3, 0, 2))
    with pytest.raises(CheckpointError, match="not a parameter of GLM-5 with this config"):
        reader.param("model.layers.4.mlp.gate.weight", full, "cpu")


def test_runner_still_refuses_a_loaded_model_at_tp_8():
    with pytest.raises(InputError, match="tp=8: a rank reads its own slices of a checkpoint directory; give its path"):
        Runner(Glm5ForCausalLM(CONFIG, device="meta"), tp=8)


@pytest.mark.parametrize("ep", [8, 2])
def test_bench_rank_at_depth_tiny_runs_its_whole_flow(tmp_path, ep):
    """At ep 8 and at the mixed ep 2 (rank 0 in group 0): either way the rank holds 1/8 of the routed expert bytes."""
    env = dict(os.environ, OUT=str(tmp_path), CUDA_VISIBLE_DEVICES="")
    flags = ["--tiny"] + ([] if ep == 8 else ["--ep", str(ep)])
    run = subprocess.run([sys.executable, os.path.join(REPO, "bench", "rank_at_depth.py"), *flags], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    with open(tmp_path / f"rank_at_depth_tiny_ep{ep}_busiest.json") as f:
        table = json.load(f)
    with open(tmp_path / f"rank_at_depth_tiny_ep{ep}_busiest_detail.json") as f:
        detail = json.load(f)
    assert table["command"].endswith("python bench/rank_at_depth.py " + " ".join(flags)) and table["commit"] \
        and table["device"]
    assert [r["point"] for r in table["rows"]] == ["ttft2k", "ttft8k", "ttft32k", "tpot1x2k", "tpot8x2k",
                                                    "tpot64x2k", "tpot1x32k", "tpot8x32k"]
    assert all(r["status"] == "measured" and r["ms"] > 0 and r["kernels_per_step"] > 0 for r in table["rows"])
    assert all(probe["eager"] for probe in detail["collective_probe"].values())
    run0 = detail["runs"][0]
    assert {c["op"]: c["count"] for c in run0["collectives_per_step"]} == {"all_reduce": 8, "all_gather": 1,
                                                                           "rtp_indexer all_gather": 4}
    # the 128-token prefill splits the indexer's top-k (16 rows a rank), the 32-token one and the decode steps do not;
    # each collective's bytes priced at the stated bus bandwidth: (W-1)/W x the gathered 128 x 8 int32 top-k
    top_k = {p: run0["points"][p]["collectives_priced"]["rtp_indexer all_gather"] for p in ("ttft32k", "ttft8k",
                                                                                            "tpot64x2k")}
    assert table["rows"][0]["collective_ms"] > 0 and detail["nvlink_bus_gbs"] == 400
    gathered = 4 * 128 * CONFIG.index_topk * 4  # 4 layers' [128, topk] int32
    assert top_k["ttft32k"] == dict(bytes=gathered, ms=float(f"{7 / 8 * gathered / 400e9 * 1e3:.4g}"))
    assert top_k["ttft8k"]["bytes"] == top_k["tpot64x2k"]["bytes"] == 0
    assert run0["weights_gb"] and run0["kv_bytes_per_token"] == 4 * (656 + 132)
    assert detail["act_quant"] is False and "W8A16 FP8 GEMMs" in detail["setup"]  # fxglm5's default
    assert run0["fp8_gemms"] == {"fp8_linear act_quant=False": 5, "fp8_linear_latent_query_indexer act_quant=False": 4,
                                 "add_rms_norm_fp8_linear act_quant=False": 4,
                                 "silu_mul_fp8_linear act_quant=False": 1,
                                 "add_rms_norm_moe_router_fp8_shared act_quant=False": 3}
    tpot = run0["points"]["tpot8x32k"]
    assert len(tpot["steps_ms"]) == 8 and tpot["step_bytes"] > 0
    assert "synthetic" in detail["context"] and "rank_at_depth_tiny" in (
        tmp_path / f"rank_at_depth_tiny_ep{ep}_busiest.md").read_text()
    expert = 3 * CONFIG.moe_intermediate_size * CONFIG.hidden_size * (1 + 4 / 128 ** 2)  # FP8 w13 + w2, their scales
    assert run0["weight_bytes"]["routed experts"] == 3 * (CONFIG.n_routed_experts / 8 * expert + 4)  # 3 MoE
    # layers, each with its int32 expert offset
    # the busiest rank's routing at each TPOT batch, its simulated figures beside the steered layers'
    assert run0["ep"] == ep and run0["load"] == "busiest" and sorted(run0["routing"], key=int) == ["1", "8", "64"]
    assert run0["routing"]["64"]["busiest_distinct_experts"] <= CONFIG.n_routed_experts / ep
    assert all(r["busiest_distinct_experts"] >= r["mean_distinct_experts"] for r in run0["routing"].values())
    # one layer of each kind, in order (bench/layer_kernels.py on the step's real sequence: 1 dense + 3 MoE layers)
    layers = tpot["profile"]["layer_kernels"]
    dense, moe = ([k["kernel"] for k in layers[kind]] for kind in ("dense", "moe"))
    # a MoE layer begins with its attention's first GEMM, the residual add and input norm in it; the steered router
    # of the reference backend runs add_rms_norm_moe_router_fp8_shared as its chain (bench/routing_load.py): its MLP
    # norm, the router, the MoE
    assert dense[0] == "fxglm5::rms_norm" and moe[0] == "fxglm5::add_rms_norm_fp8_linear"
    assert "fxglm5::add_rms_norm_fp8_linear" in dense and "fxglm5::add_rms_norm" in moe
    assert "fxglm5::silu_mul_fp8_linear" in dense and "fxglm5::moe_fp8_shared" in moe
    assert "fxglm5::moe_fp8_shared" not in dense and "fxglm5::silu_mul_fp8_linear" not in moe  # the shared expert's
    # GEMMs are the MoE's
    assert "fxglm5::rope_interleaved" not in dense + moe  # every RoPE runs inside the attention ops' kernels


def test_bench_rank_at_depth_tiny_act_quant_runs_w8a8_gemms_and_says_so(tmp_path):
    """``--act-quant``: the rank's program has every FP8 GEMM and MoE W8A8 (4 layers: 13 GEMMs, the dense MLP's down
    projection fused with its SiLU-mul, 3 MoE with their shared expert's GEMMs), recorded beside the points, in the setup line and in the file names."""
    env = dict(os.environ, OUT=str(tmp_path), CUDA_VISIBLE_DEVICES="")
    flags = ["--tiny", "--act-quant", "--points", "ttft8k,tpot8x2k"]
    run = subprocess.run([sys.executable, os.path.join(REPO, "bench", "rank_at_depth.py"), *flags], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    name = "rank_at_depth_tiny_ep8_busiest_w8a8"
    with open(tmp_path / f"{name}.json") as f:
        table = json.load(f)
    with open(tmp_path / f"{name}_detail.json") as f:
        detail = json.load(f)
    assert table["command"].endswith("python bench/rank_at_depth.py " + " ".join(flags))
    assert [(r["point"], r["status"]) for r in table["rows"]] == [("ttft8k", "measured"), ("tpot8x2k", "measured")]
    gemms = {"fp8_linear act_quant=True": 5, "fp8_linear_latent_query_indexer act_quant=True": 4,
             "add_rms_norm_fp8_linear act_quant=True": 4, "silu_mul_fp8_linear act_quant=True": 1,
             "add_rms_norm_moe_router_fp8_shared act_quant=True": 3}
    assert detail["act_quant"] is True and detail["runs"][0]["fp8_gemms"] == gemms
    notes = (tmp_path / f"{name}.md").read_text()
    assert "bf16 compute, W8A8 FP8 GEMMs (--act-quant" in notes and "FP8 GEMM ops: fp8_linear act_quant=True x5" in notes
