"""On the GPU: the stacked GEMMs of fuse_shared_input_gemms on the Triton kernel, at GLM-5's attention shapes,
equal the separate GEMMs up to the kernel's reduction order (its split of K may differ with N), with act_quant on
and off; through the paged runtime the tiny model gives the same tokens with the pass and without it."""

import pytest
import torch

from fxglm5.lowering.triton.fp8_gemm import fp8_linear
from fxglm5.model.config import Glm5Config
from fxglm5.passes.fuse_shared_input_gemms import stack, stacked_layout
from fxglm5.runtime.runner import Runner
from tests.helpers import random_model

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("act_quant", [False, True])
@pytest.mark.parametrize("m", [1, 16, 64, 4096])
def test_stacked_qkv_a_equals_the_separate_gemms(m, act_quant):
    g = torch.Generator(device="cuda").manual_seed(m)
    sizes, k = [2048, 576, 128], 6144  # q_a, kv_a (4.5 blocks), indexer wk
    weights = [(torch.randn(n, k, generator=g, device="cuda").to(torch.float8_e4m3fn),
                torch.rand(-(-n // 128), k // 128, generator=g, device="cuda") * 1e-2 + 1e-3) for n in sizes]
    order, rows = stacked_layout(sizes)
    w = stack(rows, *(weights[i][0] for i in order))
    s = stack(tuple(-(-r // 128) for r in rows), *(weights[i][1] for i in order))
    x = torch.randn(m, k, generator=g, device="cuda", dtype=torch.bfloat16)
    fused, start = fp8_linear(x, w, s, None, act_quant), 0
    for i, r in zip(order, rows):
        want = fp8_linear(x, *weights[i], None, act_quant)
        got = fused[:, start:start + sizes[i]]
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2 * want.float().abs().max().item())
        start += r


@pytest.mark.parametrize("kv_cache", ["bf16", "fp8"])
def test_runtime_same_tokens_with_and_without_the_pass(kv_cache):
    cfg = Glm5Config.preset("tiny")
    model = random_model(cfg, torch.float32).cuda()
    prompts = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43], [7, 1, 8]]
    tokens = [Runner(model, kv_cache=kv_cache, block_size=16, dtype=torch.float32, max_cache_tokens=512, device="cuda",
                     backend="triton", disabled_passes=disabled).generate(prompts, 16)
              for disabled in ((), ("fuse_shared_input_gemms",))]
    assert tokens[0] == tokens[1]
