"""Triton DSA lightning indexer over the paged FP8 key cache: FP8 logits + a radix-select top-k.

Same signature and semantics as :func:`fxglm5.lowering.reference.paged.indexer_topk_paged`.

1. ``indexer_logits_paged`` -> float32 ``[T, max_len]`` (``max_len`` defaults to the block-table width times
   the block size: a shape, never data). A program owns one query token and ``TILES * BLOCK_N`` key positions:
   it quantizes the token's [HI, 128] query to e4m3 (one power-of-two scale per head, the cache rule), reads
   ``BLOCK_N`` keys through the block table (block-major cache: a block's keys are one contiguous run, so a
   tile is one pipelined TMA box when the block size is a multiple of 32, else 16-byte gathers), runs an
   FP8 x FP8 MMA ([BLOCK_N, 128] x [128, HI], fp32 accumulate), applies relu, the per-head
   ``weights * q_scale`` and the per-key scale, and sums the heads.
   Positions beyond the causal window (``> positions[t]``) are written as -inf (tiles entirely beyond it skip
   the loads).
2. ``topk_from_logits`` (:mod:`fxglm5.lowering.triton.topk`): the exact top-k of those rows.
   Output slots past ``min(topk, positions[t] + 1)`` are -1. No host sync, no data-dependent shapes: every
   buffer is sized by the arguments, so the kernels can be captured in a CUDA graph.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from fxglm5 import settings
from fxglm5.errors import InputError
from fxglm5.lowering.reference import paged as ref
from fxglm5.lowering.reference.norm_rope import validate_rope
from fxglm5.lowering.triton.device import ensure_tma_allocator, interpreter_compat, pdl, pdl_prologue
from fxglm5.lowering.triton.fp8_gemm import row_chunk
from fxglm5.lowering.triton.norm_rope import DTYPE_CODES, rotate_pairs
from fxglm5.lowering.triton.paged_cache import rope_launch_args, e4m3_bits, pow2_scale
from fxglm5.lowering.triton.topk import SEGMENT_MAX, topk_from_logits

interpreter_compat()

__all__ = ["indexer_logits_paged", "topk_from_logits", "indexer_topk_paged", "exact_indexer_topk_paged", "SEGMENT_MAX"]



@triton.jit
def _tile_logits(k8, q8, w, ksc, valid, F32DOT: tl.constexpr, PROMOTE: tl.constexpr, EXACT: tl.constexpr = False):
    """Logits of one tile: relu([BLOCK_N, 128] e4m3 keys x [128, HI] e4m3 queries) x (weights * q scale), summed
    over the heads, x the key scale; -inf where not ``valid``. ``EXACT``: compute-dtype keys and queries, no
    scales (products exact in the float32 accumulator; only the order of the sums differs from the reference)."""
    if F32DOT:
        s = tl.dot(k8.to(tl.float32), tl.trans(q8), input_precision="ieee")  # [BLOCK_N, BLOCK_HI]
    elif EXACT:
        s = tl.dot(k8, tl.trans(q8))  # bf16 / fp16 x the same: float32 accumulation
    else:
        # Hopper FP8 wgmma accumulates with reduced precision; PROMOTE products at a time are added into fp32.
        # 128 (default): one promotion per 128-wide key, no MMA waits inside the key
        # (bench/results/indexer_precision.md: error and top-k overlap against the float reference)
        s = tl.dot(k8, tl.trans(q8), max_num_imprecise_acc=PROMOTE)
    s = tl.maximum(s, 0.0) * w[None, :]
    return tl.where(valid, tl.sum(s, axis=1) * ksc, float("-inf"))


@triton.jit
def _rotated_query(q_row, dd, hmask, cos_row, sin_row, HALF, DT: tl.constexpr):
    """One token's [BLOCK_HI, 128] query tile (``q_row``: each head's row, [BLOCK_HI, 1] pointers) with every head's
    first 2 * HALF features turned by interleaved RoPE, in q's dtype: each feature is read with its pair partner,
    the pair is rotated by :func:`~fxglm5.lowering.triton.norm_rope.rotate_pairs` (the standalone ``_rope_kernel``'s
    arithmetic and rounding, so the tile holds the bits that kernel would have stored) and the feature keeps its
    own half of the result."""
    pair = dd // 2
    m = hmask[:, None]
    even = tl.load(q_row + 2 * pair[None, :], mask=m, other=0.0)
    odd = tl.load(q_row + 2 * pair[None, :] + 1, mask=m, other=0.0)
    c = tl.load(cos_row + pair, mask=pair < HALF, other=1.0)
    s = tl.load(sin_row + pair, mask=pair < HALF, other=0.0)
    e2, o2 = rotate_pairs(even.to(tl.float32), odd.to(tl.float32), c[None, :], s[None, :], DT)
    is_even = (dd % 2 == 0)[None, :]
    turned = tl.where(is_even, e2, o2).to(even.dtype)  # exact: rotate_pairs rounded to the dtype already
    return tl.where((pair < HALF)[None, :], turned, tl.where(is_even, even, odd))


@triton.jit(do_not_specialize=["T_BUCKET"])  # an autotune key only: no recompiles per value
def _indexer_logits_kernel(
    q_ptr, stride_qt, stride_qh, w_ptr, stride_wt,
    kc_ptr, ks_ptr, n_key_rows,
    bt_ptr, stride_bt, req_ptr, pos_ptr, cos_ptr, sin_ptr, stride_c, HALF,
    o_ptr, stride_ot, HI, max_len, skip_window, T_BUCKET,
    BS: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr,
    F32DOT: tl.constexpr, PDL: tl.constexpr, PROMOTE: tl.constexpr = 128, USE_TMA: tl.constexpr = False,
    EXACT: tl.constexpr = False, ROPE_Q: tl.constexpr = False, DT: tl.constexpr = 0,
):
    # before the skip_window exit: a grid whose rows all skip would otherwise complete ahead of its predecessor
    pdl_prologue(PDL)
    D: tl.constexpr = 128
    KEY_ALIGN: tl.constexpr = 16 if BS % 4 == 0 else 4
    t = tl.program_id(0)
    pb = tl.program_id(1)
    t64 = t.to(tl.int64)
    req = tl.load(req_ptr + t).to(tl.int64)
    n_valid = tl.load(pos_ptr + t).to(tl.int32) + 1
    if n_valid <= skip_window:  # the top-k takes this row's whole window without reading its scores
        return
    n_first = pb * (BLOCK_N * TILES)
    o_row = o_ptr + t64 * stride_ot
    # cache hints: the logits (a few MB) are re-read by the top-k right after, the streamed keys (hundreds of MB)
    # never; the attention table was measured with them (their effect on the top-k was within noise:
    # docs/perf/attention_notes.md)
    if n_first < n_valid:
        hs = tl.arange(0, BLOCK_HI)
        hmask = hs < HI
        dd = tl.arange(0, D)
        q_row = q_ptr + t64 * stride_qt + hs[:, None] * stride_qh
        if ROPE_Q:  # the query's RoPE (cos / sin: this token's row of the tables), before any use of the query
            q = _rotated_query(q_row, dd, hmask, cos_ptr + t64 * stride_c, sin_ptr + t64 * stride_c, HALF, DT)
        else:
            q = tl.load(q_row + dd[None, :], mask=hmask[:, None], other=0.0)
        w = tl.load(w_ptr + t64 * stride_wt + hs, mask=hmask, other=0.0)
        if EXACT:  # the query as it is, the weights alone
            q8 = q
        else:
            qs = pow2_scale(tl.max(tl.abs(q.to(tl.float32)), axis=1))  # [BLOCK_HI]
            qb = e4m3_bits(tl.minimum(tl.maximum(q.to(tl.float32) * (1.0 / qs)[:, None], -448.0), 448.0))
            q8 = qb.to(tl.float8e4nv, bitcast=True)
            w = w * qs  # weights * q scale
        if F32DOT:
            q8 = q8.to(tl.float32)
        if EXACT:
            # a compute-dtype cache [blocks, BS, 128]: block b's keys are rows b * BS .. + BS
            for i in tl.static_range(TILES):
                offs_n = n_first + i * BLOCK_N + tl.arange(0, BLOCK_N)
                valid = offs_n < n_valid
                blk = tl.load(bt_ptr + req * stride_bt + offs_n // BS, mask=valid, other=0).to(tl.int64)
                k = tl.load(kc_ptr + (blk * BS + offs_n % BS)[:, None] * D + dd[None, :], mask=valid[:, None],
                            other=0.0, eviction_policy="evict_first")
                logit = _tile_logits(k, q8, w, 1.0, valid, F32DOT, PROMOTE, EXACT)
                tl.store(o_row + offs_n, logit, mask=offs_n < max_len, eviction_policy="evict_last")
        elif USE_TMA:
            # the cache as rows of 128 bytes (BS % 32 == 0): block b's keys are rows b * ROWS .. + BS, so a tile
            # (BLOCK_N divides BS) is one TMA box; a runtime loop lets the pipeliner keep num_stages boxes in
            # flight. Rows past the window may hold stale bytes: their logits are replaced by -inf.
            ROWS: tl.constexpr = BS * 132 // D
            # typed e4m3 (not bytes + bitcast) so that the pipeliner sees the box feed the MMA directly
            desc = tl.make_tensor_descriptor(kc_ptr.to(tl.pointer_type(tl.float8e4nv)), shape=[n_key_rows, D],
                                             strides=[D, 1], block_shape=[BLOCK_N, D])
            for i in range(TILES):
                n0 = n_first + i * BLOCK_N
                offs_n = n0 + tl.arange(0, BLOCK_N)
                valid = offs_n < n_valid
                blk = tl.load(bt_ptr + req * stride_bt + n0 // BS, mask=n0 < n_valid, other=0).to(tl.int32)
                k8 = desc.load([blk * ROWS + n0 % BS, 0])
                ksc = tl.load(ks_ptr + blk.to(tl.int64) * (BS * 33) + BS * 32 + offs_n % BS, mask=valid,
                              other=0.0)
                logit = _tile_logits(k8, q8, w, ksc, valid, F32DOT, PROMOTE)
                tl.store(o_row + offs_n, logit, mask=offs_n < max_len, eviction_policy="evict_last")
        else:
            for i in tl.static_range(TILES):
                offs_n = n_first + i * BLOCK_N + tl.arange(0, BLOCK_N)
                valid = offs_n < n_valid
                blk = tl.load(bt_ptr + req * stride_bt + offs_n // BS, mask=valid, other=0).to(tl.int64)
                off = offs_n % BS
                # block-major cache: a key starts at blk * (BS * 132) + off * 128, 16-byte aligned when
                # BS % 4 == 0 (then every key is eight 16-byte loads); its scale is float blk * (BS * 33) + BS * 32
                # + off
                roff = tl.multiple_of(blk[:, None] * (BS * 132) + off[:, None] * D, [KEY_ALIGN, KEY_ALIGN])
                k8 = tl.load(kc_ptr + roff + dd[None, :], mask=valid[:, None], other=0,
                             eviction_policy="evict_first").to(tl.float8e4nv, bitcast=True)
                ksc = tl.load(ks_ptr + blk * (BS * 33) + BS * 32 + off, mask=valid, other=0.0)
                logit = _tile_logits(k8, q8, w, ksc, valid, F32DOT, PROMOTE)
                tl.store(o_row + offs_n, logit, mask=offs_n < max_len, eviction_policy="evict_last")
    else:
        for i in tl.static_range(TILES):
            offs_n = n_first + i * BLOCK_N + tl.arange(0, BLOCK_N)
            tl.store(o_row + offs_n, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=offs_n < max_len)


_GATHER_DEFAULT = triton.Config({"BLOCK_N": 128, "TILES": 4}, num_warps=4, num_stages=1)
_TMA_DEFAULT = triton.Config({"BLOCK_N": 64, "TILES": 16, "USE_TMA": True}, num_warps=4, num_stages=3)
_LOGITS_CONFIGS = [
    _GATHER_DEFAULT,
    triton.Config({"BLOCK_N": 128, "TILES": 2}, num_warps=4, num_stages=1),
    triton.Config({"BLOCK_N": 64, "TILES": 8}, num_warps=4, num_stages=1),
    triton.Config({"BLOCK_N": 128, "TILES": 8}, num_warps=8, num_stages=1),
    # TMA boxes of one cache block's keys, pipelined (block sizes that are multiples of 32 and of BLOCK_N)
    triton.Config({"BLOCK_N": 64, "TILES": 4, "USE_TMA": True}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_N": 64, "TILES": 8, "USE_TMA": True}, num_warps=4, num_stages=3),
    _TMA_DEFAULT,
    # 2048 keys a program: 75.0 us against 77.4 at 64 x 32k (docs/perf/indexer_topk.md);
    # too few programs for short or few rows, so not the untuned default
    triton.Config({"BLOCK_N": 64, "TILES": 32, "USE_TMA": True}, num_warps=4, num_stages=4),
]


def _fitting_configs(configs, named_args, **kwargs):
    """Autotune only the TMA configurations the cache's block size allows (none over an exact-mode cache, whose
    rows are not the FP8 layout's 128-byte boxes)."""
    return [c for c in configs if not c.kwargs.get("USE_TMA")
            or (not kwargs.get("EXACT") and tma_tiles_fit(kwargs["BS"], c.kwargs["BLOCK_N"]))]


# T_BUCKET (the token count rounded up to a power of two) is only a key: the best program length depends on how
# many programs the tokens make, so a launch tuned at 64 tokens is not reused for one
_indexer_logits_tuned = triton.autotune(configs=_LOGITS_CONFIGS, key=["HI", "max_len", "BS", "T_BUCKET"],
                                        prune_configs_by={"early_config_prune": _fitting_configs})(
    _indexer_logits_kernel)


def tuned_config():
    """The logits configuration the autotuner picked last (None before the first GPU call)."""
    bc = getattr(_indexer_logits_tuned, "best_config", None)
    return None if bc is None else _config_dict(bc)


def indexer_logits_paged(q, weights, k_cache, block_table, req_idx, positions, max_len: int | None = None, *,
                         out: torch.Tensor | None = None, validate: bool = True, cfg: dict | None = None,
                         skip_window: int = 0, rope=None):
    """float32 [T, max_len] indexer scores (-inf beyond the causal window), over the FP8 cache, or over a
    compute-dtype cache ``[blocks, bs, 128]`` exactly (the exact mode: unquantized queries and keys). A row whose
    causal window (``positions[t] + 1`` keys) is at most ``skip_window`` is left as ``out`` held it: the top-k
    selects such a row's whole window without reading it (:mod:`fxglm5.lowering.triton.topk`), so a decode step
    over contexts that fit in index_topk computes no scores (the test is per row, on the device). ``rope`` =
    (cos, sin) float32 [T, R/2]: the kernel rotates each head's first R query features as it loads the query
    (``ref.rotated_queries``), so no RoPE kernel runs before it."""
    if validate:
        ref.validate_indexer_topk_paged(q, weights, k_cache, block_table, req_idx, positions, 1)
        if rope is not None:
            validate_rope(q, *rope)
    T, HI, _ = q.shape
    bs = k_cache.shape[1]
    if max_len is None:
        max_len = block_table.shape[1] * bs
    if out is None:
        out = torch.empty(T, max_len, dtype=torch.float32, device=q.device)
    if T == 0 or max_len == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    interp = settings.triton_interpret() or q.device.type != "cuda"
    exact = k_cache.dtype != torch.uint8
    # the exact mode multiplies on tensor cores where queries and keys share a 16-bit dtype, else in IEEE float32
    f32dot = interp or (exact and not (q.dtype == k_cache.dtype and q.dtype in (torch.bfloat16, torch.float16)))
    BLOCK_HI = max(16, triton.next_power_of_2(HI))
    cos, sin, stride_c, half = rope_launch_args(rope, q)
    args = (q, q.stride(0), q.stride(1), weights, weights.stride(0), k_cache,
            k_cache if exact else k_cache.view(torch.float32),
            k_cache.numel() // 128, block_table, block_table.stride(0), req_idx, positions, cos, sin, stride_c, half,
            out, out.stride(0), HI, max_len, skip_window, triton.next_power_of_2(T))
    rotate = dict(ROPE_Q=rope is not None, DT=DTYPE_CODES[q.dtype])
    if not interp and not cfg and not settings.no_autotune():
        grid = lambda meta: (T, triton.cdiv(max_len, meta["BLOCK_N"] * meta["TILES"]))  # noqa: E731
        ensure_tma_allocator()
        _indexer_logits_tuned[grid](*args, BS=bs, BLOCK_HI=BLOCK_HI, F32DOT=f32dot, EXACT=exact, **rotate,
                                    **pdl(q.device))
    else:
        c = _launch_config(bs, cfg, interp, exact)
        use_tma = bool(c.get("USE_TMA", False))
        if use_tma and (exact or not tma_tiles_fit(bs, c["BLOCK_N"])):
            raise InputError(f"indexer logits: USE_TMA needs the FP8 cache and a block size that is a multiple of 32 "
                             f"and of BLOCK_N (cache {k_cache.dtype}, block size {bs}, BLOCK_N {c['BLOCK_N']})")
        if use_tma:
            ensure_tma_allocator()
        grid = (T, triton.cdiv(max_len, c["BLOCK_N"] * c["TILES"]))
        _indexer_logits_kernel[grid](*args, BS=bs, BLOCK_HI=BLOCK_HI, BLOCK_N=c["BLOCK_N"], TILES=c["TILES"],
                                     F32DOT=f32dot, PROMOTE=c.get("PROMOTE", 128), USE_TMA=use_tma, EXACT=exact,
                                     **rotate, num_warps=c["num_warps"], num_stages=c["num_stages"], **pdl(q.device))
    return out


def _config_dict(c: triton.Config) -> dict:
    return dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages)


def _launch_config(block_size: int, cfg: dict | None, interp: bool, exact: bool = False) -> dict:
    """The logits launch when not autotuning. An explicit ``cfg`` names every option it wants over the gather
    defaults (TMA only when it asks for it). Without one: small tiles under the interpreter; on the GPU
    (FXGLM5_NO_AUTOTUNE=1) TMA boxes where the blocks allow them (the fastest measured at 64 x 32k:
    docs/perf/indexer_topk.md), else (and over an exact-mode cache) gathers."""
    if interp:
        base = dict(BLOCK_N=16, TILES=2, num_warps=4, num_stages=1)
    elif cfg or exact or not tma_tiles_fit(block_size, _TMA_DEFAULT.kwargs["BLOCK_N"]):
        base = _config_dict(_GATHER_DEFAULT)
    else:
        base = _config_dict(_TMA_DEFAULT)
    return dict(base, **(cfg or {}))


def tma_tiles_fit(block_size: int, block_n: int) -> bool:
    """TMA key tiles need 128-byte cache rows at block starts (block size % 32 == 0) and tiles inside a block."""
    return block_size % 32 == 0 and block_size % block_n == 0


# A prefill step's logits are [tokens, context] float32: 16384 tokens at a 128k context are 8.6e9 elements, past
# the kernels' int32 offsets (row * stride) and 34 GB of memory. Steps are cut into row chunks whose logits stay
# below 2^31 bytes (each chunk's top-k only reads its own rows, so the result is the same); decode steps, whose
# graph-owned buffers are passed in, never reach that size.
LOGITS_BYTES_PER_ELEMENT = 4


def indexer_topk_paged(q, weights, k_cache, block_table, req_idx, positions, topk: int, *, validate: bool = True,
                       logits_buf: torch.Tensor | None = None, out: torch.Tensor | None = None, rope=None):
    """DSA lightning indexer -> int32 [T, topk] positions (any order), -1 padded; ``rope`` = (cos, sin) [T, R/2]
    rotates the queries inside the logits kernel (:func:`indexer_logits_paged`)."""
    if validate:
        ref.validate_indexer_topk_paged(q, weights, k_cache, block_table, req_idx, positions, topk)
        if rope is not None:
            validate_rope(q, *rope)
    T, max_len = q.shape[0], block_table.shape[1] * k_cache.shape[1]
    rows = row_chunk(T, lambda r: r * max_len * LOGITS_BYTES_PER_ELEMENT) if logits_buf is None else T
    if rows < T:
        out = out if out is not None else torch.empty(T, topk, dtype=torch.int32, device=q.device)
        for s in range(0, T, rows):
            e = min(T, s + rows)
            tables = None if rope is None else (rope[0][s:e], rope[1][s:e])
            indexer_topk_paged(q[s:e], weights[s:e], k_cache, block_table, req_idx[s:e], positions[s:e], topk,
                               validate=False, out=out[s:e], rope=tables)
        return out
    logits = indexer_logits_paged(q, weights, k_cache, block_table, req_idx, positions, out=logits_buf,
                                  validate=False, skip_window=topk, rope=rope)
    return topk_from_logits(logits, positions, topk, out=out, validate=False)


def exact_indexer_topk_paged(q, weights, cache, block_table, req_idx, positions, topk: int, *,
                             rope=None) -> torch.Tensor:
    """The exact mode's selection (``fxglm5.lowering.reference.paged.exact_indexer_topk_paged``): the same kernels
    over a compute-dtype cache, with no host sync (the reference loops over the tokens on the host), so a decode
    step with this cache can be captured in a CUDA graph; ``rope`` rotates the queries in the logits kernel too.
    The caller validated (``paged_steps.indexer_step``)."""
    return indexer_topk_paged(q, weights, cache, block_table, req_idx, positions, topk, validate=False, rope=rope)
