"""W8A8 through the Runner on Hopper (``RunnerOptions(act_quant=True)``): a prefill of more than
``fp8_gemm_hopper.MIN_M`` rows runs the warp-specialized Gluon GEMM, which the default W8A16 prefill and the
reference backend never do, and every one of its calls inside the Runner gives the reference W8A8 product of its
own operands.

Why per call and not the logits: on this random tiny-tp model the logits move by 0.77 of their scale between W8A16
and W8A8 (CPU, 200 tokens): one e4m3 step is 1/16 to 1/8 of a value, and a difference that flips one activation's
rounding grows through the layers. Two correct W8A8 implementations that sum in different orders therefore give
logits an order of magnitude apart at the end (1.08 of their scale on an H100 at bb561ff,
bench/results/gpu_suite_h100_bb561ff), so only the product of each call's own operands can be held to a bound."""

import pytest
import torch

from fxglm5.compiler import act_quant_ops
from fxglm5.lowering.reference.fp8 import fp8_linear
from fxglm5.lowering.triton import fp8_gemm_hopper
from fxglm5.model.config import Glm5Config
from fxglm5.runtime.runner import Runner
from tests.helpers import random_model

pytestmark = pytest.mark.gpu
# the tiny-tp widths give the Gluon kernel GEMMs whose K it takes (a multiple of 512): o_proj's 8 heads x 128 and the
# down projections' 512 (the hidden size's 256 stays with the Triton kernel)
CONFIG = Glm5Config.preset("tiny-tp")
PROMPT_TOKENS = fp8_gemm_hopper.MIN_M + 88


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the Gluon GEMM is sm_90's")
def test_w8a8_prefill_runs_the_gluon_gemm_and_each_call_gives_the_reference_w8a8_product(monkeypatch):
    model = random_model(CONFIG, torch.bfloat16).cuda()
    prompt = torch.randint(0, CONFIG.vocab_size, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(0)).tolist()
    checked = []
    launch = fp8_gemm_hopper.launch

    def compared(a, a_s, weight, weight_scale_inv, bias, out, config=None):
        result = launch(a, a_s, weight, weight_scale_inv, bias, out, config)
        m, k = a.shape
        x = (a.float().view(m, k // 128, 128) * a_s[:, :, None]).view(m, k)  # what the kernel multiplies
        want = fp8_linear(x, weight, weight_scale_inv, None if bias is None else bias.float(), act_quant=False)
        checked.append((tuple(weight.shape), ((out.float() - want).abs().max() / want.abs().max()).item()))
        return result

    monkeypatch.setattr(fp8_gemm_hopper, "launch", compared)
    calls = {}
    for name, options in {"w8a8": dict(act_quant=True), "reference": dict(act_quant=True, backend="reference"),
                          "w8a16": dict(act_quant=False)}.items():
        runner = Runner(model, kv_cache="bf16", block_size=64, max_cache_tokens=2048, device="cuda", keep_logits=True,
                        decode_graphs=False, **options)
        assert all(quant is options["act_quant"] for _, quant in act_quant_ops(runner.program.graph))
        checked.clear()
        logits = runner.run([list(prompt)], 1)[0].logits[0].float()
        assert torch.isfinite(logits).all(), name
        calls[name] = list(checked)
    assert len(calls["w8a8"]) > 0 and calls["w8a16"] == calls["reference"] == []
    assert CONFIG.num_attention_heads * CONFIG.v_head_dim in {shape[1] for shape, _ in calls["w8a8"]}  # o_proj
    worst = max(calls["w8a8"], key=lambda c: c[1])
    assert worst[1] < 1e-2, worst
