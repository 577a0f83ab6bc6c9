"""fuse_add_rms_norm_into_gemm: fp8_linear(add_rms_norm(x, r)[0]) -> fxglm5::add_rms_norm_fp8_linear
(tests/passes/template.py's checks; near misses: a norm of no sum, normed rows that feed a MoE, normed rows two GEMMs
of different act_quant read), the normed rows kept for their other reader, the op's reference against the chain, and
the expected count on a paged and an unpaged graph (the Triton op against its two launches:
tests/kernels/test_kernels_fused.py)."""

import copy

import pytest
import torch
from torch import nn

from fxglm5.compiler import compile_model
from fxglm5.model.config import Glm5Config
from fxglm5.model.layers import Linear
from fxglm5.model.modeling import Glm5ForCausalLM
from fxglm5.model.moe import MoE
from fxglm5.passes import PIPELINE, REGISTRY, PassContext, PassManager, Stage, run_pipeline
from fxglm5.passes.graph_utils import is_op, set_op_args
from tests.helpers import randomize_
from tests.passes.template import PassTemplate, export_small, small_dims

PASS = "fuse_add_rms_norm_into_gemm"
# per tiny FP8 model: the attention's input norm of layers 1-3 and the dense layer 0's MLP norm; the fused op's
# normed output is kept (a third getitem) where the layer's indexer head weights read it too (every layer with its own
# indexer: 1-3 in "fp8", layer 2 in "shared")
FOUR = {"fxglm5.add_rms_norm": -4, "fxglm5.add_rms_norm_fp8_linear": 4, "fxglm5.fp8_linear": -4}
CFG = Glm5Config.preset("tiny").replace(hidden_size=256, n_routed_experts=8, num_experts_per_tok=2)
BEFORE = PIPELINE[Stage.FUSE_KERNELS][:PIPELINE[Stage.FUSE_KERNELS].index(PASS)]


class NormedInput(nn.Module):
    """``h = x + y`` normalized and read by two FP8 GEMMs (stacked into one by fuse_shared_input_gemms), plus a third
    reader of the normed rows and ``h`` itself (the residual); ``variant`` makes a near miss: a norm of x alone
    ("no_sum") or the normed rows fed to a MoE layer ("moe": one without a shared expert, whose norm
    fuse_add_rms_norm_into_moe leaves to this pass; with one, that pass takes the norm first)."""

    def __init__(self, variant=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(CFG.hidden_size), requires_grad=False)
        self.a, self.b = (Linear(CFG.hidden_size, n, True, torch.float32) for n in (128, 72))
        self.moe = MoE(CFG.replace(n_shared_experts=0), torch.float32) if variant == "moe" else None
        self.variant = variant

    def forward(self, x, y):
        h = x if self.variant == "no_sum" else x + y
        normed = torch.ops.fxglm5.rms_norm(h, self.weight, 1e-6)
        if self.moe is not None:
            return self.moe(normed) + h
        a, b = self.a(normed), self.b(normed)
        return torch.cat([a, b, normed.sum(-1, keepdim=True)], -1) + h[..., :201]


def _xy(batch=2, seq=5):
    gen = torch.Generator().manual_seed(batch * seq)
    return tuple(torch.randn(batch, seq, CFG.hidden_size, generator=gen) for _ in range(2))


def fused_graph(module, act_quant_of_b=None):
    """``module``'s graph as this pass receives it: through the fuse stage (its linears FP8 GEMMs, its experts the
    MoE op) and the fuse_kernels passes before this one (the GEMMs of one input stacked, the add and norm one op);
    ``act_quant_of_b``: GEMM b's act_quant set to it first (then a and b are not stacked)."""
    gm = export_small(module, _xy())
    run_pipeline(gm, PassContext(config=CFG), stages=("fuse",))
    if act_quant_of_b is not None:
        gemms = [n for n in gm.graph.nodes if is_op(n, torch.ops.fxglm5.fp8_linear.default)]
        set_op_args(gemms[-1], act_quant=act_quant_of_b)
    manager = PassManager(PassContext(config=CFG), stages=("fuse_kernels",))
    for name in BEFORE:
        manager.run_one(gm, REGISTRY[name])
    return gm


class TestFuseAddRmsNormIntoGemm(PassTemplate):
    name = PASS
    matches = {"fp8": 4, "shared": 4, "bf16": 4, "bf16ckpt": 0}
    ops = {"fp8": {**FOUR, "getitem": 3}, "shared": {**FOUR, "getitem": 1}, "bf16": {**FOUR, "getitem": 3},
           "bf16ckpt": {}}
    near_misses = ("no_sum", "moe", "two_gemms")

    def near_miss(self, case):
        if case == "two_gemms":  # W8A8 b beside W8A16 a: two GEMMs of the normed rows, the graph is the reference
            gm = fused_graph(randomize_(NormedInput()), act_quant_of_b=True)
            assert sum(is_op(n, torch.ops.fxglm5.fp8_linear.default) for n in gm.graph.nodes) == 2
            return gm, copy.deepcopy(gm), _xy(3, 7), CFG
        module = randomize_(NormedInput(case))
        gm = fused_graph(module)
        ops = {n.target for n in gm.graph.nodes}  # what the passes before this one make of it: the near pattern
        assert (torch.ops.fxglm5.add_rms_norm.default in ops) == (case != "no_sum")
        return gm, module, _xy(3, 7), CFG

    def reexport(self):
        example = _xy()
        return fused_graph(randomize_(NormedInput())), example, small_dims(example), _xy(3, 7), CFG


def test_the_normed_rows_are_kept_for_their_other_reader():
    """The stacked GEMM's input is also summed by another op: the fused op keeps the normed rows (keep_normed) and
    that op reads them from it; the sum's reader reads its second output; nothing of the chain is left."""
    gm = fused_graph(randomize_(NormedInput()))
    manager = PassManager(PassContext(config=CFG), stages=("fuse_kernels",))
    assert manager.run_one(gm, REGISTRY[PASS]).num_matches == 1
    fused = next(n for n in gm.graph.nodes if is_op(n, torch.ops.fxglm5.add_rms_norm_fp8_linear.default))
    assert fused.args[-1] is True
    outputs = {user.args[1]: user for user in fused.users}
    assert sorted(outputs) == [0, 1, 2]
    assert [u.target for u in outputs[2].users] == [torch.ops.aten.sum.dim_IntList]
    assert not any(is_op(n, torch.ops.fxglm5.add_rms_norm.default, torch.ops.fxglm5.fp8_linear.default)
                   for n in gm.graph.nodes)


@pytest.mark.parametrize("act_quant", [False, True])
@pytest.mark.parametrize("keep_normed", [False, True])
def test_the_reference_is_the_chain_it_replaces(act_quant, keep_normed):
    """add_rms_norm_fp8_linear's reference: add_rms_norm, then fp8_linear of its normed rows, the ops of the graph
    before the pass, bit for bit; the normed rows returned where kept, else an empty [..., 0]."""
    g = torch.Generator().manual_seed(1)
    x, r = (torch.randn(2, 3, 256, generator=g).to(torch.bfloat16) for _ in range(2))
    nw = (1 + 0.1 * torch.randn(256, generator=g)).to(torch.bfloat16)
    w = (torch.randn(200, 256, generator=g) * 0.5).to(torch.float8_e4m3fn)
    s = torch.rand(2, 2, generator=g) * 0.02 + 0.005
    normed, total = torch.ops.fxglm5.add_rms_norm(x, r, nw, 1e-6)
    chain = torch.ops.fxglm5.fp8_linear(normed, w, s, None, act_quant)
    out, fused_total, kept = torch.ops.fxglm5.add_rms_norm_fp8_linear(x, r, nw, 1e-6, w, s, None, act_quant,
                                                                      keep_normed)
    assert torch.equal(out, chain) and torch.equal(fused_total, total)
    assert torch.equal(kept, normed) if keep_normed else kept.shape == (2, 3, 0)


def test_expected_on_the_paged_and_the_unpaged_graph():
    """Strict compiles agree with the model's count, paged or not (the final norm's GEMM is the bf16 lm_head, not an
    fp8_linear): 4 in the tiny model; none in a bf16 checkpoint."""
    for cfg, want in ((Glm5Config.preset("tiny"), 4), (Glm5Config.preset("tiny").replace(quantization_config=None), 0)):
        model = Glm5ForCausalLM(cfg, dtype=torch.bfloat16, device="meta")
        for stages in (None, ("match", "fuse", "fuse_kernels")):
            options = {} if stages is None else dict(stages=stages)
            results = compile_model(model, strict=True, device="cpu", **options).results
            assert [(r.num_matches, r.expected) for r in results if r.name == PASS] == [(want, want)]
