"""The eager MoE reads its experts in bounded memory (issue 49): run expert by expert, it equals the dense form the
compiler captures, and no temporary it makes grows with the number of experts. At GLM-5's widths the dense form's
float32 dequantization of every expert's gate|up is a 24 GiB temporary, which put the eager oracle out of memory
beside a runner's cache on an 80 GB card."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fxglm5.model.config import Glm5Config
from fxglm5.model.moe import MoE
from tests.helpers import random_model, randomize_


class LargestTemporary(TorchDispatchMode):
    """The largest tensor (bytes) any op returns while the mode is on."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.bytes = max(self.bytes, t.numel() * t.element_size())
        return out


def many_experts(fp8: bool) -> Glm5Config:
    base = Glm5Config.preset("tiny")
    return base.replace(n_routed_experts=64, num_experts_per_tok=4, n_group=1, topk_group=1,
                        quantization_config=base.quantization_config if fp8 else None)


def largest_temporary(fn) -> int:
    with torch.no_grad(), LargestTemporary() as mode:
        fn()
    return mode.bytes


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16-weights"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_by_expert_equals_the_dense_form(fp8, dtype):
    cfg = many_experts(fp8)
    moe = randomize_(MoE(cfg, dtype)).eval()
    x = torch.randn(37, cfg.hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype)
    logits = torch.nn.functional.linear(x.float(), moe.gate.weight)
    weights, ids = torch.topk(logits.sigmoid(), cfg.num_experts_per_tok, dim=-1)
    routing = torch.zeros_like(logits).scatter(1, ids, weights)
    routing[5] = 0.0  # a token routed nowhere gets exactly zero
    with torch.no_grad():
        dense, by_expert = moe.experts.dense(x, routing), moe.experts.by_expert(x, routing)
        eager = moe.experts(x, routing)
    assert torch.equal(eager, by_expert)
    assert torch.equal(by_expert[5], torch.zeros_like(by_expert[5]))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert ((by_expert.float() - dense.float()).norm() / dense.float().norm()).item() < tol
    assert len(ids.unique()) > 16  # many experts took part, each through its own weights


def test_the_eager_moe_makes_no_temporary_that_grows_with_the_experts():
    cfg = many_experts(fp8=True)
    moe = randomize_(MoE(cfg, torch.float32)).eval()
    tokens, h, i = 6, cfg.hidden_size, cfg.moe_intermediate_size
    x = torch.randn(1, tokens, h)
    # One expert's float32 gate|up dequantization (its padded block view included) bounds it; the rest are
    # [tokens, H] or [tokens, E] sized.
    bound = 2 * i * h * 4 + 2 * tokens * (h + 2 * i + cfg.n_routed_experts) * 4
    every_expert = cfg.n_routed_experts * 2 * i * h * 4
    assert bound < every_expert / 8
    assert largest_temporary(lambda: moe(x)) <= bound
    flat = x.reshape(tokens, h)
    routing = torch.zeros(tokens, cfg.n_routed_experts).scatter(1, torch.arange(tokens)[:, None], 1.0)
    assert largest_temporary(lambda: moe.experts.dense(flat, routing)) >= every_expert  # the check sees the dense form


def test_the_eager_model_forward_never_holds_every_expert_dequantized():
    cfg = many_experts(fp8=True)
    model = random_model(cfg)
    every_expert = cfg.n_routed_experts * 2 * cfg.moe_intermediate_size * cfg.hidden_size * 4
    ids = torch.randint(0, cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    assert largest_temporary(lambda: model(ids)) < every_expert / 8
