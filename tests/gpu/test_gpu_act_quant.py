"""W8A8 through the Runner on Hopper (``RunnerOptions(act_quant=True)``): a prefill of more than
``fp8_gemm_hopper.MIN_M`` rows runs the warp-specialized Gluon GEMM, which the default W8A16 prefill never does, and
gives the logits of the same W8A8 program on the reference backend (the torch W8A8 math) to bf16 rounding."""

import pytest
import torch

from fxglm5.compiler import act_quant_ops
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
def test_w8a8_prefill_runs_the_gluon_gemm_and_gives_the_reference_w8a8_logits(monkeypatch):
    model = random_model(CONFIG, torch.bfloat16).cuda()
    prompt = torch.randint(0, CONFIG.vocab_size, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(0)).tolist()
    launches = []
    launch = fp8_gemm_hopper.launch

    def counted(*args, **kwargs):
        launches.append(args[2].shape)
        return launch(*args, **kwargs)

    monkeypatch.setattr(fp8_gemm_hopper, "launch", counted)
    logits, gluon = {}, {}
    for name, options in {"w8a8": dict(act_quant=True), "reference": dict(act_quant=True, backend="reference"),
                          "w8a16": dict(act_quant=False)}.items():
        runner = Runner(model, kv_cache="bf16", block_size=64, max_cache_tokens=2048, device="cuda", keep_logits=True,
                        decode_graphs=False, **options)
        assert all(quant is options["act_quant"] for _, quant in act_quant_ops(runner.program.graph))
        launches.clear()
        logits[name] = runner.run([list(prompt)], 1)[0].logits[0].float()
        gluon[name] = len(launches)
    assert gluon["w8a8"] > 0 and gluon["w8a16"] == gluon["reference"] == 0
    scale = logits["reference"].abs().max().item()
    err = (logits["w8a8"] - logits["reference"]).abs().max().item() / scale
    assert err < 2e-2, err
