"""The MTP layer's paged graph on the GPU (Triton kernels, bf16): its logits and hidden_out over a prefill and
decode steps against the eager Glm5MTP on the same GPU."""

import pytest
import torch

from fxglm5.compiler import compile_mtp
from fxglm5.model.modeling import Glm5ForCausalLM
from fxglm5.model.tiny import make_tiny_checkpoint
from tests.frontdoors.test_mtp_compile import IDS, run_paged

pytestmark = pytest.mark.gpu


def test_paged_mtp_graph_on_the_gpu(tmp_path):
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", fp8=True)
    model = Glm5ForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, device="cuda", progress=False, mtp=True)
    compiled = compile_mtp(model, strict=True, max_tokens=64, device="cuda")
    assert compiled.results[-1].details["backends"].startswith("triton")
    ids = torch.tensor([IDS], device="cuda")
    with torch.no_grad():
        _, hidden = model(ids, return_hidden=True)
        tokens, h = ids[:, 1:], hidden[:, :-1]
        ref_logits, ref_hidden = model.mtp(tokens, torch.arange(tokens.shape[1], device="cuda")[None], h)
        logits, out = run_paged(compiled.program, model, tokens, h)
    for got, ref in ((logits, ref_logits), (out, ref_hidden)):
        cos = torch.nn.functional.cosine_similarity(got.float(), ref.float(), dim=-1)
        assert got.shape == ref.shape and cos.min() > 0.99, cos
