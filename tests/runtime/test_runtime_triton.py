"""The full Triton path of the paged runtime (FP8 GEMM, fused MoE, cache writes, FP8 indexer + top-k,
sparse MLA) generates the same tokens as the reference path. On CPU the kernels run interpreted, so
this is small: two layers (one dense, one MoE, both with an indexer), two prompts, three new tokens (a prefill
and two decode steps); tests/gpu/test_gpu_e2e.py runs the same comparison compiled on a GPU."""

import torch

from fxglm5.model.config import Glm5Config
from fxglm5.runtime.runner import Runner
from tests.helpers import random_model

PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26], [7, 1, 8]]  # one longer than index_topk (8)


def test_triton_path_same_tokens_as_reference(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU tensors: the Triton bindings need the interpreter
    cfg = Glm5Config.preset("tiny").replace(num_hidden_layers=2, mlp_layer_types=None, indexer_types=None)
    model = random_model(cfg, torch.float32)
    outputs, backends = {}, {}
    for backend in ("reference", "triton"):
        runner = Runner(model, kv_cache="fp8", index_cache="fp8", block_size=16, dtype=torch.float32,
                        max_cache_tokens=128, backend=backend)
        backends[backend] = runner.pass_results[-1].details["backends"]
        outputs[backend] = runner.generate(PROMPTS, 3)
    assert backends == {"reference": "reference", "triton": "triton/reference"}
    assert outputs["triton"] == outputs["reference"]
