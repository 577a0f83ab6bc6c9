"""End to end on the GPU: the tiny GLM-5 lowered to Triton generates the same tokens as the reference
backend, cache-less (the match + fuse graph) and through the paged runtime with bf16 and FP8 caches,
mixed prompt lengths and prompts longer than index_topk."""

import pytest
import torch

from fxglm5.capture import capture
from fxglm5.model.config import Glm5Config
from fxglm5.passes import PassContext, run_pipeline
from fxglm5.runtime.runner import Runner
from tests.helpers import random_model

pytestmark = pytest.mark.gpu
PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43], [7, 1, 8], [2, 71, 82, 81, 82, 84, 59, 4, 5, 23, 53, 60, 28, 74, 71]]


def _greedy(graph, prompt, steps):
    tokens = list(prompt)
    for _ in range(steps):
        ids = torch.tensor([tokens], device="cuda")
        pos = torch.arange(len(tokens), device="cuda")[None]
        tokens.append(int(graph(ids, pos)[0, -1].argmax()))
    return tokens[len(prompt):]


def test_lowered_graph_same_tokens_as_reference():
    cfg = Glm5Config.preset("tiny")
    model = random_model(cfg, torch.float32).cuda()
    outputs = {}
    for backend in ("reference", "triton"):
        gm = capture(model)
        results = run_pipeline(gm, PassContext(config=cfg, backend=backend), stages=("match", "fuse", "lower"))
        assert results[-1].details["backends"].startswith(backend)
        outputs[backend] = [_greedy(gm, p, 12) for p in PROMPTS]
    assert outputs["triton"] == outputs["reference"]


@pytest.mark.parametrize("kv_cache", ["bf16", "fp8"])
def test_paged_runtime_triton_same_tokens_as_reference(kv_cache):
    cfg = Glm5Config.preset("tiny")
    model = random_model(cfg, torch.float32).cuda()
    outputs = {}
    for backend in ("reference", "triton"):
        runner = Runner(model, kv_cache=kv_cache, index_cache="fp8", block_size=16, dtype=torch.float32,
                        max_cache_tokens=512, device="cuda", backend=backend)
        outputs[backend] = runner.generate(PROMPTS, 24)
    assert outputs["triton"] == outputs["reference"]
