"""Block-FP8 GEMM in Triton: y = x @ W.T with e4m3 W and 128x128 fp32 block scales (GLM-5-FP8 layout).

Semantics are those of :mod:`fxglm5.lowering.reference.fp8`. One kernel, three activation modes:

* ``A_MODE=0`` W8A8, activations pre-quantized by :func:`quantize_act_1x128` (prefill: quantizing once is
  cheaper than re-quantizing the A tile in every N tile);
* ``A_MODE=1`` W8A8, the A tile is quantized in registers (decode: A is a few rows, re-quantizing it per
  N tile is free and saves a launch and a round trip);
* ``A_MODE=2`` W8A16, the e4m3 tile is widened to the activation dtype in registers (bf16/fp16 hold every
  e4m3 value exactly, so the products are exact and only the fp32 accumulation order differs from the
  reference; fp32 activations use an IEEE fp32 dot).

BLOCK_K is fixed at 128 so every K step meets exactly one weight-scale column and one activation-scale
column: the step's fp32 partial ``dot(a, b)`` is scaled by ``s_a[m] * s_b[n]`` and accumulated (the
DeepSeek-V3 recipe; an N tile of <= 128 aligned columns meets one weight-scale block, so the factor is a
per-row vector and costs one FMA per accumulator element).

Decode (M <= 64) is weight-bandwidth bound: 16-row M tiles, 128-wide N tiles and split-K sized for a few
CTAs per SM; the fp32 partials are summed in a fixed order by a second small kernel (deterministic), or,
with ``FIXUP``, by the last CTA to finish each tile. Prefill uses 64x128 tiles in grouped (L2-friendly)
launch order. Tiles carry no row masks: rows past M or N re-read the last row (cheap, never stored), so
partial tiles (kv_a N=576, M=1) stream like full ones; only a K tail (K % 128 != 0) is masked.
On Hopper, prefill (M > 512, W8A8, bf16/fp16) runs :mod:`fxglm5.lowering.triton.fp8_gemm_hopper` instead, a
Gluon kernel that overlaps each K step's promotion with the next step's asynchronous MMA (which Triton cannot
express); this kernel is the CPU-tested path and the fallback everywhere else.
Loop trip counts are compile-time constants: the Triton 3.6 interpreter (with numpy >= 2.4) cannot run
loops with runtime bounds, and CI runs these kernels interpreted.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from fxglm5 import settings
from fxglm5.contracts import FP8_BLOCK
from fxglm5.errors import InputError
from fxglm5.lowering.reference import fp8 as ref
from fxglm5.lowering.reference.fused import validate_add_rms_norm
from fxglm5.lowering.triton import fp8_gemm_hopper, fp8_gemv
from fxglm5.lowering.triton.device import num_sms, pdl, pdl_prologue
from fxglm5.lowering.triton.fp8_parts import (
    NormedA, _dot, _quant_rows, _silu_mul, add_rms_rstd, load_a, tile_counters, write_add_rms,
)
from fxglm5.lowering.triton.norm_rope import DTYPE_CODES, add_rms_norm

BLOCK_K = FP8_BLOCK  # one weight-scale column and one activation-scale group per K step
# The kernels index their tensors with int32 offsets: no tensor a launch touches may reach 2^31 elements (a
# prefill step of 131072 tokens through the 16384-wide fused q_b GEMM does). Calls past it run in row chunks.
INT32_ELEMENTS = 2**31


@triton.jit
def _ab_scale(s_a, s_b, SCALAR_SB: tl.constexpr):
    """[rows, cols] factor of one K step. A tile of at most 128 aligned columns meets one weight-scale
    block (SCALAR_SB): the factor is a per-row vector and costs one FMA per accumulator element."""
    if SCALAR_SB:
        return (s_a * s_b)[:, None]
    else:
        return s_a[:, None] * s_b[None, :]


@triton.jit
def _b_scale(s_b, SCALAR_SB: tl.constexpr):
    if SCALAR_SB:
        return s_b
    else:
        return s_b[None, :]


@triton.jit
def _quant_kernel(x_ptr, q_ptr, s_ptr, M, K, KG, stride_xm, stride_qm, ROWS: tl.constexpr, INTERPRET: tl.constexpr,
                  PDL: tl.constexpr):
    pdl_prologue(PDL)
    offs_m = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs_k = tl.program_id(1) * 128 + tl.arange(0, 128)
    mask = (offs_m < M)[:, None] & (offs_k < K)[None, :]
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0)
    q, s = _quant_rows(x.to(tl.float32), INTERPRET)
    tl.store(q_ptr + offs_m[:, None] * stride_qm + offs_k[None, :], q, mask=mask)
    tl.store(s_ptr + offs_m * KG + tl.program_id(1), s, mask=offs_m < M)


def quantize_act_1x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-128-column e4m3 quantization: ``(x_fp8 [M, K], scale f32 [M, ceil(K/128)])``."""
    ref._check_tensor("x", x, ref.ACT_DTYPES, 2)
    m, k = x.shape
    kg = triton.cdiv(k, 128)
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty(m, k, dtype=ref.FP8, device=x.device)
    s = torch.empty(m, kg, dtype=torch.float32, device=x.device)
    if m:
        rows = 16
        _quant_kernel[(triton.cdiv(m, rows), kg)](x, q, s, m, k, kg, x.stride(0), q.stride(0), ROWS=rows,
                                                  INTERPRET=settings.triton_interpret(), **pdl(x.device))
    return q, s


@triton.jit
def gemm_tile(
    a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, c_ptr, out_ptr, cnt_ptr, up_ptr, pid, pid_k,
    M, N, K, KG, KG_PER_SPLIT: tl.constexpr,
    stride_am, stride_asm, stride_bn, stride_bsn, stride_cm, stride_cs, stride_um,
    A_MODE: tl.constexpr, GATED_A: tl.constexpr, DT: tl.constexpr, DOT_F32: tl.constexpr, INTERPRET: tl.constexpr,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
    FIXUP: tl.constexpr,
    NO_K_MASK: tl.constexpr, SCALAR_SB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
    nw_ptr=None, sum_ptr=None, normed_ptr=None, eps=0.0, NORM_A: tl.constexpr = False, NORM_ROWS: tl.constexpr = 1,
    A_CACHE: tl.constexpr = None,
):
    """One CTA of :func:`_gemm_kernel`: output tile ``pid`` (in grouped order), K split ``pid_k``. Its own
    function so that a kernel of another GEMM can run tiles of this one as extra CTAs (the MoE's grouped GEMMs
    run the shared expert's, :mod:`fxglm5.lowering.triton.moe`) with this kernel's math, bit for bit. Returns
    whether this CTA wrote the tile's output (unsplit, or the FIXUP's last split; a split without FIXUP leaves it
    to the reduce kernel): the CTA that may go on from the finished tile in the same launch (the MoE's combine).

    NORM_A (``fp8_parts.NormedA.kernel_args``): A is the RMSNorm of ``a + up`` (up the residual), formed as each tile
    loads after the CTA has summed its rows' squares over all of K (``fp8_parts.add_rms_rstd``); the CTAs of column
    tile 0 write the sum (and the normed rows) of their K steps, so every value is written once. ``A_CACHE``: the A
    tiles' cache modifier (".cg" where another CTA of the launch wrote A: the MoE's norm tasks)."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # Grouped order: GROUP_M consecutive CTAs share one weight column tile while it is in L2.
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    gsize = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % gsize
    pid_n = (pid % width) // gsize

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, 128)
    m_mask = offs_m < M
    n_mask = offs_n < N
    # Rows past M (N) re-read row M-1 (N-1) instead of being masked: the tiles carry no row masks
    # (rows are independent in the MMA, and their results are never stored).
    rows_a = tl.minimum(offs_m, M - 1)
    rows_b = tl.minimum(offs_n, N - 1)
    a_ptrs = a_ptr + rows_a[:, None] * stride_am + offs_k[None, :]
    u_ptrs = up_ptr + rows_a[:, None] * stride_um + offs_k[None, :]
    b_ptrs = b_ptr + rows_b[:, None] * stride_bn + offs_k[None, :]
    if SCALAR_SB:
        bs_ptrs = bs_ptr + (pid_n * BLOCK_N // 128) * stride_bsn
    else:
        bs_ptrs = bs_ptr + (rows_b // 128) * stride_bsn

    if NORM_A:
        rstd = add_rms_rstd(a_ptr, up_ptr, pid_m * BLOCK_M, M, stride_am, stride_um, K, eps, SPLIT_K * KG_PER_SPLIT,
                            NORM_ROWS, BLOCK_M, DT)
    else:
        rstd = None

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(0, KG_PER_SPLIT):
        kg = pid_k * KG_PER_SPLIT + i
        a = load_a(a_ptrs, u_ptrs, kg, K, NO_K_MASK, GATED_A, DT, nw_ptr, rstd, NORM_A, A_CACHE)
        if NO_K_MASK:  # K % 128 == 0 and the splits tile KG exactly
            b = tl.load(b_ptrs + kg * 128)
            s_b = tl.load(bs_ptrs + kg)
        else:  # K tail, or steps past KG in a ragged last split (fully masked: no traffic)
            k_mask = offs_k < K - kg * 128
            b = tl.load(b_ptrs + kg * 128, mask=k_mask[None, :], other=0.0)
            s_b = tl.load(bs_ptrs + kg, mask=kg < KG, other=0.0)
        if A_MODE == 0:
            s_a = tl.load(as_ptr + rows_a * stride_asm + kg, mask=kg < KG, other=0.0)
            acc += _dot(a, tl.trans(b), INTERPRET) * _ab_scale(s_a, s_b, SCALAR_SB)
        elif A_MODE == 1:
            q, s_a = _quant_rows(a.to(tl.float32), INTERPRET)
            acc += _dot(q, tl.trans(b), INTERPRET) * _ab_scale(s_a, s_b, SCALAR_SB)
        else:
            acc += _dot(a, tl.trans(b.to(a.dtype)), DOT_F32) * _b_scale(s_b, SCALAR_SB)
    if NORM_A:
        if pid_n == 0:
            write_add_rms(a_ptrs, u_ptrs, nw_ptr, rstd, sum_ptr, normed_ptr, offs_m[:, None] * K + offs_k[None, :],
                          m_mask[:, None], pid_k * KG_PER_SPLIT, K, KG_PER_SPLIT, DT)

    c_mask = m_mask[:, None] & n_mask[None, :]
    finished = False
    if SPLIT_K == 1:
        finished = True
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)
    else:
        ws_tile = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
        tl.store(ws_tile + pid_k * stride_cs, acc, mask=c_mask)
        if FIXUP:
            # Last-arriving split of this tile reduces all partials (fixed order: deterministic), adds the
            # bias and writes the output; then resets the tile's counter for the next call / replay.
            # Saves the reduce launch. Barrier + acq_rel atomic publish the CTA's partial stores GPU-wide;
            # partials are read back from L2 (.cg), where other SMs' stores are coherent.
            tl.debug_barrier()
            arrived = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel", scope="gpu")
            finished = arrived == SPLIT_K - 1
            if finished:
                tot = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for sp in range(0, SPLIT_K):
                    tot += tl.load(ws_tile + sp * stride_cs, mask=c_mask, other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    tot += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
                out_ptrs = out_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
                tl.store(out_ptrs, tot.to(out_ptr.dtype.element_ty), mask=c_mask)
                tl.atomic_xchg(cnt_ptr + pid, 0, sem="relaxed", scope="gpu")
    return finished


@triton.jit
def _gemm_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, c_ptr, out_ptr, cnt_ptr, up_ptr,
    M, N, K, KG, KG_PER_SPLIT: tl.constexpr,
    stride_am, stride_asm, stride_bn, stride_bsn, stride_cm, stride_cs, stride_um,
    A_MODE: tl.constexpr, GATED_A: tl.constexpr, DT: tl.constexpr, DOT_F32: tl.constexpr, INTERPRET: tl.constexpr,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
    FIXUP: tl.constexpr,
    NO_K_MASK: tl.constexpr, SCALAR_SB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
    PDL: tl.constexpr,
    nw_ptr=None, sum_ptr=None, normed_ptr=None, eps=0.0, NORM_A: tl.constexpr = False, NORM_ROWS: tl.constexpr = 1,
):
    pdl_prologue(PDL)
    gemm_tile(a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, c_ptr, out_ptr, cnt_ptr, up_ptr, tl.program_id(0),
              tl.program_id(1), M, N, K, KG, KG_PER_SPLIT, stride_am, stride_asm, stride_bn, stride_bsn, stride_cm,
              stride_cs, stride_um, A_MODE, GATED_A, DT, DOT_F32, INTERPRET, HAS_BIAS, SPLIT_K, FIXUP, NO_K_MASK,
              SCALAR_SB, BLOCK_M, BLOCK_N, GROUP_M, nw_ptr, sum_ptr, normed_ptr, eps, NORM_A, NORM_ROWS)


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, h_ptr, N, stride_g, stride_u, BLOCK: tl.constexpr, DT: tl.constexpr,
                     PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(g_ptr + row * stride_g + offs, mask=mask, other=0.0)
    u = tl.load(u_ptr + row * stride_u + offs, mask=mask, other=0.0)
    tl.store(h_ptr + row * N + offs, _silu_mul(g, u, DT), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of two [M, N] row-strided tensors (the halves of a gate|up GEMM's output), one kernel."""
    m, n = gate.shape
    out = torch.empty(m, n, dtype=gate.dtype, device=gate.device)
    if m:
        block = min(1024, triton.next_power_of_2(n))
        _silu_mul_kernel[(m, triton.cdiv(n, block))](gate, up, out, n, gate.stride(0), up.stride(0), BLOCK=block,
                                                     DT=DTYPE_CODES[gate.dtype], **pdl(gate.device))
    return out


@triton.jit
def _splitk_reduce_kernel(ws_ptr, bias_ptr, c_ptr, MN, N, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Deterministic sum of the split-K partials (fixed order), + bias, cast to the output dtype."""
    pdl_prologue(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(ws_ptr + s * MN + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=mask)


# Regime defaults, the winners of the H200 sweeps (rows "sweep" in bench/results/kernels_gemm_moe*.json);
# ``fp8_linear(config=...)`` overrides any key. Decode split-K is derived: CTAS_PER_SM CTAs per SM.
# FIXUP (last CTA reduces in-kernel, one launch) measured equal to the reduce kernel timed alone; in a whole decode
# step (bench/results/rank_at_depth_fuse_kernels_5cf6615) it saves 390 launches at batch 1 for the same kernel time, but at batch 64 (64-row
# tiles) the last CTAs' serial sums cost 3 ms of kernel time a step: decode reduces in the GEMM up to 16 rows.
DECODE = dict(BLOCK_N=128, CTAS_PER_SM=4, GROUP_M=1, num_warps=4, num_stages=3, fused_quant=True, FIXUP=True)
MEDIUM = dict(BLOCK_M=64, BLOCK_N=128, CTAS_PER_SM=2, GROUP_M=8, num_warps=4, num_stages=3, fused_quant=False, FIXUP=False)
PREFILL = dict(BLOCK_M=64, BLOCK_N=128, SPLIT_K=1, GROUP_M=8, num_warps=4, num_stages=3, fused_quant=False, FIXUP=False)

def pick_config(m: int, n: int, k: int, act_quant: bool, num_sms: int = 132, config: Optional[dict] = None) -> dict:
    """Tile/split/pipeline choice per regime: decode M<=64 (weight-bandwidth bound), medium, prefill."""
    kg = triton.cdiv(k, 128)
    if m <= 64:
        cfg = dict(DECODE, BLOCK_M=16 if m <= 16 else (32 if m <= 32 else 64))
        cfg["FIXUP"] = cfg["FIXUP"] and cfg["BLOCK_M"] == 16
    elif m <= 512:
        cfg = dict(MEDIUM)
    else:
        cfg = dict(PREFILL)
    cfg.update(config or {})
    if "SPLIT_K" not in cfg:
        tiles = triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
        cfg["SPLIT_K"] = max(1, min(kg, round(cfg["CTAS_PER_SM"] * num_sms / tiles)))
    return cfg


def row_chunk(m: int, elements, align: int = 1) -> int:
    """Rows per chunk (``m`` if no chunking is needed) so that ``elements(rows)``, the most elements any tensor of
    a launch over ``rows`` rows holds (monotone in rows), stays below INT32_ELEMENTS: a call split into such row
    chunks, each an independent launch on contiguous row views, never overflows the kernels' int32 offsets.
    Halved until it fits, kept a multiple of ``align`` (whole M tiles: every row keeps its place in its tile)."""
    rows = m
    while rows > align and elements(rows) >= INT32_ELEMENTS:
        rows = max(align, rows // 2 // align * align)
    return rows


GATED_ROWS = 64  # up to this many rows the gate of a gated input is applied as the decode kernel loads its A tile


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    act_quant: bool = True,
    *,
    config: Optional[dict] = None,
    up: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Block-FP8 linear (see module doc); ``config`` overrides :func:`pick_config` (benchmark sweeps).

    The Gluon Hopper kernel runs where :func:`fp8_gemm_hopper.supported` says it applies (its own keys of
    ``config`` override :func:`fp8_gemm_hopper.pick_config`); ``config={"kernel": "triton"}`` forces this Triton
    kernel, ``{"kernel": "gluon"}`` the Gluon one (a ValueError where it does not apply). Up to
    ``fp8_gemv.ROWS`` rows, the GEMV (:mod:`fp8_gemv`) runs where ``fp8_gemv.GEMV["enabled"]``, or with
    ``{"kernel": "gemv"}`` (its other keys override ``fp8_gemv.GEMV``).

    ``up``: ``x`` is a gated MLP's gate and the GEMM's input is ``silu(x) * up`` (``fxglm5::silu_mul_fp8_linear``),
    applied as the kernel loads each A tile for up to GATED_ROWS rows (decode: the activation is a few rows, the
    weights are the cost), else by one elementwise kernel before the GEMM."""
    ref.check_linear_inputs(x, weight, weight_scale_inv, bias)
    if up is not None and (up.shape != x.shape or up.dtype != x.dtype):
        raise InputError(f"up: {up.dtype} {tuple(up.shape)} does not match the gate's {x.dtype} {tuple(x.shape)}")
    n, k = weight.shape
    lead = x.shape[:-1]
    x2, u2 = (None if t is None else _rows(t, k) for t in (x, up))
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*lead, n)
    rows = row_chunk(m, lambda r: r * max(n, k), align=128)  # 128: a multiple of every BLOCK_M
    if rows < m:
        for i in range(0, m, rows):
            out[i:i + rows] = fp8_linear(x2[i:i + rows], weight, weight_scale_inv, bias, act_quant, config=config,
                                         up=None if u2 is None else u2[i:i + rows])
        return out.view(*lead, n)
    weight = weight.contiguous()
    weight_scale_inv = weight_scale_inv.contiguous()
    kernel = (config or {}).get("kernel")
    if kernel not in (None, "triton", "gluon", "gemv"):
        raise ValueError(f"fp8_linear: config kernel must be 'triton', 'gluon' or 'gemv', got {kernel!r}")
    if runs_gemv(m, kernel):
        if m > fp8_gemv.ROWS:
            raise ValueError(f"fp8_linear: the GEMV serves up to {fp8_gemv.ROWS} rows, got {m}")
        gemv_config = {key: v for key, v in (config or {}).items() if key != "kernel"}
        fp8_gemv.launch(x2, u2, weight.contiguous(), weight_scale_inv.contiguous(), bias, act_quant, out,
                        num_sms(x.device), gemv_config)
        return out.view(*lead, n)
    gluon_ok = kernel != "triton" and fp8_gemm_hopper.supported(x2, weight, act_quant)
    if kernel == "gluon" and not gluon_ok:
        raise ValueError(f"fp8_linear: the Gluon Hopper kernel does not serve these inputs (x {tuple(x2.shape)} "
                         f"{x2.dtype} on {x2.device}, weight {tuple(weight.shape)}, act_quant={act_quant})")
    sms = num_sms(x.device)
    cfg = pick_config(m, n, k, act_quant, sms, config)
    if u2 is not None and (gluon_ok or not gates_in_kernel(m, act_quant, cfg)):
        x2, u2 = silu_mul(x2, u2), None
    if gluon_ok:
        a, a_s = quantize_act_1x128(x2)
        fp8_gemm_hopper.launch(a, a_s, weight, weight_scale_inv, None if bias is None else bias.contiguous(), out,
                               config)
        return out.view(*lead, n)
    _launch(x2, u2, weight, weight_scale_inv, bias, act_quant, cfg, out)
    return out.view(*lead, n)


def gates_in_kernel(m: int, act_quant: bool, cfg: dict) -> bool:
    """Whether the Triton kernel applies a gated input's ``silu(gate) * up`` as it loads each A tile: up to
    GATED_ROWS rows, where A is widened (W8A16) or quantized in registers, not by the quant kernel before it."""
    return m <= GATED_ROWS and not (act_quant and not cfg["fused_quant"])


NORM_ROWS = fp8_gemv.ROWS  # up to this many rows (decode) a normed input's RMSNorm is formed in the GEMM's A loads


def add_rms_norm_fp8_linear(x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                            weight: torch.Tensor, weight_scale_inv: torch.Tensor, bias: Optional[torch.Tensor] = None,
                            act_quant: bool = True, keep_normed: bool = False, *,
                            config: Optional[dict] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fxglm5::add_rms_norm_fp8_linear``: ``(fp8_linear(normed), total, normed or [..., 0])`` of ``normed, total =
    add_rms_norm(x, residual, norm_weight, eps)``, ``normed`` returned where ``keep_normed``; all contiguous.

    Up to NORM_ROWS rows, where the GEMM forms its A tiles in registers (the GEMV, or the Triton kernel quantizing or
    widening A as it loads: :func:`gates_in_kernel`) and x and residual share a dtype, one launch: every CTA sums its
    rows' squares of ``round(x + residual)`` over the whole row, then forms each A tile as the norm's normed values
    (``fp8_parts.load_a``), and column tile 0's CTAs write the sum (and the normed rows). The A operand is what
    ``add_rms_norm``'s kernel writes except where the two sums of squares, taken in different orders, round to
    factors an ulp apart and a normed value lies that close to a rounding boundary of the dtype (it then differs by
    one unit of it; tests/kernels/test_kernels_fused.py measures how often). Otherwise (prefill) ``add_rms_norm``'s
    kernel, then :func:`fp8_linear`: the chain's bits."""
    validate_add_rms_norm(x, residual, norm_weight, eps)
    ref.check_linear_inputs(x, weight, weight_scale_inv, bias)
    n, k = weight.shape
    lead = x.shape[:-1]
    m = x.numel() // k if k else 0
    kernel = (config or {}).get("kernel")
    fused = 0 < m <= NORM_ROWS and residual.dtype == x.dtype and kernel != "gluon" and settings.joins("norm_gemm")
    if fused and not runs_gemv(m, kernel):
        cfg = pick_config(m, n, k, act_quant, num_sms(x.device), config)
        fused = gates_in_kernel(m, act_quant, cfg)
    if not fused:
        normed, total = add_rms_norm(x, residual, norm_weight, eps, validate=False)
        out = fp8_linear(normed, weight, weight_scale_inv, bias, act_quant, config=config)
        return out, total, normed if keep_normed else normed.new_empty(*lead, 0)
    x2, r2 = _rows(x, k), _rows(residual, k)
    total = torch.empty(m, k, dtype=x.dtype, device=x.device)
    normed = torch.empty_like(total) if keep_normed else None
    norm = NormedA(r2, norm_weight.contiguous(), eps, total, normed)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    weight, weight_scale_inv = weight.contiguous(), weight_scale_inv.contiguous()
    if runs_gemv(m, kernel):
        gemv_config = {key: v for key, v in (config or {}).items() if key != "kernel"}
        fp8_gemv.launch(x2, None, weight, weight_scale_inv, bias, act_quant, out, num_sms(x.device), gemv_config,
                        norm)
    else:
        _launch(x2, None, weight, weight_scale_inv, bias, act_quant, cfg, out, norm)
    kept = normed.view(x.shape) if keep_normed else x.new_empty(*lead, 0)
    return out.view(*lead, n), total.view(x.shape), kept


def runs_gemv(m: int, kernel: Optional[str]) -> bool:
    """Whether :func:`fp8_linear` of ``m`` rows runs the GEMV (``kernel``: its config's choice, if any)."""
    return kernel == "gemv" or (kernel is None and fp8_gemv.GEMV["enabled"] and m <= fp8_gemv.ROWS)


def lone_launch(x2, u2, weight, weight_scale_inv, act_quant, out, counter_offset=0, bias=None):
    """``(launch, config)``: the one :func:`_gemm_kernel` launch ``fp8_linear(x2, weight, weight_scale_inv, bias,
    act_quant, up=u2)`` makes into ``out`` (its default config), the A tile quantized (or widened) and gated in
    registers, split over K with the FIXUP or not at all; None where that call launches anything else or more (the
    GEMV, the Gluon kernel, a quant or silu kernel before, the reduce kernel after). A kernel that runs this
    launch's tiles as extra CTAs of its own (:func:`gemm_tile`) gives fp8_linear's bits without its launch."""
    m, k = x2.shape
    if runs_gemv(m, None) or fp8_gemm_hopper.supported(x2, weight, act_quant):
        return None
    cfg = pick_config(m, weight.shape[0], k, act_quant, num_sms(x2.device))
    if (act_quant and not cfg["fused_quant"]) or (u2 is not None and not gates_in_kernel(m, act_quant, cfg)):
        return None
    launch = gemm_launch(x2, x2, 1 if act_quant else 2, u2, weight, weight_scale_inv, bias, cfg, out, counter_offset)
    return None if launch.reduce else (launch, cfg)


def _rows(t: torch.Tensor, k: int) -> torch.Tensor:
    """``t`` as [rows, k] with unit column stride (a row-strided view where it already is one)."""
    rows = t.reshape(-1, k)
    return rows if rows.stride(1) == 1 else rows.contiguous()


class GemmLaunch(NamedTuple):
    """One :func:`_gemm_kernel` launch: its grid, positional arguments and constexprs (``meta``, without the launch
    options), whether the split-K reduce kernel must follow it (split over K without FIXUP), and the norm's keyword
    arguments where A is a normed input (``fp8_parts.NormedA.kernel_args``)."""
    grid: tuple[int, int]
    args: tuple
    meta: dict
    reduce: bool
    norm: Optional[dict] = None


def quantized_input(x2, act_quant, cfg):
    """(A, its scales, A_MODE) of a launch: quantized once by the quant kernel (mode 0), in registers (1), or
    W8A16 (2, no scales: A stands in for them)."""
    if act_quant and not cfg["fused_quant"]:
        return *quantize_act_1x128(x2), 0
    return x2, x2, (1 if act_quant else 2)


def gemm_launch(a, a_s, mode, u2, weight, weight_scale_inv, bias, cfg, out, counter_offset=0,
                norm: Optional[NormedA] = None) -> GemmLaunch:
    """The launch of ``a`` [m, k] (``quantized_input``'s, ``u2`` the up half of a gated input; ``norm``: A is the
    RMSNorm of ``a + norm.residual``, A formed in registers) by ``weight`` into ``out`` [m, n]; its FIXUP counters
    start ``counter_offset`` into :func:`tile_counters` (a kernel that runs these tiles beside its own keeps its own
    counters below)."""
    (m, k), n = a.shape, weight.shape[0]
    kg = triton.cdiv(k, 128)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    kg_per_split = triton.cdiv(kg, cfg["SPLIT_K"])
    split = triton.cdiv(kg, kg_per_split)
    c = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=a.device)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), split)
    fixup = bool(cfg.get("FIXUP", False)) and split > 1
    cnt = tile_counters(a.device, counter_offset + grid[0])[counter_offset:] if fixup else c
    second = u2 if norm is None else norm.residual  # the A loads' second operand, if any
    args = (a, a_s, weight, weight_scale_inv, bias if bias is not None else out, c, out, cnt,
            a if second is None else second, m, n, k, kg, kg_per_split, a.stride(0), a_s.stride(0), weight.stride(0),
            weight_scale_inv.stride(0), n, m * n, a.stride(0) if second is None else second.stride(0))
    meta = dict(A_MODE=mode, GATED_A=u2 is not None, DT=DTYPE_CODES[out.dtype],
                DOT_F32=out.dtype == torch.float32 or settings.triton_interpret(),
                INTERPRET=settings.triton_interpret(), HAS_BIAS=bias is not None, SPLIT_K=split, FIXUP=fixup,
                NO_K_MASK=k % 128 == 0 and split * kg_per_split == kg, SCALAR_SB=bn <= 128, BLOCK_M=bm, BLOCK_N=bn,
                GROUP_M=cfg["GROUP_M"])
    return GemmLaunch(grid, args, meta, split > 1 and not fixup, None if norm is None else norm.kernel_args(m, bm))


def _launch(x2, u2, weight, weight_scale_inv, bias, act_quant, cfg, out, norm: Optional[NormedA] = None) -> None:
    """The Triton kernel (and, split over K without FIXUP, the reduce kernel) into ``out`` [m, n]."""
    a, a_s, mode = quantized_input(x2, act_quant, cfg)
    launch = gemm_launch(a, a_s, mode, u2, weight, weight_scale_inv, bias, cfg, out, norm=norm)
    _gemm_kernel[launch.grid](*launch.args, **launch.meta, **(launch.norm or {}), num_warps=cfg["num_warps"],
                              num_stages=cfg["num_stages"], **pdl(x2.device))
    if launch.reduce:
        m, n = out.shape
        block = 1024
        c = launch.args[5]
        _splitk_reduce_kernel[(triton.cdiv(m * n, block),)](
            c, bias if bias is not None else out, out, m * n, n, SPLIT_K=launch.meta["SPLIT_K"],
            HAS_BIAS=bias is not None, BLOCK=block, **pdl(x2.device)
        )
