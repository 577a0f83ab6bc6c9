"""Speculative decoding on the GPU (Triton kernels, decode CUDA graphs for the verify shapes): the tokens with
speculation equal those without, for k = 1..4, bf16 and FP8 caches, a batch of mixed lengths with prompts
longer than index_topk; drafts forced to be accepted, forced to be rejected, and the tiny checkpoint's MTP layer."""

import pytest
import torch

from fxglm5.model.config import Glm5Config
from fxglm5.model.modeling import Glm5ForCausalLM
from fxglm5.model.tiny import make_tiny_checkpoint
from fxglm5.runtime.runner import Runner
from fxglm5.runtime.speculative import ScriptedDrafter, SpeculativeConfig
from tests.helpers import random_model
from tests.runtime.test_speculative import Rejecting

pytestmark = pytest.mark.gpu
PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43], [7, 1, 8], [2, 71, 82, 81, 82, 84, 59, 4, 5, 23, 53, 60, 28, 74, 71]]
NEW = 24


def options(kv_cache):
    return dict(kv_cache=kv_cache, index_cache="fp8", block_size=16, dtype=torch.float32, max_cache_tokens=1024,
                device="cuda", backend="triton", max_decode_batch=4)


def replayed_verify(runner, k):
    graphs = runner.decode_graphs
    return graphs is not None and graphs.disabled is None and any(key[2] == k + 1 for key in graphs.graphs)


@pytest.fixture(scope="module")
def model():
    return random_model(Glm5Config.preset("tiny"), torch.float32).cuda()


@pytest.mark.parametrize("kv_cache", ["bf16", "fp8"])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_forced_drafts_with_graphs_same_tokens(model, kv_cache, k):
    plain = Runner(model, **options(kv_cache))
    want = plain.generate(PROMPTS, NEW)
    graph = plain.program
    script = {tuple(p): w for p, w in zip(PROMPTS, want)}
    for drafter, length in ((ScriptedDrafter(script), k + 1), (Rejecting(script), 1)):
        r = Runner(model, program=graph, speculative=SpeculativeConfig(num_tokens=k), drafter=drafter,
                   **options(kv_cache))
        assert r.generate(PROMPTS, NEW) == want
        assert replayed_verify(r, k)
        assert all(s == length for s in r.run(PROMPTS, NEW)[0].acceptance[:-1])


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("mtp") / "fp8", fp8=True)
    return Glm5ForCausalLM.from_pretrained(ckpt, dtype=torch.float32, device="cuda", progress=False, mtp=True)


@pytest.mark.parametrize("kv_cache", ["bf16", "fp8"])
def test_mtp_drafts_with_graphs_same_tokens(mtp_model, kv_cache):
    want = Runner(mtp_model, **options(kv_cache)).generate(PROMPTS, NEW)
    graph = mtp_graph = None
    for k in (1, 2, 3, 4):
        r = Runner(mtp_model, program=graph, mtp_program=mtp_graph, speculative=SpeculativeConfig(num_tokens=k),
                   **options(kv_cache))
        graph, mtp_graph = r.program, r.drafter.program
        assert r.generate(PROMPTS, NEW) == want, k
        assert replayed_verify(r, k) and r.acceptance.steps > 0
