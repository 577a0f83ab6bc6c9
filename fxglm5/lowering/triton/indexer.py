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

A decode step (:func:`one_launch_round`: up to 16 tokens, logits rows of at most 8192 keys, which the segment top-k
selects in one round) runs both in one launch, ``_indexer_topk_kernel``: the logits programs, each row's last one (a
ticket on a per-row counter) selecting that row with the top-k kernel's own code, so the indices and their order are
the two launches' under the same logits configuration (issue 45, item 5: a decode layer's attention block one launch
shorter). Every logits path takes it: FP8 gathers or TMA boxes, the exact mode's keys. The choice is made here, from the
step's shapes, inside ``fxglm5::rtp_indexer``'s Triton body (``indexer_topk_paged``, which
``fxglm5.lowering.reference.paged_steps.indexer_step`` calls): the op, its inputs and its result are unchanged, so no
graph op and no pass. A pass could not make the choice: it rests on the token count and the block table's width,
which the exported graph holds as dynamic sizes; each call (each decode graph's capture) has them. Where the
indexer's query is the wq_b part of the q_b GEMM with its latent query (the pass ``fuse_indexer_into_q_b``), the same
programs (:func:`select_row`) run as the last tasks of that GEMM's launch (``latent_query_indexer``), chosen per call
by the same test.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from fxglm5 import settings
from fxglm5.errors import InputError
from fxglm5.lowering.reference import paged as ref
from fxglm5.lowering.reference.norm_rope import validate_rope
from fxglm5.lowering.triton import tasks
from fxglm5.lowering.triton.device import ensure_tma_allocator, interpreter_compat, pdl, pdl_prologue
from fxglm5.lowering.triton.fp8_gemm import row_chunk
from fxglm5.lowering.triton.fp8_parts import tile_counters
from fxglm5.lowering.triton.norm_rope import DTYPE_CODES, rotate_pairs
from fxglm5.lowering.triton.paged_cache import rope_launch_args, e4m3_bits, pow2_scale
from fxglm5.lowering.triton.topk import SEGMENT_MAX, one_round, select_segment, topk_from_logits, window_row

interpreter_compat()

__all__ = ["indexer_logits_paged", "topk_from_logits", "indexer_topk_paged", "exact_indexer_topk_paged",
           "one_launch_round", "SEGMENT_MAX"]



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
def _query_mask(hmask, dd, QD: tl.constexpr):
    """The query tile's load mask: its heads, and below 128 features the head's ``QD`` (no mask of the features at
    128, so the standalone launches' code is what it was)."""
    m = hmask[:, None]
    if QD < 128:
        m = m & (dd < QD)[None, :]
    return m


@triton.jit
def _rotated_query(q_row, dd, hmask, cos_row, sin_row, HALF, DT: tl.constexpr, QD: tl.constexpr = 128,
                   Q_CACHE: tl.constexpr = None):
    """One token's [BLOCK_HI, 128] query tile (``q_row``: each head's row, [BLOCK_HI, 1] pointers) with every head's
    first 2 * HALF features turned by interleaved RoPE, in q's dtype: each feature is read with its pair partner,
    the pair is rotated by :func:`~fxglm5.lowering.triton.norm_rope.rotate_pairs` (the standalone ``_rope_kernel``'s
    arithmetic and rounding, so the tile holds the bits that kernel would have stored) and the feature keeps its
    own half of the result. Features from ``QD`` (an even head width) on are zero: the padding the op gives a
    narrower query."""
    pair = dd // 2
    m = _query_mask(hmask, dd, QD)
    even = tl.load(q_row + 2 * pair[None, :], mask=m, other=0.0, cache_modifier=Q_CACHE)
    odd = tl.load(q_row + 2 * pair[None, :] + 1, mask=m, other=0.0, cache_modifier=Q_CACHE)
    c = tl.load(cos_row + pair, mask=pair < HALF, other=1.0)
    s = tl.load(sin_row + pair, mask=pair < HALF, other=0.0)
    e2, o2 = rotate_pairs(even.to(tl.float32), odd.to(tl.float32), c[None, :], s[None, :], DT)
    is_even = (dd % 2 == 0)[None, :]
    turned = tl.where(is_even, e2, o2).to(even.dtype)  # exact: rotate_pairs rounded to the dtype already
    return tl.where((pair < HALF)[None, :], turned, tl.where(is_even, even, odd))


@triton.jit
def _logits_program(q_ptr, stride_qt, stride_qh, w_ptr, stride_wt, kc_ptr, ks_ptr, n_key_rows, bt_ptr, stride_bt,
                    req_ptr, cos_ptr, sin_ptr, stride_c, HALF, o_row, HI, max_len, t, pb, n_valid, BS: tl.constexpr,
                    BLOCK_HI: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr, F32DOT: tl.constexpr,
                    PROMOTE: tl.constexpr, USE_TMA: tl.constexpr, EXACT: tl.constexpr, ROPE_Q: tl.constexpr,
                    DT: tl.constexpr, QD: tl.constexpr = 128, Q_CACHE: tl.constexpr = None):
    """Program ``(t, pb)``'s logits: token t's scores of key positions ``pb * BLOCK_N * TILES`` onwards, TILES tiles
    of BLOCK_N keys, stored to its row ``o_row`` (-inf past the window of ``n_valid`` keys). Every indexer kernel
    runs it (:func:`_indexer_logits_kernel`, and :func:`select_row` for :func:`_indexer_topk_kernel` and the q_b
    GEMM's launch): the same launch configuration computes the same bits in each. ``QD``: the query heads' width
    (128, or a narrower head read as if zero-padded to 128); ``Q_CACHE``: the query loads' cache modifier (".cg"
    where another CTA of the launch wrote the query)."""
    D: tl.constexpr = 128
    KEY_ALIGN: tl.constexpr = 16 if BS % 4 == 0 else 4
    t64 = t.to(tl.int64)
    req = tl.load(req_ptr + t).to(tl.int64)
    n_first = pb * (BLOCK_N * TILES)
    # cache hints: the logits (a few MB) are re-read by the top-k right after, the streamed keys (hundreds of MB)
    # never; the attention table was measured with them (their effect on the top-k was within noise:
    # docs/perf/attention_notes.md)
    if n_first < n_valid:
        hs = tl.arange(0, BLOCK_HI)
        hmask = hs < HI
        dd = tl.arange(0, D)
        q_row = q_ptr + t64 * stride_qt + hs[:, None] * stride_qh
        if ROPE_Q:  # the query's RoPE (cos / sin: this token's row of the tables), before any use of the query
            q = _rotated_query(q_row, dd, hmask, cos_ptr + t64 * stride_c, sin_ptr + t64 * stride_c, HALF, DT, QD,
                               Q_CACHE)
        else:
            q = tl.load(q_row + dd[None, :], mask=_query_mask(hmask, dd, QD), other=0.0, cache_modifier=Q_CACHE)
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
    """A program per (token, TILES * BLOCK_N key positions): :func:`_logits_program`; rows whose window holds at
    most ``skip_window`` keys are left as they were."""
    # before the skip_window exit: a grid whose rows all skip would otherwise complete ahead of its predecessor
    pdl_prologue(PDL)
    t = tl.program_id(0)
    n_valid = tl.load(pos_ptr + t).to(tl.int32) + 1
    if n_valid <= skip_window:  # the top-k takes this row's whole window without reading its scores
        return
    _logits_program(q_ptr, stride_qt, stride_qh, w_ptr, stride_wt, kc_ptr, ks_ptr, n_key_rows, bt_ptr, stride_bt,
                    req_ptr, cos_ptr, sin_ptr, stride_c, HALF, o_ptr + t.to(tl.int64) * stride_ot, HI, max_len, t,
                    tl.program_id(1), n_valid, BS, BLOCK_HI, BLOCK_N, TILES, F32DOT, PROMOTE, USE_TMA, EXACT, ROPE_Q,
                    DT)


@triton.jit
def select_row(t, pb, programs, q_ptr, stride_qt, stride_qh, w_ptr, stride_wt, kc_ptr, ks_ptr, n_key_rows, bt_ptr,
               stride_bt, req_ptr, pos_ptr, cos_ptr, sin_ptr, stride_c, HALF, o_ptr, stride_ot, HI, max_len, sel_ptr,
               stride_st, bin_ptr, cnt_ptr, topk, task_ptr, dep, signals, BS: tl.constexpr, BLOCK_HI: tl.constexpr,
               BLOCK_N: tl.constexpr, TILES: tl.constexpr, F32DOT: tl.constexpr, C: tl.constexpr,
               BIN_C: tl.constexpr, PROMOTE: tl.constexpr, USE_TMA: tl.constexpr, EXACT: tl.constexpr,
               ROPE_Q: tl.constexpr, DT: tl.constexpr, QD: tl.constexpr = 128, Q_CACHE: tl.constexpr = None,
               WAIT: tl.constexpr = False):
    """Program ``pb`` of the ``programs`` logits programs of row t, with the row's selection: the whole of a program
    of :func:`_indexer_topk_kernel`, which the q_b GEMM's launch runs as its last tasks too
    (``latent_query_indexer``), so both give the same bits. Once its logits are stored the program takes a ticket on
    the row's counter ``cnt[t]``, and the program that takes the row's last ticket selects the row's top-k with the
    segment top-k's single round (``topk.select_segment`` over the whole row, the four C-long chunks and BIN_C of
    ``topk.one_round``: the code and constants ``_segment_topk_kernel`` runs, so the same indices in the same order),
    reading the other programs' logits from L2 (.cg), and resets the counter (the next call and a CUDA-graph replay
    start from zero). A row whose window fits in ``topk`` computes no logits: its first program writes the window's
    positions (``topk.window_row``). ``WAIT``: before reading the query, wait until dependency ``dep`` of the launch's
    tasks (:mod:`fxglm5.lowering.triton.tasks`, counters ``task_ptr``) has ``signals`` signals (the GEMM tiles that
    hold the query's columns); a row that fits waits for nothing."""
    t64 = t.to(tl.int64)
    n_valid = tl.load(pos_ptr + t).to(tl.int32) + 1
    n_sel = tl.minimum(n_valid, max_len)  # the window the top-k sees in a row of max_len scores
    sel_row = sel_ptr + t64 * stride_st
    if n_sel <= topk:
        if pb == 0:
            window_row(sel_row, n_sel, topk, C)
    else:
        if WAIT:
            tasks.wait(task_ptr, dep, signals)
        o_row = o_ptr + t64 * stride_ot
        _logits_program(q_ptr, stride_qt, stride_qh, w_ptr, stride_wt, kc_ptr, ks_ptr, n_key_rows, bt_ptr, stride_bt,
                        req_ptr, cos_ptr, sin_ptr, stride_c, HALF, o_row, HI, max_len, t, pb, n_valid, BS, BLOCK_HI,
                        BLOCK_N, TILES, F32DOT, PROMOTE, USE_TMA, EXACT, ROPE_Q, DT, QD, Q_CACHE)
        tl.debug_barrier()  # the tile's logits stored before its arrival is published
        if tl.atomic_add(cnt_ptr + t, 1, sem="acq_rel", scope="gpu") == programs - 1:
            select_segment(o_row, o_row, o_row, sel_row, sel_row, bin_ptr + t64 * (8 * BIN_C), 0, max_len, n_sel,
                           topk, C, False, False, BIN_C, ".cg")
            tl.atomic_xchg(cnt_ptr + t, 0, sem="relaxed", scope="gpu")


@triton.jit(do_not_specialize=["T_BUCKET"])
def _indexer_topk_kernel(
    q_ptr, stride_qt, stride_qh, w_ptr, stride_wt,
    kc_ptr, ks_ptr, n_key_rows,
    bt_ptr, stride_bt, req_ptr, pos_ptr, cos_ptr, sin_ptr, stride_c, HALF,
    o_ptr, stride_ot, HI, max_len, T_BUCKET, sel_ptr, stride_st, bin_ptr, cnt_ptr, topk,
    BS: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr,
    F32DOT: tl.constexpr, C: tl.constexpr, BIN_C: tl.constexpr, PDL: tl.constexpr, PROMOTE: tl.constexpr = 128,
    USE_TMA: tl.constexpr = False, EXACT: tl.constexpr = False, ROPE_Q: tl.constexpr = False, DT: tl.constexpr = 0,
):
    """The logits and the top-k of a decode step in one launch (:func:`one_launch_round`): the grid of
    :func:`_indexer_logits_kernel`, each program :func:`select_row` of its (row, logits program)."""
    pdl_prologue(PDL)  # before the fitting rows' early exit
    select_row(tl.program_id(0), tl.program_id(1), tl.num_programs(1), q_ptr, stride_qt, stride_qh, w_ptr, stride_wt,
               kc_ptr, ks_ptr, n_key_rows, bt_ptr, stride_bt, req_ptr, pos_ptr, cos_ptr, sin_ptr, stride_c, HALF,
               o_ptr, stride_ot, HI, max_len, sel_ptr, stride_st, bin_ptr, cnt_ptr, topk, cnt_ptr, 0, 0, BS, BLOCK_HI,
               BLOCK_N, TILES, F32DOT, C, BIN_C, PROMOTE, USE_TMA, EXACT, ROPE_Q, DT)


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
# many programs the tokens make, so a launch tuned at 64 tokens is not reused for one. The one-launch kernel is tuned
# on its own (its programs carry the top-k's registers, and its last programs select)
_indexer_logits_tuned = triton.autotune(configs=_LOGITS_CONFIGS, key=["HI", "max_len", "BS", "T_BUCKET"],
                                        prune_configs_by={"early_config_prune": _fitting_configs})(
    _indexer_logits_kernel)
_indexer_topk_tuned = triton.autotune(configs=_LOGITS_CONFIGS, key=["HI", "max_len", "BS", "T_BUCKET"],
                                      prune_configs_by={"early_config_prune": _fitting_configs})(
    _indexer_topk_kernel)


def tuned_config(one_launch: bool = False):
    """The configuration the autotuner picked last for the logits kernel (``one_launch``: for the kernel that also
    selects, :func:`one_launch_round`); None before the first GPU call."""
    bc = getattr(_indexer_topk_tuned if one_launch else _indexer_logits_tuned, "best_config", None)
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
    T = q.shape[0]
    if max_len is None:
        max_len = block_table.shape[1] * k_cache.shape[1]
    if out is None:
        out = torch.empty(T, max_len, dtype=torch.float32, device=q.device)
    if T and max_len:
        _launch(q, weights, k_cache, block_table, req_idx, positions, max_len, out, cfg, rope, (skip_window,))
    return out


def _launch(q, weights, k_cache, block_table, req_idx, positions, max_len, out, cfg, rope, tail, select=None):
    """Launch the logits kernel over the logits rows ``out`` (``tail`` = its arguments after the token bucket:
    ``(skip_window,)``) or, given ``select`` = (C, BIN_C), the one-launch kernel (``tail``: the selection's output,
    its row stride, the bin scratch, the row counters, topk)."""
    T = q.shape[0]
    bs = k_cache.shape[1]
    if q.stride(-1) != 1:
        q = q.contiguous()
    row, const, interp = logits_args(q, weights, k_cache, block_table, req_idx, positions, max_len, out, rope)
    bucket = triton.next_power_of_2(T)
    args = (*row, *((bucket, *tail) if select else (*tail, bucket)))
    const.update(dict(C=select[0], BIN_C=select[1]) if select else {})
    exact = const["EXACT"]
    if not interp and not cfg and not settings.no_autotune():
        grid = lambda meta: (T, triton.cdiv(max_len, meta["BLOCK_N"] * meta["TILES"]))  # noqa: E731
        ensure_tma_allocator()
        tuner = _indexer_topk_tuned if select else _indexer_logits_tuned
        tuner[grid](*args, **const, **pdl(q.device))
        return
    c = _launch_config(bs, cfg, interp, exact)
    use_tma = bool(c.get("USE_TMA", False))
    if use_tma and (exact or not tma_tiles_fit(bs, c["BLOCK_N"])):
        raise InputError(f"indexer logits: USE_TMA needs the FP8 cache and a block size that is a multiple of 32 "
                         f"and of BLOCK_N (cache {k_cache.dtype}, block size {bs}, BLOCK_N {c['BLOCK_N']})")
    if use_tma:
        ensure_tma_allocator()
    grid = (T, triton.cdiv(max_len, c["BLOCK_N"] * c["TILES"]))
    kernel = _indexer_topk_kernel if select else _indexer_logits_kernel
    kernel[grid](*args, BLOCK_N=c["BLOCK_N"], TILES=c["TILES"], PROMOTE=c.get("PROMOTE", 128), USE_TMA=use_tma,
                 **const, num_warps=c["num_warps"], num_stages=c["num_stages"], **pdl(q.device))


def interpreted(device: torch.device) -> bool:
    """Whether the kernels run interpreted for tensors on ``device`` (TRITON_INTERPRET=1, or not a CUDA device)."""
    return settings.triton_interpret() or device.type != "cuda"


def logits_args(q, weights, k_cache, block_table, req_idx, positions, max_len, out, rope,
                interp: bool | None = None) -> tuple[tuple, dict, bool]:
    """(the logits kernels' arguments up to ``max_len``, their constexprs of the step, whether Triton interprets:
    ``interp``, else :func:`interpreted`) for the queries ``q`` [T, HI, <=128] (unit column stride) over the logits
    rows ``out``."""
    HI = q.shape[1]
    interp = interpreted(q.device) if interp is None else interp
    exact = k_cache.dtype != torch.uint8
    # the exact mode multiplies on tensor cores where queries and keys share a 16-bit dtype, else in IEEE float32
    f32dot = interp or (exact and not (q.dtype == k_cache.dtype and q.dtype in (torch.bfloat16, torch.float16)))
    cos, sin, stride_c, half = rope_launch_args(rope, q)
    args = (q, q.stride(0), q.stride(1), weights, weights.stride(0), k_cache,
            k_cache if exact else k_cache.view(torch.float32),
            k_cache.numel() // 128, block_table, block_table.stride(0), req_idx, positions, cos, sin, stride_c, half,
            out, out.stride(0), HI, max_len)
    const = dict(BS=k_cache.shape[1], BLOCK_HI=max(16, triton.next_power_of_2(HI)), F32DOT=f32dot, EXACT=exact,
                 ROPE_Q=rope is not None, DT=DTYPE_CODES[q.dtype])
    return args, const, interp


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


def gather_config(block_size: int, interp: bool, exact: bool = False) -> dict:
    """The logits launch a kernel takes that runs the indexer's programs beside other work (``latent_query_indexer``:
    no autotuner inside a launch of tasks, no TMA): the interpreter's small tiles, else the gather default (4 warps,
    the warps of the tasks beside it)."""
    return _launch_config(block_size, {"USE_TMA": False}, interp, exact)


def tma_tiles_fit(block_size: int, block_n: int) -> bool:
    """TMA key tiles need 128-byte cache rows at block starts (block size % 32 == 0) and tiles inside a block."""
    return block_size % 32 == 0 and block_size % block_n == 0


# A prefill step's logits are [tokens, context] float32: 16384 tokens at a 128k context are 8.6e9 elements, past
# the kernels' int32 offsets (row * stride) and 34 GB of memory. Steps are cut into row chunks whose logits stay
# below 2^31 bytes (each chunk's top-k only reads its own rows, so the result is the same); decode steps, whose
# graph-owned buffers are passed in, never reach that size.
LOGITS_BYTES_PER_ELEMENT = 4


# The one-launch kernel serves decode steps: up to ONE_LAUNCH_ROWS tokens whose logits rows (the block table's
# width in keys) are at most ONE_LAUNCH_KEYS long and take one round of the segment top-k (topk.one_round).
# Keys: the round holds its row in registers, a key and its index per entry: at 8192 keys, 64 of each a thread in the
# 4-warp programs of most logits configurations, 230 to 250 registers a thread and no spill (ptxas for sm_90, Triton
# 3.6: tests/kernels/test_indexer_topk_compile.py); at 16384 keys the 4-warp programs spill 360 to 456 bytes a
# thread, and 8 warps would hold 243 to 247 registers a thread: one program an SM, where the logits kernel alone
# (144 to 148) fits three. Rows: every program of the launch carries the round's registers, so two or three logits
# programs fit an SM instead of three: a decode step's grid (16 tokens x 8192 keys: 64 to 512 programs, by the
# configuration) still runs in one or two waves, a prefill's thousands of programs would run in more; 16 is the
# decode batch of the step's other one-launch kernels (f32_linear.MAX_GEMV_ROWS). Longer rows or more tokens: the
# logits kernel, then the top-k's own launches. None of this is timed yet (a GPU run would say whether 16384-key
# rows at 8 warps, or more tokens, gain).
ONE_LAUNCH_ROWS = 16
ONE_LAUNCH_KEYS = 8192


def one_launch_round(tokens: int, max_len: int, topk: int, interp: bool) -> tuple[int, int] | None:
    """``(C, BIN_C)`` of the top-k round that :func:`indexer_topk_paged` runs inside its logits launch for a step of
    ``tokens`` rows of ``max_len`` scores (``topk.one_round``: what ``topk_from_logits`` would launch on them), or
    None where the step takes the two launches."""
    if tokens > ONE_LAUNCH_ROWS or max_len > ONE_LAUNCH_KEYS or not settings.joins("indexer"):  # opt-in
        return None
    return one_round(max_len, topk, interp)


def indexer_topk_paged(q, weights, k_cache, block_table, req_idx, positions, topk: int, *, validate: bool = True,
                       logits_buf: torch.Tensor | None = None, out: torch.Tensor | None = None, rope=None,
                       cfg: dict | None = None):
    """DSA lightning indexer -> int32 [T, topk] positions (any order), -1 padded; ``rope`` = (cos, sin) [T, R/2]
    rotates the queries inside the logits kernel (:func:`indexer_logits_paged`); ``cfg``: the logits launch's
    configuration (else autotuned on the GPU).

    A decode step (:func:`one_launch_round`) runs one launch, ``_indexer_topk_kernel``: the logits kernel's
    programs, the last program of each row selecting its top-k; the indices, and their order, are those of the
    logits kernel under the same configuration followed by ``topk_from_logits``. Other steps launch those two."""
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
                               validate=False, out=out[s:e], rope=tables, cfg=cfg)
        return out
    select = one_launch_round(T, max_len, topk, settings.triton_interpret() or q.device.type != "cuda")
    if select is None or T == 0 or max_len == 0:
        logits = indexer_logits_paged(q, weights, k_cache, block_table, req_idx, positions, out=logits_buf,
                                      validate=False, skip_window=topk, rope=rope, cfg=cfg)
        return topk_from_logits(logits, positions, topk, out=out, validate=False)
    logits, out, tail = selection_buffers(T, max_len, topk, select, q.device, logits_buf, out)
    _launch(q, weights, k_cache, block_table, req_idx, positions, max_len, logits, cfg, rope, tail, select)
    return out


def selection_buffers(T, max_len, topk, select, device, logits=None, out=None, counters=None):
    """(the logits rows [T, max_len], the selection [T, topk], the one-launch kernel's arguments after the logits
    rows: the selection, its row stride, the bin scratch of the round ``select`` = (C, BIN_C), the rows' ticket
    counters (``counters``, else the first T of ``fp8_parts.tile_counters``), topk)."""
    logits = logits if logits is not None else torch.empty(T, max_len, dtype=torch.float32, device=device)
    out = out if out is not None else torch.empty(T, topk, dtype=torch.int32, device=device)
    bins = torch.empty(T, 8 * select[1], dtype=torch.int32, device=device)
    counters = counters if counters is not None else tile_counters(device, T)
    return logits, out, (out, out.stride(0), bins, counters, topk)


def exact_indexer_topk_paged(q, weights, cache, block_table, req_idx, positions, topk: int, *,
                             rope=None) -> torch.Tensor:
    """The exact mode's selection (``fxglm5.lowering.reference.paged.exact_indexer_topk_paged``): the same kernels
    over a compute-dtype cache, with no host sync (the reference loops over the tokens on the host), so a decode
    step with this cache can be captured in a CUDA graph; ``rope`` rotates the queries in the logits kernel too.
    The caller validated (``paged_steps.indexer_step``)."""
    return indexer_topk_paged(q, weights, cache, block_table, req_idx, positions, topk, validate=False, rope=rope)
