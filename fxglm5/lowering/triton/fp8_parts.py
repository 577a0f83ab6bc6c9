"""The pieces the block-FP8 GEMM kernels share (:mod:`fp8_gemm`, :mod:`fp8_gemv`, the MoE and float32 GEMV kernels):
in-register 1x128 activation quantization with exact e4m3 rounding, the MMA with its interpreter-safe float32 form,
the gated MLP's ``silu(gate) * up`` at the unfused graph's rounding points, and the split-K arrival counters."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fxglm5.lowering.triton.norm_rope import round_to


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
