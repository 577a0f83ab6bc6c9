"""An artifact exported on the CPU and served on the GPU (the cache and lower stages run at load, for CUDA:
Triton kernels): the tokens of the checkpoint's own paged runtime on the GPU."""

import pytest
import torch

from fxglm5.artifact import export_artifact, load_artifact
from fxglm5.model.modeling import Glm5ForCausalLM
from fxglm5.model.tiny import make_tiny_checkpoint
from fxglm5.runtime.runner import Runner

pytestmark = pytest.mark.gpu


def test_a_cpu_exported_artifact_serves_on_the_gpu(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", fp8=True)
    path = export_artifact(Glm5ForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, progress=False), tmp_path / "tiny.pt2")
    prompts = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26], [7, 1, 8]]
    options = dict(kv_cache="fp8", block_size=64, max_cache_tokens=1024, device="cuda")
    runner = load_artifact(path).runner(**options)
    assert runner.pass_results[-1].details["backends"].startswith("triton")
    got = runner.generate(prompts, 8)
    assert got == Runner(ckpt, dtype=torch.bfloat16, **options).generate(prompts, 8)
