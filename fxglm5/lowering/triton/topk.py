"""Triton exact top-k over float32 score rows (the DSA indexer's selection), CUDA-graph safe.

Selection works on the order-preserving uint32 image of the scores (-0.0 and +0.0 share one key); output slots
past ``min(topk, positions[t] + 1)`` are -1. Tie rule (``fxglm5::indexer_topk``'s, on both paths): among equal
scores the lower index wins, i.e. the selected set is that of
:func:`fxglm5.lowering.reference.attention.topk_lowest_index_ties`; the order within it differs (below). No host
sync, no data-dependent shapes: every buffer is sized by the arguments.

A row whose causal window fits in the top-k (``min(positions[t] + 1, L) <= topk``) has nothing to select: both
methods write ``0 .. n-1`` then -1 for it without reading its scores, which the indexer then need not compute
(:func:`fxglm5.lowering.triton.indexer.indexer_topk_paged`). The test is per row, on the device.

- Rows up to 32768 ("segments"): a tournament. Each round cuts every row's list (the scores row, then the
  candidates the previous round kept, indices and keys side by side) into segments of 16384 entries; one CTA
  per segment narrows the bin holding its k-th largest key two bits at a time (CTA-wide reductions of three
  counts) until the bin holds at most 128 keys per warp (2048 of round 1's 16384). A round that is not the last
  keeps every key at or above the bin (fewer than k + 2048: a superset of the segment's top-k) and stops there;
  the last round writes the keys above the bin to the output and copies the bin to scratch, where the remaining
  bits are resolved over those few keys before the bin's selected keys are written. A row's top-k lies inside
  the union of its segments' top-k, so at GLM-5's top-2048 a 32768-entry row becomes 8192 candidates, which one
  segment holds; the last round is the answer.
- Longer rows ("multi"): every row is cut into ``chunk``-long segments, one CTA each; 4 passes of 8 bits, each
  a ``tl.histogram`` per segment added into a global [4, T, 256] histogram with atomics (every CTA replays the
  earlier passes' digit choices from those histograms: a reverse cumsum finds the digit that holds the k-th
  largest); a count pass (keys above / equal to the threshold per segment) and a write pass that places keys
  above the threshold and the lowest-index keys equal to it at offsets from exclusive prefix sums of the
  per-segment counts (deterministic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fxglm5 import settings
from fxglm5.errors import InputError
from fxglm5.lowering.reference import paged as ref
from fxglm5.lowering.triton.device import interpreter_compat, num_sms, pdl, pdl_prologue

interpreter_compat()

__all__ = ["topk_from_logits", "multi_segment_length", "one_round", "SEGMENT_MAX"]



@triton.jit
def _float_key(x):
    """float32 -> uint32 whose unsigned order is the float order; -0.0 maps to +0.0's key (equal scores tie, and
    the indexer's sums of relu * weight give both zeros)."""
    b = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return (b ^ ((b >> 31) | -2147483648)).to(tl.uint32, bitcast=True)


@triton.jit
def _segment_keys(x_row, ids_row, keys_row, j0, n_list, n_valid, GATHER: tl.constexpr, C: tl.constexpr,
                  CACHE: tl.constexpr):
    """Keys and row indices of entries ``j0 .. j0+C-1`` of a row's list: the logits row itself (loaded with the
    cache modifier ``CACHE``), or (GATHER) the previous round's candidates, whose indices (-1 = none) and keys it
    wrote side by side (read back contiguously rather than gathered from the logits row). Order-preserving uint32
    keys; entries past the window, past the list or without a candidate get key 0, below every float's key (-inf
    maps to 0x007FFFFF), so they are never counted or selected."""
    j = j0 + tl.arange(0, C)
    if GATHER:
        ids = tl.load(ids_row + j, mask=j < n_list, other=-1)
        key = tl.load(keys_row + j, mask=j < n_list, other=0).to(tl.uint32, bitcast=True)
        return tl.where(ids >= 0, key, 0), ids
    else:
        m = j < n_valid
        return tl.where(m, _float_key(tl.load(x_row + j, mask=m, other=0.0, cache_modifier=CACHE)), 0), j


@triton.jit
def _segment_chunks(x_row, ids_row, keys_row, j0, n_list, n_valid, GATHER: tl.constexpr, C: tl.constexpr,
                    CACHE: tl.constexpr):
    """A segment's entries ``j0 .. j0+4C-1`` as four register chunks: (keys, indices) x 4."""
    k0, i0 = _segment_keys(x_row, ids_row, keys_row, j0, n_list, n_valid, GATHER, C, CACHE)
    k1, i1 = _segment_keys(x_row, ids_row, keys_row, j0 + C, n_list, n_valid, GATHER, C, CACHE)
    k2, i2 = _segment_keys(x_row, ids_row, keys_row, j0 + 2 * C, n_list, n_valid, GATHER, C, CACHE)
    k3, i3 = _segment_keys(x_row, ids_row, keys_row, j0 + 3 * C, n_list, n_valid, GATHER, C, CACHE)
    return k0, i0, k1, i1, k2, i2, k3, i3


@triton.jit
def _place(key, ids, thr, gt_base, eq_base, eq_quota, orow, okrow, KEYS_OUT: tl.constexpr):
    """Write the chunk's selected row indices (and, with KEYS_OUT, their keys): keys above ``thr``, and keys
    equal to it while the quota of ties lasts (first in list order), in list order. One prefix sum carries both
    counts (above in the low 16 bits, equal in the high bits: a chunk holds at most 8192 keys); an entry's slot
    is the keys above before it plus the ties before it, capped at the quota. Returns the running counts."""
    gt = (key > thr).to(tl.int32)
    eq = (key == thr).to(tl.int32)
    cs = tl.cumsum(gt + (eq << 16), 0)
    n_gt = gt_base + (cs & 0xFFFF)  # inclusive counts up to each entry
    n_eq = eq_base + (cs >> 16)
    take = (gt == 1) | ((eq == 1) & (n_eq <= eq_quota))
    slot = n_gt - gt + tl.minimum(n_eq - eq, eq_quota)
    tl.store(orow + slot, ids, mask=take)
    if KEYS_OUT:
        tl.store(okrow + slot, key.to(tl.int32, bitcast=True), mask=take)
    tot = tl.sum(gt + (eq << 16), 0)
    return gt_base + (tot & 0xFFFF), eq_base + (tot >> 16)


@triton.jit
def _count_ge(k0, k1, k2, k3, c):
    return (k0 >= c).to(tl.int32) + (k1 >= c).to(tl.int32) + (k2 >= c).to(tl.int32) + (k3 >= c).to(tl.int32)


@triton.jit
def _add3(a0, a1, a2, b0, b1, b2):
    return a0 + b0, a1 + b1, a2 + b2


@triton.jit
def _narrow(k0, k1, k2, k3, k_eff, thr, n_lo, n_hi, step, cap):
    """Narrow the bin ``[thr, thr | (2^(32 - 2 step) - 1)]`` that holds the k_eff-th largest of the four chunks'
    keys two bits per step, until it holds at most ``cap`` keys, or all 32 bits are fixed, or exactly k_eff keys
    are at or above its lower end (then those are the selection, whatever the remaining bits: with distinct
    scores this ends the search once the bin's lower end passes the (k_eff+1)-th key, several steps before all
    bits are fixed). ``n_lo`` / ``n_hi``: the keys at or above the bin's lower end / above its upper end (so
    ``n_hi < k_eff <= n_lo`` for k_eff > 0).
    A step is one CTA-wide reduction of three counts (no histograms, no atomics); a runtime loop, not unrolled:
    the unrolled search was ~14k instructions of straight-line code, fetched again by every CTA, which ran
    40-70 % slower whenever that code had left L2 (docs/perf/indexer_topk.md).
    Returns ``(thr, n_lo, n_hi, step)``."""
    while (step < 16) & (n_lo - n_hi > cap) & (n_lo != k_eff):
        bit = tl.full([], 1, tl.uint32) << (30 - 2 * step).to(tl.uint32)
        c1 = thr | bit  # the lower ends of the sub-bins 01, 10, 11
        c2 = thr | (bit << 1)
        c3 = thr | (bit * 3)
        n1, n2, n3 = tl.reduce((_count_ge(k0, k1, k2, k3, c1), _count_ge(k0, k1, k2, k3, c2),
                                _count_ge(k0, k1, k2, k3, c3)), 0, _add3)
        # the highest sub-bin whose lower end still has k_eff keys at or above it
        p3 = n3 >= k_eff
        p2 = n2 >= k_eff
        p1 = n1 >= k_eff
        thr = tl.where(p3, c3, tl.where(p2, c2, tl.where(p1, c1, thr)))
        n_hi = tl.where(p3, n_hi, tl.where(p2, n3, tl.where(p1, n2, n1)))
        n_lo = tl.where(p3, n3, tl.where(p2, n2, tl.where(p1, n1, n_lo)))
        step += 1
    return thr, n_lo, n_hi, step


@triton.jit
def _split_bin(key, ids, thr, top, decided, n_hi, quota, above_base, bin_base, orow, brow, CAP: tl.constexpr):
    """One chunk of the split pass, in list order at running offsets (one prefix sum, above in the low 16 bits).
    Keys above the bin's upper end ``top`` go to the output (selected whatever the exact threshold). Keys inside
    ``[thr, top]`` go to the bin scratch (CAP keys, then CAP indices); or, once the selection is ``decided`` (the
    bin is a single key value, e.g. massive ties, or all its keys are selected), the first ``quota`` of them go
    straight to the output after the ``n_hi`` keys above. Returns the running offsets."""
    above = (key > top).to(tl.int32)
    inb = ((key >= thr) & (key <= top)).to(tl.int32)
    cs = tl.cumsum(above + (inb << 16), 0)
    b_rank = bin_base + (cs >> 16) - 1
    to_out = (above == 1) | ((inb == 1) & (decided == 1) & (b_rank < quota))
    o_slot = tl.where(above == 1, above_base + (cs & 0xFFFF) - 1, n_hi + b_rank)
    tl.store(orow + o_slot, ids, mask=to_out)
    to_bin = (inb == 1) & (decided == 0)
    tl.store(brow + b_rank, key.to(tl.int32, bitcast=True), mask=to_bin)
    tl.store(brow + CAP + b_rank, ids, mask=to_bin)
    tot = tl.sum(above + (inb << 16), 0)
    return above_base + (tot & 0xFFFF), bin_base + (tot >> 16)


@triton.jit
def _bin_chunk(brow, c, n_bin, BIN_C: tl.constexpr, CHUNK: tl.constexpr):
    """Chunk ``c`` of the bin scratch: (keys, indices), key 0 past the ``n_bin`` entries."""
    j = c * BIN_C + tl.arange(0, BIN_C)
    m = j < n_bin
    key = tl.load(brow + j, mask=m, other=0).to(tl.uint32, bitcast=True)
    return key, tl.load(brow + CHUNK + j, mask=m, other=-1)


@triton.jit
def _select_in_bin(brow, n_bin, thr, step, k_eff, n_above, orow, BIN_C: tl.constexpr):
    """After the split pass: resolve the remaining bits over the bin scratch's ``n_bin`` keys and write the
    bin's selected indices (keys above the exact threshold, then ties in list order) after the ``n_above``
    already written."""
    tl.debug_barrier()  # the bin scratch was written by other threads of this CTA
    b0, i0 = _bin_chunk(brow, 0, n_bin, BIN_C, 4 * BIN_C)
    b1, i1 = _bin_chunk(brow, 1, n_bin, BIN_C, 4 * BIN_C)
    b2, i2 = _bin_chunk(brow, 2, n_bin, BIN_C, 4 * BIN_C)
    b3, i3 = _bin_chunk(brow, 3, n_bin, BIN_C, 4 * BIN_C)
    k_rem = k_eff - n_above
    thr, n_lo, n_gt, step = _narrow(b0, b1, b2, b3, k_rem, thr, n_bin, tl.zeros([], tl.int32), step, 0)
    # all 32 bits fixed: the n_gt keys above the value thr and its first ties; else exactly k_rem keys are >= thr
    quota = tl.where(n_lo == k_rem, k_rem, k_rem - n_gt)
    base, eqb = _place(b0, i0, thr, n_above, 0, quota, orow, orow, False)
    base, eqb = _place(b1, i1, thr, base, eqb, quota, orow, orow, False)
    base, eqb = _place(b2, i2, thr, base, eqb, quota, orow, orow, False)
    base, eqb = _place(b3, i3, thr, base, eqb, quota, orow, orow, False)


@triton.jit
def _pad(orow, okrow, n_out, width, KEYS_OUT: tl.constexpr, C: tl.constexpr):
    """-1 (and key 0) in the output slots ``n_out .. width``."""
    for c0 in range(0, width, C):
        pad = c0 + tl.arange(0, C)
        pmask = (pad >= n_out) & (pad < width)
        tl.store(orow + pad, tl.full([C], -1, tl.int32), mask=pmask)
        if KEYS_OUT:
            tl.store(okrow + pad, tl.zeros([C], tl.int32), mask=pmask)


@triton.jit
def _window_slots(orow, j, n_valid, topk):
    """Output slots ``j`` (those below ``topk``) of a row whose whole causal window is its selection: slot j holds
    position j inside the window, -1 past it. No score is read."""
    tl.store(orow + j, tl.where(j < n_valid, j, -1), mask=j < topk)


@triton.jit
def window_row(orow, n_valid, topk, C: tl.constexpr):
    """All ``topk`` output slots of a row whose whole causal window (``n_valid`` keys) is its selection, C at a
    time: ``0 .. n_valid-1``, then -1. No score is read."""
    for c0 in range(0, topk, C):
        _window_slots(orow, c0 + tl.arange(0, C), n_valid, topk)


@triton.jit
def select_segment(x_row, ids_row, keys_row, o_row, ko_row, brow, sg, n_list, n_valid, topk, C: tl.constexpr,
                   GATHER: tl.constexpr, KEEP: tl.constexpr, BIN_C: tl.constexpr, CACHE: tl.constexpr):
    """One CTA's selection over segment ``sg`` (4*C list entries) of one row whose window exceeds ``topk``: the
    whole of :func:`_segment_topk_kernel`'s work on a row (that kernel's docstring states it), shared with the
    indexer's one-launch kernel (``indexer._indexer_topk_kernel``), which runs it in the program that finished
    a row's logits. Rows: ``x_row`` (the scores, loaded with the cache modifier ``CACHE``), ``ids_row`` /
    ``keys_row`` (GATHER: the previous round's candidates), ``o_row`` / ``ko_row`` (the output indices / kept keys),
    ``brow`` (this CTA's 8*BIN_C-entry bin scratch, the last round's)."""
    k0, i0, k1, i1, k2, i2, k3, i3 = _segment_chunks(x_row, ids_row, keys_row, sg * (4 * C), n_list, n_valid, GATHER,
                                                     C, CACHE)
    k_eff = tl.minimum(topk, tl.sum(_count_ge(k0, k1, k2, k3, tl.full([], 1, tl.uint32)), 0))
    zero = tl.zeros([], tl.int32)
    thr, n_lo, n_hi, step = _narrow(k0, k1, k2, k3, k_eff, tl.zeros([], tl.uint32), zero + 4 * C, zero, zero,
                                    4 * BIN_C)
    # the bin [thr, top] holds at most 4*BIN_C keys, or one key value when all 32 bits are fixed (exact), or its
    # keys are all selected (n_lo == k_eff: decided, however many); the n_hi keys above it are all selected
    exact = (step == 16).to(tl.int32)
    decided = exact | (n_lo == k_eff).to(tl.int32)
    quota = k_eff - n_hi
    if KEEP:
        width = topk + 4 * BIN_C
        orow = o_row + sg * width
        okrow = ko_row + sg * width
        ties = tl.where(exact == 1, quota, 4 * C)
        gb, eb = _place(k0, i0, thr, 0, 0, ties, orow, okrow, True)
        gb, eb = _place(k1, i1, thr, gb, eb, ties, orow, okrow, True)
        gb, eb = _place(k2, i2, thr, gb, eb, ties, orow, okrow, True)
        gb, eb = _place(k3, i3, thr, gb, eb, ties, orow, okrow, True)
        _pad(orow, okrow, gb + tl.minimum(eb, ties), width, True, C)
    else:
        low_bits = tl.full([], 0xFFFFFFFF, tl.uint32) >> (2 * tl.minimum(step, 15)).to(tl.uint32)
        top = tl.where(exact == 1, thr, thr | low_bits)
        ab, bb = _split_bin(k0, i0, thr, top, decided, n_hi, quota, 0, 0, o_row, brow, 4 * BIN_C)
        ab, bb = _split_bin(k1, i1, thr, top, decided, n_hi, quota, ab, bb, o_row, brow, 4 * BIN_C)
        ab, bb = _split_bin(k2, i2, thr, top, decided, n_hi, quota, ab, bb, o_row, brow, 4 * BIN_C)
        ab, bb = _split_bin(k3, i3, thr, top, decided, n_hi, quota, ab, bb, o_row, brow, 4 * BIN_C)
        if decided == 0:
            _select_in_bin(brow, bb, thr, step, k_eff, n_hi, o_row, BIN_C)
        _pad(o_row, o_row, k_eff, topk, False, C)


@triton.jit
def _segment_topk_kernel(x_ptr, stride_xt, ids_ptr, kin_ptr, stride_it, pos_ptr, o_ptr, ko_ptr, stride_ot, bin_ptr,
                         L, n_list, topk, C: tl.constexpr, GATHER: tl.constexpr, KEEP: tl.constexpr,
                         BIN_C: tl.constexpr, PDL: tl.constexpr):
    """One CTA per (row, segment of 4*C list entries), the segment in registers as four C-long chunks
    (:func:`select_segment`).

    The search narrows the bin holding the segment's k-th key over all 4*C keys only until the bin holds at most
    4*BIN_C of them (a few steps at GLM-5's shapes). Then:

    - ``KEEP`` (every round but the last): the segment keeps every key at or above the bin's lower end, a superset
      of its top-k of fewer than ``topk + 4*BIN_C`` keys, in list order: indices to ``o[row, segment * width ...]``
      and keys to ``ko`` at the same places, -1 / key 0 padded to ``width = topk + 4*BIN_C``. The next round
      selects among them, so this round needs neither the remaining bits nor the bin scratch (they took a third of
      round 1: docs/perf/indexer_topk.md). A bin of one key value (all bits fixed: massive ties) keeps
      only the first ``topk - above`` of its ties. With ``BIN_C`` = 0 the search runs until exactly the segment's
      top-k remain (for lists that supersets would not shorten).
    - the last round: the exact top-``topk`` row indices (ties first in list order), -1 padded, to
      ``o[row, :topk]``. A split pass writes the keys above the bin straight to the output and copies the bin's
      (key, index) pairs to this CTA's ``bin_ptr`` scratch, and the remaining bits are resolved over those few.
      Output order: the keys above the bin in list order, then the bin's selected keys in list order. A decided
      bin (one key value, or exactly k keys at or above its lower end, however many) needs no fine steps: the
      split pass writes its first ``topk - above`` keys straight to the output.

    A row whose window fits in ``topk`` reads nothing: its rounds that keep candidates write none, and the last
    round writes the window's positions in order (:func:`window_row`)."""
    pdl_prologue(PDL)  # before the fitting rows' early exit (a grid of them only would end ahead of its predecessor)
    t = tl.program_id(0)
    sg = tl.program_id(1)
    t64 = t.to(tl.int64)
    n_valid = tl.minimum(tl.load(pos_ptr + t).to(tl.int32) + 1, L)
    if n_valid <= topk:
        if not KEEP:
            window_row(o_ptr + t64 * stride_ot, n_valid, topk, C)
        return
    select_segment(x_ptr + t64 * stride_xt, ids_ptr + t64 * stride_it, kin_ptr + t64 * stride_it,
                   o_ptr + t64 * stride_ot, ko_ptr + t64 * stride_ot, bin_ptr + t64 * (8 * BIN_C), sg, n_list,
                   n_valid, topk, C, GATHER, KEEP, BIN_C, "")


@triton.jit
def _radix_replay(hist_ptr, t, T, k_eff, NP: tl.constexpr):
    """Replay the digit selections of the first NP passes from their histograms -> (prefix, k_rem)."""
    bins = tl.arange(0, 256)
    prefix = tl.zeros([1], tl.uint32)
    k_rem = tl.zeros([1], tl.int32) + k_eff
    for p in tl.static_range(NP):
        h = tl.load(hist_ptr + (p * T + t) * 256 + bins)
        ge = tl.cumsum(h, 0, reverse=True)
        sel = tl.max(tl.where(ge >= k_rem, bins, -1), 0)
        k_rem = k_rem - tl.sum(tl.where(bins > sel, h, 0), 0)
        prefix = prefix | (tl.maximum(sel, 0).to(tl.uint32) << (24 - 8 * p))
    return prefix, k_rem


@triton.jit
def _radix_hist_kernel(x_ptr, stride_xt, pos_ptr, hist_ptr, T, L, topk, PASS: tl.constexpr, SEG: tl.constexpr,
                       PDL: tl.constexpr):
    """Pass PASS (8 bits) of the multi-CTA radix select: a CTA histograms one SEG-long segment of one row."""
    pdl_prologue(PDL)
    t = tl.program_id(0)
    seg = tl.program_id(1)
    n_valid = tl.minimum(tl.load(pos_ptr + t).to(tl.int32) + 1, L)
    if (seg * SEG < n_valid) & (n_valid > topk):  # a window that fits in topk is selected whole: no histogram
        prefix, k_rem = _radix_replay(hist_ptr, t, T, topk, PASS)
        offs = seg * SEG + tl.arange(0, SEG)
        m = offs < n_valid
        key = _float_key(tl.load(x_ptr + t.to(tl.int64) * stride_xt + offs, mask=m, other=0.0))
        if PASS > 0:
            m = m & ((key >> (32 - 8 * PASS)) == (prefix >> (32 - 8 * PASS)))
        d = ((key >> (24 - 8 * PASS)) & 255).to(tl.int32)
        h = tl.histogram(d, 256, mask=m)
        bins = tl.arange(0, 256)
        tl.atomic_add(hist_ptr + (PASS * T + t) * 256 + bins, h, mask=h > 0)


@triton.jit
def _radix_count_kernel(x_ptr, stride_xt, pos_ptr, hist_ptr, cnt_ptr, T, L, topk, NSEG, SEG: tl.constexpr,
                        PDL: tl.constexpr):
    """Per segment: how many keys are above the threshold and how many equal it (rows longer than topk only)."""
    pdl_prologue(PDL)  # before the fitting rows' early exit
    t = tl.program_id(0)
    seg = tl.program_id(1)
    n_valid = tl.minimum(tl.load(pos_ptr + t).to(tl.int32) + 1, L)
    if n_valid <= topk:
        return
    thr, k_rem = _radix_replay(hist_ptr, t, T, topk, 4)
    offs = seg * SEG + tl.arange(0, SEG)
    m = offs < n_valid
    key = _float_key(tl.load(x_ptr + t.to(tl.int64) * stride_xt + offs, mask=m, other=0.0))
    gt = tl.sum((m & (key > thr)).to(tl.int32), 0)
    eq = tl.sum((m & (key == thr)).to(tl.int32), 0)
    tl.store(cnt_ptr + (t * NSEG + seg) * 2, gt)
    tl.store(cnt_ptr + (t * NSEG + seg) * 2 + 1, eq)


@triton.jit
def _radix_write_kernel(x_ptr, stride_xt, pos_ptr, hist_ptr, cnt_ptr, o_ptr, stride_ot, T, L, topk, NSEG,
                        SEG: tl.constexpr, NSEG_PAD: tl.constexpr, PDL: tl.constexpr):
    """Write the selected indices: keys above the threshold, then the lowest-index keys equal to it; every
    segment's output offsets are exclusive prefix sums of the per-segment counts (deterministic). A row longer
    than topk fills all topk slots; a row whose window fits in topk (no histogram, no counts) gets its window's
    positions, segment s writing slots ``s*SEG .. (s+1)*SEG`` (the segments cover the topk slots)."""
    pdl_prologue(PDL)  # before the fitting rows' early exit
    t = tl.program_id(0)
    seg = tl.program_id(1)
    n_valid = tl.minimum(tl.load(pos_ptr + t).to(tl.int32) + 1, L)
    orow = o_ptr + t.to(tl.int64) * stride_ot
    if n_valid <= topk:
        _window_slots(orow, seg * SEG + tl.arange(0, SEG), n_valid, topk)
        return
    thr, k_rem = _radix_replay(hist_ptr, t, T, topk, 4)
    n_gt = topk - k_rem
    sidx = tl.arange(0, NSEG_PAD)
    before = sidx < seg
    cg = tl.load(cnt_ptr + (t * NSEG + sidx) * 2, mask=before, other=0)
    ce = tl.load(cnt_ptr + (t * NSEG + sidx) * 2 + 1, mask=before, other=0)
    base_gt = tl.sum(cg, 0)
    base_eq = tl.sum(ce, 0)
    offs = seg * SEG + tl.arange(0, SEG)
    m = offs < n_valid
    key = _float_key(tl.load(x_ptr + t.to(tl.int64) * stride_xt + offs, mask=m, other=0.0))
    gt = m & (key > thr)
    eq = m & (key == thr)
    tl.store(orow + base_gt + tl.cumsum(gt.to(tl.int32), 0) - 1, offs, mask=gt)
    rank_eq = base_eq + tl.cumsum(eq.to(tl.int32), 0) - 1
    tl.store(orow + n_gt + rank_eq, offs, mask=eq & (rank_eq < k_rem))


SEGMENT_MAX = 32768  # longest segment one CTA holds in registers (four chunks of at most 8192 keys)


def _segment_len(entries: int) -> int:
    """A segment holds four register chunks of a power-of-two length of at least 32."""
    return max(128, triton.next_power_of_2(entries))


def _segment_length(topk: int, chunk: int | None, interp: bool) -> int:
    """The tournament's segment length: ``chunk`` (16384 on the GPU: docs/perf/indexer_topk.md), at least
    twice ``topk`` so that every round at least halves the list."""
    seg = _segment_len(max(chunk or (64 if interp else 16384), 2 * topk))
    if seg > SEGMENT_MAX:
        raise InputError(f"topk_from_logits: topk={topk} needs segments of {seg} > SEGMENT_MAX={SEGMENT_MAX}"
                         " entries; use method='multi'")
    return seg


def one_round(length: int, topk: int, interp: bool) -> tuple[int, int] | None:
    """``(C, BIN_C)`` of the selection :func:`topk_from_logits` launches by default over rows of ``length`` scores
    where it is one round of the segments method (one CTA a row, the whole row in its registers as four C-long
    chunks; BIN_C as that round sets it, whatever the warps), else None (longer rows: more rounds, or the multi
    radix). The indexer's one-launch kernel runs this round (``indexer._indexer_topk_kernel``)."""
    if length > SEGMENT_MAX or length > _segment_length(topk, None, interp):
        return None
    C, _, bin_c = _round_shape(_segment_len(length), None, interp)
    return C, bin_c


def _tournament(x, pos, topk, out, seg, num_warps, interp):
    """Rounds of segment selections over ``x``'s rows until one segment holds a row's candidates; the last round
    writes ``out``."""
    T = x.shape[0]
    cand, n_list = None, x.shape[1]
    while n_list > seg:  # a round: every segment keeps a superset of its top-k (indices and keys)
        C, nw, bin_c = _round_shape(seg, num_warps, interp)
        nseg = triton.cdiv(n_list, seg)
        if nseg * (topk + 4 * bin_c) >= n_list:
            # a list only a little longer than a segment: supersets would not shorten it, so this round keeps
            # exactly each segment's top-k (no bin: the search runs to the last bit), which halves it (seg >= 2k)
            bin_c = 0
        kept = torch.empty(2, T, nseg * (topk + 4 * bin_c), dtype=torch.int32, device=x.device)
        _segment_topk_kernel[(T, nseg)](
            x, x.stride(0), *_candidates(cand, kept[0]), pos, kept[0], kept[1], kept.stride(1), kept, x.shape[1],
            n_list, topk, C=C, GATHER=cand is not None, KEEP=True, BIN_C=bin_c, num_warps=nw, **pdl(x.device))
        cand, n_list = (kept[0], kept[1]), kept.shape[2]
    C, nw, bin_c = _round_shape(_segment_len(n_list), num_warps, interp)
    bins = torch.empty(T, 8 * bin_c, dtype=torch.int32, device=x.device)
    _segment_topk_kernel[(T, 1)](
        x, x.stride(0), *_candidates(cand, out), pos, out, out, out.stride(0), bins, x.shape[1], n_list, topk, C=C,
        GATHER=cand is not None, KEEP=False, BIN_C=bin_c, num_warps=nw, **pdl(x.device))
    return out


def _candidates(cand, dummy):
    """(ids, keys, row stride) of the previous round's candidates; ``dummy`` stands in for them in the first round,
    which reads the scores instead."""
    ids, keys = cand if cand is not None else (dummy, dummy)
    return ids, keys, ids.stride(0)


def _round_shape(seg, num_warps, interp):
    """(chunk length, warps, bin chunk) of a round over ``seg``-entry segments. The bin holds four keys per thread:
    2048 of round 1's 16384 entries, 1024 of the last round's 8192.
    16 warps for 16384-entry segments, 8 for the 8192 candidates of the last round. Alone, 8 warps ran round 1
    faster; after other traffic (the logits kernel, in a model) they ran it much slower than 16 warps: the
    narrower launch's binary holds more unrolled per-thread code (docs/perf/indexer_topk.md)."""
    C = seg // 4
    nw = num_warps or (4 if interp else max(4, min(16, C // 256)))
    return C, nw, min(32 * nw, C // 4)


def multi_segment_length(rows: int, length: int, sms: int) -> int:
    """The multi radix's scores per CTA: 4096, halved (down to 512) while the rows make fewer CTAs than SMs. At
    batch 1 / 131k, 4096 gave 32 CTAs and a 36.7 us span against 31.1 at 512; at batch 4 / 65k 36.7 against 31.8
    at 1024; at batch 8 / 65k 2048 and 4096 are even (37.5 / 37.7); from batch 16 / 65k 4096 is the fastest
    (bench/results/indexer_sweep_bf5bc34/multi_chunk_first_look.log, kernel spans of one call)."""
    seg = 4096
    while seg > 512 and rows * triton.cdiv(length, seg) < sms:
        seg //= 2
    return seg


def topk_from_logits(logits, positions, topk: int, *, out: torch.Tensor | None = None, chunk: int | None = None,
                     method: str | None = None, workspace: dict | None = None, num_warps: int | None = None,
                     validate: bool = True):
    """int32 [T, topk]: indices of the ``min(topk, positions[t]+1)`` largest of ``logits[t, :positions[t]+1]``
    (ties at the threshold broken towards lower indices), -1 padded.

    ``method="segments"`` (the default for rows up to ``SEGMENT_MAX``): a tournament of exact selections. Each
    round cuts every row's list (first the logits row, then the candidates the previous round kept) into
    segments of ``chunk`` entries (a power of two; 16384 on the GPU: docs/perf/indexer_topk.md). One CTA
    per segment keeps it in registers and narrows the bin holding its ``topk``-th largest key two bits at a time
    until the bin is small. A round that is not the last keeps the keys at or above the bin (a superset of the
    segment's top ``topk``, with their keys); the last round resolves the rest over the bin's few keys and writes
    the row's top ``topk`` indices. Every index of the row's top-k is in its segment's top-k, so the candidates
    shrink at least 4/3x (4x at GLM-5's shapes) per round until one segment holds a row; that last round's
    selection is the answer: the keys above the last bin in increasing index order, then the rest of the selection
    in increasing index order. 64 x 32768 becomes 128 CTAs, then 64 over 8192 candidates each, instead of 64 CTAs on the whole row.
    ``method="multi"`` (the default for longer rows, where the tournament's rounds of few CTAs lose to its
    parallelism: bench/results/kernels_attention.md): radix select spread over ``T x ceil(L / chunk)`` CTAs
    (``chunk`` from :func:`multi_segment_length` on the GPU: at least as many CTAs as SMs where it can),
    4 histogram passes (global atomics into a [4, T, 256] histogram) + a count pass + a write pass with
    deterministic prefix sums: 6 launches. ``workspace`` may hold preallocated ``hist`` ([4, T, 256] int32) and
    ``cnt``.
    No host sync in either (CUDA-graph safe); ``num_warps`` overrides the launch width. Rows whose window fits in
    ``topk`` get ``0 .. positions[t]`` in order; their scores are never read (they may be garbage).
    """
    if validate:
        ref.validate_topk_from_logits(logits, positions, topk, out)
    T, L = logits.shape
    if out is None:
        out = torch.empty(T, topk, dtype=torch.int32, device=logits.device)
    if T == 0:
        return out
    method = method or ("segments" if L <= SEGMENT_MAX else "multi")
    if method not in ("segments", "multi"):
        raise InputError(f"topk_from_logits: method {method!r} (expected 'segments' or 'multi')")
    interp = settings.triton_interpret() or logits.device.type != "cuda"
    if method == "segments":
        return _tournament(logits, positions, topk, out, _segment_length(topk, chunk, interp), num_warps, interp)
    seg = chunk or (64 if interp else multi_segment_length(T, L, num_sms(logits.device)))
    nseg = max(triton.cdiv(L, seg), triton.cdiv(topk, seg))
    ws = workspace if workspace is not None else {}
    hist = ws.get("hist")
    if hist is None or hist.shape != (4, T, 256):
        hist = torch.empty(4, T, 256, dtype=torch.int32, device=logits.device)
    cnt = ws.get("cnt")
    if cnt is None or cnt.shape != (T, nseg, 2):
        cnt = torch.empty(T, nseg, 2, dtype=torch.int32, device=logits.device)
    hist.zero_()
    nw = 8 if seg >= 2048 else 4
    grid = (T, nseg)
    for p in range(4):
        _radix_hist_kernel[grid](logits, logits.stride(0), positions, hist, T, L, topk, PASS=p, SEG=seg, num_warps=nw,
                                 **pdl(logits.device))
    _radix_count_kernel[grid](logits, logits.stride(0), positions, hist, cnt, T, L, topk, nseg, SEG=seg,
                              num_warps=nw, **pdl(logits.device))
    _radix_write_kernel[grid](logits, logits.stride(0), positions, hist, cnt, out, out.stride(0), T, L, topk, nseg,
                              SEG=seg, NSEG_PAD=max(2, triton.next_power_of_2(nseg)), num_warps=nw,
                              **pdl(logits.device))
    return out
