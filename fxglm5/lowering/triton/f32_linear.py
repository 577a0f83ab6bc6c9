"""``fxglm5::f32_linear`` on the GPU: ``x.float() @ W.T`` (W float32) times a few scalars.

The MoE router (W [256, 6144]) and the DSA indexer's head weights (W [32, 6144]) read a few MB of float32 weights.
Up to MAX_GEMV_ROWS rows (a decode batch) they are a GEMV, and one Triton kernel does all of it: x read in its own
dtype and widened in registers, exact float32 products summed row by row (no tensor-core rounding of the weights),
every row of a weight tile served from one load, K split over enough CTAs to stream the weights, and the last CTA
of each column tile summing the partials in a fixed order (deterministic), applying the scales one by one as the
reference does and writing the tile (the split-K fix-up of :mod:`fxglm5.lowering.triton.fp8_gemm`): one launch
where the unfused graph ran a cast, a cuBLAS GEMM (a SIMT kernel and a split-K reduction at 8 rows) and a kernel
per scale. More rows are a GEMM, which cuBLAS's float32 kernels do well: there the op runs as its reference does.
(Why not a Triton IEEE float32 ``tl.dot`` for every row count: on an H200 it takes 23 us a call at batch 1 and
300 us at 2048 rows, against 5.6 / 68 us for cuBLAS: bench/results/rank_at_depth/README.md. At 8 rows the cuBLAS
path cost about 1.1 ms of an H100's 39-layer decode step: bench/results/rank_at_depth_busiest_h100_0f645d0.)
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fxglm5.lowering.reference import fused as ref
from fxglm5.lowering.triton.device import num_sms, pdl, pdl_prologue
from fxglm5.lowering.triton.fp8_parts import tile_counters

MAX_SCALES = 4
MAX_GEMV_ROWS = 16  # more rows: cuBLAS's float32 GEMM
BLOCK_N = 16
CTAS_PER_SM = 2


def block_k(rows: int) -> int:
    """The K step: 128 for one row, less as rows are added, so that a step's products (rows x BLOCK_N x BLOCK_K)
    stay at most 8192 per CTA: registers, not spills."""
    return max(32, 128 // triton.next_power_of_2(rows))


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
def _f32_gemv_kernel(x_ptr, w_ptr, ws_ptr, out_ptr, cnt_ptr, M, N, K, stride_xm, stride_wn, s0, s1, s2, s3,
                     NUM_SCALES: tl.constexpr, STEPS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """One column tile x one K split: partial[m, n] = sum_k w[n, k] * x[m, k] for every row m (each weight tile
    loaded once); the tile's last split sums the partials."""
    pdl_prologue(PDL)
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    w_rows = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * stride_wn  # rows past N re-read the last
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(0, STEPS):
        offs_k = (pid_k * STEPS + i) * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_rows + offs_k[None, :], mask=k_mask[None, :], other=0.0)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    tile = offs_m[:, None] * N + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT == 1:
        tl.store(out_ptr + tile, _scaled(acc, s0, s1, s2, s3, NUM_SCALES), mask=mask)
    else:
        tl.store(ws_ptr + pid_k * M * N + tile, acc, mask=mask)
        tl.debug_barrier()  # the CTA's partial stored before its arrival is published (see fp8_gemm's FIXUP)
        if tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for sp in range(0, SPLIT):
                total += tl.load(ws_ptr + sp * M * N + tile, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + tile, _scaled(total, s0, s1, s2, s3, NUM_SCALES), mask=mask)
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")


def gemv_config(n: int, k: int, sms: int, rows: int = 1) -> dict:
    """The K split that gives about CTAS_PER_SM CTAs per SM over the column tiles (and its steps per CTA)."""
    tiles, k_steps = triton.cdiv(n, BLOCK_N), triton.cdiv(k, block_k(rows))
    steps = triton.cdiv(k_steps, max(1, min(k_steps, round(CTAS_PER_SM * sms / tiles))))
    return dict(STEPS=steps, SPLIT=triton.cdiv(k_steps, steps))


def f32_linear(x: torch.Tensor, weight: torch.Tensor, scales: Sequence[float], *,
               validate: bool = True) -> torch.Tensor:
    """float32 ``x @ weight.T`` times each of ``scales`` (at most MAX_SCALES) in turn; x of any float dtype."""
    if validate:
        ref.validate_f32_linear(x, weight, scales, MAX_SCALES)
    n, k = weight.shape
    rows = x.numel() // k
    if not 0 < rows <= MAX_GEMV_ROWS:  # a GEMM (or no rows): cuBLAS's float32 kernels, the scales in place after it
        y = F.linear(x.float(), weight)
        for s in scales:
            y.mul_(s)
        return y
    weight, x2 = weight.contiguous(), x.reshape(rows, k).contiguous()
    out = torch.empty(rows, n, dtype=torch.float32, device=x.device)
    cfg = gemv_config(n, k, num_sms(x.device), rows)
    tiles = triton.cdiv(n, BLOCK_N)
    split = cfg["SPLIT"] > 1
    ws = torch.empty(cfg["SPLIT"], rows, n, dtype=torch.float32, device=x.device) if split else out
    counters = tile_counters(x.device, tiles) if split else out
    padded = [float(s) for s in scales] + [1.0] * (MAX_SCALES - len(scales))
    _f32_gemv_kernel[(tiles, cfg["SPLIT"])](x2, weight, ws, out, counters, rows, n, k, x2.stride(0),
                                             weight.stride(0), *padded, NUM_SCALES=len(scales),
                                             BLOCK_M=triton.next_power_of_2(rows), BLOCK_N=BLOCK_N,
                                             BLOCK_K=block_k(rows), num_warps=4, **cfg, **pdl(x.device))
    return out.view(*x.shape[:-1], n)
