"""lower: every fxglm5 op bound to the backend chosen for it at lower time, from the node's metadata, and the choice
recorded: on the node (``meta['fxglm5_backend']``), in the pass's details, and in ``fxglm5 inspect --device``
(tests/passes/template.py's checks, then the choice per device and backend)."""

import copy
import dataclasses

import re

import pytest
import torch

from fxglm5.capture import capture
from fxglm5.cli import main
from fxglm5.lowering import backend_choice
from fxglm5.model.config import Glm5Config
from fxglm5.model.modeling import Glm5ForCausalLM
from fxglm5.passes import PassContext, run_pipeline
from tests.passes.modules import paged_reexport
from tests.passes.template import PassTemplate, pipeline

CFG = Glm5Config.preset("tiny")
# what the tiny FP8 model holds after match + fuse: op -> node count
COUNTS = {"rms_norm": 17, "fp8_linear": 36, "rope_interleaved": 16, "indexer_topk": 4, "sparse_mla": 4,
          "moe_route": 3, "moe_fp8": 3}
TRITON = {"rms_norm", "fp8_linear", "rope_interleaved", "moe_route", "moe_fp8"}  # the ops with a Triton kernel


class TestLower(PassTemplate):
    name = "lower"
    # every fxglm5 node left by the cache and fuse_kernels stages: 13 norms (7 of them now add_rms_norm, 4
    # rms_norm_write_caches) less the 4 add_rms_norm inside the GEMM that reads them and the 3 inside the MoE op that
    # reads them, the FP8 linears as
    # fuse_shared_input_gemms leaves them (36 -> 20, the shared-indexer model's 32 -> 20) less the 3 shared experts' 2
    # each, inside their MoE (1 of the 14 left silu_mul_fp8_linear, 4 add_rms_norm_fp8_linear, 4 the q_b GEMMs with
    # their latent query and, in each layer with its own indexer, that indexer: fp8_linear_latent_query_indexer, else
    # fp8_linear_latent_query; the indexers' head weights' f32_linears are inside rms_norm_write_caches, the routers'
    # inside moe_router), the 4 attention ops and 3 MoE with their routers (no RoPE: the cache stage folded every one
    # into the attention ops; fuse_router_into_moe every router into its MoE)
    matches = {"fp8": 6 + 14 + 4 + 3, "shared": 6 + 14 + 4 + 3, "bf16": 27}
    ops = {"fp8": {}, "shared": {}}  # the nodes keep their ops (a bound op counts as the op it implements)
    near_misses = ("aten_rms_norm",)

    def near_miss(self, case):
        """torch's own aten.rms_norm, the name of an fxglm5 op in another namespace: not lowered."""
        graph = torch.fx.Graph()
        x, w = graph.placeholder("x"), graph.placeholder("w")
        graph.output(graph.call_function(torch.ops.aten.rms_norm.default, (x, [8], w, 1e-6)))
        gm = torch.fx.GraphModule(torch.nn.Module(), graph)
        args = (torch.randn(2, 3, 8), torch.rand(8))
        return gm, lambda x, w: torch.nn.functional.rms_norm(x, [8], w, 1e-6), args, None

    def reexport(self):
        return paged_reexport(self.name)


def test_every_fxglm5_node_is_bound_and_recorded():
    gm = pipeline("fp8").after["lower"]
    lowered = [n for n in gm.graph.nodes if n.op == "call_function" and "fxglm5_backend" in n.meta]
    assert len(lowered) == TestLower.matches["fp8"]
    assert all(isinstance(n.target, backend_choice.Bound) and n.target.backend == "reference" for n in lowered)
    assert not any(isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "fxglm5" for n in gm.graph.nodes)


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
            assert isinstance(node.target, backend_choice.Bound)  # chosen now: no per-call Dispatch left
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
    assert "fuse_kernels fuse_shared_input_gemms matches=12 (expected 12)" in out
    assert "  fp8_linear: triton x9\n" in out and "  sparse_mla: reference x4\n" in out
    assert "  silu_mul_fp8_linear: triton x1\n" in out and "  add_rms_norm: triton x1\n" in out  # the final norm
    assert "  add_rms_norm_fp8_linear: triton x4\n" in out
    assert "fuse_kernels fuse_shared_add_into_moe matches=3 (expected 3)" in out
    assert "fuse_kernels fuse_shared_expert_into_moe matches=3 (expected 3)" in out
    assert "  add_rms_norm_moe_router_fp8_shared: triton x3\n" in out and "  moe_router_fp8_shared:" not in out
    assert re.search(r"fuse_kernels fuse_router_into_moe +matches=3 \(expected 3\)", out)
    assert re.search(r"fuse_kernels fuse_add_rms_norm_into_moe +matches=3 \(expected 3\)", out)


def test_a_choice_reading_a_run_time_input_is_left_to_each_call(monkeypatch):
    """A supports check that reads a graph input without metadata (the paged index cache: one graph serves FP8
    and exact caches) gets the per-call Dispatch; given the input's metadata, the same node is bound at lower
    time. The check here is planted on the indexer's Triton entry (the indexer itself now serves both caches)."""
    from fxglm5.lowering import implementations as table

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    triton_entry = table._IMPLS["rtp_indexer"]["triton"]
    monkeypatch.setitem(table._IMPLS["rtp_indexer"], "triton", dataclasses.replace(
        triton_entry, supports=lambda q, k, w, topk, cache, *rest: None if cache.dtype == torch.uint8 else "exact"))
    graph = torch.fx.Graph()
    q, k, w, cache, slots, table_, req, pos = (graph.placeholder(n) for n in
                                               ("q", "k", "w", "cache", "slots", "table", "req", "pos"))
    call = graph.call_function(torch.ops.fxglm5.rtp_indexer.default, (q, k, w, 8, cache, slots, table_, req, pos, 64))
    order = backend_choice.backend_order("cpu", "triton")
    assert isinstance(backend_choice.bind(call, "rtp_indexer", order, "cpu"), backend_choice.Dispatch)
    for dtype, backend in ((torch.uint8, "triton"), (torch.float32, "reference")):
        cache.meta["val"] = torch.empty(4, 16, 132 if dtype == torch.uint8 else 128, dtype=dtype, device="meta")
        bound = backend_choice.bind(call, "rtp_indexer", order, "cpu")
        assert isinstance(bound, backend_choice.Bound) and bound.backend == backend


def test_in_the_paged_graph_every_node_is_bound_at_lower_time():
    """Through every stage (cache included) on the meta device for CUDA: every node is bound at lower time (the
    indexer was left to each call while its Triton entry served only FP8 index caches, whose dtype is a run-time
    input). The final rms_norm reads the rows select_sampled_rows keeps, whose count only the step knows: it was a
    per-call Dispatch while those rows had no metadata."""
    from fxglm5.compiler import compile_model
    from fxglm5.passes.lower import placement

    graph = compile_model(Glm5ForCausalLM(CFG, dtype=torch.bfloat16, device="meta"), device="cuda", max_tokens=4096).graph
    per_call = {op for (op, backend) in placement(graph) if backend == "runtime"}
    assert per_call == set()
    # 17 matched, 4 folded into the cache writes, 7 into add_rms_norm (4 of them then into the GEMM that reads them,
    # 3 into the MoE op that reads them), the 4 query latents' into rms_norm_write_caches
    assert placement(graph)[("rms_norm", "triton")] == 2 and ("add_rms_norm", "triton") not in placement(graph)
    assert placement(graph)[("add_rms_norm_moe_router_fp8_shared", "triton")] == 3
    assert placement(graph)[("add_rms_norm_fp8_linear", "triton")] == 4
    assert placement(graph)[("rms_norm_write_caches", "triton")] == 4
