"""insert_paged_cache: every canonical attention op becomes its cached RTP op, the caches and the forward
context become graph inputs in the documented order, and the rewritten graph computes what the canonical
graph computes (flat tokens of several requests against the paged cache vs. each request alone).
"""

import copy

import torch
from torch import nn

from fxglm5.capture import capture
from fxglm5.lowering.reference.paged import slots_from_positions
from fxglm5.model.config import Glm5Config
from fxglm5.model.modeling import Glm5ForCausalLM
from fxglm5.passes import PassContext, op_histogram, run_pipeline
from fxglm5.passes.insert_paged_cache import PagedSignature
from tests.paged_helpers import model_and_graph

CANONICAL_ATTENTION = ("fxglm5.sparse_mla", "fxglm5.mla", "fxglm5.indexer_topk")


def placeholders(gm):
    return [n.name for n in gm.graph.nodes if n.op == "placeholder"]


def random_fp8_tiny(seed=0):
    cfg = Glm5Config.preset("tiny")
    torch.manual_seed(seed)
    model = Glm5ForCausalLM(cfg, dtype=torch.float32)
    for name, p in model.named_parameters():
        if p.dtype == torch.float8_e4m3fn:
            p.data = (torch.randn(p.shape) * 0.5).to(torch.float8_e4m3fn)
        elif "scale_inv" in name:
            p.data = torch.rand(p.shape) * 0.05 + 0.02
        else:
            p.data = torch.randn(p.shape, dtype=p.dtype) * 0.05
    return cfg, model


def flat_batch(lengths, block_size, vocab, gen):
    ids = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
    req = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    pos = torch.cat([torch.arange(n) for n in lengths])
    per_req = [-(-n // block_size) for n in lengths]
    table = torch.zeros(len(lengths), max(per_req), dtype=torch.long)
    nxt = 1
    for i, n in enumerate(per_req):
        table[i, :n] = torch.arange(nxt, nxt + n)
        nxt += n
    return ids, req, pos, table, slots_from_positions(table, req, pos, block_size), nxt


def test_tiny_model_counts_signature_and_outputs():
    cfg, model = random_fp8_tiny()
    gm = capture(model)
    run_pipeline(gm, PassContext(config=cfg), stages=("match", "fuse"))
    canonical = copy.deepcopy(gm)
    result, selected, folded = run_pipeline(gm, PassContext(config=cfg, strict=True), stages=("cache",))
    assert (result.name, result.num_matches, result.expected) == ("insert_paged_cache", 4, 4)
    # the kept rows are selected before the lm_head linear and the final norm
    assert (selected.name, selected.num_matches, selected.details) == ("select_sampled_rows", 1, {"ops_moved": 2})
    assert result.details == {"indexers": 4}
    # 4 MLA ops (kv norm + q/k RoPE each) and 4 indexers (k LayerNorm + RoPE each)
    assert (folded.name, folded.num_matches, folded.expected) == ("fuse_norm_rope_into_cache_writes", 8, 8)
    assert folded.details == {"norms": 8, "ropes": 12}
    ops = op_histogram(gm)
    assert not any(op in ops for op in CANONICAL_ATTENTION)
    assert ops["fxglm5.rtp_sparse_mla"] == 4 and ops["fxglm5.rtp_indexer"] == 4 and "fxglm5.rtp_mla" not in ops
    # left: 4 norms per layer + the final one, less the 4 folded kv norms; the 4 indexer query RoPEs
    assert ops["fxglm5.rms_norm"] == 13 and ops["fxglm5.rope_interleaved"] == 4 and "aten.layer_norm" not in ops
    caches = [f"{kind}_cache_{i}" for i in range(4) for kind in ("kv", "index")]
    assert placeholders(gm) == ["input_ids", "position_ids", "slot_mapping", "block_table", "req_idx",
                                "logits_indices", *caches]
    assert gm.meta["paged_cache"].cache_names == caches
    assert run_pipeline(gm, PassContext(config=cfg), stages=("cache",))[0].num_matches == 0  # nothing left

    gen = torch.Generator().manual_seed(0)
    ids, req, pos, table, slots, used = flat_batch([11, 4, 7], 4, cfg.vocab_size, gen)
    tensors = [torch.zeros(used, 4, 576) if i % 2 == 0 else torch.zeros(used, 4, 128) for i in range(8)]
    out = gm(torch.cat(ids)[None], pos[None], slots, table, req, torch.arange(len(req)), *tensors)
    for i, seq in enumerate(ids):
        ref = canonical(seq[None], torch.arange(len(seq))[None])[0]
        torch.testing.assert_close(out[0, req == i], ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    last = torch.tensor([10, 14, 21])  # each request's last token: the step again (same cache rows), 3 logits rows
    kept = gm(torch.cat(ids)[None], pos[None], slots, table, req, last, *tensors)
    assert kept.shape == (1, 3, cfg.vocab_size)
    torch.testing.assert_close(kept[0], out[0, last], rtol=1e-5, atol=1e-5 * out.abs().max().item())


def test_shared_indexer_layers_get_no_index_cache():
    _, gm = model_and_graph("exact")  # indexer_types full, shared, full
    assert gm.meta["paged_cache"] == PagedSignature((("kv_cache_0", "index_cache_0"), ("kv_cache_1", None),
                                                     ("kv_cache_2", "index_cache_2")))
    ops = op_histogram(gm)
    assert ops["fxglm5.rtp_sparse_mla"] == 3 and ops["fxglm5.rtp_indexer"] == 2
    assert not any(op in ops for op in CANONICAL_ATTENTION)


class DenseMLA(nn.Module):
    """A module whose attention is the canonical dense ``fxglm5::mla`` (GLM-5 itself has none)."""

    def __init__(self, heads=2, dn=8, dr=16, rank=64, dv=8, width=32):
        super().__init__()
        self.shape = heads, dn, dr
        self.emb = nn.Embedding(50, width)
        self.q_nope, self.q_pe = nn.Linear(width, heads * dn), nn.Linear(width, heads * dr)
        self.kv_c, self.k_pe = nn.Linear(width, rank), nn.Linear(width, dr)
        self.w_uk = nn.Parameter(torch.randn(heads, dn, rank) * 0.2)
        self.w_uv = nn.Parameter(torch.randn(heads, dv, rank) * 0.2)
        self.kv_norm = nn.Parameter(1 + 0.1 * torch.randn(rank))

    def forward(self, input_ids, position_ids):
        b, s = input_ids.shape
        h, dn, dr = self.shape
        x = self.emb(input_ids) + 0.1 * position_ids[..., None].float()
        angles = position_ids[..., None].float() * torch.linspace(1.0, 0.01, dr // 2)
        cos, sin = angles.cos(), angles.sin()
        rope = torch.ops.fxglm5.rope_interleaved
        q_pe = rope(self.q_pe(x).view(b, s, h, dr), cos, sin)
        k_pe = rope(self.k_pe(x).view(b, s, 1, dr), cos, sin).squeeze(2)
        kv_c = torch.ops.fxglm5.rms_norm(self.kv_c(x), self.kv_norm, 1e-6)
        out = torch.ops.fxglm5.mla(self.q_nope(x).view(b, s, h, dn), q_pe, kv_c, k_pe, self.w_uk, self.w_uv, 0.3)
        return out.reshape(b, s, -1)


def test_dense_mla_becomes_rtp_mla():
    torch.manual_seed(0)
    model = DenseMLA().requires_grad_(False)
    gm = capture(model)
    result, selected, folded = run_pipeline(gm, PassContext(), stages=("cache",))
    assert selected.num_matches == 0  # the module ends in a reshape, not a row-wise op: selected at the output
    assert result.num_matches == 1 and result.details == {"indexers": 0}
    assert folded.num_matches == 1 and folded.details == {"norms": 1, "ropes": 2}
    ops = op_histogram(gm)
    assert ops.get("fxglm5.rtp_mla") == 1 and "fxglm5.mla" not in ops
    assert "fxglm5.rms_norm" not in ops and "fxglm5.rope_interleaved" not in ops
    assert placeholders(gm)[-1] == "kv_cache_0"
    ids, req, pos, table, slots, used = flat_batch([6, 3], 2, 50, torch.Generator().manual_seed(1))
    out = gm(torch.cat(ids)[None], pos[None], slots, table, req, torch.arange(len(req)), torch.zeros(used, 2, 576))
    for i, seq in enumerate(ids):
        ref = model(seq[None], torch.arange(len(seq))[None])[0]
        torch.testing.assert_close(out[0, req == i], ref, rtol=1e-5, atol=1e-5)
