"""Triton cache writes for the paged caches: latent 576 (compute dtype), FP8 ds_mla 656 bytes, indexer 132 bytes
per token (block-major).

Same signatures and semantics as :mod:`fxglm5.lowering.reference.paged` (slot < 0 = padding, skipped;
per-128-value power-of-two FP8 scales computed in-kernel with the exact float32-bit rule). One program per
token; runs on CUDA and under ``TRITON_INTERPRET=1`` on CPU tensors.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from fxglm5.lowering.reference import paged as ref


def interpreter_compat() -> None:
    """Make Triton 3.6's interpreter work with numpy >= 2.3 (idempotent; a no-op when not interpreting).

    The interpreter holds every scalar as a 1-element array and implements ``tensor.__index__`` as
    ``int(array)``, which numpy 2.3+ refuses for 1-d arrays: any ``range()`` with a runtime bound fails. We
    wrap its tensor patcher so that ``__index__`` uses ``.item()``.
    """
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        return
    try:
        import triton.runtime.interpreter as interp
    except Exception:  # pragma: no cover
        return
    orig = getattr(interp, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "_fxglm5_compat", False):
        return

    def _patched(tensor, scope, _orig=orig):
        _orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _patched._fxglm5_compat = True
    interp._patch_lang_tensor = _patched


interpreter_compat()


def ensure_tma_allocator() -> None:
    """TMA descriptors built in-kernel need a global scratch allocator (set once, if nobody set one)."""
    from triton.runtime import _allocation

    if _allocation._allocator.get() is _allocation._NULL_ALLOCATOR:
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))


__all__ = ["write_latent_cache", "write_indexer_cache", "slots_from_positions", "pow2_scale", "e4m3_bits",
           "bf16_bits", "ensure_tma_allocator", "interpreter_compat"]


@triton.jit
def e4m3_bits(y):
    """fp32 (|y| <= 448) -> e4m3 byte (uint8), round to nearest even, in integer arithmetic.

    Bit-exact with torch's ``.to(torch.float8_e4m3fn)`` (also under the interpreter, whose own fp8
    conversion mis-rounds values that carry into the next binade, and drops the sign of -0).
    """
    a = tl.abs(y)
    ab = a.to(tl.int32, bitcast=True)
    rb = (ab + 0x7FFFF + ((ab >> 20) & 1)) & -1048576
    bn = (((rb >> 23) - 120) << 3) | ((rb >> 20) & 7)
    bs = ((a * 512.0 + 12582912.0) - 12582912.0).to(tl.int32)  # subnormals: multiples of 2**-9
    b = tl.where(a < 0.015625, bs, bn)
    sign = (y.to(tl.int32, bitcast=True) >> 31) & 1
    return (b | (sign << 7)).to(tl.uint8)


@triton.jit
def bf16_bits(y):
    """fp32 -> bf16 bits (uint16), round to nearest even (the interpreter's own cast truncates)."""
    b = y.to(tl.int32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return (r & 0xFFFF).to(tl.uint16)


@triton.jit
def pow2_scale(amax):
    """amax (fp32) -> 2**ceil(log2(max(amax, 1e-10) / 448)), exact on the float32 bits."""
    s = tl.maximum(amax, 1e-10) / 448.0
    bits = s.to(tl.int32, bitcast=True)
    e = (bits >> 23) & 0xFF
    e = e + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return (e << 23).to(tl.float32, bitcast=True)


@triton.jit
def _write_latent_bf_kernel(kv_ptr, pe_ptr, slot_ptr, cache_ptr, stride_kv, stride_pe,
                            R: tl.constexpr, DR: tl.constexpr, BF16: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        offs = tl.arange(0, R)
        x = tl.load(kv_ptr + t * stride_kv + offs)
        od = tl.arange(0, DR)
        p = tl.load(pe_ptr + t * stride_pe + od)
        row = cache_ptr + slot * (R + DR)
        if BF16:  # cache_ptr is a uint16 view
            tl.store(row + offs, bf16_bits(x.to(tl.float32)))
            tl.store(row + R + od, bf16_bits(p.to(tl.float32)))
        else:
            tl.store(row + offs, x.to(cache_ptr.dtype.element_ty))
            tl.store(row + R + od, p.to(cache_ptr.dtype.element_ty))


@triton.jit
def _write_latent_fp8_kernel(kv_ptr, pe_ptr, slot_ptr, c8_ptr, c32_ptr, c16_ptr, stride_kv, stride_pe,
                             R: tl.constexpr, DR: tl.constexpr, G: tl.constexpr):
    # c8: the uint8 cache (656 per row), c32: float32 view (164 per row), c16: int16 view (328 per row)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        NG: tl.constexpr = R // G
        og = tl.arange(0, NG)
        oi = tl.arange(0, G)
        x = tl.load(kv_ptr + t * stride_kv + og[:, None] * G + oi[None, :]).to(tl.float32)  # [NG, G]
        amax = tl.max(tl.abs(x), axis=1)
        sc = pow2_scale(amax)
        y = x * (1.0 / sc)[:, None]
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        tl.store(c8_ptr + slot * 656 + og[:, None] * G + oi[None, :], e4m3_bits(y))
        tl.store(c32_ptr + slot * 164 + 128 + og, sc)
        od = tl.arange(0, DR)
        p = tl.load(pe_ptr + t * stride_pe + od).to(tl.float32)
        tl.store(c16_ptr + slot * 328 + 264 + od, bf16_bits(p))


@triton.jit
def _write_index_kernel(k_ptr, slot_ptr, c8_ptr, c32_ptr, stride_k, D: tl.constexpr, BS: tl.constexpr):
    # block-major (reference.paged.indexer_cache_parts): a block is BS * 132 bytes, its BS keys (D bytes each)
    # then their BS float32 scales; c32 is the float32 view (BS * 33 floats per block)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        blk = slot // BS
        off = slot % BS
        od = tl.arange(0, D)
        x = tl.load(k_ptr + t * stride_k + od).to(tl.float32)
        sc = pow2_scale(tl.max(tl.abs(x), axis=0))
        y = tl.minimum(tl.maximum(x * (1.0 / sc), -448.0), 448.0)
        tl.store(c8_ptr + blk * (BS * 132) + off * D + od, e4m3_bits(y))
        tl.store(c32_ptr + blk * (BS * 33) + BS * 32 + off, sc)


def _contig_rows(x):
    return x if x.stride(-1) == 1 else x.contiguous()


def write_latent_cache(cache, kv_c, k_pe, slot_mapping, *, validate: bool = True) -> None:
    """In-place write of ``[kv_c | k_pe]`` at ``slot_mapping`` in the 576 (compute dtype) or 656 (uint8) layout."""
    if validate:
        ref.validate_write_latent_cache(cache, kv_c, k_pe, slot_mapping)
    T = kv_c.shape[0]
    if T == 0:
        return
    kv_c = _contig_rows(kv_c)
    k_pe = _contig_rows(k_pe)
    if cache.dtype == torch.uint8:
        _write_latent_fp8_kernel[(T,)](
            kv_c, k_pe, slot_mapping, cache, cache.view(torch.float32),
            cache.view(torch.int16), kv_c.stride(0), k_pe.stride(0), R=512, DR=64, G=128, num_warps=4)
    else:
        bf16 = cache.dtype == torch.bfloat16
        _write_latent_bf_kernel[(T,)](kv_c, k_pe, slot_mapping, cache.view(torch.int16) if bf16 else cache,
                                      kv_c.stride(0), k_pe.stride(0), R=512, DR=64, BF16=bf16, num_warps=4)


def write_indexer_cache(cache, k, slot_mapping, *, validate: bool = True) -> None:
    """In-place write of FP8 indexer keys (block-major, 132 bytes per token) at ``slot_mapping``."""
    if validate:
        ref.validate_write_indexer_cache(cache, k, slot_mapping)
    T = k.shape[0]
    if T == 0:
        return
    k = _contig_rows(k)
    _write_index_kernel[(T,)](k, slot_mapping, cache, cache.view(torch.float32),
                              k.stride(0), D=128, BS=cache.shape[1], num_warps=1)


def slots_from_positions(block_table, req_idx, positions, block_size: int = 64, *, validate: bool = True):
    """Same as the reference (pure tensor ops, graph-safe)."""
    return ref.slots_from_positions(block_table, req_idx, positions, block_size, validate=validate)
