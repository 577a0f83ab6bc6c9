"""MLA attention with the DSA lightning indexer, in its naive, cache-less reference form.

The indexer scores every causal key per query and keeps the top ``index_topk``; the selection is
applied to the MLA softmax as an additive mask (-inf outside the chosen tokens). The compiler's
match_mla / match_sparse_mla passes recognise exactly this math and replace it with the canonical
``fxglm5::mla`` / ``fxglm5::indexer_topk`` + ``fxglm5::sparse_mla`` ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fxglm5.contracts import topk_lowest_index_ties
from fxglm5.model.config import Glm5Config
from fxglm5.model.layers import Linear, RMSNorm, apply_rope_interleaved


class Indexer(nn.Module):
    """DSA lightning indexer: score[t, s] = sum_h w[t,h] * relu(q[t,h] . k[s] / sqrt(d)), causal top-k."""

    def __init__(self, cfg: Glm5Config, dtype: torch.dtype, device=None):
        super().__init__()
        fp8 = cfg.is_fp8
        self.n_heads, self.head_dim, self.rope_dim = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
        self.topk = cfg.index_topk
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, fp8, dtype, device)
        self.wk = Linear(cfg.hidden_size, self.head_dim, fp8, dtype, device)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6, dtype=dtype, device=device)
        self.k_norm.requires_grad_(False)
        # weights_proj is never quantized; it is kept in float32 like transformers does.
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads, False, torch.float32, device)

    def forward(self, x, q_latent, cos, sin, causal):
        """Returns the selection mask [B, S, S] (True = attend) for this layer's queries."""
        bsz, seq, _ = x.shape
        q = self.wq_b(q_latent).view(bsz, seq, self.n_heads, self.head_dim)
        q_rope, q_nope = q.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        q = torch.cat([apply_rope_interleaved(q_rope, cos, sin), q_nope], dim=-1)
        k = self.k_norm(self.wk(x)).view(bsz, seq, 1, self.head_dim)
        k_rope, k_nope = k.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        k = torch.cat([apply_rope_interleaved(k_rope, cos, sin), k_nope], dim=-1).view(bsz, seq, self.head_dim)

        logits = torch.einsum("bshd,btd->bsht", q.float(), k.float()) * self.head_dim**-0.5
        weights = self.weights_proj(x.float()) * self.n_heads**-0.5
        scores = (F.relu(logits) * weights[..., None]).sum(dim=2)
        scores = scores.masked_fill(~causal, float("-inf"))
        # Pad with topk -inf columns so a fixed k works for any length (a shorter causal window selects
        # all of it); the padded and non-causal picks are removed again by the causal mask. Among equal
        # scores the lower position wins, as on every other path of the indexer.
        padded = torch.cat([scores, scores.new_full((bsz, seq, self.topk), float("-inf"))], dim=-1)
        chosen = topk_lowest_index_ties(padded, self.topk)[1]
        selected = torch.zeros_like(padded, dtype=torch.bool).scatter(-1, chosen, True)
        return selected[..., :seq]


class MLAAttention(nn.Module):
    """Multi-head latent attention (naive form: per-head keys/values expanded from the latent)."""

    def __init__(self, cfg: Glm5Config, layer: int, dtype: torch.dtype, device=None):
        super().__init__()
        fp8 = cfg.is_fp8
        self.n_heads = cfg.num_attention_heads
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_rank = cfg.kv_lora_rank
        self.scale = cfg.softmax_scale
        self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, fp8, dtype, device)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6, dtype, device)
        self.q_b_proj = Linear(cfg.q_lora_rank, self.n_heads * cfg.qk_head_dim, fp8, dtype, device)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, self.kv_rank + self.rope, fp8, dtype, device)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, 1e-6, dtype, device)
        self.kv_b_proj = Linear(self.kv_rank, self.n_heads * (self.nope + self.v_dim), fp8, dtype, device)
        self.o_proj = Linear(self.n_heads * self.v_dim, cfg.hidden_size, fp8, dtype, device)
        self.indexer = Indexer(cfg, dtype, device) if cfg.has_indexer(layer) else None

    def forward(self, x, cos, sin, prev_selection):
        """x [B, S, hidden] -> ([B, S, hidden], selection mask used, for a following 'shared' layer).
        ``prev_selection``: the selection of the layer before (a 'shared' layer without an indexer reuses it;
        None before the first layer). The causal mask is built here, inside the layer, so that a layer compiled
        on its own (torch.compile's regional recipe) still shows the passes the whole pattern."""
        bsz, seq, _ = x.shape
        causal = causal_mask(seq, x.device)
        q_latent = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_latent).view(bsz, seq, self.n_heads, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        kv = self.kv_a_proj_with_mqa(x)
        c_kv, k_pe = kv.split([self.kv_rank, self.rope], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        q_pe = apply_rope_interleaved(q_pe, cos, sin)
        k_pe = apply_rope_interleaved(k_pe.view(bsz, seq, 1, self.rope), cos, sin)

        selection = self.indexer(x, q_latent, cos, sin, causal) if self.indexer is not None else prev_selection
        allowed = causal if selection is None else causal & selection
        out = naive_mla(q_nope, q_pe, c_kv, k_pe, self.kv_b_proj, allowed, self.v_dim, self.scale)
        return self.o_proj(out), selection


def causal_mask(seq: int, device) -> torch.Tensor:
    """[1, S, S] boolean, True where key <= query."""
    idx = torch.arange(seq, device=device)
    return (idx[None, :] <= idx[:, None])[None]


def naive_mla(q_nope, q_pe, c_kv, k_pe, kv_b_proj, allowed, v_dim: int, scale: float) -> torch.Tensor:
    """The naive MLA core: per-head keys and values expanded from the latent by kv_b_proj.

    q_nope [B,S,H,dn], q_pe [B,S,H,dr] (roped), c_kv [B,S,R], k_pe [B,S,1,dr] (roped), ``allowed``
    [B|1, S, S] boolean (True = attend) -> [B, S, H*dv].
    """
    bsz, seq, heads, nope = q_nope.shape
    kv_full = kv_b_proj(c_kv).view(bsz, seq, heads, nope + v_dim)
    k_nope, v = kv_full.split([nope, v_dim], dim=-1)
    query = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2)
    key = torch.cat([k_nope, k_pe.expand(bsz, seq, heads, k_pe.shape[-1])], dim=-1).transpose(1, 2)
    scores = torch.matmul(query, key.transpose(2, 3)) * scale
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q_nope.dtype)
    return torch.matmul(probs, v.transpose(1, 2)).transpose(1, 2).reshape(bsz, seq, heads * v_dim)
