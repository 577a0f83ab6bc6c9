"""Triton cache writes for the paged caches: latent 576 (compute dtype), FP8 ds_mla 656 bytes, indexer 132 bytes
per token (block-major).

Same signatures and semantics as :mod:`fxglm5.lowering.reference.paged` (slot < 0 = padding, skipped;
per-128-value power-of-two FP8 scales computed in-kernel with the exact float32-bit rule). One program per
token; runs on CUDA and under ``TRITON_INTERPRET=1`` on CPU tensors.

Each write's body is a ``@triton.jit`` row helper (``_latent_row_*``, ``_index_row``) that its standalone kernel calls
for its token, and so does the horizontally fused kernel of :func:`rms_norm_write_caches`, whose programs split into
roles: the query latent's RMSNorm (``norm_rope.rms_norm_row``), the latent row, the indexer key, and at decode the
indexer's head weights (``f32_linear``'s GEMV helpers over its grid). The launches build their arguments once
(``_latent_launch``, ``_index_launch``, ``norm_rope.rms_norm_launch``, ``_weights_launch``), in the helpers' order.

The attention's latent query (``[q_nope . W_UK | rope(q_pe)]``) is a tile function too (:func:`latent_query_tile`),
run by its own launch (:func:`latent_query`) or, up to LATENT_QUERY_ROWS tokens, as the last tasks of the q_b GEMM's
launch that produces q_nope and q_pe (:func:`fp8_linear_latent_query`, ``fp8_gemm.gemm_tile`` for the GEMM's tiles,
:mod:`fxglm5.lowering.triton.tasks` for the dependency of each head's programs on its columns' tiles).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fxglm5 import settings
from fxglm5.lowering.reference import paged as ref
from fxglm5.lowering.reference.fused import query_heads
from fxglm5.lowering.triton import tasks
from fxglm5.lowering.triton.device import interpreter_compat, num_sms, pdl, pdl_prologue
from fxglm5.lowering.triton.f32_linear import (MAX_SCALES, f32_linear, finish_tile, gemv_launch, gemv_tile_start,
                                               gemv_tile_sum, is_gemv, operands, padded_scales, split_buffers)
from fxglm5.lowering.triton.fp8_gemm import fp8_linear, gemm_tile, lone_launch
from fxglm5.lowering.triton.norm_rope import (DTYPE_CODES, rms_norm_launch, rms_norm_row, rms_normalize, rotate_pairs,
                                              round_to)

interpreter_compat()


__all__ = ["write_latent_cache", "write_indexer_cache", "write_exact_index_keys", "write_index_keys",
           "rms_norm_write_caches", "latent_query", "fp8_linear_latent_query",
           "slots_from_positions", "pow2_scale", "e4m3_bits", "bf16_bits", "rope_launch_args", "WRITE_WARPS"]

# the latent query's launch: its warps, and up to how many tokens its decode tiles (16 tokens x 32 columns) serve, the
# rows up to which the q_b GEMM's launch runs it (fp8_linear_latent_query)
LATENT_QUERY_WARPS = 4
LATENT_QUERY_ROWS = 16
# the warps of every cache-write launch, standalone or in rms_norm_write_caches' kernel: a row's sums (its RMS, the
# LayerNorm's mean and variance, the FP8 amax) reduce over the same thread layout, so both give the same bits
WRITE_WARPS = 4


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
def _latent_values(kv_row, w_ptr, RK, eps, R: tl.constexpr, G: tl.constexpr, NORM: tl.constexpr, DT: tl.constexpr):
    """The 512 latent values of one token as a float32 [R // G, G] tile (zero past RK), RMS-normed if NORM, and
    the tile's offsets in the row."""
    idx = tl.arange(0, R // G)[:, None] * G + tl.arange(0, G)[None, :]
    x = tl.load(kv_row + idx, mask=idx < RK, other=0.0).to(tl.float32)
    if NORM:
        w = tl.load(w_ptr + idx, mask=idx < RK, other=0.0).to(tl.float32)
        x = rms_normalize(x, w, eps, RK, DT)
    return x, idx


@triton.jit
def _rope_values(pe_row, cos_row, sin_row, RP, HALF, DR: tl.constexpr, ROPE: tl.constexpr, DT: tl.constexpr):
    """The (even, odd) halves of one token's rope features, [DR // 2] each (zero past RP), rotated if ROPE."""
    op = tl.arange(0, DR // 2)
    m = op < RP // 2
    even = tl.load(pe_row + 2 * op, mask=m, other=0.0).to(tl.float32)
    odd = tl.load(pe_row + 2 * op + 1, mask=m, other=0.0).to(tl.float32)
    if ROPE:
        c = tl.load(cos_row + op, mask=op < HALF, other=1.0)
        s = tl.load(sin_row + op, mask=op < HALF, other=0.0)
        even, odd = rotate_pairs(even, odd, c, s, DT)
    return even, odd


@triton.jit
def _latent_row_bf(t, kv_ptr, pe_ptr, slot_ptr, cache_ptr, w_ptr, cos_ptr, sin_ptr, stride_kv, stride_pe, stride_c, RK,
                   RP, HALF, eps, R: tl.constexpr, DR: tl.constexpr, G: tl.constexpr, NORM: tl.constexpr,
                   ROPE: tl.constexpr, DT: tl.constexpr, BF16: tl.constexpr):
    """Token t's 576-wide row in a compute-dtype latent cache (``cache_ptr`` a uint16 view of a bf16 one)."""
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        x, idx = _latent_values(kv_ptr + t * stride_kv, w_ptr, RK, eps, R, G, NORM, DT)
        even, odd = _rope_values(pe_ptr + t * stride_pe, cos_ptr + t * stride_c, sin_ptr + t * stride_c, RP, HALF,
                                 DR, ROPE, DT)
        op = tl.arange(0, DR // 2)
        row = cache_ptr + slot * (R + DR)
        if BF16:  # cache_ptr is a uint16 view
            tl.store(row + idx, bf16_bits(x))
            tl.store(row + R + 2 * op, bf16_bits(even))
            tl.store(row + R + 2 * op + 1, bf16_bits(odd))
        else:
            tl.store(row + idx, x.to(cache_ptr.dtype.element_ty))
            tl.store(row + R + 2 * op, even.to(cache_ptr.dtype.element_ty))
            tl.store(row + R + 2 * op + 1, odd.to(cache_ptr.dtype.element_ty))


@triton.jit
def _latent_row_fp8(t, kv_ptr, pe_ptr, slot_ptr, c8_ptr, c32_ptr, c16_ptr, w_ptr, cos_ptr, sin_ptr, stride_kv,
                    stride_pe, stride_c, RK, RP, HALF, eps, R: tl.constexpr, DR: tl.constexpr, G: tl.constexpr,
                    NORM: tl.constexpr, ROPE: tl.constexpr, DT: tl.constexpr):
    """Token t's 656-byte row in an FP8 latent cache. c8: the uint8 cache (656 per row), c32: its float32 view (164
    per row), c16: its int16 view (328 per row)."""
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        x, idx = _latent_values(kv_ptr + t * stride_kv, w_ptr, RK, eps, R, G, NORM, DT)  # [R // G, G]
        sc = pow2_scale(tl.max(tl.abs(x), axis=1))
        y = tl.minimum(tl.maximum(x * (1.0 / sc)[:, None], -448.0), 448.0)
        tl.store(c8_ptr + slot * 656 + idx, e4m3_bits(y))
        tl.store(c32_ptr + slot * 164 + 128 + tl.arange(0, R // G), sc)
        even, odd = _rope_values(pe_ptr + t * stride_pe, cos_ptr + t * stride_c, sin_ptr + t * stride_c, RP, HALF,
                                 DR, ROPE, DT)
        op = tl.arange(0, DR // 2)
        tl.store(c16_ptr + slot * 328 + 264 + 2 * op, bf16_bits(even))
        tl.store(c16_ptr + slot * 328 + 264 + 2 * op + 1, bf16_bits(odd))


@triton.jit
def _latent_row(t, kv_ptr, pe_ptr, slot_ptr, c8_ptr, c32_ptr, c16_ptr, w_ptr, cos_ptr, sin_ptr, stride_kv, stride_pe,
                stride_c, RK, RP, HALF, eps, R: tl.constexpr, DR: tl.constexpr, G: tl.constexpr, NORM: tl.constexpr,
                ROPE: tl.constexpr, DT: tl.constexpr, FP8: tl.constexpr, BF16: tl.constexpr):
    """Token t's latent row in either layout (``FP8``: the 656-byte one; else c8 is the compute-dtype cache)."""
    if FP8:
        _latent_row_fp8(t, kv_ptr, pe_ptr, slot_ptr, c8_ptr, c32_ptr, c16_ptr, w_ptr, cos_ptr, sin_ptr, stride_kv,
                        stride_pe, stride_c, RK, RP, HALF, eps, R, DR, G, NORM, ROPE, DT)
    else:
        _latent_row_bf(t, kv_ptr, pe_ptr, slot_ptr, c8_ptr, w_ptr, cos_ptr, sin_ptr, stride_kv, stride_pe, stride_c,
                       RK, RP, HALF, eps, R, DR, G, NORM, ROPE, DT, BF16)


@triton.jit
def _write_latent_bf_kernel(kv_ptr, pe_ptr, slot_ptr, cache_ptr, c32_ptr, c16_ptr, w_ptr, cos_ptr, sin_ptr, stride_kv,
                            stride_pe, stride_c, RK, RP, HALF, eps, R: tl.constexpr, DR: tl.constexpr,
                            G: tl.constexpr, NORM: tl.constexpr, ROPE: tl.constexpr, DT: tl.constexpr,
                            FP8: tl.constexpr, BF16: tl.constexpr, PDL: tl.constexpr):
    # the arguments of _latent_row (c32 / c16 / FP8 unused: the launches share one argument list)
    pdl_prologue(PDL)
    _latent_row_bf(tl.program_id(0), kv_ptr, pe_ptr, slot_ptr, cache_ptr, w_ptr, cos_ptr, sin_ptr, stride_kv,
                   stride_pe, stride_c, RK, RP, HALF, eps, R, DR, G, NORM, ROPE, DT, BF16)


@triton.jit
def _write_latent_fp8_kernel(kv_ptr, pe_ptr, slot_ptr, c8_ptr, c32_ptr, c16_ptr, w_ptr, cos_ptr, sin_ptr, stride_kv,
                             stride_pe, stride_c, RK, RP, HALF, eps, R: tl.constexpr, DR: tl.constexpr,
                             G: tl.constexpr, NORM: tl.constexpr, ROPE: tl.constexpr, DT: tl.constexpr,
                             FP8: tl.constexpr, BF16: tl.constexpr, PDL: tl.constexpr):
    # the arguments of _latent_row (FP8 / BF16 unused: the launches share one argument list)
    pdl_prologue(PDL)
    _latent_row_fp8(tl.program_id(0), kv_ptr, pe_ptr, slot_ptr, c8_ptr, c32_ptr, c16_ptr, w_ptr, cos_ptr, sin_ptr,
                    stride_kv, stride_pe, stride_c, RK, RP, HALF, eps, R, DR, G, NORM, ROPE, DT)


@triton.jit
def _index_row(t, k_ptr, slot_ptr, c8_ptr, c32_ptr, w_ptr, b_ptr, cos_ptr, sin_ptr, stride_k, stride_c, KD, HALF, eps,
               D: tl.constexpr, BS: tl.constexpr, NORM: tl.constexpr, ROPE: tl.constexpr, DT: tl.constexpr,
               EXACT: tl.constexpr, BF16: tl.constexpr):
    """Token t's indexer key: LayerNorm (NORM), RoPE of its first pairs (ROPE), stored.

    EXACT: c8 is a compute-dtype cache [blocks, BS, D] (an int16 view of its bits when BF16) that keeps the key
    unquantized. Otherwise block-major (reference.paged.indexer_cache_parts): a block is BS * 132 bytes, its BS keys
    (D bytes each) then their BS float32 scales; c32 is the float32 view (BS * 33 floats per block). The key is held
    as a [D // 2, 2] tile of (even, odd) pairs so that RoPE can rotate them in registers."""
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        op = tl.arange(0, D // 2)
        oc = tl.arange(0, 2)[None, :]
        idx = 2 * op[:, None] + oc
        m = idx < KD
        x = tl.load(k_ptr + t * stride_k + idx, mask=m, other=0.0).to(tl.float32)
        if NORM:  # the indexer's LayerNorm (float32 statistics, one rounding)
            mean = tl.sum(tl.sum(x, axis=1), axis=0) / KD
            xc = tl.where(m, x - mean, 0.0)
            r = tl.math.div_rn(1.0, tl.sqrt_rn(tl.sum(tl.sum(xc * xc, axis=1), axis=0) / KD + eps))
            w = tl.load(w_ptr + idx, mask=m, other=0.0).to(tl.float32)
            b = tl.load(b_ptr + idx, mask=m, other=0.0).to(tl.float32)
            x = round_to(xc * r * w + b, DT)
        if ROPE:
            c = tl.load(cos_ptr + t * stride_c + op, mask=op < HALF, other=1.0)
            s = tl.load(sin_ptr + t * stride_c + op, mask=op < HALF, other=0.0)
            even, odd = rotate_pairs(tl.sum(tl.where(oc == 0, x, 0.0), axis=1), tl.sum(tl.where(oc == 1, x, 0.0), axis=1),
                                     c, s, DT)
            x = tl.where(oc == 0, even[:, None], odd[:, None])
        if EXACT:
            if BF16:
                tl.store(c8_ptr + slot * D + idx, bf16_bits(x))
            else:
                tl.store(c8_ptr + slot * D + idx, x.to(c8_ptr.dtype.element_ty))
        else:
            sc = pow2_scale(tl.max(tl.max(tl.abs(x), axis=1), axis=0))
            y = tl.minimum(tl.maximum(x * (1.0 / sc), -448.0), 448.0)
            blk = slot // BS
            off = slot % BS
            tl.store(c8_ptr + blk * (BS * 132) + off * D + idx, e4m3_bits(y))
            tl.store(c32_ptr + blk * (BS * 33) + BS * 32 + off, sc)


@triton.jit
def _write_index_kernel(k_ptr, slot_ptr, c8_ptr, c32_ptr, w_ptr, b_ptr, cos_ptr, sin_ptr, stride_k, stride_c, KD,
                        HALF, eps, D: tl.constexpr, BS: tl.constexpr, NORM: tl.constexpr, ROPE: tl.constexpr,
                        DT: tl.constexpr, EXACT: tl.constexpr, BF16: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    _index_row(tl.program_id(0), k_ptr, slot_ptr, c8_ptr, c32_ptr, w_ptr, b_ptr, cos_ptr, sin_ptr, stride_k, stride_c,
               KD, HALF, eps, D, BS, NORM, ROPE, DT, EXACT, BF16)


@triton.jit
def _norm_write_caches_kernel(
        x_ptr, xw_ptr, out_ptr, stride_x, QD, q_eps, Q_BLOCK: tl.constexpr, Q_DT: tl.constexpr,
        kv_ptr, pe_ptr, slot_ptr, c8_ptr, c32_ptr, c16_ptr, kv_w_ptr, cos_ptr, sin_ptr, stride_kv, stride_pe, stride_c,
        RK, RP, HALF, kv_eps, R: tl.constexpr, DR: tl.constexpr, G: tl.constexpr, KV_NORM: tl.constexpr,
        KV_ROPE: tl.constexpr, KV_DT: tl.constexpr, KV_FP8: tl.constexpr, KV_BF16: tl.constexpr,
        k_ptr, k_slot_ptr, i8_ptr, i32_ptr, k_w_ptr, k_b_ptr, k_cos_ptr, k_sin_ptr, stride_k, k_stride_c, KD, K_HALF,
        k_eps, D: tl.constexpr, BS: tl.constexpr, K_NORM: tl.constexpr, K_ROPE: tl.constexpr, K_DT: tl.constexpr,
        K_EXACT: tl.constexpr, K_BF16: tl.constexpr,
        hx_ptr, hw_ptr, hws_ptr, hout_ptr, hcnt_ptr, HM, HN, HK, stride_hx, stride_hw, s0, s1, s2, s3,
        NUM_SCALES: tl.constexpr, STEPS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        T, INDEX: tl.constexpr, WEIGHTS: tl.constexpr, PDL: tl.constexpr):
    """fxglm5::rms_norm_write_caches in one launch. Program ``role * T + t`` (role < 2, or 3 with ``INDEX``) is token
    t's query-latent RMSNorm (role 0, :func:`rms_norm_row`'s arguments), its latent-cache row (role 1,
    :func:`_latent_row`'s) or its indexer key (role 2, :func:`_index_row`'s); they read only their own rows. With
    ``WEIGHTS`` the programs after those are f32_linear's GEMV of the indexer's head weights (the ``h*`` arguments
    and the constexprs after them, ``_f32_gemv_kernel``'s): one column tile x one K split each, in that kernel's
    order, its first weight tile requested before the PDL wait (the other programs request none: their K is 0) and
    the tile's last split summing the partials (``f32_linear.finish_tile``)."""
    pid = tl.program_id(0)
    rows = T * (3 if INDEX else 2)  # the token rows' programs, before the GEMV's
    if WEIGHTS:
        g = tl.maximum(pid - rows, 0)
        tiles = tl.cdiv(HN, BLOCK_N)
        pid_n, pid_k = g % tiles, g // tiles
        offs_n, w_rows, w = gemv_tile_start(hw_ptr, HN, tl.where(pid >= rows, HK, 0), stride_hw, pid_n, pid_k, STEPS,
                                            BLOCK_N, BLOCK_K)
    pdl_prologue(PDL)
    if pid < rows:
        t = pid % T
        role = pid // T
        if role == 0:
            rms_norm_row(x_ptr, xw_ptr, out_ptr, t, stride_x, QD, q_eps, Q_BLOCK, Q_DT)
        elif role == 1:
            _latent_row(t, kv_ptr, pe_ptr, slot_ptr, c8_ptr, c32_ptr, c16_ptr, kv_w_ptr, cos_ptr, sin_ptr, stride_kv,
                        stride_pe, stride_c, RK, RP, HALF, kv_eps, R, DR, G, KV_NORM, KV_ROPE, KV_DT, KV_FP8, KV_BF16)
        elif INDEX:
            _index_row(t, k_ptr, k_slot_ptr, i8_ptr, i32_ptr, k_w_ptr, k_b_ptr, k_cos_ptr, k_sin_ptr, stride_k,
                       k_stride_c, KD, K_HALF, k_eps, D, BS, K_NORM, K_ROPE, K_DT, K_EXACT, K_BF16)
    elif WEIGHTS:
        acc, tile, mask = gemv_tile_sum(hx_ptr, stride_hx, HM, HN, HK, offs_n, w_rows, w, pid_k, STEPS, BLOCK_M,
                                        BLOCK_K)
        finish_tile(acc, hws_ptr, hout_ptr, hcnt_ptr, tile, mask, pid_n, pid_k, HM * HN, s0, s1, s2, s3, NUM_SCALES,
                    SPLIT)


@triton.jit
def latent_query_tile(tt, h, ct, qn_ptr, w_ptr, pe_ptr, cos_ptr, sin_ptr, out_ptr, s_qn_t, s_qn_h, s_w_h, s_w_d,
                      s_pe_t, s_pe_h, stride_c, T, H, D, RA, RP, HALF, R: tl.constexpr, DR: tl.constexpr,
                      BT: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, ROPE: tl.constexpr, DT: tl.constexpr,
                      DT_PE: tl.constexpr, IEEE: tl.constexpr):
    """Program (token tile ``tt``, head ``h``, column tile ``ct``) of the latent query: out[t, h, cols] = q_nope[t, h]
    . W_UK[h][:, cols] (zero past RA), float32 accumulation rounded once to the model's dtype; column tile 0 also
    writes the rotated q_pe. Its own function so that :func:`_latent_query_kernel` and the q_b GEMM's launch
    (:func:`_gemm_latent_query_kernel`, where another CTA of the launch wrote q_nope and q_pe) run the same code, bit
    for bit; q_nope and q_pe are read from L2 (``.cg``: another SM's stores are coherent there, not in this SM's L1;
    a program reads each of its values once, so the standalone launch loses nothing by it)."""
    t = tt * BT + tl.arange(0, BT)
    tm = (t < T)[:, None]
    t64 = t.to(tl.int64)[:, None]
    cols = ct * BR + tl.arange(0, BR)[None, :]
    ok = tl.arange(0, BK)
    qn_row = qn_ptr + t64 * s_qn_t + h * s_qn_h
    w_col = w_ptr + h.to(tl.int64) * s_w_h + cols
    acc = tl.zeros([BT, BR], tl.float32)
    for k0 in range(0, D, BK):
        k = k0 + ok
        a = tl.load(qn_row + k[None, :], mask=tm & (k[None, :] < D), other=0.0, cache_modifier=".cg")
        b = tl.load(w_col + k[:, None] * s_w_d, mask=(k[:, None] < D) & (cols < RA), other=0.0)
        if IEEE:  # float32 models, and the interpreter (whose bf16 tl.dot is wrong): exact float32 products
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    out_row = out_ptr + (t64 * H + h) * (R + DR)
    tl.store(out_row + cols, round_to(acc, DT).to(out_ptr.dtype.element_ty), mask=tm)
    if ct == 0:
        op = tl.arange(0, DR // 2)[None, :]
        pm = tm & (op < RP // 2)
        pe_row = pe_ptr + t64 * s_pe_t + h * s_pe_h
        even = tl.load(pe_row + 2 * op, mask=pm, other=0.0, cache_modifier=".cg").to(tl.float32)
        odd = tl.load(pe_row + 2 * op + 1, mask=pm, other=0.0, cache_modifier=".cg").to(tl.float32)
        if ROPE:
            cm = tm & (op < HALF)
            c = tl.load(cos_ptr + t64 * stride_c + op, mask=cm, other=1.0)
            s = tl.load(sin_ptr + t64 * stride_c + op, mask=cm, other=0.0)
            even, odd = rotate_pairs(even, odd, c, s, DT_PE)
        tl.store(out_row + R + 2 * op, even.to(out_ptr.dtype.element_ty), mask=tm)
        tl.store(out_row + R + 2 * op + 1, odd.to(out_ptr.dtype.element_ty), mask=tm)


@triton.jit
def _latent_query_kernel(qn_ptr, w_ptr, pe_ptr, cos_ptr, sin_ptr, out_ptr, s_qn_t, s_qn_h, s_w_h, s_w_d, s_pe_t, s_pe_h,
                         stride_c, T, H, D, RA, RP, HALF, R: tl.constexpr, DR: tl.constexpr, BT: tl.constexpr,
                         BR: tl.constexpr, BK: tl.constexpr, ROPE: tl.constexpr, DT: tl.constexpr,
                         DT_PE: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
    """The latent query's launch: one :func:`latent_query_tile` a program of the (token tiles, heads, column tiles)
    grid."""
    pdl_prologue(PDL)
    latent_query_tile(tl.program_id(0), tl.program_id(1), tl.program_id(2), qn_ptr, w_ptr, pe_ptr, cos_ptr, sin_ptr,
                      out_ptr, s_qn_t, s_qn_h, s_w_h, s_w_d, s_pe_t, s_pe_h, stride_c, T, H, D, RA, RP, HALF, R, DR,
                      BT, BR, BK, ROPE, DT, DT_PE, IEEE)


def _contig_rows(x):
    return x if x.stride(-1) == 1 else x.contiguous()


def rope_launch_args(rope, like):
    """(cos, sin, row stride, pairs) for the kernels; dummies (never read) without RoPE."""
    if rope is None:
        return like, like, 0, 0
    cos, sin = (c.contiguous() for c in rope)
    return cos, sin, cos.stride(0), cos.shape[1]


def _latent_launch(cache, kv_c, k_pe, slot_mapping, norm, rope) -> tuple:
    """The arguments of :func:`_latent_row` after ``t`` of a latent-cache write (either layout)."""
    kv_c, k_pe = _contig_rows(kv_c), _contig_rows(k_pe)
    weight, eps = norm if norm is not None else (kv_c, 0.0)
    cos, sin, stride_c, half = rope_launch_args(rope, kv_c)
    fp8, bf16 = cache.dtype == torch.uint8, cache.dtype == torch.bfloat16
    if fp8:
        views = (cache, cache.view(torch.float32), cache.view(torch.int16))
    else:
        views = (cache.view(torch.int16) if bf16 else cache, cache, cache)
    return (kv_c, k_pe, slot_mapping, *views, weight, cos, sin, kv_c.stride(0), k_pe.stride(0), stride_c,
            kv_c.shape[1], k_pe.shape[1], half, float(eps), ref.KV_LORA_RANK, ref.ROPE_DIM, ref.FP8_GROUP,
            norm is not None, rope is not None, DTYPE_CODES[kv_c.dtype], fp8, bf16)


def write_latent_cache(cache, kv_c, k_pe, slot_mapping, *, validate: bool = True, norm=None, rope=None) -> None:
    """In-place write of ``[kv_c | k_pe]`` at ``slot_mapping`` in the 576 (compute dtype) or 656 (uint8) layout,
    RMSNorm (``norm`` = (weight, eps)) and RoPE (``rope`` = (cos, sin)) applied in the same kernel."""
    if validate:
        ref.validate_write_latent_cache(cache, kv_c, k_pe, slot_mapping, norm, rope)
    T = kv_c.shape[0]
    if T == 0:
        return
    kernel = _write_latent_fp8_kernel if cache.dtype == torch.uint8 else _write_latent_bf_kernel
    kernel[(T,)](*_latent_launch(cache, kv_c, k_pe, slot_mapping, norm, rope), num_warps=WRITE_WARPS,
                 **pdl(kv_c.device))


def write_indexer_cache(cache, k, slot_mapping, *, validate: bool = True, norm=None, rope=None) -> None:
    """In-place write of FP8 indexer keys (block-major, 132 bytes per token) at ``slot_mapping``, LayerNorm
    (``norm`` = (weight, bias, eps)) and RoPE on the first features (``rope`` = (cos, sin)) in the same kernel."""
    if validate:
        ref.validate_write_indexer_cache(cache, k, slot_mapping, norm, rope)
    _write_index_keys(cache, k, slot_mapping, norm, rope)


def write_index_keys(cache, k, slot_mapping, *, norm=None, rope=None) -> None:
    """Either index cache's write (the caller validated): FP8 rows into a uint8 cache, the exact keys into a
    compute-dtype one (the kernel reads which from the cache's dtype)."""
    _write_index_keys(cache, k, slot_mapping, norm, rope)


def write_exact_index_keys(cache, k, slot_mapping, *, norm=None, rope=None) -> None:
    """The exact mode's write: keys unquantized into a compute-dtype cache ``[blocks, bs, 128]``, LayerNorm and RoPE
    as :func:`write_indexer_cache` applies them (the caller validated; ``paged_steps.indexer_step``). One kernel and
    no host sync, where the reference's masked index write needs one, so a decode step with this cache can be
    captured in a CUDA graph."""
    _write_index_keys(cache, k, slot_mapping, norm, rope)


def _index_launch(cache, k, slot_mapping, norm, rope) -> tuple:
    """The arguments of :func:`_index_row` after ``t`` of an indexer-key write: FP8 rows into a uint8 cache, the
    exact keys into a compute-dtype one."""
    k = _contig_rows(k)
    weight, bias, eps = norm if norm is not None else (k, k, 0.0)
    cos, sin, stride_c, half = rope_launch_args(rope, k)
    exact = cache.dtype != torch.uint8
    bf16 = exact and cache.dtype == torch.bfloat16
    keys, scales = (cache.view(torch.int16) if bf16 else cache, cache) if exact else (cache, cache.view(torch.float32))
    return (k, slot_mapping, keys, scales, weight, bias, cos, sin, k.stride(0), stride_c, k.shape[1], half,
            float(eps), ref.INDEX_DIM, cache.shape[1], norm is not None, rope is not None, DTYPE_CODES[k.dtype], exact,
            bf16)


def _no_index(like) -> tuple:
    """:func:`_index_launch`'s arguments for a launch without the indexer's role (``INDEX=False`` compiles it out)."""
    return (like,) * 8 + (0, 0, 0, 0, 0.0, ref.INDEX_DIM, 1, False, False, 0, True, False)


def _write_index_keys(cache, k, slot_mapping, norm, rope) -> None:
    if k.shape[0]:
        _write_index_kernel[(k.shape[0],)](*_index_launch(cache, k, slot_mapping, norm, rope), num_warps=WRITE_WARPS,
                                           **pdl(k.device))


def _weights_launch(x, weight, scales) -> tuple:
    """(the head weights [..., N] float32, the GEMV's programs, the ``h*`` arguments of the kernel) of
    f32_linear's GEMV ``x.float() @ weight.T`` times ``scales`` over x's rows: :func:`f32_linear.gemv_launch`'s
    grid and K split, flattened (column tile fastest: ``_f32_gemv_kernel``'s order)."""
    x2, weight, out = operands(x, weight)
    (rows, k), n = x2.shape, weight.shape[0]
    (tiles, split), cfg = gemv_launch(n, k, rows, num_sms(x.device))  # its 4 warps: WRITE_WARPS (tested)
    ws, counters = split_buffers(out, split, tiles)
    return out.view(*x.shape[:-1], n), tiles * split, (
        x2, weight, ws, out, counters, rows, n, k, x2.stride(0), weight.stride(0), *padded_scales(scales),
        len(scales), cfg["STEPS"], split, cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"])


def _no_weights(like) -> tuple:
    """:func:`_weights_launch`'s kernel arguments for a launch without the GEMV (``WEIGHTS=False`` compiles it
    out)."""
    return (like,) * 5 + (0, 0, 0, 0, 0) + (1.0,) * MAX_SCALES + (0, 1, 1, 1, 1, 1)


def rms_norm_write_caches(x, weight, eps, kv_cache, kv_c, k_pe, slot_mapping, index_cache=None, k=None, *,
                          kv_norm=None, index_norm=None, rope=None, head_weights=None):
    """``rms_norm(x, weight, eps)`` (returned) and this step's rows written into the latent cache (as
    :func:`write_latent_cache` writes them) and, given ``index_cache``, its indexer keys (as
    :func:`write_indexer_cache` / :func:`write_exact_index_keys` do), in one launch of T x (2 or 3) programs (the
    caller validated; ``paged_steps.norm_write_caches_step``). Each role runs the standalone kernel's helper with its
    arguments and its number of warps, so every value is bit for bit the standalone kernels' (the query's RMSNorm:
    where that kernel runs WRITE_WARPS too, q_a's 2048 features in GLM-5).

    ``head_weights`` = (h, W, scales): also the indexer's head weights ``f32_linear(h, W, scales)``, returned after
    the normed latent. Where that is f32_linear's GEMV (:func:`f32_linear.is_gemv`: a decode step) its programs
    join the launch, the GEMV's grid as :func:`f32_linear.gemv_launch` makes it (``_weights_launch``): K split over
    the CTAs of two column tiles (GLM-5's 32 heads), each split's partial to the workspace and the tile's last split
    summing them in split order; the same helpers over the same tiles and 4 warps, so the weights are
    ``_f32_gemv_kernel``'s bit for bit, one launch and its gap fewer per indexed layer. Why the split grid and not one
    CTA a column tile looping over the splits in that order (the same bits, no counters): the weight is 786 KB of
    float32 (6144 x 32), whole on every rank (shard_indexer splits the indexer's top-k, not its projections). A CTA
    looping would read its tile's 393 KB in 48 to 96 rounds of dependent 4-8 KB requests, a DRAM latency each,
    where the split's CTAs (96 at 1 token on an H100, 192 at 2 to 16) each read their 8 KB (4 KB past 1 token) in one
    round, beside the rows' programs; the GEMV's counters reset themselves (CUDA-graph replays start from zero).
    Past MAX_GEMV_ROWS the weights are f32_linear's tensor-core GEMM, its own launch before this kernel's."""
    out, q_args = rms_norm_launch(x, weight, eps)
    T = q_args[0].shape[0]
    weights, programs, gemv = None, 0, _no_weights(x)
    if head_weights is not None:
        h, w, scales = head_weights
        if is_gemv(h.numel() // w.shape[1]) and T:
            weights, programs, gemv = _weights_launch(h, w, scales)
        else:
            weights = f32_linear(h, w, scales, validate=False)
    if T:
        latent = _latent_launch(kv_cache, kv_c, k_pe, slot_mapping, kv_norm, rope)
        index = _index_launch(index_cache, k, slot_mapping, index_norm, rope) if index_cache is not None else \
            _no_index(x)
        _norm_write_caches_kernel[(T * (2 if index_cache is None else 3) + programs,)](
            *q_args, *latent, *index, *gemv, T, INDEX=index_cache is not None, WEIGHTS=programs > 0,
            num_warps=WRITE_WARPS, **pdl(x.device))
    return out if head_weights is None else (out, weights)


def _latent_query_launch(q_nope, w_uk, q_pe, rope, out) -> tuple[tuple, tuple, dict]:
    """(grid, positional arguments, constexprs) of the latent query of q_nope [T, H, D] and q_pe [T, H, <=64] (views
    with unit column stride) into ``out`` [T, H, 576]: :func:`latent_query_tile`'s arguments after the program's
    indices, and its (token tiles, heads, column tiles) grid, 16 tokens x 32 columns up to LATENT_QUERY_ROWS tokens,
    64 x 64 above."""
    T, H, D = q_nope.shape
    w_uk = _contig_rows(w_uk.to(q_nope.dtype))
    cos, sin, stride_c, half = rope_launch_args(rope, q_pe)
    bt, br = (16, 32) if T <= LATENT_QUERY_ROWS else (64, 64)
    args = (q_nope, w_uk, q_pe, cos, sin, out, q_nope.stride(0), q_nope.stride(1), w_uk.stride(0), w_uk.stride(1),
            q_pe.stride(0), q_pe.stride(1), stride_c, T, H, D, w_uk.shape[2], q_pe.shape[2], half)
    meta = dict(R=ref.KV_LORA_RANK, DR=ref.ROPE_DIM, BT=bt, BR=br, BK=min(64, max(16, triton.next_power_of_2(D))),
                ROPE=rope is not None, DT=DTYPE_CODES[q_nope.dtype], DT_PE=DTYPE_CODES[q_pe.dtype],
                IEEE=q_nope.dtype == torch.float32 or settings.triton_interpret())
    return (triton.cdiv(T, bt), H, ref.KV_LORA_RANK // br), args, meta


def latent_query(q_nope, w_uk, q_pe, rope=None):
    """``[q_nope . W_UK | q_pe]`` [T, H, 576] in q_nope's dtype, in one kernel: the per-head product (float32
    accumulation, one rounding, as the reference's einsum) and q_pe rotated (``rope`` = (cos, sin)).

    The grid is (token tiles, heads, column tiles of the 512): at decode (T = 1, 8 heads) the 32-column tiles give
    128 programs, each reading its [D, 32] slice of W_UK once; column tile 0 also writes the rope part. Above 16
    tokens the tiles grow to 64 tokens x 64 columns, a tensor-core GEMM at any prefill length, and the product is
    written once into the concatenated rows (no separate [T, H, 512] tensor to write and copy). Up to 16 tokens the
    q_b GEMM's launch can run these programs itself (:func:`fp8_linear_latent_query`)."""
    T, H = q_nope.shape[:2]
    out = torch.empty(T, H, ref.LATENT_DIM, dtype=q_nope.dtype, device=q_nope.device)
    if T == 0:
        return out
    grid, args, meta = _latent_query_launch(_contig_rows(q_nope), w_uk, _contig_rows(q_pe), rope, out)
    _latent_query_kernel[grid](*args, **meta, num_warps=LATENT_QUERY_WARPS, **pdl(q_nope.device))
    return out


@triton.jit
def gemm_latent_query_task(
        task, a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, c_ptr, out_ptr, cnt_ptr, up_ptr, M, N, K, KG,
        KG_PER_SPLIT: tl.constexpr, stride_am, stride_asm, stride_bn, stride_bsn, stride_cm, stride_cs, stride_um,
        qn_ptr, w_ptr, pe_ptr, cos_ptr, sin_ptr, q_ptr, s_qn_t, s_qn_h, s_w_h, s_w_d, s_pe_t, s_pe_h, stride_c, T,
        H: tl.constexpr, D, RA, RP, HALF, task_ptr, q_start, head_cols, i_start, i_cols,
        A_MODE: tl.constexpr, GATED_A: tl.constexpr, DT: tl.constexpr, DOT_F32: tl.constexpr, INTERPRET: tl.constexpr,
        HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, FIXUP: tl.constexpr, NO_K_MASK: tl.constexpr,
        SCALAR_SB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
        R: tl.constexpr, DR: tl.constexpr, BT: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, ROPE: tl.constexpr,
        Q_DT: tl.constexpr, DT_PE: tl.constexpr, IEEE: tl.constexpr, SIGNALS: tl.constexpr,
        INDEX: tl.constexpr = False):
    """Task ``task`` of :func:`_gemm_latent_query_kernel` (a GEMM tile or a latent query program), its own function
    so that the launch that also runs the indexer (``latent_query_indexer``) runs these tasks with the same code.
    ``INDEX``: a finished tile that holds any of the ``i_cols`` columns from ``i_start`` (the indexer's query) also
    signals dependency H."""
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    if task < tiles * SPLIT_K:
        tile = task % tiles
        if gemm_tile(a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, c_ptr, out_ptr, cnt_ptr, up_ptr, tile, task // tiles, M,
                     N, K, KG, KG_PER_SPLIT, stride_am, stride_asm, stride_bn, stride_bsn, stride_cm, stride_cs,
                     stride_um, A_MODE, GATED_A, DT, DOT_F32, INTERPRET, HAS_BIAS, SPLIT_K, FIXUP, NO_K_MASK,
                     SCALAR_SB, BLOCK_M, BLOCK_N, GROUP_M):
            first = tl.maximum(tile * BLOCK_N - q_start, 0) // head_cols  # the first head the tile's columns meet
            for i in tl.static_range(SIGNALS):
                if (first + i < H) & (q_start + (first + i) * head_cols < (tile + 1) * BLOCK_N):
                    tasks.signal(task_ptr, first + i)
            if INDEX:
                if (i_start < (tile + 1) * BLOCK_N) & (tile * BLOCK_N < i_start + i_cols):
                    tasks.signal(task_ptr, H)
    else:
        query = task - tiles * SPLIT_K
        h = query // (tl.cdiv(T, BT) * (R // BR))
        start = q_start + h * head_cols
        tasks.wait(task_ptr, h, tiles_over(start, head_cols, BLOCK_N))
        latent_query_tile(query // (R // BR) % tl.cdiv(T, BT), h, query % (R // BR), qn_ptr, w_ptr, pe_ptr, cos_ptr,
                          sin_ptr, q_ptr, s_qn_t, s_qn_h, s_w_h, s_w_d, s_pe_t, s_pe_h, stride_c, T, H, D, RA, RP,
                          HALF, R, DR, BT, BR, BK, ROPE, Q_DT, DT_PE, IEEE)


@triton.jit
def tiles_over(start, cols, BLOCK_N: tl.constexpr):
    """How many column tiles of BLOCK_N hold some of the ``cols`` columns from ``start``: the signals a consumer of
    those columns waits for (one a finished tile)."""
    return (start + cols - 1) // BLOCK_N - start // BLOCK_N + 1


@triton.jit
def _gemm_latent_query_kernel(
        a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, c_ptr, out_ptr, cnt_ptr, up_ptr, M, N, K, KG,
        KG_PER_SPLIT: tl.constexpr, stride_am, stride_asm, stride_bn, stride_bsn, stride_cm, stride_cs, stride_um,
        qn_ptr, w_ptr, pe_ptr, cos_ptr, sin_ptr, q_ptr, s_qn_t, s_qn_h, s_w_h, s_w_d, s_pe_t, s_pe_h, stride_c, T,
        H: tl.constexpr, D, RA, RP, HALF, task_ptr, q_start, head_cols,
        A_MODE: tl.constexpr, GATED_A: tl.constexpr, DT: tl.constexpr, DOT_F32: tl.constexpr, INTERPRET: tl.constexpr,
        HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, FIXUP: tl.constexpr, NO_K_MASK: tl.constexpr,
        SCALAR_SB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
        R: tl.constexpr, DR: tl.constexpr, BT: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, ROPE: tl.constexpr,
        Q_DT: tl.constexpr, DT_PE: tl.constexpr, IEEE: tl.constexpr, SIGNALS: tl.constexpr, PDL: tl.constexpr):
    """fxglm5::fp8_linear_latent_query in one launch of tasks (:mod:`fxglm5.lowering.triton.tasks`): each CTA takes a
    task id and runs :func:`gemm_latent_query_task`. Tasks [0, tiles * SPLIT_K) are the GEMM's output tiles x K splits
    (``fp8_gemm.gemm_tile`` with ``_gemm_kernel``'s arguments, the tile fastest; the GEMM has one M tile, so a tile is
    a column tile); the CTA that completes a tile (unsplit, or its FIXUP's last split) signals dependency h of each
    query head h whose ``head_cols`` columns from ``q_start + h * head_cols`` (q_nope, then q_pe) the tile holds (at
    most ``SIGNALS``). The tasks after them are the latent query's programs (:func:`latent_query_tile` with
    :func:`_latent_query_kernel`'s arguments, ``q_ptr`` its output and ``Q_DT`` its dtype code), head by head (token
    tile, then column tile, fastest): each waits until every tile of its head's columns has signalled, then reads
    them from L2. A task waits only on tasks before it, so the launch cannot deadlock; the last CTA resets the H
    dependency counters. The PDL wait comes first: a task's role is known only once its id is taken."""
    pdl_prologue(PDL)
    gemm_latent_query_task(
        tasks.take(task_ptr), a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, c_ptr, out_ptr, cnt_ptr, up_ptr, M, N, K, KG,
        KG_PER_SPLIT, stride_am, stride_asm, stride_bn, stride_bsn, stride_cm, stride_cs, stride_um, qn_ptr, w_ptr,
        pe_ptr, cos_ptr, sin_ptr, q_ptr, s_qn_t, s_qn_h, s_w_h, s_w_d, s_pe_t, s_pe_h, stride_c, T, H, D, RA, RP, HALF,
        task_ptr, q_start, head_cols, 0, 0, A_MODE, GATED_A, DT, DOT_F32, INTERPRET, HAS_BIAS, SPLIT_K, FIXUP,
        NO_K_MASK, SCALAR_SB, BLOCK_M, BLOCK_N, GROUP_M, R, DR, BT, BR, BK, ROPE, Q_DT, DT_PE, IEEE, SIGNALS)
    tasks.finish(task_ptr, H)


def latent_query_joins(x2, weight, weight_scale_inv, bias, act_quant, out):
    """``(launch, config)`` of the GEMM where :func:`fp8_linear_latent_query` runs the latent query in its launch,
    else None: up to LATENT_QUERY_ROWS tokens (the latent query's decode tiles), where ``fp8_linear`` is one
    ``_gemm_kernel`` launch (``fp8_gemm.lone_launch``: not the GEMV, the Gluon kernel, a quant kernel before or the
    reduce kernel after) of one M tile at the latent query's warp count (a launch has one)."""
    m, n = x2.shape[0], weight.shape[0]
    if not 0 < m <= LATENT_QUERY_ROWS or not settings.joins("q_b"):  # an opt-in join (settings.DECODE_JOINS)
        return None
    lone = lone_launch(x2, None, weight, weight_scale_inv, act_quant, out, bias=bias)
    if lone is None:
        return None
    launch, cfg = lone
    one_m_tile = launch.grid[0] == triton.cdiv(n, launch.meta["BLOCK_N"])
    return lone if one_m_tile and cfg["num_warps"] == LATENT_QUERY_WARPS else None


def fp8_linear_latent_query(x, weight, weight_scale_inv, bias, act_quant, w_uk, q_start, rope_dim, rope=None):
    """``fxglm5::fp8_linear_latent_query`` (the caller validated): ``(fp8_linear(x, weight, ...) [..., N], the latent
    query [..., H, 576])`` of the H query heads the GEMM's output holds from column ``q_start`` (each q_nope [D], then
    q_pe [rope_dim]), as :func:`latent_query` makes it from those columns (W_UK [H, D, R], ``rope`` = (cos, sin)
    [tokens, rope_dim / 2]).

    Where :func:`latent_query_joins` (decode) one launch (:func:`_gemm_latent_query_kernel`): the GEMM's tiles and the
    latent query's programs are tasks of it, each query head's programs waiting for the GEMM tiles of its columns,
    each with its own launch's tile function and warps, so the bits of ``fp8_linear`` followed by
    :func:`latent_query`, one launch and its gap fewer per attention layer. Why the GEMM's launch and not the MLA's:
    the latent query reads only the GEMM's query columns, and at decode its 128 programs (8 heads x 16 column tiles)
    run beside the GEMM's last tiles instead of after the indexer. Elsewhere (prefill, the GEMV, a GEMM of several
    launches) ``fp8_linear``, then :func:`latent_query`: the chain's launches and bits."""
    heads, n, lead = w_uk.shape[0], weight.shape[0], x.shape[:-1]
    joined = joined_launch(x, weight, weight_scale_inv, bias, act_quant, w_uk, q_start, rope_dim, rope, heads)
    if joined is None:
        out, q = separate_latent_query(x, weight, weight_scale_inv, bias, act_quant, w_uk, q_start, rope_dim, rope)
    else:
        out, q = joined.out, joined.query
        _gemm_latent_query_kernel[(joined.tasks,)](*joined.args, **joined.meta, **pdl(x.device))
    return out.view(*lead, n), q.view(*lead, heads, ref.LATENT_DIM)


def separate_latent_query(x, weight, weight_scale_inv, bias, act_quant, w_uk, q_start, rope_dim, rope):
    """fp8_linear's launches, then :func:`latent_query`'s: (out [tokens, N], the latent query [tokens, H, 576])."""
    heads, nope = w_uk.shape[:2]
    out = fp8_linear(x.reshape(-1, weight.shape[1]), weight, weight_scale_inv, bias, act_quant)
    q_nope, q_pe = query_heads(out, q_start, heads, nope, rope_dim)
    return out, latent_query(q_nope, w_uk, q_pe, rope)


class JoinedLaunch(NamedTuple):
    """The GEMM's and the latent query's tasks of one launch: the GEMM's output [tokens, N] and the latent query
    [tokens, H, 576] it will write, its tasks (the GEMM's tiles x splits, then the query's programs), the GEMM's
    output tiles (the FIXUP counters it takes from ``fp8_parts.tile_counters``), the kernel's positional arguments
    up to ``head_cols`` and its constexprs with the launch options (no PDL's)."""
    out: torch.Tensor
    query: torch.Tensor
    tasks: int
    tiles: int
    args: tuple
    meta: dict


def joined_launch(x, weight, weight_scale_inv, bias, act_quant, w_uk, q_start, rope_dim, rope, deps):
    """:class:`JoinedLaunch` of :func:`fp8_linear_latent_query`'s one launch (``deps``: the task counters it needs,
    at least the H heads'), or None where :func:`latent_query_joins` says the two launches run."""
    n, k = weight.shape
    heads, nope = w_uk.shape[:2]
    x2 = x.reshape(-1, k)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    m = x2.shape[0]
    weight, weight_scale_inv = weight.contiguous(), weight_scale_inv.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    joined = latent_query_joins(x2, weight, weight_scale_inv, bias, act_quant, out)
    if joined is None:
        return None
    gemm, cfg = joined
    q = torch.empty(m, heads, ref.LATENT_DIM, dtype=x.dtype, device=x.device)
    q_nope, q_pe = (_contig_rows(t) for t in query_heads(out, q_start, heads, nope, rope_dim))
    grid, args, meta = _latent_query_launch(q_nope, w_uk, q_pe, rope, q)
    meta["Q_DT"] = meta.pop("DT")
    head_cols = nope + rope_dim
    meta.update(gemm.meta, SIGNALS=triton.cdiv(gemm.meta["BLOCK_N"] - 1, head_cols) + 1,
                num_warps=LATENT_QUERY_WARPS, num_stages=cfg["num_stages"])
    return JoinedLaunch(out, q, gemm.grid[0] * gemm.grid[1] + grid[0] * grid[1] * grid[2], gemm.grid[0],
                        (*gemm.args, *args, tasks.counters(x.device, deps), q_start, head_cols), meta)


def slots_from_positions(block_table, req_idx, positions, block_size: int = 64, *, validate: bool = True):
    """Same as the reference (pure tensor ops, graph-safe)."""
    return ref.slots_from_positions(block_table, req_idx, positions, block_size, validate=validate)
