"""Triton MLA (absorbed, MQA over the 576-wide latent rows) over the paged latent cache.

Same signature and semantics as :func:`fxglm5.lowering.reference.paged.mla_paged`.

One kernel body serves dense (causal, prefix-aware) and sparse (listed top-k positions) attention and both
cache layouts (compute dtype 576 / FP8 ds_mla 656 bytes, dequantized in-kernel to the query dtype):
- a program owns one query token and a block of ``BLOCK_H`` heads (all 64 GLM-5 heads in one block, so each
  gathered cache tile feeds a [64 x 576] x [576 x BLOCK_N] MMA and is read once per token, not once per head);
- online softmax (flash-style) over ``BLOCK_N``-row tiles, fp32 accumulation, exp2 domain;
- split-KV (flash-decoding): grid axis 1 splits the key range into ``num_splits`` chunks; each writes a
  partial (normalized) output + log-sum-exp, and a combine kernel merges them. ``num_splits == 1`` writes the
  output directly (the prefill path: many tokens already fill the machine; queries of a prefill re-read their
  prefix tiles, mostly from L2).
The number of splits is a function of the shapes only (``T``, ``H``, the block-table width), never of data,
so the launch is CUDA-graph safe (no host sync); buffers are sized by the arguments.
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
LOG2E = 1.4426950408889634


@triton.jit
def _mla_fwd_kernel(
    q_ptr, stride_qt, stride_qh,
    cache_ptr, c32_ptr, c16_ptr,
    bt_ptr, stride_bt, req_ptr,
    pos_ptr, stride_pt, K,
    o_ptr, stride_ot, stride_oh,
    po_ptr, plse_ptr,
    H, sm_scale_log2, split_len, num_splits,
    BS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, N_HB: tl.constexpr,
    FP8: tl.constexpr, SPARSE: tl.constexpr, DIRECT: tl.constexpr, IEEE: tl.constexpr,
):
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
    dr = tl.arange(0, R)
    dp = tl.arange(0, DR)
    q_row = q_ptr + t64 * stride_qt + heads[:, None] * stride_qh
    q_nope = tl.load(q_row + dr[None, :], mask=hmask[:, None], other=0.0)
    q_pe = tl.load(q_row + R + dp[None, :], mask=hmask[:, None], other=0.0)
    if IEEE:  # fp32 queries, or the interpreter (whose bf16/fp16 tl.dot is wrong): fp32 MMAs
        q_nope = q_nope.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
    dt = q_nope.dtype

    if SPARSE:
        n_total = K
    else:
        n_total = tl.load(pos_ptr + t).to(tl.int32) + 1
    start = sp * split_len
    end = tl.minimum(start + split_len, n_total)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, R], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < end
        if SPARSE:
            p = tl.load(pos_ptr + t64 * stride_pt + offs_n, mask=nmask, other=-1)
            valid = nmask & (p >= 0)
            p = tl.maximum(p, 0)
        else:
            p = offs_n
            valid = nmask
        blk = tl.load(bt_ptr + req * stride_bt + p // BS, mask=valid, other=0).to(tl.int64)
        slot = blk * BS + (p % BS)
        if FP8:
            kb = tl.load(cache_ptr + slot[:, None] * 656 + dr[None, :], mask=valid[:, None], other=0)
            ksc = tl.load(c32_ptr + slot[:, None] * 164 + 128 + dr[None, :] // 128, mask=valid[:, None], other=0.0)
            if IEEE:
                kc = kb.to(tl.float8e4nv, bitcast=True).to(tl.float32) * ksc
            else:  # e4m3 -> bf16 is exact, and so is the power-of-two scale: dequantize in 16 bits
                kc = kb.to(tl.float8e4nv, bitcast=True).to(dt) * ksc.to(dt)
            kpb = tl.load(c16_ptr + slot[:, None] * 328 + 264 + dp[None, :], mask=valid[:, None], other=0)
            kpe = kpb.to(tl.bfloat16, bitcast=True).to(dt)
        else:
            kc = tl.load(cache_ptr + slot[:, None] * 576 + dr[None, :], mask=valid[:, None], other=0.0).to(dt)
            kpe = tl.load(cache_ptr + slot[:, None] * 576 + R + dp[None, :], mask=valid[:, None], other=0.0).to(dt)
        if IEEE:
            qk = tl.dot(q_nope, tl.trans(kc), input_precision="ieee")
            qk = tl.dot(q_pe, tl.trans(kpe), qk, input_precision="ieee")
        else:
            qk = tl.dot(q_nope, tl.trans(kc))
            qk = tl.dot(q_pe, tl.trans(kpe), qk)
        qk = qk * sm_scale_log2
        qk = tl.where(valid[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        pr = tl.exp2(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(pr, 1)
        if IEEE:
            acc = tl.dot(pr.to(dt), kc, acc * alpha[:, None], input_precision="ieee")
        else:
            acc = tl.dot(pr.to(dt), kc, acc * alpha[:, None])
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    if DIRECT:
        o_row = o_ptr + t64 * stride_ot + heads[:, None] * stride_oh + dr[None, :]
        tl.store(o_row, out.to(o_ptr.dtype.element_ty), mask=hmask[:, None])
    else:
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        base = (t64 * num_splits + sp) * H + heads
        tl.store(po_ptr + base[:, None] * R + dr[None, :], out, mask=hmask[:, None])
        tl.store(plse_ptr + base, lse, mask=hmask)


@triton.jit
def _mla_combine_kernel(po_ptr, plse_ptr, o_ptr, stride_ot, stride_oh, H, num_splits, R: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    dr = tl.arange(0, R)
    m = tl.full([1], float("-inf"), tl.float32)
    for s in range(0, num_splits):
        m = tl.maximum(m, tl.load(plse_ptr + (t * num_splits + s) * H + h + tl.zeros([1], tl.int32)))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros([R], tl.float32)
    wsum = tl.zeros([1], tl.float32)
    for s in range(0, num_splits):
        base = (t * num_splits + s) * H + h
        lse = tl.load(plse_ptr + base + tl.zeros([1], tl.int32))
        w = tl.exp2(lse - m_safe)
        wsum += w
        acc += tl.load(po_ptr + base * R + dr) * w
    acc = acc / tl.where(wsum > 0.0, wsum, 1.0)
    tl.store(o_ptr + t * stride_ot + h * stride_oh + dr, acc.to(o_ptr.dtype.element_ty))


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


def _default_cfg(q, fp8, sparse, split):
    if _INTERPRET or q.device.type != "cuda":
        return dict(BLOCK_N=16, num_warps=4, num_stages=1)
    return dict(BLOCK_N=32, num_warps=8, num_stages=2)


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
        target = 2 * _num_sms(q.device)
        num_splits = max(1, min(triton.cdiv(target, T * n_hb), triton.cdiv(max_len, 64), 64))
    split_len = triton.cdiv(triton.cdiv(max(max_len, 1), num_splits), 64) * 64
    num_splits = max(1, triton.cdiv(max(max_len, 1), split_len))
    if K == 0 and sparse:
        out.zero_()
        return out
    c = dict(_default_cfg(q, fp8, sparse, num_splits > 1))
    if cfg:
        c.update(cfg)
    direct = num_splits == 1
    if direct:
        po = plse = out  # unused
    else:
        po = torch.empty(T, num_splits, H, R, dtype=torch.float32, device=q.device)
        plse = torch.empty(T, num_splits, H, dtype=torch.float32, device=q.device)
    grid = (T * n_hb, num_splits)
    _mla_fwd_kernel[grid](
        q, q.stride(0), q.stride(1),
        c8, c32, c16,
        block_table, block_table.stride(0), req_idx,
        pos_or_topk, stride_pt, K,
        out, out.stride(0), out.stride(1),
        po, plse,
        H, float(scale) * LOG2E, split_len, num_splits,
        BS=bs, BLOCK_H=BLOCK_H, BLOCK_N=c["BLOCK_N"], N_HB=n_hb, FP8=fp8, SPARSE=sparse, DIRECT=direct,
        IEEE=(q.dtype == torch.float32) or _INTERPRET, num_warps=c["num_warps"], num_stages=c["num_stages"],
    )
    if not direct:
        _mla_combine_kernel[(T, H)](po, plse, out, out.stride(0), out.stride(1), H, num_splits, R=R, num_warps=4)
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
