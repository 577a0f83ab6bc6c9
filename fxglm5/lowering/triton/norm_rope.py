"""Triton RMSNorm and interleaved RoPE, standalone and as ``@triton.jit`` helpers the cache writes fuse in.

Rounding follows :mod:`fxglm5.lowering.reference.norm_rope` (float32 math, rounded to the model's dtype where
the reference rounds), so a value is the same whether it went through these kernels or the fused cache write.
Rounding to bf16 is done on the float32 bits: the interpreter's own bf16 cast truncates.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fxglm5.lowering.reference import norm_rope as ref
from fxglm5.lowering.reference.fused import validate_add_rms_norm
from fxglm5.lowering.triton.device import interpreter_compat, pdl, pdl_prologue

interpreter_compat()

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

__all__ = ["DTYPE_CODES", "add_rms_norm", "add_rms_norm_launch", "add_rms_norm_row", "pairwise_sum", "rms_norm",
           "rms_norm_launch", "rope_interleaved", "round_to", "rms_normalize", "rms_norm_row", "rms_rstd", "rms_scale",
           "rotate_pairs"]


@triton.jit
def round_to(y, DT: tl.constexpr):
    """float32 -> the nearest value of the model's dtype (DT: 0 float32, 1 bf16, 2 fp16), kept in float32."""
    if DT == 1:
        b = y.to(tl.int32, bitcast=True)
        y = ((b + 0x7FFF + ((b >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    elif DT == 2:
        y = y.to(tl.float16).to(tl.float32)
    return y


@triton.jit
def rms_rstd(sum_sq, n, eps):
    """The factor RMSNorm scales by, ``1 / sqrt(sum_sq / n + eps)`` (correctly rounded), from the sum of squares of
    the n values."""
    return tl.math.div_rn(1.0, tl.sqrt_rn(sum_sq / n + eps))


@triton.jit
def rms_scale(x, r, w, DT: tl.constexpr):
    """The normed values of float32 x scaled by its rows' ``r`` (:func:`rms_rstd`): ``round(w * round(x * r))``."""
    return round_to(w * round_to(x * r, DT), DT)


@triton.jit
def rms_normalize(x, w, eps, n, DT: tl.constexpr):
    """GLM-5's RMSNorm of the float32 tile x (padding entries 0) over all its n real values; w the weights (0 pad)."""
    return rms_scale(x, rms_rstd(tl.sum(tl.reshape(x * x, (x.numel,)), axis=0), n, eps), w, DT)


@triton.jit
def rotate_pairs(even, odd, c, s, DT: tl.constexpr):
    """One interleaved RoPE pair rotation, rounded to the model's dtype."""
    return round_to(even * c - odd * s, DT), round_to(odd * c + even * s, DT)


@triton.jit
def rms_norm_row(x_ptr, w_ptr, out_ptr, row, stride_x, D, eps, BLOCK: tl.constexpr, DT: tl.constexpr):
    """RMSNorm of row ``row`` of x (row stride ``stride_x``) into the contiguous out: the body of the standalone
    kernel, and the query-norm role of ``paged_cache``'s kernel that also writes the caches."""
    row = row.to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = rms_normalize(x, w, eps, D, DT)
    tl.store(out_ptr + row * D + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, D, eps, BLOCK: tl.constexpr, DT: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    rms_norm_row(x_ptr, w_ptr, out_ptr, tl.program_id(0), stride_x, D, eps, BLOCK, DT)


@triton.jit
def pairwise_sum(v, LEVELS: tl.constexpr):
    """The sum of the 2**LEVELS values of the 1-D v, added in pairs level by level (v[2j] + v[2j+1], then the same on
    those sums): every addition is of two given values, so the float32 result is the same bits whatever the layout of
    v over threads and warps (``tl.sum``'s order follows the layout, so a kernel at other warps sums otherwise)."""
    for _ in tl.static_range(LEVELS):
        v = tl.sum(tl.reshape(v, (v.shape[0] // 2, 2)), axis=1)
    return tl.sum(v, axis=0)  # one value left: the sum of nothing else


@triton.jit
def add_rms_norm_row(x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, row, stride_x, stride_r, D, eps, CHUNK: tl.constexpr,
                     STEPS: tl.constexpr, LEVELS: tl.constexpr, DT: tl.constexpr):
    """Row ``row`` of ``add_rms_norm``: the sum x + r rounded to the sum's dtype (as the add rounds it) into the
    contiguous ``sum_ptr``, and its RMSNorm into the contiguous ``out_ptr``, over the STEPS chunks of CHUNK
    (2**LEVELS) columns covering D. The squares are summed chunk by chunk elementwise, then across the chunk by
    :func:`pairwise_sum`: a fixed order whatever the warp count, so the standalone kernel (:func:`_add_rms_norm_kernel`)
    and the norm tasks of the MoE's first launch (``moe._router_gate_up_kernel``, another warp count) write the
    same bits; a chunk at a time keeps a few values a thread in registers, not the whole row. A second pass forms
    the sum again (the same operations, the same bits) and writes both outputs."""
    row = row.to(tl.int64)
    offs = tl.arange(0, CHUNK)
    acc = tl.zeros((CHUNK,), dtype=tl.float32)
    for i in range(0, STEPS):
        cols = i * CHUNK + offs
        mask = cols < D
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        t = round_to(x + r, DT)
        acc += t * t
    rstd = rms_rstd(pairwise_sum(acc, LEVELS), D, eps)
    for i in range(0, STEPS):
        cols = i * CHUNK + offs
        mask = cols < D
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        t = round_to(x + r, DT)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(sum_ptr + row * D + cols, t.to(sum_ptr.dtype.element_ty), mask=mask)
        tl.store(out_ptr + row * D + cols, rms_scale(t, rstd, w, DT).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, stride_x, stride_r, D, eps, CHUNK: tl.constexpr,
                         STEPS: tl.constexpr, LEVELS: tl.constexpr, DT: tl.constexpr, PDL: tl.constexpr):
    """One row a program: :func:`add_rms_norm_row`."""
    pdl_prologue(PDL)
    add_rms_norm_row(x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, tl.program_id(0), stride_x, stride_r, D, eps, CHUNK,
                     STEPS, LEVELS, DT)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, stride_xt, stride_xh, stride_c, H, HALF, D,
                 BH: tl.constexpr, BP: tl.constexpr, DT: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    # program (token, head block): pairs p < HALF rotate, the rest of the D features pass through
    t = tl.program_id(0).to(tl.int64)
    oh = tl.program_id(1) * BH + tl.arange(0, BH)
    op = tl.arange(0, BP)
    pairs = op < D // 2
    mask = (oh[:, None] < H) & pairs[None, :]
    src = x_ptr + t * stride_xt + oh[:, None] * stride_xh + 2 * op[None, :]
    even = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    odd = tl.load(src + 1, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + t * stride_c + op, mask=op < HALF, other=1.0)
    s = tl.load(sin_ptr + t * stride_c + op, mask=op < HALF, other=0.0)
    e2, o2 = rotate_pairs(even, odd, c[None, :], s[None, :], DT)
    dst = out_ptr + t * H * D + oh[:, None] * D + 2 * op[None, :]
    tl.store(dst, e2.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + 1, o2.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_launch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, tuple]:
    """(out, the arguments of :func:`rms_norm_row` after ``row``, in order) of an RMSNorm over x's last dim: out
    contiguous in x's dtype, x's rows read strided where its last dim is contiguous."""
    rows = _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    D = x.shape[-1]
    return out, (rows, weight, out, rows.stride(0), D, float(eps), triton.next_power_of_2(D), DTYPE_CODES[x.dtype])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, validate: bool = True) -> torch.Tensor:
    """RMSNorm over the last dim of x (any leading dims, rows may be strided), out contiguous in x's dtype."""
    if validate:
        ref.validate_norm(x, weight, eps)
    out, args = rms_norm_launch(x, weight, eps)
    rows, block = args[0].shape[0], args[6]
    if rows:
        _rms_norm_kernel[(rows,)](*args, num_warps=max(1, min(16, block // 512)), **pdl(x.device))
    return out


def _rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


# the columns add_rms_norm_row sums elementwise before its pairwise sum: 8 values a thread at the MoE launch's 4 warps
ADD_NORM_CHUNK = 1024
ADD_NORM_WARPS = 4


def add_rms_norm_launch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                        out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[int, tuple, dict]:
    """(rows, the arguments of :func:`add_rms_norm_row` but ``row``, in order, its constexprs) of ``add_rms_norm`` over
    x's last dim, writing into ``out`` (normed, total: contiguous, x's shape, the sum's dtype) or new tensors
    (``args[3]``, ``args[4]``)."""
    dtype = torch.promote_types(x.dtype, residual.dtype)
    D = x.shape[-1]
    xs, rs = _rows(x), _rows(residual)
    normed, total = out if out is not None else (torch.empty(x.shape, dtype=dtype, device=x.device) for _ in range(2))
    chunk = min(ADD_NORM_CHUNK, triton.next_power_of_2(D))
    args = (xs, rs, weight, normed, total, xs.stride(0), rs.stride(0), D, float(eps))
    return xs.shape[0], args, dict(CHUNK=chunk, STEPS=triton.cdiv(D, chunk), LEVELS=chunk.bit_length() - 1,
                                   DT=DTYPE_CODES[dtype])


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 validate: bool = True, out: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm of x + residual, x + residual), one kernel (see ``fxglm5::add_rms_norm``); both contiguous, written
    into ``out`` (normed, total) where given."""
    if validate:
        validate_add_rms_norm(x, residual, weight, eps)
    rows, args, meta = add_rms_norm_launch(x, residual, weight, eps, out)
    if rows:
        _add_rms_norm_kernel[(rows,)](*args, **meta, num_warps=ADD_NORM_WARPS, **pdl(x.device))
    return args[3], args[4]


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, validate: bool = True) -> torch.Tensor:
    """x [T, H, D] (rows may be strided), cos/sin float32 [T, R/2] -> contiguous [T, H, D] (first R rotated)."""
    if validate:
        ref.validate_rope(x, cos, sin)
    T, H, D = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty((T, H, D), dtype=x.dtype, device=x.device)
    if T:
        bh = min(triton.next_power_of_2(H), 16)
        _rope_kernel[(T, triton.cdiv(H, bh))](x, cos, sin, out, x.stride(0), x.stride(1), cos.stride(0), H,
                                              cos.shape[1], D, BH=bh, BP=triton.next_power_of_2(D // 2),
                                              DT=DTYPE_CODES[x.dtype], num_warps=4, **pdl(x.device))
    return out
