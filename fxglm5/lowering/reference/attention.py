"""Torch reference semantics of the cache-less attention ops: MLA (absorbed), DSA indexer top-k, sparse MLA.

These define what ``fxglm5::mla``, ``fxglm5::indexer_topk`` and ``fxglm5::sparse_mla`` compute over a
whole [B, S] batch of sequences with causal attention (the cached RTP ops in ``paged.py`` compute the
same over paged caches). The absorbed form is used: q~ = q_nope . W_UK attends to the shared latent
rows [c_kv | k_pe]; the latent output is mapped back through W_UV. Math in float32, result in q's dtype.
"""

from __future__ import annotations

import torch

from fxglm5.contracts import topk_lowest_index_ties
from fxglm5.lowering.reference.collectives import gather_split_rows


def _causal(seq: int, device) -> torch.Tensor:
    idx = torch.arange(seq, device=device)
    return idx[None, :] <= idx[:, None]


def _latent_attention(q_nope, q_pe, kv_c, k_pe, w_uk, w_uv, scale, allowed):
    """Absorbed MLA with a boolean mask ``allowed`` [B, S, T] (True = attend)."""
    q_abs = torch.einsum("bshd,hdr->bshr", q_nope.float(), w_uk.float())
    scores = torch.einsum("bshr,btr->bhst", q_abs, kv_c.float())
    scores = (scores + torch.einsum("bshd,btd->bhst", q_pe.float(), k_pe.float())) * scale
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a query with nothing allowed gets zeros
    o_lat = torch.einsum("bhst,btr->bshr", probs, kv_c.float())
    return torch.einsum("bshr,hvr->bshv", o_lat, w_uv.float()).to(q_nope.dtype)


def mla(q_nope, q_pe, kv_c, k_pe, w_uk, w_uv, scale: float) -> torch.Tensor:
    """Causal MLA: q_nope [B,S,H,dn], q_pe [B,S,H,dr], kv_c [B,S,R], k_pe [B,S,dr], w_uk [H,dn,R], w_uv [H,dv,R]."""
    allowed = _causal(q_nope.shape[1], q_nope.device)[None].expand(q_nope.shape[0], -1, -1)
    return _latent_attention(q_nope, q_pe, kv_c, k_pe, w_uk, w_uv, scale, allowed)


def sparse_mla(q_nope, q_pe, kv_c, k_pe, w_uk, w_uv, topk_indices, scale: float) -> torch.Tensor:
    """MLA restricted to the selected key positions ``topk_indices`` [B, S, K] (-1 = unused), causal."""
    bsz, seq = q_nope.shape[:2]
    valid = topk_indices >= 0
    chosen = torch.zeros(bsz, seq, seq + 1, dtype=torch.bool, device=q_nope.device)
    chosen.scatter_(-1, torch.where(valid, topk_indices.long(), seq), True)
    allowed = chosen[..., :seq] & _causal(seq, q_nope.device)
    return _latent_attention(q_nope, q_pe, kv_c, k_pe, w_uk, w_uv, scale, allowed)


def indexer_scores(q, k, weights, rows=None) -> torch.Tensor:
    """score[b, s, t] = sum_h weights[b,s,h] * relu(q[b,s,h] . k[b,t]), -inf outside the causal window: the query at
    ``rows[s]`` (int [S'], default its own index s) sees keys t <= rows[s]."""
    logits = torch.einsum("bshd,btd->bsht", q.float(), k.float())
    scores = (torch.relu(logits) * weights.float()[..., None]).sum(dim=2)
    if rows is None:
        return scores.masked_fill(~_causal(q.shape[1], q.device), float("-inf"))
    return scores.masked_fill(torch.arange(k.shape[1], device=q.device)[None, :] > rows[:, None], float("-inf"))


def indexer_topk(q, k, weights, topk: int, group: str | None = None, world: int = 1) -> torch.Tensor:
    """DSA top-k: q [B,S,HI,D], k [B,S,D], weights [B,S,HI] (all scales folded in) -> int32 [B,S,topk].

    Each query keeps its ``topk`` best causal keys, the lower position first among equal scores
    (:func:`topk_lowest_index_ties`), listed by descending score; a causal window shorter than topk is taken
    whole and the remaining slots are -1. With a ``group`` of ``world`` ranks, a long enough sequence is split
    over them (``collectives.gather_split_rows``): each rank scores its share of the queries (a padding row as
    query 0), one all_gather gives every rank all of them.
    """
    seq = q.shape[1]

    def rows(index):
        take = torch.where(index < seq, index, 0)
        return _topk_rows(q[:, take], k, weights[:, take], topk, take).transpose(0, 1)  # [n, B, topk]

    split = gather_split_rows(rows, seq, group, world, q.device)
    return _topk_rows(q, k, weights, topk) if split is None else split.transpose(0, 1)


def _topk_rows(q, k, weights, topk: int, rows=None) -> torch.Tensor:
    """``indexer_topk`` of the queries ``q`` at ``rows`` (see :func:`indexer_scores`)."""
    scores = indexer_scores(q, k, weights, rows)
    bsz, seq = scores.shape[:2]
    padded = torch.cat([scores, scores.new_full((bsz, seq, topk), float("-inf"))], dim=-1)
    values, idx = topk_lowest_index_ties(padded, topk)
    return torch.where(torch.isfinite(values), idx, -1).to(torch.int32)
