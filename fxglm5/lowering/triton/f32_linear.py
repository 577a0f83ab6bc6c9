"""``fxglm5::f32_linear`` in Triton: ``x.float() @ W.T`` (W float32) times a few scalars, one launch.

The MoE router (W [256, 6144]) and the DSA indexer's head weights (W [64, 6144]) at decode are a few rows against a
few MB of float32 weights: bandwidth work that a cuBLAS SGEMV spread over too few CTAs and a SIMT SGEMM at batch 64
(bench profile: 117 us per 8 layers) did slowly, with a cast kernel before and a multiply kernel per scale after.
Here x is read in its own dtype and widened in registers, the products are exact float32 (an IEEE dot: FMAs, no TF32
rounding of the weights), K is split over enough CTAs to stream the weights, and the last CTA of each output tile
sums the partials in a fixed order (deterministic), applies the scales one by one as the reference does, and writes
the tile (the split-K fix-up of :mod:`fxglm5.lowering.triton.fp8_gemm`, one launch).
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from fxglm5.lowering.reference import fused as ref
from fxglm5.lowering.triton.device import num_sms, pdl, pdl_prologue
from fxglm5.lowering.triton.fp8_gemm import tile_counters

MAX_SCALES = 4
BLOCK_K = 64
CTAS_PER_SM = 2


@triton.jit
def _scaled(acc, s0, s1, s2, s3, NUM_SCALES: tl.constexpr):
    if NUM_SCALES > 0:
        acc = acc * s0
    if NUM_SCALES > 1:
        acc = acc * s1
    if NUM_SCALES > 2:
        acc = acc * s2
    if NUM_SCALES > 3:
        acc = acc * s3
    return acc


@triton.jit
def _f32_linear_kernel(x_ptr, w_ptr, ws_ptr, out_ptr, cnt_ptr, M, N, K, stride_xm, stride_wn, s0, s1, s2, s3,
                       NUM_SCALES: tl.constexpr, STEPS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    num_n = tl.cdiv(N, BLOCK_N)
    offs_m = (pid // num_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (pid % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    # rows past M / N re-read the last row (never stored): no row masks in the loop
    a_ptrs = x_ptr + tl.minimum(offs_m, M - 1).to(tl.int64)[:, None] * stride_xm
    b_ptrs = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(0, STEPS):
        offs_k = (pid_k * STEPS + i) * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = (offs_k < K)[None, :]
        a = tl.load(a_ptrs + offs_k[None, :], mask=k_mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptrs + offs_k[None, :], mask=k_mask, other=0.0)
        acc += tl.dot(a, tl.trans(b), input_precision="ieee")
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tile = offs_m[:, None] * N + offs_n[None, :]
    if SPLIT == 1:
        tl.store(out_ptr + tile, _scaled(acc, s0, s1, s2, s3, NUM_SCALES), mask=mask)
    else:
        tl.store(ws_ptr + pid_k * M * N + tile, acc, mask=mask)
        # the last split of this tile to arrive sums every split's partial, in split order (see fp8_gemm's FIXUP)
        tl.debug_barrier()
        if tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for sp in range(0, SPLIT):
                total += tl.load(ws_ptr + sp * M * N + tile, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + tile, _scaled(total, s0, s1, s2, s3, NUM_SCALES), mask=mask)
            tl.atomic_xchg(cnt_ptr + pid, 0, sem="relaxed", scope="gpu")


def pick_config(m: int, n: int, k: int, sms: int) -> dict:
    """Row / column tiles for ``m`` rows, and the K split that gives about CTAS_PER_SM CTAs per SM."""
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = 64 if n >= 64 else max(16, triton.next_power_of_2(n))
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    k_steps = triton.cdiv(k, BLOCK_K)
    steps = triton.cdiv(k_steps, max(1, min(k_steps, round(CTAS_PER_SM * sms / tiles))))
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, STEPS=steps, SPLIT=triton.cdiv(k_steps, steps))


def f32_linear(x: torch.Tensor, weight: torch.Tensor, scales: Sequence[float], *, validate: bool = True) -> torch.Tensor:
    """float32 ``x @ weight.T`` times each of ``scales`` (at most MAX_SCALES) in turn; x of any float dtype."""
    if validate:
        ref.validate_f32_linear(x, weight, scales, MAX_SCALES)
    n, k = weight.shape
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    weight = weight.contiguous()
    m = rows.shape[0]
    out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    if m:
        cfg = pick_config(m, n, k, num_sms(x.device))
        grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]), cfg["SPLIT"])
        ws = torch.empty(cfg["SPLIT"], m, n, dtype=torch.float32, device=x.device) if cfg["SPLIT"] > 1 else out
        counters = tile_counters(x.device, grid[0]) if cfg["SPLIT"] > 1 else out
        padded = [float(s) for s in scales] + [1.0] * (MAX_SCALES - len(scales))
        _f32_linear_kernel[grid](rows, weight, ws, out, counters, m, n, k, rows.stride(0), weight.stride(0), *padded,
                                 NUM_SCALES=len(scales), BLOCK_K=BLOCK_K, num_warps=4, **cfg, **pdl(x.device))
    return out.view(*x.shape[:-1], n)
