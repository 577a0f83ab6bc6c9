"""Triton MLA (absorbed, MQA over the 576-wide latent rows) over the paged latent cache.

Same signature and semantics as :func:`fxglm5.lowering.reference.paged.mla_paged`.

One kernel body serves dense (causal, prefix-aware) and sparse (listed top-k positions) attention and both
cache layouts (compute dtype 576 / FP8 ds_mla 656 bytes):
- a program owns one query token and a block of ``BLOCK_H`` heads (all 64 GLM-5 heads in one block, so each
  gathered cache tile feeds [64 x 576] x [576 x BLOCK_N] MMAs and is read once per token, not once per head);
- a tile of ``BLOCK_N`` key rows is three shared-memory operands: two 256-column halves of the latent and
  the 64 rope columns. QK^T is three chained MMAs over the 576 columns; P @ V reuses the two latent halves
  (V = the latent) into two [BLOCK_H, 256] fp32 accumulators, so each row is fetched once for both products;
- FP8 ds_mla rows are converted e4m3 -> compute dtype times their per-128-column scale in registers (exact for
  the power-of-two scales the cache writer stores) before the MMAs;
- online softmax (flash-style) over the tiles, fp32 accumulation, exp2 domain;
- tile loads: dense attention whose tiles lie inside one cache block uses TMA (``USE_TMA``: full tiles go
  straight to shared memory, multi-buffered by the software pipeliner, no masking; the ragged tail goes through
  descriptors that end at the last valid row, since rows past it may hold stale bytes); sparse attention
  gathers rows through the block table with masked loads that the pipeliner turns into asynchronous copies
  (invalid rows read 0); on CUDA, ``triton.autotune`` picks the tile size and stage count per (H, num_splits,
  dtypes) at the first (eager) call;
- split-KV (flash-decoding): grid axis 1 splits the key range into ``num_splits`` chunks (chosen from the
  shapes by :func:`pick_num_splits`: fewest waves x tiles per split); each writes a partial (normalized) output
  + log-sum-exp and a combine kernel merges them. ``num_splits == 1`` writes the output directly (the prefill
  path: many tokens already fill the machine; queries of a prefill re-read their prefix tiles, mostly from L2);
- W_UV in the combine (``w_uv``, the paged programs' decode): the combine also multiplies the merged latent output
  by W_UV and writes the value heads, and a single split writes partials too, so the attention of a decode step
  ends in one Triton kernel instead of the combine and a cuBLAS GEMM outside the PDL chain;
- the MLA and that combine in one launch (up to 16 tokens, :func:`project_fuses`): a launch of tasks
  (:mod:`fxglm5.lowering.triton.tasks`, :func:`_mla_project_kernel`) whose split tasks store their partials and
  signal their token tile's counter, and whose combine tasks (the combine's tiles, W_UV still spread over many
  CTAs) wait for every split of their tokens; the two kernels' code (:func:`_mla_split`,
  :func:`_combine_project_tile`), so their bits. On Hopper the Gluon kernel's form of it
  (``mla_hopper._mla_hopper_project_kernel``).
The number of splits is a function of the shapes only (``T``, ``H``, the block-table width), never of data,
so the launch is CUDA-graph safe (no host sync); buffers are sized by the arguments.
On Hopper, ``launch_mla`` runs :mod:`fxglm5.lowering.triton.mla_hopper` instead (a Gluon kernel with the same
semantics, for up to 64 heads and bf16 queries); this kernel is the CPU-tested path and the fallback everywhere else.
Measured on an H200, this kernel and the Hopper one side by side: docs/perf/attention.md. Two limits of Triton 3.6 on this shape (docs/perf/attention_notes.md): a QK^T that feeds
P @ V in the same iteration gets all 8 warps along its 64 rows, so both warpgroups issue the same QK^T MMAs
(N=32 instructions that re-read the 64 x 576 queries from shared memory); and no warp specialization, so
loads, softmax and MMAs of one tile do not overlap another's. Moving P @ V one iteration later removes the
duplicate MMAs but needs a second tile buffer per stage, which shared memory only allows at 32-row tiles:
measured slower (docs/perf/attention.md, mla_loop_variants).
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from fxglm5 import settings
from fxglm5.lowering.reference import paged as ref
from fxglm5.lowering.triton import mla_hopper, tasks
from fxglm5.lowering.triton.device import ensure_tma_allocator, interpreter_compat, num_sms, pdl, pdl_prologue
from fxglm5.lowering.triton.norm_rope import DTYPE_CODES, round_to

interpreter_compat()

__all__ = ["mla_paged", "mla_decode_paged", "mla_prefill_paged", "launch_mla", "launch_dispatched",
           "dispatch_num_splits", "into"]

LOG2E = 1.4426950408889634
FUSE_MAX_TOKENS = 16  # up to this many tokens the combine with W_UV runs in the MLA's launch (project_fuses)
COMBINE_WARPS = 4  # the warps of the combine's own launch


@triton.jit
def mma(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _tile_slots(n0, end, t64, req, bt_ptr, stride_bt, pos_ptr, stride_pt,
                BS: tl.constexpr, BLOCK_N: tl.constexpr, SPARSE: tl.constexpr):
    """Cache slots (int64) and validity of the BLOCK_N key rows n0 .. n0+BLOCK_N-1 of one query."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    nmask = offs_n < end
    if SPARSE:
        p = tl.load(pos_ptr + t64 * stride_pt + offs_n, mask=nmask, other=-1)
        valid = nmask & (p >= 0)
        p = tl.maximum(p, 0)
    else:
        valid = nmask
        p = offs_n
    blk = tl.load(bt_ptr + req * stride_bt + p // BS, mask=valid, other=0).to(tl.int64)
    return blk * BS + (p % BS), valid


@triton.jit
def _dequant_half(u8, sa, sb, dt: tl.constexpr):
    """[BLOCK_N, 256] e4m3 bytes x two per-row group scales (columns 0..127 / 128..255) -> dt (exact for the
    power-of-two scales the cache writer stores)."""
    cols = tl.arange(0, 256)
    s = tl.where(cols[None, :] < 128, sa.to(dt)[:, None], sb.to(dt)[:, None])
    return u8.to(tl.float8e4nv, bitcast=True).to(tl.float32).to(dt) * s  # through fp32: see mla_hopper._dequant


@triton.jit
def gather_latent_tile(slot, valid, cache_ptr, c32_ptr, c16_ptr, dt: tl.constexpr, FP8: tl.constexpr):
    """Gather one tile of latent rows -> (k_a [BLOCK_N, 256], k_b [BLOCK_N, 256], k_pe [BLOCK_N, 64]) in dt.

    Invalid rows read as zeros (masked loads), so they add nothing to P @ V. Compute-dtype rows feed the MMAs
    straight from the masked loads (the pipeliner stages them as asynchronous copies)."""
    c = tl.arange(0, 256)
    cp = tl.arange(0, 64)
    vm = valid[:, None]
    if FP8:
        row = cache_ptr + slot[:, None] * 656 + c[None, :]
        sc = c32_ptr + slot * 164 + 128
        k_a = _dequant_half(tl.load(row, mask=vm, other=0), tl.load(sc, mask=valid, other=0.0),
                            tl.load(sc + 1, mask=valid, other=0.0), dt)
        k_b = _dequant_half(tl.load(row + 256, mask=vm, other=0), tl.load(sc + 2, mask=valid, other=0.0),
                            tl.load(sc + 3, mask=valid, other=0.0), dt)
        k_pe = tl.load(c16_ptr + slot[:, None] * 328 + 264 + cp[None, :], mask=vm, other=0)
        k_pe = k_pe.to(tl.bfloat16, bitcast=True).to(dt)
    else:
        row = cache_ptr + slot[:, None] * 576 + c[None, :]
        k_a = tl.load(row, mask=vm, other=0.0).to(dt)
        k_b = tl.load(row + 256, mask=vm, other=0.0).to(dt)
        k_pe = tl.load(cache_ptr + slot[:, None] * 576 + 512 + cp[None, :], mask=vm, other=0.0).to(dt)
    return k_a, k_b, k_pe


@triton.jit
def _latent_descs(cache_ptr, c16_ptr, row0, n_rows, FP8: tl.constexpr, BLOCK_N: tl.constexpr):
    """TMA descriptors over the cache rows ``row0 .. row0 + n_rows - 1``: the latent (two 256-column boxes)
    and the rope columns. Rows past ``n_rows`` read as zeros, which is what makes a ragged tail tile safe."""
    r = row0.to(tl.int64)
    if FP8:
        desc = tl.make_tensor_descriptor(cache_ptr + r * 656, shape=[n_rows, 656], strides=[656, 1],
                                         block_shape=[BLOCK_N, 256])
        desc_pe = tl.make_tensor_descriptor(c16_ptr + r * 328, shape=[n_rows, 328], strides=[328, 1],
                                            block_shape=[BLOCK_N, 64])
    else:
        desc = tl.make_tensor_descriptor(cache_ptr + r * 576, shape=[n_rows, 576], strides=[576, 1],
                                         block_shape=[BLOCK_N, 256])
        desc_pe = tl.make_tensor_descriptor(cache_ptr + r * 576, shape=[n_rows, 576], strides=[576, 1],
                                            block_shape=[BLOCK_N, 64])
    return desc, desc_pe


@triton.jit
def _tma_tile(desc, desc_pe, c32_ptr, row, slot0, n_valid, dt: tl.constexpr, FP8: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """TMA-load the BLOCK_N latent rows at descriptor row ``row`` (cache slots ``slot0 ..``); FP8 scales of
    rows past ``n_valid`` read as 0 (their e4m3 bytes are TMA zero fill)."""
    if FP8:
        offs = tl.arange(0, BLOCK_N)
        m = offs < n_valid
        sc = c32_ptr + (slot0.to(tl.int64) + offs) * 164 + 128
        k_a = _dequant_half(desc.load([row, 0]), tl.load(sc, mask=m, other=0.0),
                            tl.load(sc + 1, mask=m, other=0.0), dt)
        k_b = _dequant_half(desc.load([row, 256]), tl.load(sc + 2, mask=m, other=0.0),
                            tl.load(sc + 3, mask=m, other=0.0), dt)
        k_pe = desc_pe.load([row, 264]).to(tl.bfloat16, bitcast=True).to(dt)
    else:
        k_a = desc.load([row, 0]).to(dt)
        k_b = desc.load([row, 256]).to(dt)
        k_pe = desc_pe.load([row, 512]).to(dt)
    return k_a, k_b, k_pe


@triton.jit
def latent_scores(q_a, q_b, q_pe, k_a, k_b, k_pe, acc, sm_scale_log2, IEEE: tl.constexpr):
    """S = (acc + Q K^T over the 576 latent + rope columns (three chained MMAs)) * sm_scale_log2: the scores in the
    exp2 domain, plus ``acc / sm_scale_log2`` (zeros: the plain scores)."""
    qk = mma(q_a, tl.trans(k_a), acc, IEEE)
    qk = mma(q_b, tl.trans(k_b), qk, IEEE)
    return mma(q_pe, tl.trans(k_pe), qk, IEEE) * sm_scale_log2


@triton.jit
def _attend(q_a, q_b, q_pe, k_a, k_b, k_pe, valid, m_i, l_i, acc_a, acc_b, sm_scale_log2,
            BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, IEEE: tl.constexpr):
    """One online-softmax step: S = Q K^T over 576 columns (:func:`latent_scores`), P @ V over the 512 latent
    columns of the same tile (two MMAs into the column halves). MASKED=False for tiles known to be all valid."""
    qk = latent_scores(q_a, q_b, q_pe, k_a, k_b, k_pe, tl.zeros([BLOCK_H, BLOCK_N], tl.float32), sm_scale_log2, IEEE)
    if MASKED:
        qk = tl.where(valid[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    if MASKED:
        m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new_safe = m_new
    l_i, acc_a, acc_b = softmax_accumulate(qk, m_i, m_new_safe, l_i, acc_a, acc_b, k_a, k_b, IEEE)
    return m_new, l_i, acc_a, acc_b


@triton.jit
def softmax_accumulate(qk, m_i, m_safe, l_i, acc_a, acc_b, k_a, k_b, IEEE: tl.constexpr):
    """The online softmax's update for one key tile, the running max ``m_i`` moved to ``m_safe`` (the new max, or
    0 where a row has seen no key yet): rescale the sum and the two latent halves, add P = exp2(qk - m_safe) and
    P @ V into them."""
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    pb = p.to(k_a.dtype)
    return l_i, mma(pb, k_a, acc_a * alpha[:, None], IEEE), mma(pb, k_b, acc_b * alpha[:, None], IEEE)


@triton.jit
def _mla_split(
    t, hb, sp,
    q_ptr, stride_qt, stride_qh,
    cache_ptr, c32_ptr, c16_ptr,
    bt_ptr, stride_bt, req_ptr,
    pos_ptr, stride_pt, K,
    o_ptr, stride_ot, stride_oh,
    po_ptr, plse_ptr,
    H, sm_scale_log2, split_len, num_splits, n_rows,
    BS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    FP8: tl.constexpr, SPARSE: tl.constexpr, DIRECT: tl.constexpr, IEEE: tl.constexpr, USE_TMA: tl.constexpr,
):
    """Token ``t``'s head block ``hb`` over split ``sp`` of its keys: the output (DIRECT) or the split's normalized
    partial and log-sum-exp. The body of :func:`_mla_fwd_kernel` and of :func:`_mla_project_kernel`'s split tasks."""
    R: tl.constexpr = 512
    t64 = t.to(tl.int64)
    req = tl.load(req_ptr + t).to(tl.int64)

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    c = tl.arange(0, 256)
    cp = tl.arange(0, 64)
    q_row = q_ptr + t64 * stride_qt + heads[:, None] * stride_qh
    q_a = tl.load(q_row + c[None, :], mask=hmask[:, None], other=0.0)
    q_b = tl.load(q_row + 256 + c[None, :], mask=hmask[:, None], other=0.0)
    q_pe = tl.load(q_row + R + cp[None, :], mask=hmask[:, None], other=0.0)
    # fp32 queries, or the interpreter (whose bf16/fp16 tl.dot is wrong): fp32 MMAs
    dt: tl.constexpr = tl.float32 if IEEE else q_ptr.dtype.element_ty
    q_a = q_a.to(dt)
    q_b = q_b.to(dt)
    q_pe = q_pe.to(dt)

    if SPARSE:
        n_total = K
    else:
        n_total = tl.load(pos_ptr + t).to(tl.int32) + 1
    start = sp * split_len
    end = tl.minimum(start + split_len, n_total)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc_a = tl.zeros([BLOCK_H, 256], tl.float32)
    acc_b = tl.zeros([BLOCK_H, 256], tl.float32)
    if USE_TMA and (not SPARSE) and (BS % BLOCK_N == 0):
        # dense: every full tile is BLOCK_N contiguous rows of one cache block -> TMA straight into shared
        # memory (multi-buffered by the pipeliner), no masking
        desc, desc_pe = _latent_descs(cache_ptr, c16_ptr, t64 * 0, n_rows, FP8, BLOCK_N)
        full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
        for n0 in range(start, full_end, BLOCK_N):
            r0 = tl.load(bt_ptr + req * stride_bt + n0 // BS) * BS + (n0 % BS)
            k_a, k_b, k_pe = _tma_tile(desc, desc_pe, c32_ptr, r0, r0, BLOCK_N, dt, FP8, BLOCK_N)
            m_i, l_i, acc_a, acc_b = _attend(q_a, q_b, q_pe, k_a, k_b, k_pe, k_a, m_i, l_i, acc_a, acc_b,
                                             sm_scale_log2, BLOCK_H, BLOCK_N, False, IEEE)
        if full_end < end:
            # the ragged tail: rows past the end may hold stale bytes (NaN included), so it is loaded through
            # descriptors that end at the last valid row (TMA zero-fills the rest) and its scores are masked
            rem = end - full_end
            r0 = tl.load(bt_ptr + req * stride_bt + full_end // BS) * BS + (full_end % BS)
            tdesc, tdesc_pe = _latent_descs(cache_ptr, c16_ptr, r0, rem, FP8, BLOCK_N)
            k_a, k_b, k_pe = _tma_tile(tdesc, tdesc_pe, c32_ptr, 0, r0, rem, dt, FP8, BLOCK_N)
            m_i, l_i, acc_a, acc_b = _attend(q_a, q_b, q_pe, k_a, k_b, k_pe, tl.arange(0, BLOCK_N) < rem, m_i,
                                             l_i, acc_a, acc_b, sm_scale_log2, BLOCK_H, BLOCK_N, True, IEEE)
    else:
        for n0 in range(start, end, BLOCK_N):
            slot, valid = _tile_slots(n0, end, t64, req, bt_ptr, stride_bt, pos_ptr, stride_pt, BS, BLOCK_N,
                                      SPARSE)
            k_a, k_b, k_pe = gather_latent_tile(slot, valid, cache_ptr, c32_ptr, c16_ptr, dt, FP8)
            m_i, l_i, acc_a, acc_b = _attend(q_a, q_b, q_pe, k_a, k_b, k_pe, valid, m_i, l_i, acc_a, acc_b,
                                             sm_scale_log2, BLOCK_H, BLOCK_N, True, IEEE)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    inv = (1.0 / l_safe)[:, None]
    if DIRECT:
        o_row = o_ptr + t64 * stride_ot + heads[:, None] * stride_oh + c[None, :]
        ty = o_ptr.dtype.element_ty
        tl.store(o_row, (acc_a * inv).to(ty), mask=hmask[:, None])
        tl.store(o_row + 256, (acc_b * inv).to(ty), mask=hmask[:, None])
    else:
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        base = (t64 * num_splits + sp) * H + heads
        po_row = po_ptr + base[:, None] * R + c[None, :]
        tl.store(po_row, acc_a * inv, mask=hmask[:, None])
        tl.store(po_row + 256, acc_b * inv, mask=hmask[:, None])
        tl.store(plse_ptr + base, lse, mask=hmask)


@triton.jit
def _mla_fwd_kernel(
    q_ptr, stride_qt, stride_qh,
    cache_ptr, c32_ptr, c16_ptr,
    bt_ptr, stride_bt, req_ptr,
    pos_ptr, stride_pt, K,
    o_ptr, stride_ot, stride_oh,
    po_ptr, plse_ptr,
    H, sm_scale_log2, split_len, num_splits, n_rows,
    BS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, N_HB: tl.constexpr,
    FP8: tl.constexpr, SPARSE: tl.constexpr, DIRECT: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
    USE_TMA: tl.constexpr = False,
):
    pdl_prologue(PDL)
    pid = tl.program_id(0)  # head blocks of one token are adjacent: they share the cache tiles through L2
    _mla_split(pid // N_HB, pid % N_HB, tl.program_id(1), q_ptr, stride_qt, stride_qh, cache_ptr, c32_ptr, c16_ptr,
               bt_ptr, stride_bt, req_ptr, pos_ptr, stride_pt, K, o_ptr, stride_ot, stride_oh, po_ptr, plse_ptr, H,
               sm_scale_log2, split_len, num_splits, n_rows, BS, BLOCK_H, BLOCK_N, FP8, SPARSE, DIRECT, IEEE, USE_TMA)


@triton.jit
def _split_weights(lse):
    """The merge weights of the splits' log-sum-exps (last axis; -inf: an empty split, weight 0) and their sum
    (kept as a size-1 last axis; 0 where every split is empty)."""
    m = tl.max(lse, -1, keep_dims=True)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    return w, tl.sum(w, -1, keep_dims=True)


@triton.jit
def _mla_combine_kernel(po_ptr, plse_ptr, o_ptr, stride_ot, stride_oh, H, num_splits,
                        R: tl.constexpr, S_PAD: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """Merge the split partials of one (token, head, column chunk): all splits loaded at once."""
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    c = tl.program_id(2)
    sp = tl.arange(0, S_PAD)
    smask = sp < num_splits
    base = (t * num_splits + sp) * H + h
    w, wsum = _split_weights(tl.load(plse_ptr + base, mask=smask, other=float("-inf")))
    d = c * BLOCK_D + tl.arange(0, BLOCK_D)
    po = tl.load(po_ptr + base[:, None] * R + d[None, :], mask=smask[:, None] & (w[:, None] > 0.0), other=0.0)
    acc = tl.sum(po * w[:, None], 0) / tl.where(wsum > 0.0, wsum, 1.0)
    tl.store(o_ptr + t * stride_ot + h * stride_oh + d, acc.to(o_ptr.dtype.element_ty))


@triton.jit
def _combine_project_tile(pid_t, h, pid_v, po_ptr, plse_ptr, w_ptr, o_ptr, s_w_h, s_w_v, T, H, V, RA, num_splits,
                          R: tl.constexpr, S_PAD: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
                          DT: tl.constexpr, IEEE: tl.constexpr, CACHE: tl.constexpr):
    """The combine with W_UV applied, one tile (token tile ``pid_t``, head ``h``, tile ``pid_v`` of the V outputs):
    merges its tokens' split partials (all splits at once, BK latent columns at a time), rounds the merged latent
    output to the model's dtype (where the unfused path stores it) and multiplies it by W_UV[h] (float32
    accumulation, one rounding at the end). BT = 1 is a GEMV on the CUDA cores (decode: a 16-row MMA would not pay
    for itself); BT >= 16 a tensor-core tl.dot. ``CACHE``: the partials' loads' cache modifier (".cg" where another
    CTA of the same launch wrote them: :func:`_mla_project_kernel`). The body of :func:`_mla_combine_project_kernel`
    and of :func:`_mla_project_kernel`'s combine tasks."""
    t = (pid_t * BT + tl.arange(0, BT)).to(tl.int64)
    tm = t < T
    sp = tl.arange(0, S_PAD)
    base = (t[:, None] * num_splits + sp[None, :]) * H + h  # [BT, S_PAD]
    w, wsum = _split_weights(tl.load(plse_ptr + base, mask=tm[:, None] & (sp[None, :] < num_splits),
                                     other=float("-inf"), cache_modifier=CACHE))
    den = tl.where(wsum > 0.0, wsum, 1.0)
    take = (w > 0.0)[:, :, None]
    v = pid_v * BV + tl.arange(0, BV)
    w_cols = w_ptr + h.to(tl.int64) * s_w_h + v[None, :] * s_w_v  # W_UV[h, v, k] as a [BK, BV] tile
    kk = tl.arange(0, BK)
    acc = tl.zeros([BT, BV], tl.float32)
    for k0 in range(0, RA, BK):
        k = k0 + kk
        po = tl.load(po_ptr + base[:, :, None] * R + k[None, None, :], mask=take & (k < RA)[None, None, :],
                     other=0.0, cache_modifier=CACHE)
        o = round_to(tl.sum(po * w[:, :, None], 1) / den, DT)  # [BT, BK]
        wt = tl.load(w_cols + k[:, None], mask=(k[:, None] < RA) & (v[None, :] < V), other=0.0)
        if BT == 1:
            acc += tl.sum(o[:, :, None] * wt.to(tl.float32)[None, :, :], 1)
        elif IEEE:  # float32 models, and the interpreter (whose bf16 tl.dot is wrong): exact float32 products
            acc = tl.dot(o, wt.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(o.to(wt.dtype), wt, acc)
    out = o_ptr + (t[:, None] * H + h) * V + v[None, :]
    tl.store(out, round_to(acc, DT).to(o_ptr.dtype.element_ty), mask=tm[:, None] & (v[None, :] < V))


@triton.jit
def _mla_combine_project_kernel(po_ptr, plse_ptr, w_ptr, o_ptr, s_w_h, s_w_v, T, H, V, RA, num_splits,
                                R: tl.constexpr, S_PAD: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr,
                                BK: tl.constexpr, DT: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
    """The combine with W_UV applied (:func:`_combine_project_tile`): program (token tile, head, tile of the V
    outputs)."""
    pdl_prologue(PDL)
    _combine_project_tile(tl.program_id(0), tl.program_id(1), tl.program_id(2), po_ptr, plse_ptr, w_ptr, o_ptr, s_w_h,
                          s_w_v, T, H, V, RA, num_splits, R, S_PAD, BT, BV, BK, DT, IEEE, "")


@triton.jit
def _mla_project_kernel(
    q_ptr, stride_qt, stride_qh, cache_ptr, c32_ptr, c16_ptr, bt_ptr, stride_bt, req_ptr, pos_ptr, stride_pt, K,
    po_ptr, plse_ptr, H, sm_scale_log2, split_len, num_splits, n_rows,
    w_ptr, o_ptr, s_w_h, s_w_v, T, V, RA, task_ptr,
    BS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, N_HB: tl.constexpr, FP8: tl.constexpr,
    SPARSE: tl.constexpr, IEEE: tl.constexpr, USE_TMA: tl.constexpr, S_PAD: tl.constexpr, BT: tl.constexpr,
    BV: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr, MAX_DEPS: tl.constexpr, PDL: tl.constexpr,
):
    """The split-KV MLA and its combine with W_UV in one launch of tasks (:mod:`fxglm5.lowering.triton.tasks`; up
    to ``FUSE_MAX_TOKENS`` tokens, :func:`project_fuses`). Each CTA takes a task id: tasks [0, T x N_HB x
    num_splits) are the (token, head block, split) programs of :func:`_mla_fwd_kernel` (:func:`_mla_split`, token
    by token), each storing its partial and log-sum-exp, then signalling its token tile's counter (dependency
    ``t // BT``); the rest are the (token tile, head, V tile) programs of :func:`_mla_combine_project_kernel`
    (:func:`_combine_project_tile`), each waiting until every split of its tile's tokens has signalled, then reading
    the partials from L2. A task waits only on tasks before it, so the launch cannot deadlock (tasks' module doc).
    The same code as the two launches, so their bits where the launches run the same warps."""
    pdl_prologue(PDL)
    task = tasks.take(task_ptr)
    splits = T * N_HB * num_splits
    if task < splits:
        pid = task // num_splits
        t = pid // N_HB
        _mla_split(t, pid % N_HB, task % num_splits, q_ptr, stride_qt, stride_qh, cache_ptr, c32_ptr, c16_ptr, bt_ptr,
                   stride_bt, req_ptr, pos_ptr, stride_pt, K, o_ptr, 0, 0, po_ptr, plse_ptr, H, sm_scale_log2,
                   split_len, num_splits, n_rows, BS, BLOCK_H, BLOCK_N, FP8, SPARSE, False, IEEE, USE_TMA)
        tasks.signal(task_ptr, t // BT)
    else:
        c = task - splits
        n_v = tl.cdiv(V, BV)
        pid_t = c // (H * n_v)
        tasks.wait(task_ptr, pid_t, tl.minimum(BT, T - pid_t * BT) * N_HB * num_splits)
        _combine_project_tile(pid_t, c // n_v % H, c % n_v, po_ptr, plse_ptr, w_ptr, o_ptr, s_w_h, s_w_v, T, H, V, RA,
                              num_splits, 512, S_PAD, BT, BV, BK, DT, IEEE, ".cg")
    tasks.finish(task_ptr, MAX_DEPS)


# GPU launch configurations, picked per (H, K, num_splits, dtypes) by triton.autotune at the first call (an
# eager warm-up call, before any CUDA-graph capture). BLOCK_H stays 64 (all GLM-5 heads in one program).
# Shared memory per stage is one BLOCK_N x 576 tile (+ the 64 x 576 queries): BLOCK_N=64 fits two stages.
_SPARSE_CONFIGS = [
    triton.Config({"BLOCK_N": 32}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_N": 32}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_N": 64}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_N": 16}, num_warps=8, num_stages=4),
]
_DENSE_CONFIGS = [
    triton.Config({"BLOCK_N": 64, "USE_TMA": True}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_N": 32, "USE_TMA": True}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_N": 32, "USE_TMA": True}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_N": 32}, num_warps=8, num_stages=3),
]
_mla_sparse_tuned = triton.autotune(configs=_SPARSE_CONFIGS, key=["H", "K", "num_splits"])(_mla_fwd_kernel)
_mla_dense_tuned = triton.autotune(configs=_DENSE_CONFIGS, key=["H", "num_splits"])(_mla_fwd_kernel)
_LAST: dict = {}


def tuned_config(kernel=None):
    """The launch of the last call: the Hopper kernel's fixed one, or the configuration the autotuner picked
    (None before the first GPU call)."""
    if kernel is None and _LAST.get("impl") == "hopper":
        rows, keys_as_rows = _LAST["rows"]
        return dict(kernel="hopper-gluon", BLOCK_N=mla_hopper.BLOCK_N, stages=mla_hopper.STAGES,
                    num_warps=4 if keys_as_rows else 8, mma_rows="keys" if keys_as_rows else "heads", heads=rows,
                    splits=_LAST["splits"])
    bc = getattr(kernel or _LAST.get("tuner"), "best_config", None)
    return None if bc is None else dict(bc.kwargs, num_warps=bc.num_warps, num_stages=bc.num_stages)


def cache_views(cache):
    if cache.dtype == torch.uint8:
        return cache, cache.view(torch.float32), cache.view(torch.int16), True
    return cache, cache, cache, False


def _pick_block_h(H: int) -> int:
    return max(16, min(64, triton.next_power_of_2(H)))


def pick_num_splits(units: int, max_len: int, sms: int, max_splits: int = 256) -> int:
    """Split count from shapes only: minimize waves x (64-row tiles per split + a per-split overhead of 2).

    ``max_splits`` is 256, not 64, so that one long row fills the GPU: at batch 1 / 32k the 64-split cap left
    68 of 132 SMs idle, and 128 splits measured faster at 32k and 131k, bf16 and FP8 (docs/perf/attention.md,
    mla_decode_splits)."""
    best, best_cost = 1, None
    for s in range(1, max(1, min(max_splits, triton.cdiv(max(max_len, 1), 64))) + 1):
        cost = triton.cdiv(units * s, sms) * (triton.cdiv(max(max_len, 1), s * 64) + 2)
        if best_cost is None or cost < best_cost:
            best, best_cost = s, cost
    return best


def _default_cfg(q, sparse):
    if settings.triton_interpret() or q.device.type != "cuda":
        return dict(BLOCK_N=16, num_warps=4, num_stages=1)
    if sparse or q.dtype == torch.float32:
        return dict(BLOCK_N=32, num_warps=8, num_stages=3)
    return dict(BLOCK_N=64, num_warps=8, num_stages=2, USE_TMA=True)


def project_fuses(T: int, w_uv) -> bool:
    """Whether the combine with W_UV runs in the MLA's launch (:func:`_mla_project_kernel`, the Hopper kernel's
    ``mla_hopper._mla_hopper_project_kernel``): up to ``FUSE_MAX_TOKENS`` tokens (decode) with W_UV to apply. Chosen
    per call inside the op (as the indexer's one-launch logits + top-k is), not by a pass: the graph's op is the same
    either way, only its launches differ, and the choice depends on the step's token count, which a pass over the
    graph (dynamic token dims) does not know. Past 16 tokens (decode batches of a rank are at most that) the two
    launches stay, and so a launch's token tiles, whose dependency counters its last CTA resets, stay at most 16."""
    return w_uv is not None and 0 < T <= FUSE_MAX_TOKENS


def launch_mla(q, cache, block_table, req_idx, pos_or_topk, scale: float, *, sparse: bool,
               num_splits: int | None = None, out: torch.Tensor | None = None, cfg: dict | None = None,
               w_uv: torch.Tensor | None = None, fuse: bool | None = None):
    """Launch MLA (dense or sparse). ``num_splits=None`` picks from the shapes only.

    With ``w_uv`` [H, V, R] the output is the value heads [T, H, V] (:func:`fxglm5.lowering.reference.paged.project_out`
    of the latent output): the attention kernel always writes split partials (one split too) and the combine applies
    W_UV (:func:`_mla_combine_project_kernel`), so a decode step's attention ends in that one kernel, inside the PDL
    chain, where the unfused path ran the combine (at more than one split) and then a cuBLAS GEMM. Up to
    ``FUSE_MAX_TOKENS`` tokens (``fuse=None``: :func:`project_fuses`) the attention and that combine are one launch
    of tasks (:func:`_mla_project_kernel`, on Hopper ``mla_hopper.launch_project``); ``fuse=False`` keeps the two
    launches (the comparison the tests make), ``fuse=True`` asks for the one (W_UV and at most 16 tokens).

    ``cfg=None`` takes the Hopper kernel where it applies (:func:`mla_hopper.supported`), else the Triton
    kernel autotuned (the one-launch kernel: :func:`_project_cfg`); ``cfg={"kernel": "hopper"}`` forces the Hopper
    kernel (an error where it does not apply), ``{"kernel": "hopper64"}`` with the heads as its 64 MMA rows whatever
    their count (:func:`mla_hopper.rows_for`); ``cfg={}`` forces the autotuned Triton kernel, any other ``cfg`` one
    explicit Triton launch."""
    T, H, _ = q.shape
    R = 512
    fused = project_fuses(T, w_uv) and settings.joins("mla_project") if fuse is None else fuse
    if fused and not project_fuses(T, w_uv):
        raise ValueError(f"launch_mla: fuse=True needs W_UV and at most {FUSE_MAX_TOKENS} tokens, not {T}")
    if out is None:
        out = torch.empty(T, H, R if w_uv is None else w_uv.shape[1], dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    BLOCK_H = (cfg or {}).get("BLOCK_H") or _pick_block_h(H)
    n_hb = triton.cdiv(H, BLOCK_H)
    max_len = pos_or_topk.shape[1] if sparse else block_table.shape[1] * cache.shape[1]
    force_hopper = cfg is not None and cfg.get("kernel") in ("hopper", "hopper64")
    hopper_ok = not settings.triton_interpret() and mla_hopper.supported(q, cache, sparse=sparse)
    keys_as_rows = False if force_hopper and cfg["kernel"] == "hopper64" else None
    hopper = (cfg is None or force_hopper) and hopper_ok
    if num_splits is None:
        # A dense keys-as-rows Hopper program (one warpgroup) counts as half an SM in the pick: measured, not
        # derived (B=64 / 32k / 8 heads, bf16 cache: 623 us with the 1 x SMs pick of 2 splits, 552 us with 4;
        # bench/results/gluon_gemm_moe_mla_h8_a4d0c02). Its ~156 KB of shared memory keeps one program resident per SM (the session-20
        # profile, bench/results/kernel_goals_ncu_17c1af7), so the gain is not co-residency. Sparse rows measured slower with
        # the larger split count, so they keep 1 x SMs.
        dense_pairs = hopper and not sparse and mla_hopper.rows_for(H, keys_as_rows)[1]
        num_splits = pick_num_splits(T * n_hb, max_len, num_sms(q.device) * (2 if dense_pairs else 1))
    split_len = triton.cdiv(triton.cdiv(max(max_len, 1), num_splits), 64) * 64
    num_splits = max(1, triton.cdiv(max(max_len, 1), split_len))
    if sparse and max_len == 0:
        out.zero_()
        return out
    direct = num_splits == 1 and w_uv is None
    if direct:
        po = plse = out  # unused
    else:
        po = torch.empty(T, num_splits, H, R, dtype=torch.float32, device=q.device)
        plse = torch.empty(T, num_splits, H, dtype=torch.float32, device=q.device)
    if force_hopper and not hopper_ok:
        raise ValueError(f"launch_mla: cfg={cfg} asks for the Hopper kernel, which does not serve these inputs "
                         f"(q {tuple(q.shape)} {q.dtype} on {q.device}, cache {cache.dtype})")
    if w_uv is not None:
        w_uv = w_uv.to(q.dtype)
        if w_uv.stride(-1) != 1:
            w_uv = w_uv.contiguous()
    if fused and hopper and not mla_hopper.project_supported(w_uv):
        fused = False  # the Hopper MLA, then the Triton combine
    _LAST["fused"] = fused
    if hopper:
        _LAST["impl"] = "hopper"
        _LAST["rows"] = mla_hopper.rows_for(H, keys_as_rows)
        _LAST["splits"] = num_splits
        ensure_tma_allocator()
        if fused:
            mla_hopper.launch_project(q, cache, block_table, req_idx, pos_or_topk, float(scale) * LOG2E, split_len,
                                      num_splits, po, plse, w_uv, out, tasks.counters(q.device, FUSE_MAX_TOKENS),
                                      sparse=sparse, keys_as_rows=keys_as_rows)
        else:
            mla_hopper.launch(q, cache, block_table, req_idx, pos_or_topk, float(scale) * LOG2E, split_len,
                              num_splits, out, po, plse, sparse=sparse, direct=direct, keys_as_rows=keys_as_rows)
    elif fused:
        _LAST["impl"] = "triton"
        _launch_triton_project(q, cache, block_table, req_idx, pos_or_topk, scale, po, plse, w_uv, out, BLOCK_H,
                               num_splits, split_len, sparse, cfg)
    else:
        _LAST["impl"] = "triton"
        _launch_triton(q, cache, block_table, req_idx, pos_or_topk, scale, out, po, plse, BLOCK_H, num_splits,
                       split_len, sparse, direct, cfg)
    if fused:
        return out
    if w_uv is not None:
        _combine_project(po, plse, w_uv, out, num_splits)
    elif not direct:
        S_PAD = max(2, triton.next_power_of_2(num_splits))
        BLOCK_D = 128 if S_PAD <= 16 else min(64, 4096 // S_PAD)  # at most 4096 partials a program past 16 splits
        _mla_combine_kernel[(T, H, R // BLOCK_D)](po, plse, out, out.stride(0), out.stride(1), H, num_splits, R=R,
                                                  S_PAD=S_PAD, BLOCK_D=BLOCK_D, num_warps=4, **pdl(q.device))
    return out


def project_tiles(T: int, num_splits: int, RA: int) -> tuple[int, int, int, int]:
    """(S_PAD, BT, BV, BK) of the combine with W_UV (:func:`_combine_project_tile`): token tiles of 16 or 64
    (tensor-core MMAs) where the tokens fill them and the [tokens, splits, columns] partial tile stays within 8K
    values; else one token a program (a GEMV: at decode 8 heads x 8 tiles of 32 outputs give 64 programs, each
    reading its 32 x 512 slice of W_UV)."""
    S_PAD = max(2, triton.next_power_of_2(num_splits))
    BT = 64 if T >= 64 and S_PAD <= 8 else 16 if T >= 16 and S_PAD <= 32 else 1
    BV = 32 if BT == 1 else 64
    BK = max(16, min(128, 8192 // (BT * S_PAD), triton.next_power_of_2(RA)))
    return S_PAD, BT, BV, BK


def _combine_project(po, plse, w_uv, out, num_splits):
    """Launch :func:`_mla_combine_project_kernel` over the tiles of :func:`project_tiles` (``COMBINE_WARPS`` warps)."""
    T, H, V = out.shape
    RA = w_uv.shape[2]
    if w_uv.stride(-1) != 1:
        w_uv = w_uv.contiguous()
    S_PAD, BT, BV, BK = project_tiles(T, num_splits, RA)
    _mla_combine_project_kernel[(triton.cdiv(T, BT), H, triton.cdiv(V, BV))](
        po, plse, w_uv, out, w_uv.stride(0), w_uv.stride(1), T, H, V, RA, num_splits, R=512, S_PAD=S_PAD, BT=BT,
        BV=BV, BK=BK, DT=DTYPE_CODES[out.dtype], IEEE=out.dtype == torch.float32 or settings.triton_interpret(),
        num_warps=COMBINE_WARPS, **pdl(out.device))


def _project_cfg(q, sparse: bool, block_h: int, cfg: dict | None) -> dict:
    """The launch of :func:`_mla_project_kernel`: an explicit ``cfg`` as it is (TMA only when asked for), else no
    autotuning (a launch of tasks holds both roles' code, and where it serves on a GPU, off Hopper, it has not been
    timed): up to 16 heads a program (GLM-5's TP8 rank), 32-row gathered tiles, dense too, at ``COMBINE_WARPS`` warps
    (the combine tasks then run at the warps of the combine's own launch, so the two launches' bits where the MLA's
    launch runs that configuration too; compiled for sm_90 it spills nothing, where the dense TMA tiles of 64 rows
    spilled at 4 and 8 warps, as the MLA's own launch does); else :func:`_default_cfg`."""
    if cfg:
        c = dict(USE_TMA=False)
        c.update({k: v for k, v in cfg.items() if k != "BLOCK_H"})
        return c
    if q.device.type == "cuda" and not settings.triton_interpret() and block_h <= 16 and q.dtype != torch.float32:
        return dict(BLOCK_N=32, num_warps=COMBINE_WARPS, num_stages=3)
    return dict(_default_cfg(q, sparse))


def _launch_triton_project(q, cache, block_table, req_idx, pos_or_topk, scale, po, plse, w_uv, out, BLOCK_H,
                           num_splits, split_len, sparse, cfg):
    """Launch :func:`_mla_project_kernel`: the split tasks (the grid of :func:`_launch_triton`, token by token),
    then the combine's tiles (:func:`project_tiles`), one CTA each."""
    T, H, _ = q.shape
    V, RA = w_uv.shape[1], w_uv.shape[2]
    bs = cache.shape[1]
    c8, c32, c16, fp8 = cache_views(cache)
    K, stride_pt = (pos_or_topk.shape[1], pos_or_topk.stride(0)) if sparse else (0, 0)
    n_hb = triton.cdiv(H, BLOCK_H)
    S_PAD, BT, BV, BK = project_tiles(T, num_splits, RA)
    c = _project_cfg(q, sparse, BLOCK_H, cfg)
    if c.get("USE_TMA") and cache.data_ptr() % 16 != 0:
        c["USE_TMA"] = False
    if c.get("USE_TMA"):
        ensure_tma_allocator()
    grid = (T * n_hb * num_splits + triton.cdiv(T, BT) * H * triton.cdiv(V, BV),)
    _mla_project_kernel[grid](
        q, q.stride(0), q.stride(1), c8, c32, c16, block_table, block_table.stride(0), req_idx, pos_or_topk, stride_pt,
        K, po, plse, H, float(scale) * LOG2E, split_len, num_splits, cache.shape[0] * bs,
        w_uv, out, w_uv.stride(0), w_uv.stride(1), T, V, RA, tasks.counters(q.device, FUSE_MAX_TOKENS),
        BS=bs, BLOCK_H=BLOCK_H, BLOCK_N=c["BLOCK_N"], N_HB=n_hb, FP8=fp8, SPARSE=sparse,
        IEEE=(q.dtype == torch.float32) or settings.triton_interpret(), USE_TMA=bool(c.get("USE_TMA", False)),
        S_PAD=S_PAD, BT=BT, BV=BV, BK=BK, DT=DTYPE_CODES[out.dtype], MAX_DEPS=FUSE_MAX_TOKENS,
        num_warps=c["num_warps"], num_stages=c["num_stages"], **pdl(q.device))


def _launch_triton(q, cache, block_table, req_idx, pos_or_topk, scale, out, po, plse, BLOCK_H, num_splits,
                   split_len, sparse, direct, cfg):
    """The generic Triton kernel: autotuned on CUDA, a fixed (or the explicit ``cfg``) launch elsewhere."""
    T, H, _ = q.shape
    bs = cache.shape[1]
    c8, c32, c16, fp8 = cache_views(cache)
    K, stride_pt = (pos_or_topk.shape[1], pos_or_topk.stride(0)) if sparse else (0, 0)
    n_hb = triton.cdiv(H, BLOCK_H)
    grid = (T * n_hb, num_splits)
    args = (q, q.stride(0), q.stride(1), c8, c32, c16, block_table, block_table.stride(0), req_idx,
            pos_or_topk, stride_pt, K, out, out.stride(0), out.stride(1), po, plse,
            H, float(scale) * LOG2E, split_len, num_splits, cache.shape[0] * bs)
    const = dict(BS=bs, BLOCK_H=BLOCK_H, N_HB=n_hb, FP8=fp8, SPARSE=sparse, DIRECT=direct,
                 IEEE=(q.dtype == torch.float32) or settings.triton_interpret())
    use_tuner = not (settings.triton_interpret() or q.device.type != "cuda" or settings.no_autotune()) and not cfg
    if use_tuner and not sparse and cache.data_ptr() % 16 != 0:  # TMA needs a 16-byte aligned base
        use_tuner = False
    if use_tuner:
        tuner = _mla_sparse_tuned if sparse else _mla_dense_tuned
        if not sparse:
            ensure_tma_allocator()
        _LAST["tuner"] = tuner
        tuner[grid](*args, **const, **pdl(q.device))
    else:
        c = dict(_default_cfg(q, sparse))
        if cfg:  # an explicit config names every option it wants (TMA only when asked for)
            c["USE_TMA"] = False
            c.update({k: v for k, v in cfg.items() if k != "BLOCK_H"})
        if c.get("USE_TMA") and cache.data_ptr() % 16 != 0:
            c["USE_TMA"] = False
        if c.get("USE_TMA"):
            ensure_tma_allocator()
        _mla_fwd_kernel[grid](*args, **const, BLOCK_N=c["BLOCK_N"], USE_TMA=bool(c.get("USE_TMA", False)),
                              num_warps=c["num_warps"], num_stages=c["num_stages"], **pdl(q.device))


def dispatch_num_splits(q) -> int | None:
    """1 (no split, the prefill path) when the tokens' head blocks alone fill the GPU twice over; else None
    (split-KV, the count picked from the shapes)."""
    n_hb = triton.cdiv(q.shape[1], _pick_block_h(q.shape[1]))
    return 1 if q.shape[0] * n_hb >= 2 * num_sms(q.device) else None


def launch_dispatched(q, cache, block_table, req_idx, pos_or_topk, scale: float, *, sparse: bool, out=None,
                      w_uv=None):
    """The dispatchers' launch: split-KV decode when the tokens alone do not fill the GPU, W_UV (if given) applied
    in its combine; else the prefill path, one pass per token writing the latent output, then cuBLAS's GEMM for
    W_UV (:func:`fxglm5.lowering.reference.paged.project_out`). The same line splits both: from 2 x SMs tokens
    (264 on an H100, at up to 64 heads) a step is a prefill, where one launch more is nothing next to its work and
    the MLA writes no partials for a combine to project; its GEMM of hundreds to thousands of rows per head stays
    with cuBLAS's tuned kernels (not measured against the Triton tile)."""
    num_splits = dispatch_num_splits(q)
    if num_splits is None or w_uv is None:
        return launch_mla(q, cache, block_table, req_idx, pos_or_topk, scale, sparse=sparse, num_splits=num_splits,
                          out=out, w_uv=w_uv)
    o_lat = launch_mla(q, cache, block_table, req_idx, pos_or_topk, scale, sparse=sparse, num_splits=num_splits)
    return into(ref.project_out(o_lat, w_uv), out)


def into(o, out):
    """``o``, or ``out`` holding it (the dispatchers' ``out=``)."""
    return o if out is None else out.copy_(o)


def mla_decode_paged(q, cache, block_table, req_idx, positions, scale: float, *, num_splits: int | None = None,
                     validate: bool = True, out=None, cfg=None):
    """Split-KV (flash-decoding) MLA; the split count comes from the shapes (graph-safe)."""
    if validate:
        ref.validate_mla_paged(q, cache, block_table, req_idx, positions, scale)
    return launch_mla(q, cache, block_table, req_idx, positions, scale, sparse=False, num_splits=num_splits,
                      out=out, cfg=cfg)


def mla_prefill_paged(q, cache, block_table, req_idx, positions, scale: float, *, validate: bool = True,
                      out=None, cfg=None):
    """Flash-style causal, prefix-aware MLA: one pass per (token, head block), no split."""
    if validate:
        ref.validate_mla_paged(q, cache, block_table, req_idx, positions, scale)
    return launch_mla(q, cache, block_table, req_idx, positions, scale, sparse=False, num_splits=1,
                      out=out, cfg=cfg)


def mla_paged(q, cache, block_table, req_idx, positions, scale: float, *, validate: bool = True, out=None,
              w_uv=None):
    """Dispatch (:func:`launch_dispatched`): split-KV decode when the tokens alone do not fill the GPU, else the
    prefill path; with ``w_uv`` the value heads [T, H, V]."""
    if validate:
        ref.validate_mla_paged(q, cache, block_table, req_idx, positions, scale)
        if w_uv is not None:
            ref.validate_project_out(q, w_uv)
    return launch_dispatched(q, cache, block_table, req_idx, positions, scale, sparse=False, out=out, w_uv=w_uv)
