"""The pieces the block-FP8 GEMM kernels share (:mod:`fp8_gemm`, :mod:`fp8_gemv`, the MoE and float32 GEMV kernels):
in-register 1x128 activation quantization with exact e4m3 rounding, the MMA with its interpreter-safe float32 form,
the A tile's load with what is applied as it loads (the gated MLP's ``silu(gate) * up`` at the unfused graph's
rounding points, or the residual add and RMSNorm of ``add_rms_norm``), and the split-K arrival counters."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from fxglm5.lowering.triton.norm_rope import rms_rstd, rms_scale, round_to


@triton.jit
def _round_e4m3(v):
    """fp32 -> nearest-even e4m3 value, still fp32 (|v| <= 448). Only used under TRITON_INTERPRET: the
    Triton 3.6 interpreter's fp32->e4m3 cast mis-rounds values that carry into the next binade (124.3
    gives 64), so we round exactly first and the cast becomes exact."""
    u = v.to(tl.uint32, bitcast=True)
    sign = u & 0x80000000
    mag = u & 0x7FFFFFFF
    normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    y = tl.abs(v) * 512.0
    sub = ((y + 12582912.0) - 12582912.0) / 512.0
    r = tl.where(tl.abs(v) < 0.015625, sub, normal)
    return (r.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _quant_rows(a, INTERPRET: tl.constexpr):
    """1x128 quantization of an fp32 [rows, 128] tile: (e4m3 tile, fp32 scale per row).

    a / s is computed as a * (1/s) plus one FMA correction step (correctly rounded but for rare
    double-rounding cases): a per-element IEEE division costs a long instruction sequence with a slow
    path that padding rows (all zeros, tiny s) hit, and this runs once per K step in the decode kernels.
    """
    amax = tl.max(tl.abs(a), axis=1)
    s = tl.math.div_rn(tl.maximum(amax, 1e-10), tl.full(amax.shape, 448.0, tl.float32))
    r = tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32), s)
    q0 = a * r[:, None]
    q = tl.fma(tl.fma(-q0, s[:, None] + tl.zeros_like(a), a), r[:, None] + tl.zeros_like(a), q0)
    q = tl.clamp(q, -448.0, 448.0)
    if INTERPRET:
        q = _round_e4m3(q)
    return q.to(tl.float8e4nv), s


@triton.jit
def _dot(a, b_t, F32: tl.constexpr):
    """MMA with fp32 accumulation; F32 widens both operands and uses an IEEE fp32 dot (fp32
    activations, and the interpreter, whose bf16 dot is wrong in Triton 3.6)."""
    if F32:
        return tl.dot(a.to(tl.float32), b_t.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b_t)


@triton.jit
def _silu_mul(gate, up, DT: tl.constexpr):
    """``silu(gate) * up`` at the unfused graph's rounding points (silu rounded to the dtype, then the product),
    in gate's dtype; DT is its code for ``round_to``."""
    g = gate.to(tl.float32)
    act = round_to(g / (1.0 + tl.exp(-g)), DT)
    return round_to(act * up.to(tl.float32), DT).to(gate.dtype)


class NormedA(NamedTuple):
    """A GEMM's A operand given as ``add_rms_norm``'s normed rows of ``x + residual``
    (``fxglm5::add_rms_norm_fp8_linear`` at decode): the kernel forms each A tile from x's and the residual's tiles as
    it loads them (:func:`load_a`) and writes the sum (the next residual) and, where ``normed`` is given, the normed
    rows too (:func:`write_add_rms`)."""

    residual: torch.Tensor  # [m, k], unit column stride, x's dtype
    weight: torch.Tensor  # [k], the norm's weight
    eps: float
    total: torch.Tensor  # [m, k] contiguous, written: round(x + residual)
    normed: Optional[torch.Tensor]  # [m, k] contiguous, written where given: the A operand itself

    def kernel_args(self, rows: int, tile_rows: int) -> dict:
        """The keyword arguments of a kernel that takes the norm (:func:`fp8_gemm.gemm_tile`, the GEMV) for ``rows``
        rows in row tiles of ``tile_rows``: NORM_ROWS, the rows a tile's :func:`add_rms_rstd` sums, is the next power
        of two of its real rows (a decode call of 1 row in a 16-row MMA tile sums 1 row, not 16)."""
        return dict(nw_ptr=self.weight, sum_ptr=self.total, normed_ptr=self.normed, eps=float(self.eps), NORM_A=True,
                    NORM_ROWS=triton.next_power_of_2(min(rows, tile_rows)))


@triton.jit
def add_rms_rstd(x_ptr, r_ptr, first_row, M, stride_x, stride_r, K, eps, K_STEPS: tl.constexpr,
                 ROWS: tl.constexpr, TILE_ROWS: tl.constexpr, DT: tl.constexpr):
    """The RMSNorm factor (:func:`rms_rstd`) of each of a row tile's TILE_ROWS rows ``first_row + i`` of ``total =
    round(x + r)`` (rounded to the dtype as the add rounds it) over all K of its values (``K_STEPS`` 128-wide steps
    cover K). Only the tile's first ROWS rows are summed (the host makes them cover its rows below M), the others get
    0: at decode the tile has more rows than the step (1 row in a 16-row MMA tile), and the full rows read here,
    which every CTA of the GEMM reads, are the cost of the norm in the GEMM. The sums run in chunks of 1024 / ROWS
    columns (8 values a thread of the tiled GEMM's 4 warps; tests/kernels/test_add_rms_norm_gemm_compile.py: no
    spills for sm_90), elementwise, then across the chunk: another order than ``add_rms_norm``'s one reduction over
    the row, so the factor may differ from that kernel's by an ulp (and a normed value within that of a rounding
    boundary of the dtype by one unit of it)."""
    BLOCK: tl.constexpr = 1024 // ROWS
    STEPS: tl.constexpr = (K_STEPS * 128 + BLOCK - 1) // BLOCK
    rows = tl.minimum(first_row + tl.arange(0, ROWS), M - 1)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    for i in range(0, STEPS):
        cols = i * BLOCK + offs
        mask = (cols < K)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        t = round_to(x + r, DT)
        acc += t * t
    rstd = rms_rstd(tl.sum(acc, axis=1), K, eps)
    if ROWS == TILE_ROWS:
        return rstd
    # the tile's rows past ROWS lie past M: their A values are never stored, a factor of 0 serves them
    return tl.sum(tl.where(tl.arange(0, TILE_ROWS)[:, None] == tl.arange(0, ROWS)[None, :], rstd[None, :], 0.0), axis=1)


@triton.jit
def _add_rms(x, r, w, rstd, DT: tl.constexpr):
    """(total, normed) of the tiles x and r (float32 values of the dtype): ``total = round(x + r)``, as the add rounds
    it, and its normed values by the rows' factors ``rstd`` (:func:`add_rms_rstd`) and the norm weight's columns ``w``:
    what add_rms_norm writes, up to the factor's ulp."""
    t = round_to(x.to(tl.float32) + r.to(tl.float32), DT)
    return t, rms_scale(t, rstd[:, None], w.to(tl.float32)[None, :], DT)


@triton.jit
def load_a(a_ptrs, u_ptrs, kg, K, NO_K_MASK: tl.constexpr, GATED_A: tl.constexpr, DT: tl.constexpr, nw_ptr=None,
           rstd=None, NORM_A: tl.constexpr = False, CACHE: tl.constexpr = None):
    """K step ``kg``'s A tile [rows, 128] (zero past K): x's tile, or ``silu(gate) * up`` for a gated input (GATED_A:
    ``a_ptrs`` the gate, ``u_ptrs`` up), or the RMSNorm of ``x + residual`` (NORM_A: ``u_ptrs`` the residual, ``nw_ptr``
    the norm weight, ``rstd`` the rows' factors). ``CACHE``: x's loads' cache modifier (".cg" where another CTA of the
    launch wrote x: the MoE's norm tasks, ``moe._router_gate_up_kernel``)."""
    if NO_K_MASK:
        a = tl.load(a_ptrs + kg * 128, cache_modifier=CACHE)
        if GATED_A:
            a = _silu_mul(a, tl.load(u_ptrs + kg * 128), DT)
        if NORM_A:
            a = _add_rms(a, tl.load(u_ptrs + kg * 128), tl.load(nw_ptr + kg * 128 + tl.arange(0, 128)), rstd,
                         DT)[1].to(a.dtype)
    else:
        k_mask = tl.arange(0, 128) < K - kg * 128
        a = tl.load(a_ptrs + kg * 128, mask=k_mask[None, :], other=0.0, cache_modifier=CACHE)
        if GATED_A:  # silu(0) * 0 = 0 past K
            a = _silu_mul(a, tl.load(u_ptrs + kg * 128, mask=k_mask[None, :], other=0.0), DT)
        if NORM_A:  # 0 * rstd * 0 = 0 past K
            w = tl.load(nw_ptr + kg * 128 + tl.arange(0, 128), mask=k_mask, other=0.0)
            a = _add_rms(a, tl.load(u_ptrs + kg * 128, mask=k_mask[None, :], other=0.0), w, rstd, DT)[1].to(a.dtype)
    return a


@triton.jit
def write_add_rms(a_ptrs, u_ptrs, nw_ptr, rstd, sum_ptr, normed_ptr, offs, rows, kg0, K, STEPS: tl.constexpr,
                  DT: tl.constexpr):
    """The sum (and, where ``normed_ptr`` is given, the normed values: the A tiles :func:`load_a` forms, bit for bit)
    of ``STEPS`` K steps from ``kg0`` of a row tile, written at ``offs`` (the tile's [rows, 128] offsets into the
    contiguous outputs) for the ``rows`` below M: by the CTAs of the GEMM's first column tile, each its K steps, so
    every value once and none inside the GEMM's loop, where the stores would hold its A tiles in registers longer."""
    for i in range(0, STEPS):
        kg = kg0 + i
        k_mask = tl.arange(0, 128) < K - kg * 128
        mask = rows & k_mask[None, :]
        x, r = tl.load(a_ptrs + kg * 128, mask=mask, other=0.0), tl.load(u_ptrs + kg * 128, mask=mask, other=0.0)
        t, n = _add_rms(x, r, tl.load(nw_ptr + kg * 128 + tl.arange(0, 128), mask=k_mask, other=0.0), rstd, DT)
        tl.store(sum_ptr + offs + kg * 128, t.to(sum_ptr.dtype.element_ty), mask=mask)
        if normed_ptr is not None:
            tl.store(normed_ptr + offs + kg * 128, n.to(normed_ptr.dtype.element_ty), mask=mask)


_COUNTERS: dict = {}


def tile_counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 arrival counters for the split-K fixup, one per output tile, kept per device.

    Every tile's last CTA resets its counter, so the buffer stays zero between calls and graph replays
    (kernels of one stream run one after another; concurrent streams would need their own buffers)."""
    key = (device.type, device.index)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1 << 16), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf
