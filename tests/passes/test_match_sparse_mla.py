"""match_sparse_mla: the DSA indexer + top-k + mask + attention -> fxglm5::indexer_topk + fxglm5::sparse_mla
(tests/passes/template.py's checks, and hypothesis properties over random attention configs; near misses: the
bottom k or an unstable sort in the selection, and dense attention, masked causally or not at all)."""

import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from fxglm5.model.attention import MLAAttention
from fxglm5.model.config import Glm5Config
from fxglm5.model.layers import rope_cos_sin
from fxglm5.passes import op_histogram
from tests.helpers import randomize_
from tests.passes.modules import MLA_EXAMPLE, assert_leaves_dense_mla, dense_mla, exporting, mla_inputs, mla_shapes
from tests.passes.template import PassTemplate, assert_same_output, assert_untouched, export_small, run_small, small_dims

# per layer the latent attention (kv_b_proj's dequantized linear, matmuls, softmax, the selection's mask) and per
# layer with its own indexer the scoring, the stable descending sort and the scatter of the top k; per layer the
# causal mask it builds (arange, le and three unsqueezes)
SPARSE_OPS_FULL = {
    "aten.__and__": -4, "aten.alias": -4, "aten.arange": -4, "aten.bitwise_not": -8, "aten.cat": -12,
    "aten.einsum": -4, "aten.expand": -8, "aten.le": -4, "aten.linear": -4, "aten.masked_fill": -8, "aten.matmul": -8,
    "aten.mul": -12, "aten.new_full": -4, "aten.relu": -4, "aten.reshape": -4, "aten.scatter": -4, "aten.slice": -12,
    "aten.softmax": -4, "aten.sort": -4, "aten.split_with_sizes": -4, "aten.squeeze": 4, "aten.sum": -4,
    "aten.to": -24, "aten.transpose": -20, "aten.unsqueeze": -28, "aten.view": -4, "aten.zeros_like": -4,
    "getitem": -19, "fxglm5.indexer_topk": 4, "fxglm5.sparse_mla": 4}
# what one indexer adds to that: a layer that reuses the previous top-k has none
ONE_INDEXER = {"aten.bitwise_not": -1, "aten.cat": -1, "aten.einsum": -1, "aten.masked_fill": -1, "aten.mul": -1,
               "aten.new_full": -1, "aten.relu": -1, "aten.scatter": -1, "aten.slice": -3, "aten.sort": -1,
               "aten.sum": -1, "aten.to": -2, "aten.unsqueeze": -1, "aten.zeros_like": -1, "getitem": -2,
               "fxglm5.indexer_topk": 1}
SPARSE_OPS_SHARED = {op: n - 2 * ONE_INDEXER.get(op, 0) for op, n in SPARSE_OPS_FULL.items()}


class AttentionLayer(nn.Module):
    """One GLM-5 attention layer (MLA + DSA indexer; the layer builds its causal mask) with RoPE; ``shared``: a
    second layer that reuses the first one's top-k."""

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
EXAMPLE = {**MLA_EXAMPLE, "topk": 4, "shared": True}


def _layer_inputs(p, cfg, batch=None, seq=None):
    batch, seq = batch or p["batch"], seq or p["seq"]
    gen = torch.Generator().manual_seed(batch * seq)
    x = torch.randn(batch, seq, cfg.hidden_size, generator=gen).to(p["dtype"])
    return x, torch.arange(seq)[None].expand(batch, -1) + 3


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


ORDERS = {"bottom_k": (False, True), "unstable_sort": (True, False)}


def _other_sort_layer(p, order):
    cfg = small_cfg(p)
    module = randomize_(AttentionLayer(cfg, torch.float32))
    module.attn.indexer = OtherSortIndexer(module.attn.indexer, *order)
    return cfg, module


class TestMatchSparseMla(PassTemplate):
    name = "match_sparse_mla"
    matches = {"fp8": 4, "shared": 4, "bf16": 4}  # every layer
    ops = {"fp8": SPARSE_OPS_FULL, "shared": SPARSE_OPS_SHARED}
    near_misses = ("bottom_k", "unstable_sort", "dense_causal", "dense_nomask")

    def near_miss(self, case):
        if case.startswith("dense_"):  # the dense attention is match_mla's, with or without its causal mask
            module = dense_mla(MLA_EXAMPLE, None if case == "dense_causal" else "nomask")
            return export_small(module, mla_inputs(MLA_EXAMPLE)), module, mla_inputs({**MLA_EXAMPLE, "seq": 11}, 1), None
        cfg, module = _other_sort_layer(EXAMPLE, ORDERS[case])
        args = _layer_inputs(EXAMPLE, cfg)
        return export_small(module, args), module, _layer_inputs(EXAMPLE, cfg, 3, 11), cfg

    def reexport(self):
        cfg = small_cfg(EXAMPLE)
        module = randomize_(AttentionLayer(cfg, torch.float32, shared=True))
        example = _layer_inputs(EXAMPLE, cfg)
        return export_small(module, example), example, small_dims(example), _layer_inputs(EXAMPLE, cfg, 3, 11), cfg


@exporting
@given(sparse_shapes)
def test_match_sparse_mla_property(p):
    cfg = small_cfg(p)
    module = randomize_(AttentionLayer(cfg, p["dtype"], p["shared"]))
    args = _layer_inputs(p, cfg)
    gm, result = run_small("match_sparse_mla", module, args, cfg)
    ops = result.ops_after
    assert result.num_matches == 1 + p["shared"] and ops.get("fxglm5.sparse_mla") == result.num_matches
    assert ops.get("fxglm5.indexer_topk") == 1 and "aten.sort" not in ops and "aten.softmax" not in ops
    # float32: exact selection; bf16: the fused op's fp32 math may break a bf16 near-tie differently.
    if p["dtype"] == torch.float32:
        assert_same_output(gm(*args), module(*args), 1e-4)


@exporting
@given(sparse_shapes, st.sampled_from(sorted(ORDERS)))
def test_match_sparse_mla_leaves_other_topk(p, order):
    p = {**p, "dtype": torch.float32}
    cfg, module = _other_sort_layer(p, ORDERS[order])
    args = _layer_inputs(p, cfg)
    gm = export_small(module, args)
    assert_untouched("match_sparse_mla", gm, module, args, cfg)
    assert "aten.sort" in op_histogram(gm)


@exporting
@given(mla_shapes, st.sampled_from(["scale", "bias", "nomask"]))
def test_match_sparse_mla_leaves_dense_mla(p, variant):
    assert_leaves_dense_mla("match_sparse_mla", p, variant)
