"""fuse_shared_input_gemms: the FP8 GEMMs that read one activation become one GEMM over stacked weights.

Checked against the same graph lowered without the pass (the pass disabled): exact match counts in strict
mode, the fused graph's outputs and cache writes bitwise equal (the reference GEMM in float32, act_quant on
and off), GLM-5's attention shapes (kv_a's 4.5 blocks), the recipe the torch.compile backend's rebind derives
another layer's stacked weights from, and the near-misses left alone (another input, a bias, a plain weight).
"""

import copy
import itertools
import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence
from torch.export import Dim

from fxglm5.backend import rebind
from fxglm5.capture import capture, export_graph
from fxglm5.lowering.reference.paged import slots_from_positions
from fxglm5.model.config import Glm5Config
from fxglm5.model.layers import Linear
from fxglm5.passes import PIPELINE, REGISTRY, PassContext, PassManager, Stage, op_histogram, run_pipeline
from tests.helpers import random_model, randomize_

PASS = "fuse_shared_input_gemms"
FP8_LINEAR = "fxglm5.fp8_linear"
# the stage's other fusions, off: this file compares the graph with and without this one
OTHERS = tuple(name for name in PIPELINE[Stage.FUSE_KERNELS] if name != PASS)
STAGES = ("fuse_kernels", "lower")


@pytest.fixture(scope="module")
def tiny_cached():
    """The tiny FP8 GLM-5 (float32 compute) through match, fuse and cache: what the lower stage receives."""
    cfg = Glm5Config.preset("tiny")
    model = random_model(cfg, torch.float32)
    gm = capture(model)
    run_pipeline(gm, PassContext(config=cfg, strict=True), stages=("match", "fuse", "cache"))
    return cfg, gm


def _step_inputs(cfg, lengths=(11, 4, 7), block=4):
    """Flat prefill tokens of three requests over a paged cache, and fresh zero caches for the tiny model."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (sum(lengths),), generator=gen)
    req = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.cat([torch.arange(n) for n in lengths])
    blocks = [-(-n // block) for n in lengths]  # request i's blocks follow request i-1's, from block 1
    firsts = list(itertools.accumulate(blocks, initial=1))
    table = pad_sequence([torch.arange(f, f + n) for f, n in zip(firsts, blocks)], batch_first=True)
    start = firsts[-1]
    args = (ids[None], pos[None], slots_from_positions(table, req, pos, block), table, req, torch.arange(len(req)))
    return args, lambda: [torch.zeros(start, block, 576 if i % 2 == 0 else 128) for i in range(8)]


@pytest.mark.parametrize("act_quant", [False, True], ids=["w8a16", "w8a8"])
def test_tiny_model_counts_and_bitwise_outputs(tiny_cached, act_quant):
    cfg, cached = tiny_cached
    unfused, fused = copy.deepcopy(cached), copy.deepcopy(cached)
    run_pipeline(unfused, PassContext(config=cfg, strict=True, act_quant=act_quant, disabled=(PASS, *OTHERS)),
                 stages=STAGES)
    result, _, lowered = run_pipeline(fused, PassContext(config=cfg, strict=True, act_quant=act_quant, disabled=OTHERS),
                                   stages=STAGES)
    # per layer: q_a + kv_a + wk, q_b + wq_b, gate + up: 3 groups of 7 GEMMs, 4 layers
    assert (result.name, result.num_matches, result.expected, result.details) == (PASS, 12, 12, {"gemms": 28})
    assert op_histogram(unfused)[FP8_LINEAR] == 36 and op_histogram(fused)[FP8_LINEAR] == 36 - 28 + 12
    assert "fp8_linear:reference x20" in lowered.details["ops"]
    # the members' weights leave the graph: it holds one copy of the weights, not the stacked and the separate ones
    def weight_bytes(gm):
        return sum(t.numel() * t.element_size() for t in (*gm.parameters(), *gm.buffers()))
    stacked = weight_bytes(fused) - weight_bytes(unfused)
    assert not any(".q_a_proj." in name or ".gate_proj." in name for name, _ in fused.named_parameters())
    assert 0 <= stacked < 0.02 * weight_bytes(unfused)  # only the zero rows padding kv_a to whole 128-row blocks
    args, caches = _step_inputs(cfg)
    want_caches, got_caches = caches(), caches()
    want, got = unfused(*args, *want_caches), fused(*args, *got_caches)
    assert torch.equal(got, want)  # bitwise: each output column is the same fp32 dot product
    assert all(torch.equal(a, b) for a, b in zip(got_caches, want_caches))


def test_strict_mode_counts_a_missing_group(tiny_cached):
    """One group fewer than the model has (a member given a bias) is an error in strict mode."""
    cfg, cached = tiny_cached
    gm = copy.deepcopy(cached)
    readers = {}
    for n in gm.graph.nodes:
        if n.target is torch.ops.fxglm5.fp8_linear.default:
            readers.setdefault(n.args[0], []).append(n)
    node = next(group for group in readers.values() if len(group) == 2)[0]  # a gate / up pair
    node.args = (*node.args[:3], node.args[0], node.args[4])  # any tensor as a bias: the pass must skip it
    with pytest.raises(Exception, match="fuse_shared_input_gemms: found 11 matches, the model needs 12"):
        run_pipeline(gm, PassContext(config=cfg, strict=True, disabled=OTHERS), stages=STAGES)


class AttentionInput(nn.Module):
    """GLM-5's projections of the attention input: q_a, kv_a (576 rows: 4.5 blocks), the indexer's wk, and
    weights_proj (float32, never quantized, on x.float())."""

    def __init__(self, hidden=6144, sizes=(2048, 576, 128), heads=32):
        super().__init__()
        self.q_a, self.kv_a, self.wk = (Linear(hidden, n, True, torch.float32) for n in sizes)
        self.weights_proj = Linear(hidden, heads, False, torch.float32)

    def forward(self, x):
        return self.q_a(x).sum(-1) + self.kv_a(x)[..., :64].sum(-1), self.wk(x), self.weights_proj(x.float())


def _fused_graph(module, x, act_quant=False):
    gm = export_graph(module, (torch.zeros(2, 3, x.shape[-1]),), ({0: Dim("b", max=64), 1: Dim("s", max=4096)},))
    run_pipeline(gm, PassContext(act_quant=act_quant), stages=("fuse",))
    unfused = copy.deepcopy(gm)
    result = PassManager(PassContext(act_quant=act_quant), stages=("fuse_kernels",)).run_one(gm, REGISTRY[PASS])
    return unfused, gm, result


@pytest.mark.parametrize("act_quant", [False, True], ids=["w8a16", "w8a8"])
def test_glm5_attention_shapes(act_quant):
    module = randomize_(AttentionInput(), seed=1)
    x = torch.randn(2, 5, 6144)
    unfused, fused, result = _fused_graph(module, x, act_quant)
    assert (result.num_matches, result.details) == (1, {"gemms": 3})
    ops = op_histogram(fused)
    assert ops[FP8_LINEAR] == 1 and ops["aten.linear"] == 1  # weights_proj stays a float32 linear
    (node,) = [n for n in fused.graph.nodes if n.target is torch.ops.fxglm5.fp8_linear.default]
    weight, scale = (fused.get_buffer(a.target) for a in node.args[1:3])
    # q_a (16 blocks), wk (1 block), kv_a last: its short edge block needs no padding rows
    assert weight.shape == (2048 + 128 + 576, 6144) and scale.shape == (16 + 1 + 5, 48)
    assert torch.equal(scale, torch.cat([module.q_a.weight_scale_inv, module.wk.weight_scale_inv,
                                         module.kv_a.weight_scale_inv]))
    for got, want in zip(fused(x), unfused(x)):
        assert torch.equal(got, want)


def _as_buffers(module: nn.Module) -> nn.Module:
    """Parameters as buffers, as the backend holds Dynamo's weight inputs (rebind registers buffers)."""
    for sub in module.modules():
        for name, p in list(sub.named_parameters(recurse=False)):
            delattr(sub, name)
            sub.register_buffer(name, p.data)
    return module


def test_rebind_derives_the_stacked_weights_of_other_layers():
    """The torch.compile backend hands one lowered graph another layer's weights: the stacked constants come
    from those, through the recipe the pass recorded (tiny widths: kv_a 160 rows padded to 256, wk 64 last)."""
    module = _as_buffers(randomize_(AttentionInput(hidden=256, sizes=(128, 160, 64), heads=4), seed=2))
    x = torch.randn(3, 2, 256)
    unfused, fused, _ = _fused_graph(module, x)
    other = _as_buffers(randomize_(AttentionInput(hidden=256, sizes=(128, 160, 64), heads=4), seed=3))
    weights = dict(other.named_buffers())
    got, want = rebind(fused, weights)(x), rebind(unfused, weights)(x)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not all(torch.equal(a, b) for a, b in zip(got, fused(x)))  # the other layer's weights were used


class NearMisses(nn.Module):
    """Pairs that must stay apart: FP8 GEMMs on different inputs, an FP8 GEMM beside a plain one on one input,
    and an FP8 GEMM beside one with a bias."""

    def __init__(self, hidden=256):
        super().__init__()
        self.a, self.b, self.c, self.d, self.e = (Linear(hidden, 128, True, torch.float32) for _ in range(5))
        self.plain = Linear(hidden, 128, False, torch.float32)
        self.bias = nn.Parameter(torch.zeros(128), requires_grad=False)

    def forward(self, x):
        y = x * 2
        biased = F.linear(y, self.e.dequantized_weight(y.dtype), self.bias)
        return self.a(x) + self.b(x * 3), self.c(x + 1) + self.plain(x + 1), self.d(y) + biased


def test_near_misses_are_left_alone():
    module = randomize_(NearMisses(), seed=4)
    x = torch.randn(2, 3, 256)
    unfused, fused, result = _fused_graph(module, x)
    assert result.num_matches == 0 and op_histogram(fused) == op_histogram(unfused)
    assert op_histogram(fused)[FP8_LINEAR] == 5
    for got, want in zip(fused(x), module(x)):
        torch.testing.assert_close(got, want)


class ThreeOnOneInput(nn.Module):
    """Three FP8 GEMMs reading one activation (q_a, kv_a, wk's shapes at tiny widths)."""

    def __init__(self, hidden=256):
        super().__init__()
        self.a, self.b, self.c = (Linear(hidden, n, True, torch.float32) for n in (128, 160, 64))

    def forward(self, x):
        return self.a(x), self.b(x), self.c(x)


def test_a_member_with_another_act_quant_stays_out_of_the_group():
    """A GEMM that quantizes its activation (W8A8) beside two that do not, on one input, is no member of their
    group: the stacked GEMM has one act_quant for all its columns, so fusing it would change its answers. The other
    two are fused; every output is what the graph gave before."""
    module = randomize_(ThreeOnOneInput(), seed=5)
    x = torch.randn(2, 3, 256)
    gm = export_graph(module, (torch.zeros(2, 3, 256),), ({0: Dim("b", max=64), 1: Dim("s", max=4096)},))
    run_pipeline(gm, PassContext(), stages=("fuse",))
    gemms = [n for n in gm.graph.nodes if n.target is torch.ops.fxglm5.fp8_linear.default]
    assert len(gemms) == 3 and all(n.args[4] is False for n in gemms)
    gemms[1].args = (*gemms[1].args[:4], True)  # kv_a's shape, W8A8
    gm.recompile()
    unfused = copy.deepcopy(gm)
    result = PassManager(PassContext(), stages=("fuse_kernels",)).run_one(gm, REGISTRY[PASS])
    assert (result.num_matches, result.details) == (1, {"gemms": 2})
    left = [n for n in gm.graph.nodes if n.target is torch.ops.fxglm5.fp8_linear.default]
    assert sorted(n.args[4] for n in left) == [False, True]
    alone = next(n for n in left if n.args[4])
    assert operator.attrgetter(alone.args[1].target)(gm).shape == (160, 256)  # the W8A8 GEMM over its own weight
    for got, want in zip(gm(x), unfused(x)):
        assert torch.equal(got, want)
