"""``fxglm5::f32_linear`` on the GPU: ``x.float() @ W.T`` (W float32) times a few scalars.

The MoE router (W [256, 6144]) and the DSA indexer's head weights (W [32, 6144]) read a few MB of float32 weights.
Up to MAX_GEMV_ROWS rows (a decode batch) they are a GEMV, and one Triton kernel does all of it: x read in its own
dtype and widened in registers, exact float32 products summed row by row (no tensor-core rounding of the weights),
every row of a weight tile served from one load, K split over enough CTAs to stream the weights, and the last CTA
of each column tile summing the partials in a fixed order (deterministic), applying the scales one by one as the
reference does and writing the tile (the split-K fix-up of :mod:`fxglm5.lowering.triton.fp8_gemm`): one launch
where the unfused graph ran a cast, a cuBLAS GEMM (a SIMT kernel and a split-K reduction at 8 rows) and a kernel
per scale. The MoE router's GEMV runs inside ``moe._router_kernel`` (``fxglm5::moe_router``), whose last CTA then
routes the rows, and as the first tasks of ``moe._router_gate_up_kernel`` (``fxglm5::moe_router_fp8_shared``): both
run the same tiles and splits (:func:`gemv_launch`) over the same helpers, so their logits are this kernel's bit for
bit. (Why not a Triton IEEE float32 ``tl.dot`` for every row count: on an H200 it takes 23 us
a call at batch 1 and 300 us at 2048 rows, against 5.6 / 68 us for cuBLAS: bench/results/rank_at_depth/README.md. At
8 rows the cuBLAS path cost about 1.1 ms of an H100's 39-layer decode step:
bench/results/rank_at_depth_busiest_h100_0f645d0.)

More rows are a GEMM, on tensor cores with float32-class accuracy (3xTF32, as CUTLASS and Triton's
``input_precision="tf32x3"`` do it, here written out). An IEEE ``tl.dot`` runs on the CUDA cores; a TF32 MMA runs
on the tensor cores but keeps 10 of float32's 23 mantissa bits of each operand, a relative error near 2e-4 in the
logits at K = 6144, where the router's top-8 choice and the indexer's head weights want float32's. So each
operand is split into a TF32 high part (rounded to nearest, ties away from zero: PTX's ``cvt.rna.tf32.f32``) and
the TF32 rounding of its remainder, and the product is hi*hi + hi*lo + lo*hi: lo*lo and the remainders' rounding
leave at most about 2^-22 of each product. A bf16 or fp16 x (the model's case: the hidden states) is exact in
TF32, so it has no low part and a K step is two MMAs, not three (Triton's tf32x3 would run three). Each K step's
MMAs sum into a fresh accumulator that is then added to the running sum in IEEE float32: a tensor core truncates
as it accumulates, and a running sum carried through every MMA of K = 6144 would lose more than the split gains
(triton-lang/triton#4603). The result is about 2e-7 (relative, Frobenius) from a float64 product at K = 6144
under the interpreter, where the CPU's float32 GEMM is 3e-7 from it; the tests hold it under 1e-6 (CPU) and to
within twice cuBLAS float32's distance (GPU), where TF32 alone is 2e-4 off. So it is not bitwise cuBLAS's float32
GEMM, nor far from it: a few 1e-7, the order of the sums. An inf in x or W gives NaN (its low part is inf - inf).
As the GEMV: x read in its own dtype, the scales applied one by one after the sum, K split over CTAs with the same
fix-up where the tiles alone leave SMs idle (deterministic). It replaces cuBLAS's SIMT float32 GEMM and the
bf16 -> float32 cast before it (about 0.9 ms a MoE layer at an 8k prompt on an H100,
bench/results/sparse_mla_prefill_tile_h100_e238402); its own GPU times are not measured yet
(bench/f32_linear_prefill.py). TF32 MMAs are NVIDIA's, sm_80 on; other GPUs (ROCm builds) keep their BLAS's float32
GEMM.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from fxglm5.lowering.reference import fused as ref
from fxglm5.lowering.triton.device import capability, num_sms, pdl, pdl_prologue
from fxglm5.lowering.triton.fp8_parts import tile_counters

MAX_SCALES = 4
MAX_GEMV_ROWS = 16  # more rows: the tensor-core GEMM
BLOCK_N = 16
CTAS_PER_SM = 2
GEMM_BLOCK_K = 32  # 128 bytes of a float32 weight row per K step


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
def finish_tile(acc, ws_ptr, out_ptr, cnt_ptr, tile, mask, counter, pid_k, MN, s0, s1, s2, s3,
                NUM_SCALES: tl.constexpr, SPLIT: tl.constexpr):
    """Write one output tile (``tile``: offsets into the [M, N] output, MN = M * N) from this CTA's sum over its K
    range: scaled and stored where K is not split; else the partial goes to its workspace slice and the tile's last
    CTA to arrive sums the slices in split order, applies the scales and resets the tile's counter. Returns whether
    this CTA wrote the tile (every CTA where K is not split, the tile's last split where it is): a kernel that goes
    on from the finished output (``moe._router_tile``) goes on in that CTA."""
    if SPLIT == 1:
        tl.store(out_ptr + tile, _scaled(acc, s0, s1, s2, s3, NUM_SCALES), mask=mask)
        wrote = True
    else:
        tl.store(ws_ptr + pid_k * MN + tile, acc, mask=mask)
        tl.debug_barrier()  # the CTA's partial stored before its arrival is published (see fp8_gemm's FIXUP)
        wrote = tl.atomic_add(cnt_ptr + counter, 1, sem="acq_rel", scope="gpu") == SPLIT - 1
        if wrote:
            total = tl.zeros_like(acc)
            for sp in range(0, SPLIT):
                total += tl.load(ws_ptr + sp * MN + tile, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + tile, _scaled(total, s0, s1, s2, s3, NUM_SCALES), mask=mask)
            tl.atomic_xchg(cnt_ptr + counter, 0, sem="relaxed", scope="gpu")
    return wrote


@triton.jit
def gemv_weights(w_rows, step, K, BLOCK_K: tl.constexpr):
    """K step ``step``'s weight tile [BLOCK_N, BLOCK_K] of the rows ``w_rows`` (columns past K read as 0). The
    weights are constants no kernel writes, so a kernel may request its first tile before its PDL wait: its latency
    then overlaps the previous kernel's tail."""
    offs_k = step * BLOCK_K + tl.arange(0, BLOCK_K)
    return tl.load(w_rows + offs_k[None, :], mask=(offs_k < K)[None, :], other=0.0)


@triton.jit
def _gemv_step(x_rows, m_mask, w, step, K, BLOCK_K: tl.constexpr, CACHE: tl.constexpr = None):
    """One K step's exact float32 products, summed over the step: [BLOCK_M, BLOCK_N] from x's rows (read in their
    own dtype, widened in registers, with the cache modifier ``CACHE``) and the step's weight tile ``w`` (every row
    served from that one load)."""
    offs_k = step * BLOCK_K + tl.arange(0, BLOCK_K)
    x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0,
                cache_modifier=CACHE).to(tl.float32)
    return tl.sum(x[:, None, :] * w[None, :, :], axis=2)


@triton.jit
def gemv_partial(x_rows, m_mask, w_rows, w_first, first, K, STEPS: tl.constexpr, BLOCK_K: tl.constexpr,
                 CACHE: tl.constexpr = None):
    """partial[m, n] = sum_k w[n, k] * x[m, k] over the STEPS K steps from ``first`` (one CTA's split), the steps
    summed in order; ``w_first``: the first step's weight tile, loaded by the caller (:func:`gemv_weights`, before
    its PDL wait); x read with the cache modifier ``CACHE``."""
    acc = _gemv_step(x_rows, m_mask, w_first, first, K, BLOCK_K, CACHE)
    for i in range(1, STEPS):
        acc += _gemv_step(x_rows, m_mask, gemv_weights(w_rows, first + i, K, BLOCK_K), first + i, K, BLOCK_K, CACHE)
    return acc


@triton.jit
def gemv_tile_start(w_ptr, N, K, stride_wn, pid_n, pid_k, STEPS: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    """Column tile ``pid_n`` x K split ``pid_k`` of the GEMV, up to the caller's PDL wait: the tile's columns, its
    weight rows (rows past N re-read the last) and its first K step's weight tile (:func:`gemv_weights`; a K of 0
    requests nothing)."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_rows = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * stride_wn
    return offs_n, w_rows, gemv_weights(w_rows, pid_k * STEPS, K, BLOCK_K)


@triton.jit
def gemv_tile_sum(x_ptr, stride_xm, M, N, K, offs_n, w_rows, w_first, pid_k, STEPS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, CACHE: tl.constexpr = None):
    """The rest of :func:`gemv_tile_start`'s tile, after the PDL wait: this split's partial over every row of x (read
    with the cache modifier ``CACHE``: ".cg" where another CTA of the launch wrote x), with the tile's offsets into
    the [M, N] output and its mask, as :func:`finish_tile` takes them."""
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    acc = gemv_partial(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm, m_mask, w_rows, w_first, pid_k * STEPS, K,
                       STEPS, BLOCK_K, CACHE)
    return acc, offs_m[:, None] * N + offs_n[None, :], m_mask[:, None] & (offs_n < N)[None, :]


@triton.jit
def _f32_gemv_kernel(x_ptr, w_ptr, ws_ptr, out_ptr, cnt_ptr, M, N, K, stride_xm, stride_wn, s0, s1, s2, s3,
                     NUM_SCALES: tl.constexpr, STEPS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """One column tile x one K split: partial[m, n] = sum_k w[n, k] * x[m, k] for every row m (each weight tile
    loaded once); the tile's last split sums the partials."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n, w_rows, w = gemv_tile_start(w_ptr, N, K, stride_wn, pid_n, pid_k, STEPS, BLOCK_N, BLOCK_K)
    pdl_prologue(PDL)
    acc, tile, mask = gemv_tile_sum(x_ptr, stride_xm, M, N, K, offs_n, w_rows, w, pid_k, STEPS, BLOCK_M, BLOCK_K)
    finish_tile(acc, ws_ptr, out_ptr, cnt_ptr, tile, mask, pid_n, pid_k, M * N, s0, s1, s2, s3, NUM_SCALES, SPLIT)


@triton.jit
def _tf32(v):
    """float32 ``v`` rounded to TF32 (10 mantissa bits; to nearest, ties away from zero, as ``cvt.rna.tf32.f32``):
    half a TF32 ulp added to the magnitude's bits, the 13 bits below it cleared. Bit operations, so that the
    interpreter splits exactly as the GPU does."""
    return ((v.to(tl.uint32, bitcast=True) + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def _f32_gemm_kernel(x_ptr, w_ptr, ws_ptr, out_ptr, cnt_ptr, M, N, K, stride_xm, stride_wn, s0, s1, s2, s3,
                     NUM_SCALES: tl.constexpr, SPLIT_X: tl.constexpr, STEPS: tl.constexpr, SPLIT: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] output tile x one K split on TF32 tensor cores, 3xTF32 (the module docstring): per K
    step w = w_hi + w_lo (and x = x_hi + x_lo where SPLIT_X: a float32 x), the small products first into a fresh
    accumulator, then x_hi * w_hi, then that step's sum added to the tile's in IEEE float32."""
    pdl_prologue(PDL)
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    x_rows = x_ptr + tl.minimum(offs_m, M - 1).to(tl.int64)[:, None] * stride_xm  # rows past M re-read the last
    w_rows = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * stride_wn  # (and past N), never stored
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(0, STEPS):
        offs_k = (pid_k * STEPS + i) * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = (offs_k < K)[None, :]
        x = tl.load(x_rows + offs_k[None, :], mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(w_rows + offs_k[None, :], mask=k_mask, other=0.0)
        w_hi = _tf32(w)
        w_hi_t, w_lo_t = tl.trans(w_hi), tl.trans(_tf32(w - w_hi))
        if SPLIT_X:
            x_hi = _tf32(x)
            step = tl.dot(_tf32(x - x_hi), w_hi_t, input_precision="tf32")
            step = tl.dot(x_hi, w_lo_t, step, input_precision="tf32")
        else:
            x_hi = x
            step = tl.dot(x_hi, w_lo_t, input_precision="tf32")
        acc += tl.dot(x_hi, w_hi_t, step, input_precision="tf32")
    finish_tile(acc, ws_ptr, out_ptr, cnt_ptr, offs_m[:, None] * N + offs_n[None, :],
                (offs_m < M)[:, None] & (offs_n < N)[None, :], pid_m * tl.num_programs(1) + pid_n, pid_k, M * N,
                s0, s1, s2, s3, NUM_SCALES, SPLIT)


def _split_k(k_steps: int, ctas: int, tiles: int) -> dict:
    """The K split that brings ``tiles`` output tiles to about ``ctas`` CTAs (none where the tiles reach it), and
    its steps per CTA."""
    steps = triton.cdiv(k_steps, max(1, min(k_steps, round(ctas / tiles))))
    return dict(STEPS=steps, SPLIT=triton.cdiv(k_steps, steps))


def gemv_config(n: int, k: int, sms: int, rows: int = 1) -> dict:
    """The K split that gives about CTAS_PER_SM CTAs per SM over the column tiles (and its steps per CTA)."""
    return _split_k(triton.cdiv(k, block_k(rows)), CTAS_PER_SM * sms, triton.cdiv(n, BLOCK_N))


def gemv_launch(n: int, k: int, rows: int, sms: int) -> tuple[tuple[int, int], dict]:
    """The GEMV's grid (column tiles, K splits) and launch keywords over ``rows`` rows (1 to MAX_GEMV_ROWS) of a
    [n, k] weight on ``sms`` SMs: :func:`gemv_config`'s K split, 4 warps. ``moe.moe_router`` launches its
    kernel with these too, so that its partial sums, their reduction and so its logits are the GEMV's, bit for
    bit (the reductions' order in registers follows the tile shapes and the warps)."""
    cfg = gemv_config(n, k, sms, rows)
    cfg.update(BLOCK_M=triton.next_power_of_2(rows), BLOCK_N=BLOCK_N, BLOCK_K=block_k(rows), num_warps=4)
    return (triton.cdiv(n, BLOCK_N), cfg["SPLIT"]), cfg


def gemm_config(m: int, n: int, k: int, sms: int) -> dict:
    """Tiles of 128 columns (fewer where N is less: the indexer's 32), of 128 rows where those fill the SMs and 64
    where not (8 warps for 128 x 128, two warp groups of 64 rows; else 4), and a K split where even 64-row tiles
    leave SMs idle (decode batches past MAX_GEMV_ROWS, short prompts)."""
    block_n = min(128, max(16, triton.next_power_of_2(n)))
    block_m = 128 if triton.cdiv(m, 128) * triton.cdiv(n, block_n) >= sms else 64
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=8 if block_m * block_n >= 128 * 128 else 4,
                **_split_k(triton.cdiv(k, GEMM_BLOCK_K), sms, tiles))


def splits_x(dtype: torch.dtype) -> bool:
    """Whether the GEMM splits x into TF32 parts: where its dtype has more mantissa bits than TF32's 10 (float32,
    float64 read as float32); bf16, fp16 and fp8 values are exact in TF32."""
    return torch.finfo(dtype).eps < 2.0 ** -10


def tensor_core_gemm(device: torch.device) -> bool:
    """Whether rows past MAX_GEMV_ROWS run the TF32 tensor-core GEMM: NVIDIA from sm_80 (TF32 MMAs), and the
    interpreter (CPU tensors); other GPUs (ROCm builds, capability None) run their BLAS's float32 GEMM."""
    if device.type != "cuda":
        return True
    cap = capability(device)
    return cap is not None and cap >= (8, 0)


def is_gemv(rows: int) -> bool:
    """Whether :func:`f32_linear` over ``rows`` rows runs the GEMV kernel (a decode batch), not the GEMM: the row
    counts at which a kernel that reuses the GEMV's helpers over :func:`gemv_launch`'s grid gives its bits."""
    return 0 < rows <= MAX_GEMV_ROWS


def operands(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x as contiguous [rows, K] rows, the weight contiguous, the float32 output [rows, N]) of a launch."""
    n, k = weight.shape
    x2 = x.reshape(x.numel() // k, k).contiguous()
    return x2, weight.contiguous(), torch.empty(x2.shape[0], n, dtype=torch.float32, device=x.device)


def split_buffers(out: torch.Tensor, split: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the partials [split, rows, N], the arrival counters, one per output tile) of :func:`finish_tile`'s fix-up
    over ``split`` K splits; ``out`` for both where K is not split (the kernel then touches neither)."""
    if split == 1:
        return out, out
    return out.new_empty(split, *out.shape), tile_counters(out.device, tiles)


def padded_scales(scales: Sequence[float]) -> list[float]:
    """The kernels' four scale arguments: ``scales``, then ones (NUM_SCALES says how many apply)."""
    return [float(s) for s in scales] + [1.0] * (MAX_SCALES - len(scales))


def f32_linear(x: torch.Tensor, weight: torch.Tensor, scales: Sequence[float], *,
               validate: bool = True) -> torch.Tensor:
    """float32 ``x @ weight.T`` times each of ``scales`` (at most MAX_SCALES) in turn; x of any float dtype."""
    if validate:
        ref.validate_f32_linear(x, weight, scales, MAX_SCALES)
    n, k = weight.shape
    rows = x.numel() // k
    gemv = is_gemv(rows)
    if rows == 0 or not (gemv or tensor_core_gemm(x.device)):  # no rows, or a GPU without TF32 MMAs
        y = F.linear(x.float(), weight)
        for s in scales:
            y.mul_(s)
        return y
    x2, weight, out = operands(x, weight)
    if gemv:
        kernel = _f32_gemv_kernel
        grid, cfg = gemv_launch(n, k, rows, num_sms(x.device))
    else:
        cfg = gemm_config(rows, n, k, num_sms(x.device))
        kernel = _f32_gemm_kernel
        grid = (triton.cdiv(rows, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]), cfg["SPLIT"])
        cfg.update(SPLIT_X=splits_x(x.dtype), BLOCK_K=GEMM_BLOCK_K, num_stages=3)
    ws, counters = split_buffers(out, cfg["SPLIT"], math.prod(grid[:-1]))
    kernel[grid](x2, weight, ws, out, counters, rows, n, k, x2.stride(0), weight.stride(0), *padded_scales(scales),
                 NUM_SCALES=len(scales), **cfg, **pdl(x.device))
    return out.view(*x.shape[:-1], n)
