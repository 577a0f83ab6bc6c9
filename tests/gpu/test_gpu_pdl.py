"""Programmatic dependent launch (FXGLM5_PDL=1) on the GPU: the decode path's Triton kernels launched so that each
may start while its predecessor drains give the same results as plain launches, eagerly and replayed from a CUDA
graph: a chain of 40 dependent kernels (each reading what the one before wrote, where a missing wait would read
stale data), and the tiny model's decode steps, token for token and bitwise."""

import pytest
import torch

from fxglm5.lowering.triton import device, f32_linear, fp8_gemm, norm_rope
from fxglm5.model.config import Glm5Config
from fxglm5.runtime.runner import Runner
from tests.helpers import random_model

pytestmark = pytest.mark.gpu


def test_pdl_is_on_only_where_asked(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setenv("FXGLM5_PDL", "0")
    assert device.pdl(cuda) == {"PDL": False}
    monkeypatch.setenv("FXGLM5_PDL", "1")
    hopper = device.capability(cuda)[0] >= 9
    assert device.pdl(cuda) == ({"PDL": True, "launch_pdl": True} if hopper else {"PDL": False})
    assert device.pdl(torch.device("cpu")) == {"PDL": False}


def _chain(x, w, s, norm_w, router):
    """40 dependent launches: norm -> GEMM -> norm ... -> a float32 GEMV at the end, each reading the last output."""
    h = x
    for _ in range(10):
        normed, h = norm_rope.add_rms_norm(h, x, norm_w, 1e-5)
        h = fp8_gemm.fp8_linear(normed, w, s, None, False, config={"FIXUP": True})
        h = norm_rope.rms_norm(h, norm_w, 1e-5)
    return f32_linear.f32_linear(h, router, [0.5])


@pytest.mark.parametrize("rows", [1, 64])
def test_a_dependent_chain_is_the_same_with_and_without_pdl(rows, monkeypatch):
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 2048, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(2048, 2048, device="cuda", generator=g) * 0.5).to(torch.float8_e4m3fn)
    s = torch.rand(16, 16, device="cuda", generator=g) * 0.02 + 0.005
    norm_w = torch.ones(2048, device="cuda", dtype=torch.bfloat16)
    router = torch.randn(256, 2048, device="cuda", generator=g)
    monkeypatch.setenv("FXGLM5_PDL", "0")
    want = _chain(x, w, s, norm_w, router)
    monkeypatch.setenv("FXGLM5_PDL", "1")
    assert torch.equal(_chain(x, w, s, norm_w, router), want)  # eager, compiled with the PDL prologue
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _chain(x, w, s, norm_w, router)
    for _ in range(3):
        out.zero_()
        graph.replay()
        assert torch.equal(out, want)


def test_tiny_model_decodes_the_same_with_pdl(monkeypatch):
    model = random_model(Glm5Config.preset("tiny"), torch.bfloat16).cuda()
    prompts = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46], [7, 1, 8]]
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("FXGLM5_PDL", flag)
        runner = Runner(model, kv_cache="fp8", block_size=16, dtype=torch.bfloat16, device="cuda", keep_logits=True)
        seqs = runner.run(prompts, 8)
        assert runner.decode_graphs.graphs  # decode steps replayed from CUDA graphs
        runs[flag] = [s.output for s in seqs], [torch.stack(s.logits) for s in seqs]
    assert runs["1"][0] == runs["0"][0]
    assert all(torch.equal(a, b) for a, b in zip(runs["1"][1], runs["0"][1]))
