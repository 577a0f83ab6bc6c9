"""Sparse MLA for prefill: a tile of consecutive query tokens walks its sequence's key blocks once, on tensor cores.

Same signature and semantics as :func:`fxglm5.lowering.reference.paged.sparse_mla_paged` (attention over exactly
the listed positions, -1 = unused entry, a position listed twice weighs twice, a row with no valid entry gives
zeros). Why a second kernel: the per-token kernel (:mod:`fxglm5.lowering.triton.sparse_mla`) gathers each query
token's own top-k rows, so an 8k prompt at top-k 2048 gathers 16M latent rows (10.7 GB of 656-byte FP8 rows) a
layer, and its MMAs have one token's heads (8 of a TP8 rank) as rows. Here the tokens of a tile share one load of
each key block any of them lists, and their heads together fill 64 MMA rows:

1. :func:`_count_listed` counts, per query token ``t`` and position ``p``, how often ``t`` lists ``p`` (16-bit
   counters, two per int32 word, atomic adds: exact while the top-k width is below 65536) and marks the key blocks
   of ``BLOCK_N`` positions some token of each tile lists; an argsort puts each tile's marked blocks first, in
   block order (no host sync). Tokens are counted in chunks so the counters stay under ``COUNT_BUDGET`` bytes.
2. :func:`_tile_kernel`: a program owns ``BLOCK_Q`` consecutive tokens x the heads (``BLOCK_Q * HEADS`` = 64 MMA
   rows: 8 tokens x 8 heads at TP8) and one request among them (normally the only one; grid axis 1 numbers the
   requests a tile can hold, up to the batch's, and a program without one walks nothing). It walks only the
   tile's marked blocks, without a branch, so the pipeliner can overlap a block's gathers with the previous one's
   MMAs: each block is gathered once for the whole tile through the block table (rows no token of the request
   lists read as zeros, so stale bytes never reach P @ V) and feeds the same three QK^T and two P @ V MMAs as the
   per-token kernel (:func:`fxglm5.lowering.triton.mla.latent_scores`). Each (token, key) score gets log2 of its
   count added (a position listed n times weighs n; unlisted: a bias far below any score) by a fourth, one-hot
   MMA in the QK^T chain, then the online softmax (exp2 domain, fp32) of flash attention.

Positions are attended exactly as listed; causality is the list's (the cached op's validation rejects a position
after its query's, as for the reference). :func:`tile_applies` says where the paged program's sparse MLA runs
this kernel (from the shapes only). On Hopper, step 2 is the Gluon tile of
:mod:`fxglm5.lowering.triton.sparse_mla_tile_hopper` where it applies (:func:`uses_gluon`: same inputs, QK^T not
duplicated over the warpgroups); this kernel stays the CPU-tested path and the fallback.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fxglm5 import settings
from fxglm5.contracts import KV_LORA_RANK
from fxglm5.lowering.reference import paged as ref
from fxglm5.lowering.triton import sparse_mla_tile_hopper as tile_hopper
from fxglm5.lowering.triton.device import interpreter_compat
from fxglm5.lowering.triton.mla import (LOG2E, cache_views, gather_latent_tile, latent_scores, mma,
                                        softmax_accumulate)

interpreter_compat()

__all__ = ["sparse_mla_tile_paged", "tile_applies", "uses_gluon", "block_q", "COUNT_BUDGET", "GPU_LAUNCH"]

MMA_ROWS = 64  # tokens x heads of a program: the per-token kernel's 64-head block, two [64, 256] fp32 accumulators
COUNT_BUDGET = 128 << 20  # bytes of listing counters at a time: an 8k prompt at once (8192 tokens x 8192 positions)
MAX_LISTED = (1 << 16) - 1  # a 16-bit counter holds a position listed up to this many times by one token
# the score bias of an unlisted (token, key): finite, so that the one-hot MMA's zeros times it stay 0 (not NaN), and
# far below any real score (bf16 and fp32 hold it, fp16 does not); a running maximum below UNLISTED_BELOW has seen
# no listed key (UNLISTED times any softmax scale above 1e-10 is below it)
UNLISTED = tl.constexpr(-1.0e30)
UNLISTED_BELOW = tl.constexpr(-1.0e20)


@triton.jit
def _count_listed(topk_ptr, stride_kt, K, counts_ptr, words_per_row, used_ptr, n_key_blocks,
                  BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """counts[t, p] += 1 for every listed position p of token t (16-bit lanes of int32 words: lane p % 2 of word
    p // 2, little-endian); used[t // BLOCK_Q, p // BLOCK_N] = 1 (the key blocks some token of the tile lists)."""
    t = tl.program_id(0).to(tl.int64)
    row = counts_ptr + t * words_per_row
    used = used_ptr + (t // BLOCK_Q) * n_key_blocks
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        p = tl.load(topk_ptr + t * stride_kt + offs, mask=offs < K, other=-1).to(tl.int32)
        listed = p >= 0
        tl.atomic_add(row + p // 2, tl.where(p % 2 == 1, 65536, 1), mask=listed, sem="relaxed")
        tl.store(used + p // BLOCK_N, 1, mask=listed)


@triton.jit
def _tile_kernel(
    q_ptr, stride_qt, stride_qh,
    cache_ptr, c32_ptr, c16_ptr,
    bt_ptr, stride_bt, req_ptr,
    counts_ptr, count_stride, n_pos, blocks_ptr, n_key_blocks, n_blocks_ptr, leads_ptr, n_slots,
    o_ptr, stride_ot, stride_oh,
    T, H, sm_scale_log2,
    BS: tl.constexpr, BLOCK_Q: tl.constexpr, HEADS: tl.constexpr, BLOCK_N: tl.constexpr,
    FP8: tl.constexpr, IEEE: tl.constexpr,
):
    """Program (tile, i): the request whose first token in the tile is ``leads[tile, i]`` (T: none, nothing to do,
    without a branch: an empty walk and masked loads / stores), over the key blocks the tile lists, in block order."""
    BLOCK_M: tl.constexpr = BLOCK_Q * HEADS
    tile = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest prefixes first: a shorter tail wave
    t0 = tile * BLOCK_Q
    lead = tl.load(leads_ptr + tile * n_slots + tl.program_id(1))
    has_req = lead < T
    req = tl.load(req_ptr + tl.minimum(lead, T - 1))
    req64 = req.to(tl.int64)
    rows = tl.arange(0, BLOCK_M)
    tok = t0 + rows // HEADS
    head = rows % HEADS
    row_ok = (tok < T) & (head < H)
    tok64 = tok.to(tl.int64)
    mine = row_ok & (tl.load(req_ptr + tok, mask=row_ok, other=-1) == req) & has_req  # the rows of this request

    c = tl.arange(0, 256)
    cp = tl.arange(0, 64)
    q_row = q_ptr + tok64[:, None] * stride_qt + head[:, None] * stride_qh
    # fp32 queries, or the interpreter (whose bf16/fp16 tl.dot is wrong): fp32 MMAs
    dt: tl.constexpr = tl.float32 if IEEE else q_ptr.dtype.element_ty
    q_a = tl.load(q_row + c[None, :], mask=mine[:, None], other=0.0).to(dt)
    q_b = tl.load(q_row + 256 + c[None, :], mask=mine[:, None], other=0.0).to(dt)
    q_pe = tl.load(q_row + 512 + cp[None, :], mask=mine[:, None], other=0.0).to(dt)

    # the tile's tokens (padded to the MMA's K of 16) and the one-hot [row, token] matrix that adds each token's
    # score bias to its heads' rows through one more MMA in the QK^T chain
    TOKS: tl.constexpr = max(16, BLOCK_Q)
    toks = t0 + tl.arange(0, TOKS)
    tok_ok = (tl.arange(0, TOKS) < BLOCK_Q) & (toks < T)
    tok_mine = tok_ok & (tl.load(req_ptr + toks, mask=tok_ok, other=-1) == req) & has_req
    count_row = toks * count_stride  # int32: the launcher keeps a chunk's counters under 2**31 entries
    # the bias MMA in bf16 (or fp32), whatever the queries: UNLISTED overflows fp16
    bias_dt: tl.constexpr = tl.float32 if IEEE else tl.bfloat16
    one_hot = ((rows // HEADS)[:, None] == tl.arange(0, TOKS)[None, :]).to(bias_dt)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc_a = tl.zeros([BLOCK_M, 256], tl.float32)
    acc_b = tl.zeros([BLOCK_M, 256], tl.float32)
    n_walk = tl.where(has_req, tl.load(n_blocks_ptr + tile), 0)
    blocks = blocks_ptr + tile.to(tl.int64) * n_key_blocks
    for j in range(0, n_walk):
        offs_n = tl.load(blocks + j) * BLOCK_N + tl.arange(0, BLOCK_N)
        cnt = tl.load(counts_ptr + (count_row[:, None] + offs_n[None, :]),
                      mask=tok_mine[:, None] & (offs_n < n_pos)[None, :], other=0).to(tl.float32)
        listed = tl.max(cnt, 0) > 0  # rows no token of this request lists read as zeros: stale bytes stay out
        blk = tl.load(bt_ptr + req64 * stride_bt + offs_n // BS, mask=listed, other=0).to(tl.int64)
        k_a, k_b, k_pe = gather_latent_tile(blk * BS + offs_n % BS, listed, cache_ptr, c32_ptr, c16_ptr, dt, FP8)
        # each (token, key) score plus log2(count) (0 listed once, 1 twice, ...; UNLISTED not listed), through the
        # one-hot MMA: applying a [token, key] tensor to the [row, key] scores elementwise would convert its layout
        # between the MMAs, which makes ptxas serialize them (C7515)
        bias = tl.where(cnt > 0.0, tl.log2(tl.maximum(cnt, 1.0)) / sm_scale_log2, UNLISTED).to(bias_dt)
        qk = latent_scores(q_a, q_b, q_pe, k_a, k_b, k_pe,
                           mma(one_hot, bias, tl.zeros([BLOCK_M, BLOCK_N], tl.float32), IEEE), sm_scale_log2, IEEE)
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new < UNLISTED_BELOW, 0.0, m_new)  # nothing listed yet: every weight 0
        l_i, acc_a, acc_b = softmax_accumulate(qk, m_i, m_safe, l_i, acc_a, acc_b, k_a, k_b, IEEE)
        m_i = m_new
    inv = (1.0 / tl.where(l_i > 0.0, l_i, 1.0))[:, None]  # nothing listed: zeros
    o_row = o_ptr + tok64[:, None] * stride_ot + head[:, None] * stride_oh + c[None, :]
    ty = o_ptr.dtype.element_ty
    tl.store(o_row, (acc_a * inv).to(ty), mask=mine[:, None])
    tl.store(o_row + 256, (acc_b * inv).to(ty), mask=mine[:, None])


def block_q(H: int) -> int:
    """Query tokens per program: the 64 MMA rows shared among the heads (8 at TP8's 8 heads)."""
    return max(1, MMA_ROWS // triton.next_power_of_2(H))


def tile_applies(q, cache, block_table, topk_pos) -> bool:
    """Whether the paged program's sparse MLA takes this kernel (shapes only, no host sync): a prefill, i.e. on
    average at least one full tile of tokens per request, at least two tokens a tile, a top-k width the 16-bit
    counters hold, and a prefix (the block table's width) of at most ``block_q`` top-k lists: walking a tile's
    whole prefix then loads no more rows than its tokens' own gathers would. Float32 queries only interpreted: on a
    GPU their tile and key blocks need 316 KB of shared memory (an H100 has 227 KB), and float32 is the reference
    dtype of the tests, not a served one; the per-token kernel serves them."""
    T, H, _ = q.shape
    K = topk_pos.shape[1]
    bq = block_q(H)
    return (settings.sparse_mla_tile() and bq >= 2 and 0 < K <= MAX_LISTED and T >= bq * block_table.shape[0]
            and block_table.shape[1] * cache.shape[1] <= bq * K
            and (q.dtype != torch.float32 or settings.triton_interpret()))


# the launch on a GPU (two stages: the pipeliner turns the next listed block's gathers into asynchronous copies
# while this one's MMAs run) and in the interpreter (small tiles). 64-key blocks: the fastest of bench/
# sparse_mla_prefill.py --sweep at an 8k prompt, 8 heads on an H100 (bench/results/sparse_mla_prefill_tile_h100_e238402:
# FP8 cache 5.43 ms against 6.00 with 32-key blocks and 6.21 for the per-token kernel; bf16 cache 3.80 against 6.14
# and 3.69-3.84). One stage was faster still with the FP8 cache (5.02 ms) but gives up the pipelined gathers.
GPU_LAUNCH = dict(BLOCK_N=64, num_warps=8, num_stages=2)
INTERPRETER_LAUNCH = dict(BLOCK_N=16, num_warps=4, num_stages=1)


def _default_cfg(q) -> dict:
    return INTERPRETER_LAUNCH if settings.triton_interpret() or q.device.type != "cuda" else GPU_LAUNCH


def _request_leads(req_idx: torch.Tensor, bq: int, slots: int) -> torch.Tensor:
    """int32 [tiles, slots]: per tile of ``bq`` tokens, the first token (index into ``req_idx``) of each request
    among them, in token order, then ``len(req_idx)`` (no request). Device ops only (no host sync)."""
    n = req_idx.shape[0]
    tiles = triton.cdiv(n, bq)
    reqs = torch.full((tiles * bq,), -1, dtype=torch.int64, device=req_idx.device)
    reqs[:n] = req_idx
    reqs = reqs.view(tiles, bq)
    earlier = torch.ones(bq, bq, dtype=torch.bool, device=req_idx.device).tril(-1)  # [k, j]: j before k
    first = (reqs >= 0) & ~((reqs[:, :, None] == reqs[:, None, :]) & earlier).any(dim=2)
    nth = torch.where(first, first.cumsum(dim=1) - 1, slots)  # slot of each first token; the rest to a spare column
    tok = torch.arange(tiles * bq, device=req_idx.device).view(tiles, bq)
    leads = torch.full((tiles, slots + 1), n, dtype=torch.int64, device=req_idx.device)
    return leads.scatter_(1, nth, torch.where(first, tok, n))[:, :slots].to(torch.int32).contiguous()


def uses_gluon(q, cache, cfg: dict | None = None) -> bool:
    """Whether :func:`sparse_mla_tile_paged` runs the Gluon tile (:mod:`fxglm5.lowering.triton.sparse_mla_tile_hopper`)
    for these inputs and ``cfg``: with ``cfg=None`` where it applies (``tile_hopper.supported``: sm_90, bf16 queries,
    64 rows of tokens x heads, ...; ``FXGLM5_SPARSE_MLA_TILE_GLUON=0`` keeps the Triton tile); ``{"kernel":
    "gluon"}`` forces it (a ValueError where it does not apply); ``{"kernel": "triton"}`` or any launch options run
    the Triton tile kernel."""
    kernel = (cfg or {}).get("kernel")
    if kernel not in (None, "gluon", "triton"):
        raise ValueError(f"sparse_mla_tile_paged: cfg kernel {kernel!r} is neither 'gluon' nor 'triton'")
    if kernel == "gluon" and len(cfg) > 1:
        raise ValueError(f"sparse_mla_tile_paged: cfg={cfg}: the Gluon tile takes no launch options")
    H = q.shape[1]
    ok = tile_hopper.supported(q, cache, block_q(H), triton.next_power_of_2(H))
    if kernel == "gluon" and not ok:
        raise ValueError(f"sparse_mla_tile_paged: cfg={cfg} asks for the Gluon tile, which does not serve these "
                         f"inputs (q {tuple(q.shape)} {q.dtype} on {q.device}, cache {cache.dtype})")
    return ok and (cfg is None or kernel == "gluon")


def sparse_mla_tile_paged(q, cache, block_table, req_idx, topk_pos, scale: float, *, validate: bool = True,
                          out=None, cfg: dict | None = None):
    """Sparse MLA over query tiles -> [T, H, 512] in q.dtype: the Gluon tile on Hopper (:func:`uses_gluon`), else
    :func:`_tile_kernel`. ``cfg``: ``{"kernel": "gluon" | "triton"}``, or the Triton tile's launch options
    (``BLOCK_Q``, ``BLOCK_N``, ``num_warps``, ``num_stages``) over the defaults."""
    if validate:
        ref.validate_sparse_mla_paged(q, cache, block_table, req_idx, topk_pos, scale)
    T, H, _ = q.shape
    K = topk_pos.shape[1]
    if K > MAX_LISTED:
        raise ValueError(f"sparse_mla_tile_paged: top-k width {K} exceeds the 16-bit counters' {MAX_LISTED}")
    if out is None:
        out = torch.empty(T, H, KV_LORA_RANK, dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    if K == 0:
        return out.zero_()
    if q.stride(-1) != 1:
        q = q.contiguous()
    gluon = uses_gluon(q, cache, cfg)
    cfg = {k: v for k, v in (cfg or {}).items() if k != "kernel"}
    # the Gluon tile walks mla_hopper's 64-key blocks, the Triton tile's GPU default
    c = {**_default_cfg(q), "BLOCK_Q": block_q(H), **cfg, **(dict(BLOCK_N=tile_hopper.BLOCK_N) if gluon else {})}
    bq, bn, bs = c["BLOCK_Q"], c["BLOCK_N"], cache.shape[1]
    n_pos = block_table.shape[1] * bs  # every listed position lies inside the block table
    words, n_key_blocks = triton.cdiv(n_pos, 2), triton.cdiv(n_pos, bn)
    chunk = min(T, max(bq, COUNT_BUDGET // (4 * words) // bq * bq))  # tokens counted at a time, whole tiles
    counts = torch.empty(chunk, words, dtype=torch.int32, device=q.device)
    used = torch.empty(triton.cdiv(chunk, bq), n_key_blocks, dtype=torch.int8, device=q.device)
    c8, c32, c16, fp8 = cache_views(cache)
    ieee = q.dtype == torch.float32 or settings.triton_interpret()
    req_idx, topk_pos = req_idx.contiguous(), topk_pos.contiguous()
    for s in range(0, T, chunk):
        n, tiles = min(chunk, T - s), triton.cdiv(min(chunk, T - s), bq)
        cnt, use = counts[:n], used[:tiles]
        cnt.zero_()
        use.zero_()
        _count_listed[(n,)](topk_pos[s:], K, K, cnt, words, use, n_key_blocks, BLOCK_Q=bq, BLOCK_N=bn,
                            BLOCK_K=min(1024, triton.next_power_of_2(K)))
        # each tile's listed key blocks first, in block order, and their count (no host sync)
        blocks = torch.argsort(use, dim=1, descending=True, stable=True).to(torch.int32)
        n_blocks = use.sum(dim=1, dtype=torch.int32)
        slots = min(bq, block_table.shape[0])  # requests a tile can hold
        leads = _request_leads(req_idx[s:s + n], bq, slots)
        qs, os_ = q[s:s + n], out[s:s + n]
        if gluon:
            tile_hopper.launch(qs, cache, block_table, req_idx[s:], cnt.view(torch.int16), 2 * words, n_pos, blocks,
                               n_key_blocks, n_blocks, leads, os_, n, float(scale) * LOG2E, bq,
                               triton.next_power_of_2(H))
            continue
        _tile_kernel[(tiles, slots)](
            qs, qs.stride(0), qs.stride(1), c8, c32, c16, block_table, block_table.stride(0), req_idx[s:],
            cnt.view(torch.int16), 2 * words, n_pos, blocks, n_key_blocks, n_blocks, leads, slots, os_, os_.stride(0),
            os_.stride(1), n, H, float(scale) * LOG2E, BS=bs, BLOCK_Q=bq, HEADS=triton.next_power_of_2(H),
            BLOCK_N=bn, FP8=fp8, IEEE=ieee, num_warps=c["num_warps"], num_stages=c["num_stages"])
    return out
