"""Property tests for every pass over random small configs, plus the near-misses each must leave alone.

Each example: build a small module in the generic form -> export with dynamic batch/seq -> run one
pass -> exact match count, generic ops gone, outputs equal the unrewritten graph; a near-miss variant
(another scale, an extra bias, no causal mask, a different top-k, a wrong block scale, gate|up blocked as
one weight, another router)
gets zero matches and still computes the right answer.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.export import Dim

from fxglm5.capture import export_graph
from fxglm5.model.attention import MLAAttention, naive_mla
from fxglm5.model.config import Glm5Config
from fxglm5.model.layers import Linear, dequantize_weight, rope_cos_sin
from fxglm5.model.moe import MoE, StackedExperts
from fxglm5.passes import REGISTRY, PassContext, PassManager, op_histogram
from tests.helpers import randomize_, rel_err

DIMS = {0: Dim("batch", min=1, max=16), 1: Dim("seq", min=1, max=512)}
# every example exports its module: half the profile's examples (4 in CI, 50 with HYPOTHESIS_PROFILE=local)
exporting = settings(max_examples=max(3, settings.default.max_examples // 2))


def run_pass(name, module, args, cfg=None):
    """Export ``module(*args)`` (every arg dynamic in dims 0/1), run pass ``name``; (gm, num_matches).

    Export traces a size-2 example (a size-1 dim would be specialised), the checks run ``args``."""
    example = tuple(torch.zeros(max(a.shape[0], 2), max(a.shape[1], 2), *a.shape[2:], dtype=a.dtype) for a in args)
    gm = export_graph(module, example, tuple(DIMS for _ in args))
    result = PassManager(PassContext(config=cfg), stages=(REGISTRY[name].stage,)).run_one(gm, REGISTRY[name])
    return gm, result.num_matches


def _check_equal(gm, module, args, tol):
    out, ref = gm(*args).float(), module(*args).float()
    # A near-miss module may itself produce NaN (e.g. a selection with no causal key): same NaNs then.
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol * ref.nan_to_num().abs().max().item(), equal_nan=True)


# ---------------------------------------------------------------- MLA (dense causal) --------------
class DenseMLA(nn.Module):
    """The model's naive MLA core with a plain causal mask; ``variant`` makes a near-miss."""

    def __init__(self, heads, rank, nope, rope, v_dim, fp8, dtype, variant=None):
        super().__init__()
        self.kv_b_proj = Linear(rank, heads * (nope + v_dim), fp8, dtype)
        self.v_dim, self.variant = v_dim, variant
        self.scale = (nope + rope) ** -0.5 * (1.5 if variant == "scale" else 1.0)
        self.bias = nn.Parameter(torch.tensor([0.3], dtype=dtype), requires_grad=False)

    def forward(self, q_nope, q_pe, c_kv, k_pe):
        seq = q_nope.shape[1]
        idx = torch.arange(seq, device=q_nope.device)
        allowed = (idx[None, :] <= idx[:, None])[None]
        if self.variant == "nomask":
            allowed = torch.ones_like(allowed)
        if self.variant == "bias":
            return naive_mla_with_bias(q_nope, q_pe, c_kv, k_pe, self.kv_b_proj, allowed, self.v_dim, self.scale, self.bias)
        return naive_mla(q_nope, q_pe, c_kv, k_pe, self.kv_b_proj, allowed, self.v_dim, self.scale)


def naive_mla_with_bias(q_nope, q_pe, c_kv, k_pe, kv_b_proj, allowed, v_dim, scale, bias):
    """naive_mla with an extra additive score bias (ALiBi-like): not MLA's math."""
    bsz, seq, heads, nope = q_nope.shape
    k_nope, v = kv_b_proj(c_kv).view(bsz, seq, heads, nope + v_dim).split([nope, v_dim], dim=-1)
    query = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2)
    key = torch.cat([k_nope, k_pe.expand(bsz, seq, heads, k_pe.shape[-1])], dim=-1).transpose(1, 2)
    scores = torch.matmul(query, key.transpose(2, 3)) * scale + bias
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q_nope.dtype)
    return torch.matmul(probs, v.transpose(1, 2)).transpose(1, 2).reshape(bsz, seq, heads * v_dim)


mla_shapes = st.fixed_dictionaries({
    "heads": st.integers(1, 4), "rank": st.sampled_from([32, 64, 160]), "nope": st.sampled_from([8, 16]),
    "rope": st.sampled_from([4, 8]), "v_dim": st.sampled_from([8, 24]), "batch": st.integers(1, 3),
    "seq": st.integers(1, 20), "fp8": st.booleans(), "dtype": st.sampled_from([torch.float32, torch.bfloat16]),
})


def _mla_inputs(p, seed=0):
    gen = torch.Generator().manual_seed(seed)
    b, s, h = p["batch"], p["seq"], p["heads"]
    shapes = [(b, s, h, p["nope"]), (b, s, h, p["rope"]), (b, s, p["rank"]), (b, s, 1, p["rope"])]
    return tuple(torch.randn(shape, generator=gen).to(p["dtype"]) for shape in shapes)


def _tol(dtype):
    return 1e-4 if dtype == torch.float32 else 3e-2


@exporting
@given(mla_shapes)
def test_match_mla_property(p):
    module = randomize_(DenseMLA(p["heads"], p["rank"], p["nope"], p["rope"], p["v_dim"], p["fp8"], p["dtype"]))
    args = _mla_inputs(p)
    gm, matches = run_pass("match_mla", module, args)
    assert matches == 1
    ops = op_histogram(gm)
    assert ops.get("fxglm5.mla") == 1 and "aten.softmax" not in ops and "aten.matmul" not in ops
    _check_equal(gm, module, args, _tol(p["dtype"]))


@exporting
@given(mla_shapes, st.sampled_from(["scale", "bias", "nomask"]))
def test_match_mla_leaves_near_misses(p, variant):
    module = randomize_(DenseMLA(p["heads"], p["rank"], p["nope"], p["rope"], p["v_dim"], p["fp8"], p["dtype"], variant))
    args = _mla_inputs(p)
    for name in ("match_mla", "match_sparse_mla"):
        gm, matches = run_pass(name, module, args)
        assert matches == 0 and "aten.softmax" in op_histogram(gm)
        _check_equal(gm, module, args, 1e-6)


# ---------------------------------------------------------------- sparse MLA + indexer -------------
class AttentionLayer(nn.Module):
    """One GLM-5 attention layer (MLA + DSA indexer, which builds its causal mask) from a config, with RoPE."""

    def __init__(self, cfg, dtype, shared=False):
        super().__init__()
        self.cfg, self.shared = cfg, shared
        self.attn = MLAAttention(cfg, 0, dtype)
        self.attn2 = MLAAttention(cfg.replace(indexer_types=["full", "shared"], num_hidden_layers=2, mlp_layer_types=None), 1, dtype) if shared else None

    def forward(self, x, positions):
        cos, sin = rope_cos_sin(positions, self.cfg.qk_rope_head_dim, self.cfg.rope_theta)
        out, selection = self.attn(x, cos, sin, None)
        if self.attn2 is not None:
            out2, _ = self.attn2(out, cos, sin, selection)
            out = out + out2
        return out


def small_cfg(p):
    return Glm5Config.preset("tiny").replace(
        hidden_size=128, num_attention_heads=p["heads"], num_key_value_heads=p["heads"], q_lora_rank=128,
        kv_lora_rank=p["rank"], qk_nope_head_dim=p["nope"], qk_rope_head_dim=p["rope"], v_head_dim=p["v_dim"],
        index_topk=p["topk"], index_head_dim=32, index_n_heads=8, num_hidden_layers=1, mlp_layer_types=None,
        indexer_types=None, quantization_config=Glm5Config.preset("tiny").quantization_config if p["fp8"] else None,
    )


sparse_shapes = mla_shapes.flatmap(lambda p: st.fixed_dictionaries({
    **{k: st.just(v) for k, v in p.items()}, "topk": st.integers(1, 8), "shared": st.booleans(),
}))


def _layer_inputs(p, cfg):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(p["batch"], p["seq"], cfg.hidden_size, generator=gen).to(p["dtype"])
    return x, torch.arange(p["seq"])[None].expand(p["batch"], -1) + 3


@exporting
@given(sparse_shapes)
def test_match_sparse_mla_property(p):
    cfg = small_cfg(p)
    module = randomize_(AttentionLayer(cfg, p["dtype"], p["shared"]))
    args = _layer_inputs(p, cfg)
    gm, matches = run_pass("match_sparse_mla", module, args, cfg)
    ops = op_histogram(gm)
    assert matches == 1 + p["shared"] and ops.get("fxglm5.sparse_mla") == matches
    assert ops.get("fxglm5.indexer_topk") == 1 and "aten.sort" not in ops and "aten.softmax" not in ops
    # float32: exact selection; bf16: the fused op's fp32 math may break a bf16 near-tie differently.
    if p["dtype"] == torch.float32:
        _check_equal(gm, module, args, 1e-4)


class OtherSortIndexer(nn.Module):
    """Near-misses of the DSA selection: the first k of an ascending sort (the bottom k), or of an unstable sort
    (ties in any order: not the tie rule of ``indexer_topk``)."""

    def __init__(self, indexer, descending, stable):
        super().__init__()
        self.inner, self.descending, self.stable = indexer, descending, stable

    def forward(self, x, q_latent, cos, sin, causal):
        idx = self.inner
        bsz, seq, _ = x.shape
        q = idx.wq_b(q_latent).view(bsz, seq, idx.n_heads, idx.head_dim)
        k = idx.k_norm(idx.wk(x)).view(bsz, seq, idx.head_dim)
        scores = (F.relu(torch.einsum("bshd,btd->bsht", q.float(), k.float()) * idx.head_dim**-0.5)
                  * (idx.weights_proj(x.float()) * idx.n_heads**-0.5)[..., None]).sum(dim=2)
        scores = scores.masked_fill(~causal, float("-inf"))
        padded = torch.cat([scores, scores.new_full((bsz, seq, idx.topk), float("-inf"))], dim=-1)
        chosen = padded.sort(dim=-1, descending=self.descending, stable=self.stable).indices[..., :idx.topk]
        return torch.zeros_like(padded, dtype=torch.bool).scatter(-1, chosen, True)[..., :seq]


@exporting
@given(sparse_shapes, st.sampled_from([(False, True), (True, False)]))
def test_match_sparse_mla_leaves_other_topk(p, order):
    cfg = small_cfg(p)
    module = randomize_(AttentionLayer(cfg, torch.float32))
    module.attn.indexer = OtherSortIndexer(module.attn.indexer, *order)
    args = _layer_inputs({**p, "dtype": torch.float32}, cfg)
    gm, matches = run_pass("match_sparse_mla", module, args, cfg)
    assert matches == 0 and "aten.sort" in op_histogram(gm)
    _check_equal(gm, module, args, 1e-6)


# ---------------------------------------------------------------- FP8 linear ------------------------
class Fp8Linears(nn.Module):
    def __init__(self, sizes, dtype, variant=None):
        super().__init__()
        self.layers = nn.ModuleList(Linear(k, n, True, dtype) for n, k in sizes)
        self.variant = variant

    def forward(self, x):
        out = []
        for layer in self.layers:
            scale = layer.weight_scale_inv
            if self.variant == "doubled":
                scale = scale * 2
            if self.variant == "transposed":
                scale = scale.t()
            w = dequantize_weight(layer.weight, scale, x.dtype)
            out.append(F.linear(x[..., : layer.in_features], w).sum(-1))
        return torch.stack(out, -1)


linear_shapes = st.fixed_dictionaries({
    "sizes": st.lists(st.tuples(st.sampled_from([64, 128, 192, 576 // 3]), st.sampled_from([128, 200, 320])), min_size=1, max_size=3),
    "batch": st.integers(1, 3), "seq": st.integers(1, 9), "dtype": st.sampled_from([torch.float32, torch.bfloat16]),
})


@exporting
@given(linear_shapes)
def test_fuse_fp8_linear_property(p):
    module = randomize_(Fp8Linears(p["sizes"], p["dtype"]))
    args = (torch.randn(p["batch"], p["seq"], 320).to(p["dtype"]),)
    gm, matches = run_pass("fuse_fp8_linear", module, args)
    ops = op_histogram(gm)
    assert matches == len(p["sizes"]) and ops.get("fxglm5.fp8_linear") == matches and "aten.linear" not in ops
    _check_equal(gm, module, args, _tol(p["dtype"]))


@exporting
@given(linear_shapes, st.sampled_from(["doubled", "transposed"]))
def test_fuse_fp8_linear_leaves_wrong_scales(p, variant):
    # A transposed scale is only wrong when the weight has several blocks each way: square 256 / 320.
    sizes = [(256 + 64 * (n % 2), 256 + 64 * (n % 2)) for n, _ in p["sizes"]] if variant == "transposed" else p["sizes"]
    module = randomize_(Fp8Linears(sizes, torch.float32, variant))
    args = (torch.randn(p["batch"], p["seq"], 320),)
    gm, matches = run_pass("fuse_fp8_linear", module, args)
    assert matches == 0 and op_histogram(gm).get("aten.linear") == len(sizes)
    _check_equal(gm, module, args, 1e-6)


# ---------------------------------------------------------------- MoE --------------------------------
moe_shapes = st.fixed_dictionaries({
    "experts": st.sampled_from([4, 8, 16]), "top_k": st.integers(1, 4), "hidden": st.sampled_from([128, 256, 200]),
    "inter": st.sampled_from([128, 24, 200]),
    "shared": st.integers(0, 1), "fp8": st.booleans(), "tokens": st.integers(1, 12),
    "dtype": st.sampled_from([torch.float32, torch.bfloat16]), "norm": st.booleans(),
})


def moe_cfg(p):
    base = Glm5Config.preset("tiny")
    return base.replace(
        hidden_size=p["hidden"], moe_intermediate_size=p["inter"], n_routed_experts=p["experts"],
        num_experts_per_tok=min(p["top_k"], p["experts"]),
        n_shared_experts=p["shared"], norm_topk_prob=p["norm"],
        quantization_config=base.quantization_config if p["fp8"] else None,
    )


class SoftmaxRouterMoE(MoE):
    """Near-miss: softmax scoring instead of GLM-5's sigmoid + correction bias."""

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        logits = F.linear(flat.float(), self.gate.weight.float())
        weights, ids = logits.softmax(-1).topk(self.cfg.num_experts_per_tok, dim=-1)
        return self.experts(flat, torch.zeros_like(logits).scatter(1, ids, weights)).view(x.shape)


@exporting
@given(moe_shapes)
def test_fuse_fp8_moe_property(p):
    cfg = moe_cfg(p)
    module = randomize_(MoE(cfg, p["dtype"]))
    args = (torch.randn(1, p["tokens"], p["hidden"]).to(p["dtype"]),)
    gm, matches = run_pass("fuse_fp8_moe", module, args, cfg)
    ops = op_histogram(gm)
    assert matches == 1 and ops.get("fxglm5.moe_fp8") == 1 and ops.get("fxglm5.moe_route") == 1
    assert "aten.einsum" not in ops and "aten.sigmoid" not in ops
    if p["dtype"] == torch.float32:
        _check_equal(gm, module, args, 1e-4)


class OnePieceGateUp(StackedExperts):
    """Near-miss: gate|up dequantized as one [2I, H] weight. With I = 200 its scales have the shape of the
    per-half ones (ceil(400/128) = 2 * ceil(200/128)), but the up half's first rows take the gate's last block."""

    def weights(self, dtype):
        return (dequantize_weight(self.gate_up_proj, self.gate_up_proj_scale_inv, dtype),
                dequantize_weight(self.down_proj, self.down_proj_scale_inv, dtype))


def test_fuse_fp8_moe_leaves_one_piece_gate_up():
    p = dict(experts=8, top_k=2, hidden=256, inter=200, shared=0, fp8=True, tokens=5, dtype=torch.float32, norm=True)
    cfg = moe_cfg(p)
    module = MoE(cfg, torch.float32)
    module.experts = OnePieceGateUp(cfg, torch.float32)
    module = randomize_(module)
    args = (torch.randn(1, p["tokens"], p["hidden"]),)
    gm, matches = run_pass("fuse_fp8_moe", module, args, cfg)
    assert matches == 0 and "aten.einsum" in op_histogram(gm)
    _check_equal(gm, module, args, 1e-6)


@pytest.mark.parametrize("inter,hidden,experts", [(2048, 6144, StackedExperts), (2048 - 64, 6144 + 64, StackedExperts),
                                                   (2048 - 64, 6144 + 64, OnePieceGateUp)])
def test_fuse_fp8_moe_glm5_size_experts(inter, hidden, experts):
    """GLM-5-size stacked experts (on the meta device; too large to probe) are judged by their size-free
    structure, verified on the model's own dequantize_gate_up at a small shape of the same divisibility
    by 128: accepted at GLM-5's widths and at partial-block ones, the one-piece near-miss refused."""
    cfg = Glm5Config.preset("glm5").replace(moe_intermediate_size=inter, hidden_size=hidden)
    module = MoE(cfg, torch.bfloat16, device="meta")
    module.experts = experts(cfg, torch.bfloat16, device="meta")
    example = (torch.zeros(2, 3, hidden, dtype=torch.bfloat16, device="meta"),)
    gm = export_graph(module, example, (DIMS,))
    result = PassManager(PassContext(config=cfg), stages=("fuse",)).run_one(gm, REGISTRY["fuse_fp8_moe"])
    assert result.num_matches == (experts is StackedExperts)
    if result.num_matches:
        fused = next(n for n in gm.graph.nodes if n.target is torch.ops.fxglm5.moe_fp8.default)
        assert tuple(fused.args[4].meta["val"].shape) == (256, 2 * -(-inter // 128), -(-hidden // 128))


@exporting
@given(moe_shapes)
def test_fuse_fp8_moe_leaves_softmax_router(p):
    cfg = moe_cfg({**p, "dtype": torch.float32})
    module = randomize_(SoftmaxRouterMoE(cfg, torch.float32))
    args = (torch.randn(1, p["tokens"], p["hidden"]),)
    gm, matches = run_pass("fuse_fp8_moe", module, args, cfg)
    assert matches == 0 and "aten.einsum" in op_histogram(gm)
    _check_equal(gm, module, args, 1e-6)


def test_expected_scale_is_the_models():
    assert math.isclose(Glm5Config.preset("glm5").softmax_scale, 1 / 16)
