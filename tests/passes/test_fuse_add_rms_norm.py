"""fuse_add_rms_norm: rms_norm(a + b) -> fxglm5::add_rms_norm, the sum its second output (tests/passes/template.py's
checks; near misses: a scaled add, a broadcast add; and the expected count on a paged and an unpaged graph)."""

import torch
from torch import nn

from fxglm5.compiler import compile_model
from fxglm5.model.config import Glm5Config
from fxglm5.model.modeling import Glm5ForCausalLM
from tests.helpers import randomize_
from tests.passes.template import PassTemplate, export_small, small_dims

# 7 per tiny model: both sums of layers 1-3, the attention's of layer 0 (the paged final norm reads sampled rows)
SEVEN = {"aten.add": -7, "fxglm5.add_rms_norm": 7, "fxglm5.rms_norm": -7, "getitem": 14}


class Residual(nn.Module):
    """``h = x + y``, ``norm(h)`` and ``h`` itself (the residual); ``variant``: the add scaled by alpha=2 ("alpha") or
    of a [D] vector broadcast over the rows ("broadcast"), near misses."""

    def __init__(self, dim=64, variant=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(dim), requires_grad=False)
        self.variant = variant

    def forward(self, x, y):
        if self.variant == "alpha":
            h = torch.add(x, y, alpha=2)
        elif self.variant == "broadcast":
            h = x + self.bias
        else:
            h = x + y
        return torch.ops.fxglm5.rms_norm(h, self.weight, 1e-6) * 3 + h


def _xy(batch=2, seq=5):
    gen = torch.Generator().manual_seed(batch * seq)
    return torch.randn(batch, seq, 64, generator=gen), torch.randn(batch, seq, 64, generator=gen)


class TestFuseAddRmsNorm(PassTemplate):
    name = "fuse_add_rms_norm"
    matches = {"fp8": 7, "shared": 7, "bf16": 7, "bf16ckpt": 7}
    ops = {"fp8": SEVEN, "shared": SEVEN, "bf16": SEVEN}
    near_misses = ("alpha", "broadcast")

    def near_miss(self, case):
        module = randomize_(Residual(variant=case))
        return export_small(module, _xy()), module, _xy(3, 7), None

    def reexport(self):
        example = _xy()
        return export_small(randomize_(Residual()), example), example, small_dims(example), _xy(3, 7), None


def test_expected_on_the_paged_and_the_unpaged_graph():
    """Strict compiles agree with the model's count: 2 per layer, the first layer's input norm not; the final norm
    too where it reads the last sum (no cache stage: the rows are not selected before it)."""
    cfg = Glm5Config.preset("tiny")
    model = Glm5ForCausalLM(cfg, dtype=torch.bfloat16, device="meta")
    paged = {r.name: r for r in compile_model(model, strict=True, device="cpu").results}["fuse_add_rms_norm"]
    assert (paged.num_matches, paged.expected) == (7, 7)
    unpaged = compile_model(model, strict=True, device="cpu", stages=("match", "fuse", "fuse_kernels")).results
    assert [(r.num_matches, r.expected) for r in unpaged if r.name == "fuse_add_rms_norm"] == [(8, 8)]
