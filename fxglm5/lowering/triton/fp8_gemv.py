"""Block-FP8 GEMV for decode (M <= 16 rows): y = x @ W.T with e4m3 W and 128x128 fp32 block scales, the
semantics of :mod:`fxglm5.lowering.reference.fp8` (and of :func:`fp8_gemm.fp8_linear`, whose kernel it replaces there).

Why another kernel: a decode GEMM reads megabytes of weights for a few rows of activations, so its time is the
weight stream plus fixed costs. The tiled GEMM pays those costs per call (16-row MMA tiles for one row, short CTAs,
a prologue that waits for the previous kernel before touching memory); at batch 1 in a 78-layer step its calls
averaged 12 us for about 2 us of bytes (bench/results/session21). This kernel:

- streams each weight tile once, with as few rows as the step has: up to 4 rows (``M_PAD`` 1, 2 or 4) the products
  are float32 FMAs over a [rows, BLOCK_N, 128] register tile (no MMA padded to 16 rows); 5 to 16 rows use a 16-row MMA;
- launches one wave: ``CTAS_PER_SM`` CTAs per SM, each a BLOCK_N x (K / SPLIT_K) slab walked in 128-wide K steps,
  every step meeting one weight-scale block (scaled once per step, as the DeepSeek recipe does);
- reduces split-K inside the kernel (the last CTA of each column tile sums the partials in a fixed order:
  deterministic, no second launch);
- under programmatic dependent launch, requests its first weight tile and scale *before* waiting for the previous
  kernel: the weights are the program's constants (no kernel writes them), so only the activation load waits.

Activations as in the tiled kernel: ``act_quant`` quantizes each row 1x128 to e4m3 in registers (W8A8, the
checkpoint's recipe), otherwise the e4m3 tile is widened to the activation dtype (W8A16); a gated input
(``silu(gate) * up``), or the RMSNorm of a residual sum (``fp8_gemm.add_rms_norm_fp8_linear``: each CTA first sums
its rows' squares, after the wait on the previous kernel), is formed as the tile is loaded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fxglm5 import settings
from fxglm5.lowering.triton.device import pdl, pdl_prologue
from fxglm5.lowering.triton.fp8_parts import (
    NormedA, _dot, _quant_rows, add_rms_rstd, load_a, tile_counters, write_add_rms,
)
from fxglm5.lowering.triton.norm_rope import DTYPE_CODES

ROWS = 16  # the most rows a call may have
# CTAs per SM of the one wave, the column tile per row count (M_PAD x BLOCK_N x 128 fp32 products in registers stay
# at 8192 for the FMA path), warps and pipeline stages. Not yet tuned on a GPU: the decode step's variant ``gemv``
# (bench/rank_at_depth.py) measures it against the tiled kernel.
# PREFETCH: the next K step's weight tile requested before this step's math (two tiles in flight a CTA).
GEMV = dict(enabled=False, CTAS_PER_SM=2, BLOCK_N={1: 64, 2: 32, 4: 16, 16: 64}, num_warps=8, num_stages=4,
            PREFETCH=False)


@triton.jit
def _load_w(b_ptrs, bs_ptr, kg, K, KG, NO_K_MASK: tl.constexpr):
    """K step ``kg``'s weight tile [BLOCK_N, 128] and its scale (zero past K)."""
    if NO_K_MASK:
        return tl.load(b_ptrs + kg * 128), tl.load(bs_ptr + kg)
    k_mask = tl.arange(0, 128) < K - kg * 128
    return (tl.load(b_ptrs + kg * 128, mask=k_mask[None, :], other=0.0),
            tl.load(bs_ptr + kg, mask=kg < KG, other=0.0))


@triton.jit
def _step(a, b, s_b, A_MODE: tl.constexpr, USE_DOT: tl.constexpr, F32: tl.constexpr, INTERPRET: tl.constexpr):
    """One K step's scaled partial [M_PAD, BLOCK_N]: (e4m3 rows x e4m3 weights) x both scales (A_MODE 1), or
    (rows x weights widened to the rows' dtype) x the weight scale (A_MODE 2)."""
    if A_MODE == 1:
        x, s_a = _quant_rows(a.to(tl.float32), INTERPRET)
        w = b
    else:
        x = a
        w = b.to(a.dtype)
    if USE_DOT:
        part = _dot(x, tl.trans(w), F32)
    else:  # exact products (e4m3 x e4m3, or a 16-bit value x an e4m3 one) summed in float32
        part = tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    if A_MODE == 1:
        return part * (s_a * s_b)[:, None]
    return part * s_b


@triton.jit
def _gemv_kernel(a_ptr, u_ptr, b_ptr, bs_ptr, bias_ptr, ws_ptr, out_ptr, cnt_ptr,
                 M, N, K, KG, stride_am, stride_um, stride_bn, stride_bsn,
                 KG_PER_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                 A_MODE: tl.constexpr, GATED_A: tl.constexpr, DT: tl.constexpr, USE_DOT: tl.constexpr,
                 F32: tl.constexpr, INTERPRET: tl.constexpr, HAS_BIAS: tl.constexpr, NO_K_MASK: tl.constexpr,
                 PREFETCH: tl.constexpr, PDL: tl.constexpr, nw_ptr=None, sum_ptr=None, normed_ptr=None, eps=0.0,
                 NORM_A: tl.constexpr = False, NORM_ROWS: tl.constexpr = 1):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, 128)
    # Rows past N (M) re-read row N-1 (M-1): no row masks in the stream; their results are never stored.
    b_ptrs = b_ptr + tl.minimum(offs_n, N - 1)[:, None] * stride_bn + offs_k[None, :]
    bs_row = bs_ptr + (pid_n * BLOCK_N // 128) * stride_bsn  # BLOCK_N divides 128: one scale block row
    kg0 = pid_k * KG_PER_SPLIT
    # The weights are constants no kernel writes: the first K step's tile is requested before the wait on the
    # previous kernel, so its latency overlaps that kernel's tail under programmatic dependent launch.
    b, s_b = _load_w(b_ptrs, bs_row, kg0, K, KG, NO_K_MASK)
    pdl_prologue(PDL)
    offs_m = tl.arange(0, M_PAD)
    rows_a = tl.minimum(offs_m, M - 1)
    a_ptrs = a_ptr + rows_a[:, None] * stride_am + offs_k[None, :]
    u_ptrs = u_ptr + rows_a[:, None] * stride_um + offs_k[None, :]
    if NORM_A:  # A = the RMSNorm of x + residual (u): its rows' factors over all of K first, by every CTA
        rstd = add_rms_rstd(a_ptr, u_ptr, 0, M, stride_am, stride_um, K, eps, SPLIT_K * KG_PER_SPLIT, NORM_ROWS,
                            M_PAD, DT)
    else:
        rstd = None
    if PREFETCH:
        # the next K step's weight tile is requested before this step's math, so two tiles are in flight a CTA
        # (the software pipeliner stages only loads that feed an MMA, not the FMA path's). The request after a
        # split's last step is never used; clamped to the last K step, it stays in bounds (a ragged split's steps
        # past K meet zero activations whatever tile they hold)
        acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
        for i in range(0, KG_PER_SPLIT):
            b_next, s_next = _load_w(b_ptrs, bs_row, tl.minimum(kg0 + i + 1, KG - 1), K, KG, NO_K_MASK)
            a = load_a(a_ptrs, u_ptrs, kg0 + i, K, NO_K_MASK, GATED_A, DT, nw_ptr, rstd, NORM_A)
            acc += _step(a, b, s_b, A_MODE, USE_DOT, F32, INTERPRET)
            b, s_b = b_next, s_next
    else:
        a = load_a(a_ptrs, u_ptrs, kg0, K, NO_K_MASK, GATED_A, DT, nw_ptr, rstd, NORM_A)
        acc = _step(a, b, s_b, A_MODE, USE_DOT, F32, INTERPRET)
        for i in range(1, KG_PER_SPLIT):
            b, s_b = _load_w(b_ptrs, bs_row, kg0 + i, K, KG, NO_K_MASK)
            a = load_a(a_ptrs, u_ptrs, kg0 + i, K, NO_K_MASK, GATED_A, DT, nw_ptr, rstd, NORM_A)
            acc += _step(a, b, s_b, A_MODE, USE_DOT, F32, INTERPRET)
    if NORM_A:
        if pid_n == 0:  # column tile 0's CTAs write the sum (and the normed rows) of their K steps: every value once
            write_add_rms(a_ptrs, u_ptrs, nw_ptr, rstd, sum_ptr, normed_ptr, offs_m[:, None] * K + offs_k[None, :],
                          (offs_m < M)[:, None], kg0, K, KG_PER_SPLIT, DT)
    c_mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tile = offs_m[:, None] * N + offs_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + tile, acc.to(out_ptr.dtype.element_ty), mask=c_mask)
    else:
        tl.store(ws_ptr + pid_k * M * N + tile, acc, mask=c_mask)
        # the column tile's last CTA to arrive sums every split's partial in split order (deterministic), adds the
        # bias and writes the output, then resets the counter for the next call or graph replay; the barrier and
        # the acq_rel atomic publish this CTA's partial GPU-wide, and the partials are read from L2 (.cg)
        tl.debug_barrier()
        if tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
            tot = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
            for sp in range(0, SPLIT_K):
                tot += tl.load(ws_ptr + sp * M * N + tile, mask=c_mask, other=0.0, cache_modifier=".cg")
            if HAS_BIAS:
                tot += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + tile, tot.to(out_ptr.dtype.element_ty), mask=c_mask)
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")


def rows_padded(m: int) -> int:
    """The kernel's row tile for ``m`` rows: 1, 2 or 4 (FMA products), else 16 (MMA)."""
    return next(r for r in (1, 2, 4, 16) if r >= m)


def plan(m: int, n: int, k: int, sms: int, config: dict | None = None) -> dict:
    """The launch for an [m, k] x [n, k] call: row tile, column tile, split-K (one wave of CTAS_PER_SM CTAs per
    SM), K steps per split; ``config`` overrides GEMV's keys (``BLOCK_N`` an int there; ``M_PAD`` 16 takes the MMA
    path for fewer rows, a sweep's choice)."""
    cfg = dict(GEMV, **(config or {}))
    m_pad = cfg.get("M_PAD") or rows_padded(m)
    if m_pad not in (1, 2, 4, 16) or m_pad < m:
        raise ValueError(f"fp8 gemv: M_PAD must be 1, 2, 4 or 16 and at least the {m} rows, got {m_pad}")
    bn = cfg["BLOCK_N"][m_pad] if isinstance(cfg["BLOCK_N"], dict) else cfg["BLOCK_N"]
    if 128 % bn:
        raise ValueError(f"fp8 gemv: BLOCK_N must divide 128 (one weight-scale block row), got {bn}")
    kg = triton.cdiv(k, 128)
    tiles = triton.cdiv(n, bn)
    split = max(1, min(kg, round(cfg["CTAS_PER_SM"] * sms / tiles)))
    per_split = triton.cdiv(kg, split)
    return dict(cfg, M_PAD=m_pad, BLOCK_N=bn, KG_PER_SPLIT=per_split, SPLIT_K=triton.cdiv(kg, per_split))


def launch(x2, u2, weight, weight_scale_inv, bias, act_quant: bool, out, sms: int, config: dict | None = None,
           norm: NormedA | None = None) -> None:
    """``out`` [m, n] = the block-FP8 linear of ``x2`` [m, k] (m <= ROWS; ``u2``: the gated input's up half; ``norm``:
    the input is the RMSNorm of ``x2 + norm.residual``, its sum written), the inputs checked and laid out by
    :func:`fp8_gemm.fp8_linear` (:func:`fp8_gemm.add_rms_norm_fp8_linear`)."""
    (m, k), n = x2.shape, weight.shape[0]
    if not 0 < m <= ROWS:
        raise ValueError(f"fp8 gemv: {m} rows; the GEMV serves 1 to {ROWS}")
    c = plan(m, n, k, sms, config)
    split, per_split, kg = c["SPLIT_K"], c["KG_PER_SPLIT"], triton.cdiv(k, 128)
    grid = (triton.cdiv(n, c["BLOCK_N"]), split)
    ws = torch.empty(split, m, n, dtype=torch.float32, device=x2.device) if split > 1 else out
    cnt = tile_counters(x2.device, grid[0]) if split > 1 else out
    interpret = settings.triton_interpret()
    second = u2 if norm is None else norm.residual  # the A loads' second operand, if any
    _gemv_kernel[grid](
        x2, x2 if second is None else second, weight, weight_scale_inv, out if bias is None else bias, ws, out, cnt,
        m, n, k, kg, x2.stride(0), x2.stride(0) if second is None else second.stride(0), weight.stride(0),
        weight_scale_inv.stride(0),
        KG_PER_SPLIT=per_split, SPLIT_K=split, M_PAD=c["M_PAD"], BLOCK_N=c["BLOCK_N"], A_MODE=1 if act_quant else 2,
        GATED_A=u2 is not None, DT=DTYPE_CODES[x2.dtype], USE_DOT=c["M_PAD"] == 16,
        F32=x2.dtype == torch.float32 or interpret, INTERPRET=interpret, HAS_BIAS=bias is not None,
        NO_K_MASK=k % 128 == 0 and split * per_split == kg, PREFETCH=c["PREFETCH"], num_warps=c["num_warps"],
        num_stages=c["num_stages"], **({} if norm is None else norm.kernel_args(m, c["M_PAD"])), **pdl(x2.device))
