"""The lower pass chooses each node's backend at lower time, from the node's metadata, and records it: on the
node (``meta['fxglm5_backend']``), in the pass's details, and in ``fxglm5 inspect --device``."""

import copy

import pytest
import torch

from fxglm5.capture import capture
from fxglm5.cli import main
from fxglm5.lowering import registry
from fxglm5.model.config import Glm5Config
from fxglm5.model.modeling import Glm5ForCausalLM
from fxglm5.passes import PassContext, run_pipeline

CFG = Glm5Config.preset("tiny")
# what the tiny FP8 model holds after match + fuse: op -> node count
# fp8_linear: 36 GEMMs, 28 of them in 12 shared-input groups (fuse_shared_input_gemms runs first)
COUNTS = {"rms_norm": 17, "fp8_linear": 20, "rope_interleaved": 16, "indexer_topk": 4, "sparse_mla": 4,
          "moe_route": 3, "moe_fp8": 3}
TRITON = {"rms_norm", "fp8_linear", "rope_interleaved", "moe_route", "moe_fp8"}  # the ops with a Triton kernel


@pytest.fixture(scope="module")
def fused():
    """The tiny FP8 model on the meta device, matched and fused once (lowering only rewrites, so meta is fine)."""
    gm = capture(Glm5ForCausalLM(CFG, dtype=torch.bfloat16, device="meta"))
    run_pipeline(gm, PassContext(config=CFG))
    return gm


def _lower(fused, device, backend=None):
    gm = copy.deepcopy(fused)
    result = run_pipeline(gm, PassContext(config=CFG, backend=backend, extras={"device": device}), stages=("lower",))
    recorded = {}
    for node in gm.graph.nodes:
        if "fxglm5_backend" in node.meta:
            assert isinstance(node.target, registry.Bound)  # chosen now: no per-call Dispatch left
            assert node.target.backend == node.meta["fxglm5_backend"]
            recorded.setdefault(node.target.op, set()).add(node.meta["fxglm5_backend"])
    return result[-1], recorded


@pytest.mark.parametrize("device, backend, expected", [
    ("cpu", None, {op: "reference" for op in COUNTS}),  # CPU: reference unless Triton is asked for
    ("cpu", "triton", {op: "triton" if op in TRITON else "reference" for op in COUNTS}),  # interpreted
    ("cuda", None, {op: "triton" if op in TRITON else "reference" for op in COUNTS}),
])
def test_backend_recorded_per_op_kind(fused, device, backend, expected, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # what lets Triton take CPU tensors (a GPU host does not set it)
    result, recorded = _lower(fused, device, backend)
    assert recorded == {op: {b} for op, b in expected.items()}
    assert result.num_matches == sum(COUNTS.values())
    assert result.details["ops"].split(",") == [f"{op}:{expected[op]} x{n}" for op, n in COUNTS.items()]


def test_metadata_decides_a_refusal_at_lower_time(fused, monkeypatch):
    """bf16 expert weights (no scales, as a bf16 checkpoint's) are refused by the Triton MoE from the node's
    arguments alone, at lower time."""
    gm = copy.deepcopy(fused)
    for node in gm.graph.nodes:
        if node.target is torch.ops.fxglm5.moe_fp8.default:
            node.args = (*node.args[:4], None, node.args[5], None, node.args[7])
    run_pipeline(gm, PassContext(config=CFG, extras={"device": "cuda"}), stages=("lower",))
    moe = [n for n in gm.graph.nodes if n.meta.get("fxglm5_backend") and n.target.op == "moe_fp8"]
    assert [n.meta["fxglm5_backend"] for n in moe] == ["reference"] * 3


def test_inspect_prints_what_runs_where(capsys):
    assert main(["inspect", "--preset", "tiny", "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    assert "lowered for cuda (backends tried in order triton/reference):" in out
    assert "lower fuse_shared_input_gemms matches=12 (expected 12)" in out
    assert "  fp8_linear: triton x20\n" in out and "  sparse_mla: reference x4\n" in out
    assert "  moe_fp8: triton x3\n" in out


def test_a_choice_reading_a_run_time_input_is_left_to_each_call(monkeypatch):
    """The paged index cache is a graph input without metadata (one graph serves FP8 and exact caches): the
    Triton indexer's check reads its dtype, so that node gets the per-call Dispatch; given the cache's
    metadata, the same node is bound at lower time."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    graph = torch.fx.Graph()
    q, k, w, cache, slots, table, req, pos = (graph.placeholder(n) for n in
                                              ("q", "k", "w", "cache", "slots", "table", "req", "pos"))
    call = graph.call_function(torch.ops.fxglm5.rtp_indexer.default, (q, k, w, 8, cache, slots, table, req, pos, 64))
    order = registry.backend_order("cpu", "triton")
    assert isinstance(registry.bind(call, "rtp_indexer", order, "cpu"), registry.Dispatch)
    for dtype, backend in ((torch.uint8, "triton"), (torch.float32, "reference")):
        cache.meta["val"] = torch.empty(4, 16, 132 if dtype == torch.uint8 else 128, dtype=dtype, device="meta")
        bound = registry.bind(call, "rtp_indexer", order, "cpu")
        assert isinstance(bound, registry.Bound) and bound.backend == backend
