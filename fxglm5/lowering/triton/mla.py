"""Triton MLA (absorbed, MQA over the 576-wide latent rows) over the paged latent cache.

Same signature and semantics as :func:`fxglm5.lowering.reference.paged.mla_paged`.

One kernel body serves dense (causal, prefix-aware) and sparse (listed top-k positions) attention and both
cache layouts (compute dtype 576 / FP8 ds_mla 656 bytes):
- a program owns one query token and a block of ``BLOCK_H`` heads (all 64 GLM-5 heads in one block, so each
  gathered cache tile feeds [64 x 576] x [576 x BLOCK_N] MMAs and is read once per token, not once per head);
- the 512 latent columns are 4 groups of 128 (the FP8 scale groups): QK = 4 K=128 MMAs + the rope MMA, PV
  accumulates into 4 [BLOCK_H, 128] fp32 accumulators; FP8 rows are converted e4m3 -> bf16 (exact) and the
  per-group power-of-two scale is folded into the scores (QK) and into P (PV), never applied to the tile;
- online softmax (flash-style) over ``BLOCK_N``-row tiles, fp32 accumulation, exp2 domain;
- tile loads: pointer gathers through the block table (sparse and dense), optionally prefetched one tile ahead
  (PREFETCH), or TMA descriptor loads of BLOCK_N contiguous rows inside one cache block (dense, USE_TMA);
  on CUDA, ``triton.autotune`` picks among these per (H, num_splits, dtypes) at the first (eager) call;
- split-KV (flash-decoding): grid axis 1 splits the key range into ``num_splits`` chunks (chosen from the
  shapes by :func:`pick_num_splits`: fewest waves x tiles per split); each writes a partial (normalized) output
  + log-sum-exp and a combine kernel merges them. ``num_splits == 1`` writes the output directly (the prefill
  path: many tokens already fill the machine; queries of a prefill re-read their prefix tiles, mostly from L2).
The number of splits is a function of the shapes only (``T``, ``H``, the block-table width), never of data,
so the launch is CUDA-graph safe (no host sync); buffers are sized by the arguments.
Measured on an H200 (bench/results/kernels_attention.md): far below the bandwidth targets; each iteration
runs 9 small dependent wgmma groups (M=64, N=BLOCK_N) plus the softmax with one CTA per SM, so the loop is
latency-bound, not bandwidth-bound.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from fxglm5.lowering.reference import paged as ref
from fxglm5.lowering.triton.paged_cache import interpreter_compat

interpreter_compat()

__all__ = ["mla_paged", "mla_decode_paged", "mla_prefill_paged", "launch_mla"]

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_NO_TUNE = os.environ.get("FXGLM5_NO_AUTOTUNE", "0") == "1"  # fixed default configs (no tuning compiles)
LOG2E = 1.4426950408889634


@triton.jit
def _mm(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _load_tile(n0, end, t64, req, cache_ptr, c32_ptr, c16_ptr, bt_ptr, stride_bt, pos_ptr, stride_pt,
               BS: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr, SPARSE: tl.constexpr):
    """Gather BLOCK_N cache rows (raw: e4m3 bytes / compute dtype) -> (k0..k3 [BLOCK_N, 128], kpe [BLOCK_N, 64],
    s0..s3 [BLOCK_N] fp32 scales (1 for compute-dtype caches), valid [BLOCK_N])."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    nmask = offs_n < end
    CONTIG: tl.constexpr = (not SPARSE) and (BS % BLOCK_N == 0)
    if SPARSE:
        p = tl.load(pos_ptr + t64 * stride_pt + offs_n, mask=nmask, other=-1)
        valid = nmask & (p >= 0)
        p = tl.maximum(p, 0)
        blk = tl.load(bt_ptr + req * stride_bt + p // BS, mask=valid, other=0).to(tl.int64)
        slot = blk * BS + (p % BS)
    elif CONTIG:  # the tile lies inside one cache block: one block-table read, contiguous rows
        valid = nmask
        blk = tl.load(bt_ptr + req * stride_bt + n0 // BS, mask=n0 < end, other=0).to(tl.int64)
        slot = blk * BS + (n0 % BS) + tl.arange(0, BLOCK_N)
    else:
        valid = nmask
        blk = tl.load(bt_ptr + req * stride_bt + offs_n // BS, mask=valid, other=0).to(tl.int64)
        slot = blk * BS + (offs_n % BS)
    d = tl.arange(0, 128)
    dp = tl.arange(0, 64)
    vm = valid[:, None]
    if FP8:
        row = slot[:, None] * 656 + d[None, :]
        k0 = tl.load(cache_ptr + row, mask=vm, other=0)
        k1 = tl.load(cache_ptr + row + 128, mask=vm, other=0)
        k2 = tl.load(cache_ptr + row + 256, mask=vm, other=0)
        k3 = tl.load(cache_ptr + row + 384, mask=vm, other=0)
        s0 = tl.load(c32_ptr + slot * 164 + 128, mask=valid, other=0.0)
        s1 = tl.load(c32_ptr + slot * 164 + 129, mask=valid, other=0.0)
        s2 = tl.load(c32_ptr + slot * 164 + 130, mask=valid, other=0.0)
        s3 = tl.load(c32_ptr + slot * 164 + 131, mask=valid, other=0.0)
        kpe = tl.load(c16_ptr + slot[:, None] * 328 + 264 + dp[None, :], mask=vm, other=0)
    else:
        row = slot[:, None] * 576 + d[None, :]
        k0 = tl.load(cache_ptr + row, mask=vm, other=0.0)
        k1 = tl.load(cache_ptr + row + 128, mask=vm, other=0.0)
        k2 = tl.load(cache_ptr + row + 256, mask=vm, other=0.0)
        k3 = tl.load(cache_ptr + row + 384, mask=vm, other=0.0)
        kpe = tl.load(cache_ptr + slot[:, None] * 576 + 512 + dp[None, :], mask=vm, other=0.0)
        one = tl.full([BLOCK_N], 1.0, tl.float32)
        s0 = one
        s1 = one
        s2 = one
        s3 = one
    return k0, k1, k2, k3, kpe, s0, s1, s2, s3, valid


@triton.jit
def _tile_step(q0, q1, q2, q3, q_pe, k0, k1, k2, k3, kpe, s0, s1, s2, s3, valid,
               m_i, l_i, acc0, acc1, acc2, acc3, sm_scale_log2,
               BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr, IEEE: tl.constexpr):
    """One online-softmax step over a gathered tile."""
    dt = q0.dtype
    vm = valid[:, None]
    if FP8:
        # e4m3 -> bf16/fp16/fp32 is exact; the per-group scale is folded into the scores and into P
        # (rows past the end are zeroed: TMA tiles may hold stale bytes there, and 0 * NaN would leak into PV)
        k0 = tl.where(vm, k0.to(tl.float8e4nv, bitcast=True).to(dt), 0.0)
        k1 = tl.where(vm, k1.to(tl.float8e4nv, bitcast=True).to(dt), 0.0)
        k2 = tl.where(vm, k2.to(tl.float8e4nv, bitcast=True).to(dt), 0.0)
        k3 = tl.where(vm, k3.to(tl.float8e4nv, bitcast=True).to(dt), 0.0)
        kpe = kpe.to(tl.bfloat16, bitcast=True).to(dt)
        zero = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
        qk = _mm(q_pe, tl.trans(kpe), zero, IEEE)
        qk += _mm(q0, tl.trans(k0), zero, IEEE) * s0[None, :]
        qk += _mm(q1, tl.trans(k1), zero, IEEE) * s1[None, :]
        qk += _mm(q2, tl.trans(k2), zero, IEEE) * s2[None, :]
        qk += _mm(q3, tl.trans(k3), zero, IEEE) * s3[None, :]
    else:
        # the select between the load and the MMAs also lets the pipeliner stage the tile (a loaded tile that
        # feeds both QK^T and PV straight from shared memory is not pipelined)
        k0 = tl.where(vm, k0, 0.0).to(dt)
        k1 = tl.where(vm, k1, 0.0).to(dt)
        k2 = tl.where(vm, k2, 0.0).to(dt)
        k3 = tl.where(vm, k3, 0.0).to(dt)
        kpe = kpe.to(dt)
        qk = _mm(q0, tl.trans(k0), tl.zeros([BLOCK_H, BLOCK_N], tl.float32), IEEE)
        qk = _mm(q1, tl.trans(k1), qk, IEEE)
        qk = _mm(q2, tl.trans(k2), qk, IEEE)
        qk = _mm(q3, tl.trans(k3), qk, IEEE)
        qk = _mm(q_pe, tl.trans(kpe), qk, IEEE)
    qk = qk * sm_scale_log2
    qk = tl.where(valid[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    pr = tl.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(pr, 1)
    if FP8:
        acc0 = _mm((pr * s0[None, :]).to(dt), k0, acc0 * alpha[:, None], IEEE)
        acc1 = _mm((pr * s1[None, :]).to(dt), k1, acc1 * alpha[:, None], IEEE)
        acc2 = _mm((pr * s2[None, :]).to(dt), k2, acc2 * alpha[:, None], IEEE)
        acc3 = _mm((pr * s3[None, :]).to(dt), k3, acc3 * alpha[:, None], IEEE)
    else:
        pb = pr.to(dt)
        acc0 = _mm(pb, k0, acc0 * alpha[:, None], IEEE)
        acc1 = _mm(pb, k1, acc1 * alpha[:, None], IEEE)
        acc2 = _mm(pb, k2, acc2 * alpha[:, None], IEEE)
        acc3 = _mm(pb, k3, acc3 * alpha[:, None], IEEE)
    return m_new, l_i, acc0, acc1, acc2, acc3


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
    FP8: tl.constexpr, SPARSE: tl.constexpr, DIRECT: tl.constexpr, IEEE: tl.constexpr, PREFETCH: tl.constexpr,
    USE_TMA: tl.constexpr = False,
):
    # The 512 latent columns are handled as 4 groups of 128 (the FP8 scale groups): QK is 4 K=128 MMAs (+ the
    # rope MMA), PV accumulates into 4 [BLOCK_H, 128] accumulators. PREFETCH issues the next tile's gathers
    # before the current tile's MMAs (register double buffering).
    R: tl.constexpr = 512
    DR: tl.constexpr = 64
    pid = tl.program_id(0)  # head blocks of one token are adjacent: they share the cache tiles through L2
    t = pid // N_HB
    hb = pid % N_HB
    sp = tl.program_id(1)
    t64 = t.to(tl.int64)
    req = tl.load(req_ptr + t).to(tl.int64)

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    dg = tl.arange(0, 128)
    dp = tl.arange(0, DR)
    q_row = q_ptr + t64 * stride_qt + heads[:, None] * stride_qh
    q0 = tl.load(q_row + dg[None, :], mask=hmask[:, None], other=0.0)
    q1 = tl.load(q_row + 128 + dg[None, :], mask=hmask[:, None], other=0.0)
    q2 = tl.load(q_row + 256 + dg[None, :], mask=hmask[:, None], other=0.0)
    q3 = tl.load(q_row + 384 + dg[None, :], mask=hmask[:, None], other=0.0)
    q_pe = tl.load(q_row + R + dp[None, :], mask=hmask[:, None], other=0.0)
    if IEEE:  # fp32 queries, or the interpreter (whose bf16/fp16 tl.dot is wrong): fp32 MMAs
        q0 = q0.to(tl.float32)
        q1 = q1.to(tl.float32)
        q2 = q2.to(tl.float32)
        q3 = q3.to(tl.float32)
        q_pe = q_pe.to(tl.float32)

    if SPARSE:
        n_total = K
    else:
        n_total = tl.load(pos_ptr + t).to(tl.int32) + 1
    start = sp * split_len
    end = tl.minimum(start + split_len, n_total)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, 128], tl.float32)
    acc1 = tl.zeros([BLOCK_H, 128], tl.float32)
    acc2 = tl.zeros([BLOCK_H, 128], tl.float32)
    acc3 = tl.zeros([BLOCK_H, 128], tl.float32)
    if USE_TMA and (not SPARSE) and (BS % BLOCK_N == 0):
        # dense attention, tiles inside one cache block: TMA loads of BLOCK_N contiguous rows (the software
        # pipeliner stages descriptor loads asynchronously; it does not stage these pointer gathers)
        if FP8:
            desc = tl.make_tensor_descriptor(cache_ptr, shape=[n_rows, 656], strides=[656, 1],
                                             block_shape=[BLOCK_N, 128])
            desc_pe = tl.make_tensor_descriptor(c16_ptr, shape=[n_rows, 328], strides=[328, 1],
                                                block_shape=[BLOCK_N, 64])
        else:
            desc = tl.make_tensor_descriptor(cache_ptr, shape=[n_rows, 576], strides=[576, 1],
                                             block_shape=[BLOCK_N, 128])
            desc_pe = tl.make_tensor_descriptor(cache_ptr, shape=[n_rows, 576], strides=[576, 1],
                                                block_shape=[BLOCK_N, 64])
        one = tl.full([BLOCK_N], 1.0, tl.float32)
        for n0 in range(start, end, BLOCK_N):
            blk = tl.load(bt_ptr + req * stride_bt + n0 // BS)
            r0 = blk * BS + (n0 % BS)
            offs_n = n0 + tl.arange(0, BLOCK_N)
            valid = offs_n < end
            k0 = desc.load([r0, 0])
            k1 = desc.load([r0, 128])
            k2 = desc.load([r0, 256])
            k3 = desc.load([r0, 384])
            if FP8:
                kpe = desc_pe.load([r0, 264])
                slot = blk.to(tl.int64) * BS + (n0 % BS) + tl.arange(0, BLOCK_N)
                s0 = tl.load(c32_ptr + slot * 164 + 128, mask=valid, other=0.0)
                s1 = tl.load(c32_ptr + slot * 164 + 129, mask=valid, other=0.0)
                s2 = tl.load(c32_ptr + slot * 164 + 130, mask=valid, other=0.0)
                s3 = tl.load(c32_ptr + slot * 164 + 131, mask=valid, other=0.0)
            else:
                kpe = desc_pe.load([r0, 512])
                s0 = one
                s1 = one
                s2 = one
                s3 = one
            m_i, l_i, acc0, acc1, acc2, acc3 = _tile_step(
                q0, q1, q2, q3, q_pe, k0, k1, k2, k3, kpe, s0, s1, s2, s3, valid,
                m_i, l_i, acc0, acc1, acc2, acc3, sm_scale_log2, BLOCK_H, BLOCK_N, FP8, IEEE)
    elif PREFETCH:
        k0, k1, k2, k3, kpe, s0, s1, s2, s3, valid = _load_tile(
            start, end, t64, req, cache_ptr, c32_ptr, c16_ptr, bt_ptr, stride_bt, pos_ptr, stride_pt,
            BS, BLOCK_N, FP8, SPARSE)
        for n0 in range(start, end, BLOCK_N):
            n0_next = n0 + BLOCK_N
            nk0, nk1, nk2, nk3, nkpe, ns0, ns1, ns2, ns3, nvalid = _load_tile(
                n0_next, end, t64, req, cache_ptr, c32_ptr, c16_ptr, bt_ptr, stride_bt, pos_ptr, stride_pt,
                BS, BLOCK_N, FP8, SPARSE)
            m_i, l_i, acc0, acc1, acc2, acc3 = _tile_step(
                q0, q1, q2, q3, q_pe, k0, k1, k2, k3, kpe, s0, s1, s2, s3, valid,
                m_i, l_i, acc0, acc1, acc2, acc3, sm_scale_log2, BLOCK_H, BLOCK_N, FP8, IEEE)
            k0, k1, k2, k3, kpe, s0, s1, s2, s3, valid = nk0, nk1, nk2, nk3, nkpe, ns0, ns1, ns2, ns3, nvalid
    else:
        for n0 in range(start, end, BLOCK_N):
            k0, k1, k2, k3, kpe, s0, s1, s2, s3, valid = _load_tile(
                n0, end, t64, req, cache_ptr, c32_ptr, c16_ptr, bt_ptr, stride_bt, pos_ptr, stride_pt,
                BS, BLOCK_N, FP8, SPARSE)
            m_i, l_i, acc0, acc1, acc2, acc3 = _tile_step(
                q0, q1, q2, q3, q_pe, k0, k1, k2, k3, kpe, s0, s1, s2, s3, valid,
                m_i, l_i, acc0, acc1, acc2, acc3, sm_scale_log2, BLOCK_H, BLOCK_N, FP8, IEEE)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    inv = (1.0 / l_safe)[:, None]
    if DIRECT:
        o_row = o_ptr + t64 * stride_ot + heads[:, None] * stride_oh + dg[None, :]
        ty = o_ptr.dtype.element_ty
        tl.store(o_row, (acc0 * inv).to(ty), mask=hmask[:, None])
        tl.store(o_row + 128, (acc1 * inv).to(ty), mask=hmask[:, None])
        tl.store(o_row + 256, (acc2 * inv).to(ty), mask=hmask[:, None])
        tl.store(o_row + 384, (acc3 * inv).to(ty), mask=hmask[:, None])
    else:
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        base = (t64 * num_splits + sp) * H + heads
        po_row = po_ptr + base[:, None] * R + dg[None, :]
        tl.store(po_row, acc0 * inv, mask=hmask[:, None])
        tl.store(po_row + 128, acc1 * inv, mask=hmask[:, None])
        tl.store(po_row + 256, acc2 * inv, mask=hmask[:, None])
        tl.store(po_row + 384, acc3 * inv, mask=hmask[:, None])
        tl.store(plse_ptr + base, lse, mask=hmask)


@triton.jit
def _mla_combine_kernel(po_ptr, plse_ptr, o_ptr, stride_ot, stride_oh, H, num_splits,
                        R: tl.constexpr, S_PAD: tl.constexpr, BLOCK_D: tl.constexpr):
    """Merge the split partials of one (token, head, column chunk): all splits loaded at once."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    c = tl.program_id(2)
    sp = tl.arange(0, S_PAD)
    smask = sp < num_splits
    base = (t * num_splits + sp) * H + h
    lse = tl.load(plse_ptr + base, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.where(smask, tl.exp2(lse - m_safe), 0.0)
    wsum = tl.sum(w, 0)
    d = c * BLOCK_D + tl.arange(0, BLOCK_D)
    po = tl.load(po_ptr + base[:, None] * R + d[None, :], mask=smask[:, None] & (w[:, None] > 0.0), other=0.0)
    acc = tl.sum(po * w[:, None], 0) / tl.where(wsum > 0.0, wsum, 1.0)
    tl.store(o_ptr + t * stride_ot + h * stride_oh + d, acc.to(o_ptr.dtype.element_ty))


# GPU launch configurations, picked per (H, K, num_splits, dtypes) by triton.autotune at the first call (an
# eager warm-up call, before any CUDA-graph capture). BLOCK_H stays 64 (all GLM-5 heads in one program).
# Dense attention may also use TMA tile loads (USE_TMA: contiguous rows inside one cache block).
_SPARSE_CONFIGS = [
    triton.Config({"BLOCK_N": 32, "PREFETCH": False}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_N": 32, "PREFETCH": True}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_N": 16, "PREFETCH": True}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_N": 64, "PREFETCH": False}, num_warps=8, num_stages=2),
]
_DENSE_CONFIGS = _SPARSE_CONFIGS[:3] + [
    triton.Config({"BLOCK_N": 32, "PREFETCH": False, "USE_TMA": True}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_N": 64, "PREFETCH": False, "USE_TMA": True}, num_warps=8, num_stages=2),
    triton.Config({"BLOCK_N": 64, "PREFETCH": False}, num_warps=8, num_stages=2),
]
_mla_sparse_tuned = triton.autotune(configs=_SPARSE_CONFIGS, key=["H", "K", "num_splits"])(_mla_fwd_kernel)
_mla_dense_tuned = triton.autotune(configs=_DENSE_CONFIGS, key=["H", "num_splits"])(_mla_fwd_kernel)
_LAST: dict = {}


def _ensure_allocator():
    """TMA descriptors built in-kernel need a global scratch allocator (set once, if nobody set one)."""
    from triton.runtime import _allocation

    if _allocation._allocator.get() is _allocation._NULL_ALLOCATOR:
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))


def tuned_config(kernel=None):
    """The configuration the autotuner picked for the last launch (None before the first GPU call)."""
    bc = getattr(kernel or _LAST.get("tuner"), "best_config", None)
    return None if bc is None else dict(bc.kwargs, num_warps=bc.num_warps, num_stages=bc.num_stages)


def _cache_views(cache):
    if cache.dtype == torch.uint8:
        return cache, cache.view(torch.float32), cache.view(torch.int16), True
    return cache, cache, cache, False


def _num_sms(device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _pick_block_h(H: int) -> int:
    return max(16, min(64, triton.next_power_of_2(H)))


def pick_num_splits(units: int, max_len: int, sms: int, max_splits: int = 64) -> int:
    """Split count from shapes only: minimize waves x (64-row tiles per split + a per-split overhead of 2)."""
    best, best_cost = 1, None
    for s in range(1, max(1, min(max_splits, triton.cdiv(max(max_len, 1), 64))) + 1):
        cost = triton.cdiv(units * s, sms) * (triton.cdiv(max(max_len, 1), s * 64) + 2)
        if best_cost is None or cost < best_cost:
            best, best_cost = s, cost
    return best


def _default_cfg(q, fp8, sparse, split):
    if _INTERPRET or q.device.type != "cuda":
        return dict(BLOCK_N=16, num_warps=4, num_stages=1)
    return dict(BLOCK_N=32, num_warps=8, num_stages=2, USE_TMA=not sparse and q.dtype != torch.float32)


def launch_mla(q, cache, block_table, req_idx, pos_or_topk, scale: float, *, sparse: bool,
               num_splits: int | None = None, out: torch.Tensor | None = None, cfg: dict | None = None):
    """Launch the shared MLA kernel (dense or sparse). ``num_splits=None`` picks from the shapes only."""
    T, H, _ = q.shape
    R = 512
    if out is None:
        out = torch.empty(T, H, R, dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    c8, c32, c16, fp8 = _cache_views(cache)
    bs = cache.shape[1]
    BLOCK_H = (cfg or {}).get("BLOCK_H") or _pick_block_h(H)
    n_hb = triton.cdiv(H, BLOCK_H)
    if sparse:
        K = pos_or_topk.shape[1]
        max_len = K
        stride_pt = pos_or_topk.stride(0)
    else:
        K = 0
        max_len = block_table.shape[1] * bs
        stride_pt = 0
    if num_splits is None:
        num_splits = pick_num_splits(T * n_hb, max_len, _num_sms(q.device))
    split_len = triton.cdiv(triton.cdiv(max(max_len, 1), num_splits), 64) * 64
    num_splits = max(1, triton.cdiv(max(max_len, 1), split_len))
    if K == 0 and sparse:
        out.zero_()
        return out
    direct = num_splits == 1
    if direct:
        po = plse = out  # unused
    else:
        po = torch.empty(T, num_splits, H, R, dtype=torch.float32, device=q.device)
        plse = torch.empty(T, num_splits, H, dtype=torch.float32, device=q.device)
    grid = (T * n_hb, num_splits)
    args = (q, q.stride(0), q.stride(1), c8, c32, c16, block_table, block_table.stride(0), req_idx,
            pos_or_topk, stride_pt, K, out, out.stride(0), out.stride(1), po, plse,
            H, float(scale) * LOG2E, split_len, num_splits, cache.shape[0] * bs)
    const = dict(BS=bs, BLOCK_H=BLOCK_H, N_HB=n_hb, FP8=fp8, SPARSE=sparse, DIRECT=direct,
                 IEEE=(q.dtype == torch.float32) or _INTERPRET)
    use_tuner = not (_INTERPRET or q.device.type != "cuda" or _NO_TUNE) and not cfg
    if use_tuner and not sparse and cache.data_ptr() % 16 != 0:  # TMA needs a 16-byte aligned base
        use_tuner = False
    if use_tuner:
        tuner = _mla_sparse_tuned if sparse else _mla_dense_tuned
        if not sparse:
            _ensure_allocator()
        _LAST["tuner"] = tuner
        tuner[grid](*args, **const)
    else:
        c = dict(_default_cfg(q, fp8, sparse, num_splits > 1))
        if cfg:  # an explicit config names every option it wants (TMA only when asked for)
            c["USE_TMA"] = False
            c.update({k: v for k, v in cfg.items() if k != "BLOCK_H"})
        if c.get("USE_TMA") and cache.data_ptr() % 16 != 0:
            c["USE_TMA"] = False
        if c.get("USE_TMA"):
            _ensure_allocator()
        _mla_fwd_kernel[grid](*args, **const, BLOCK_N=c["BLOCK_N"], PREFETCH=c.get("PREFETCH", False),
                              USE_TMA=bool(c.get("USE_TMA", False)), num_warps=c["num_warps"],
                              num_stages=c["num_stages"])
    if not direct:
        S_PAD = max(2, triton.next_power_of_2(num_splits))
        BLOCK_D = 128 if S_PAD <= 16 else 64
        _mla_combine_kernel[(T, H, R // BLOCK_D)](po, plse, out, out.stride(0), out.stride(1), H, num_splits, R=R,
                                                  S_PAD=S_PAD, BLOCK_D=BLOCK_D, num_warps=4)
    return out


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


def mla_paged(q, cache, block_table, req_idx, positions, scale: float, *, validate: bool = True, out=None):
    """Dispatch: split-KV decode when the tokens alone do not fill the GPU, else the prefill path."""
    if validate:
        ref.validate_mla_paged(q, cache, block_table, req_idx, positions, scale)
    n_hb = triton.cdiv(q.shape[1], _pick_block_h(q.shape[1]))
    if q.shape[0] * n_hb >= 2 * _num_sms(q.device):
        return launch_mla(q, cache, block_table, req_idx, positions, scale, sparse=False, num_splits=1, out=out)
    return launch_mla(q, cache, block_table, req_idx, positions, scale, sparse=False, out=out)
