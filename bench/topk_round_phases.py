"""Where the top-k tournament spends its time (H200, 64 rows x 32768 scores, top-2048), and which launch width and
bin cap suit each round.

Round 1 cuts every row into two 16384-entry segments, one CTA each (128 CTAs). The segment kernel (``topk.py``)
loads its segment into registers (four chunks), narrows the bin holding the 2048-th key over every key until the
bin holds at most ``4 * BIN_C`` keys (the coarse steps), and keeps every key at or above the bin's lower end (one
prefix sum per chunk): at most 2048 + 4 * BIN_C candidates per segment. The last round selects the exact top-2048
among a row's candidates (64 CTAs over 8192 entries): coarse steps, a split of the keys above the bin to the output
and the bin to scratch, the remaining bits over the bin, the bin's placement.

Rows (inputs in L2 between the 20 calls captured per graph, as the scores are right after the logits kernel):
round 1 cut after loading and after the coarse steps (each cut stores something that depends on the work before
it), then the whole round (the package kernel) at several widths and bin caps, checked to keep a superset of each
segment's top-2048 within its slots; the last round at several widths, checked exact; both rounds through
``topk_from_logits``. A second table times round 1 and the last round as the only top-k kernel of a replay after
512 MB of other reads, as they run in a model after the logits kernel (a narrow round 1 slowed down there by
12 us in session 6: bench/results/kernels_attention_NOTES.md). Saves bench/results/topk_round_phases.*.

    python bench/topk_round_phases.py
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.harness import Results, capture_graph, kernel_times, time_graph_us  # noqa: E402
from fxglm5.lowering.triton import topk  # noqa: E402
from fxglm5.lowering.triton.topk import _narrow, _segment_chunks  # noqa: E402

B, L, TOPK, SEG = 64, 32768, 2048, 16384
C = SEG // 4  # a chunk: a segment is four


@triton.jit
def _round1_cut(x_ptr, stride_xt, pos_ptr, o_ptr, stride_ot, L, topk, C: tl.constexpr, BIN_C: tl.constexpr,
                PHASE: tl.constexpr):
    """Round 1 of the package segment kernel cut after loading (PHASE 0) or after the coarse steps (PHASE 1)."""
    t = tl.program_id(0)
    sg = tl.program_id(1)
    t64 = t.to(tl.int64)
    n_valid = tl.minimum(tl.load(pos_ptr + t).to(tl.int32) + 1, L)
    row = x_ptr + t64 * stride_xt
    k0, i0, k1, i1, k2, i2, k3, i3 = _segment_chunks(row, row, row, sg * (4 * C), L, n_valid, False, C)
    orow = o_ptr + t64 * stride_ot + sg
    if PHASE == 0:
        tl.store(orow, tl.max(tl.maximum(tl.maximum(k0, k1), tl.maximum(k2, k3)), 0).to(tl.int32, bitcast=True))
    else:
        zero = tl.zeros([], tl.int32)
        k_eff = tl.minimum(topk, tl.minimum(n_valid - sg * (4 * C), 4 * C))
        thr, n_lo, n_hi, step = _narrow(k0, k1, k2, k3, k_eff, tl.zeros([], tl.uint32), zero + 4 * C, zero, zero,
                                        4 * BIN_C)
        tl.store(orow, thr.to(tl.int32, bitcast=True) + step)


def _round1(x, pos, nw, bin_c):
    """(launch, kept) for the package round 1 at ``nw`` warps and a ``4 * bin_c``-key bin cap."""
    kept = torch.empty(2, B, 2 * (TOPK + 4 * bin_c), dtype=torch.int32, device="cuda")
    launch = lambda: topk._segment_topk_kernel[(B, L // SEG)](  # noqa: E731
        x, x.stride(0), kept[0], kept[1], kept.stride(1), pos, kept[0], kept[1], kept.stride(1), kept, L, L, TOPK,
        C=C, GATHER=False, KEEP=True, BIN_C=bin_c, num_warps=nw)
    return launch, kept


def _last_round(x, pos, kept, out, nw):
    """A launch of the package last round over round 1's candidates ``kept`` at ``nw`` warps."""
    n_list = kept.shape[2]
    seg = topk._segment_len(n_list)
    c, _, bin_c = topk._round_shape(seg, nw, False)
    bins = torch.empty(B, 8 * bin_c, dtype=torch.int32, device="cuda")
    return lambda: topk._segment_topk_kernel[(B, 1)](
        x, x.stride(0), kept[0], kept[1], kept.stride(1), pos, out, out, out.stride(0), bins, L, n_list, TOPK, C=c,
        GATHER=True, KEEP=False, BIN_C=bin_c, num_warps=nw)


def _superset_kept(x, kept, width):
    """Every segment's slots hold its top-2048 (a superset of it, the rest -1) with their keys."""
    for t in range(0, B, 5):
        for g in range(L // SEG):
            ids = kept[0, t, g * width:(g + 1) * width].long()
            ids = ids[ids >= 0]
            seg = x[t, g * SEG:(g + 1) * SEG]
            if not torch.equal(x[t, ids].topk(TOPK).values, seg.topk(TOPK).values):
                return False
            keys = topk_keys(x[t, ids])
            if not torch.equal(kept[1, t, g * width:g * width + len(ids)], keys):
                return False
    return True


def topk_keys(v):
    """The order-preserving int32 image of float32 scores (the kernel's keys, as stored)."""
    b = v.view(torch.int32)
    return b ^ ((b >> 31) | -2147483648)


def _sorted(t):
    return torch.sort(t, 1).values


def main():
    torch.manual_seed(0)
    x = torch.randn(B, L, device="cuda")
    pos = torch.full((B,), L - 1, device="cuda", dtype=torch.int32)
    want = _sorted(torch.topk(x, TOPK, 1).indices.int())
    out = torch.empty(B, TOPK, dtype=torch.int32, device="cuda")
    cut_out = torch.empty(B, 2, dtype=torch.int32, device="cuda")
    results = Results()
    for phase, name in enumerate(("load", "+coarse steps")):
        us = time_graph_us(lambda: _round1_cut[(B, L // SEG)](x, x.stride(0), pos, cut_out, cut_out.stride(0), L, TOPK,
                                                              C=C, BIN_C=512, PHASE=phase, num_warps=16),
                           calls_per_graph=20)
        results.add(kernel=f"round 1 cut: {name}", num_warps=16, bin_c=512, us=round(us, 1), exact="")
    for nw, bin_c in ((16, 512), (16, 256), (16, 1024), (8, 512), (8, 256)):
        launch, kept = _round1(x, pos, nw, bin_c)
        us = time_graph_us(launch, calls_per_graph=20)
        results.add(kernel="round 1 (keep: the whole round)", num_warps=nw, bin_c=bin_c, us=round(us, 1),
                    exact=_superset_kept(x, kept, TOPK + 4 * bin_c))
    launch, kept = _round1(x, pos, 16, 512)
    launch()
    for nw in (4, 8, 16):
        run = _last_round(x, pos, kept, out, nw)
        us = time_graph_us(run, calls_per_graph=20)
        results.add(kernel=f"last round ({kept.shape[2]} candidates)", num_warps=nw, bin_c="default", us=round(us, 1),
                    exact=torch.equal(_sorted(out), want))
    us = time_graph_us(lambda: topk.topk_from_logits(x, pos, TOPK, out=out), calls_per_graph=20)
    results.add(kernel="topk_from_logits (both rounds)", num_warps="default", bin_c="default", us=round(us, 1),
                exact=torch.equal(_sorted(out), want))
    _after_other_work(results, x, pos, out)
    print(results.markdown())
    print("saved", results.save("topk_round_phases"))


def _after_other_work(results, x, pos, out):
    """Round 1 at two widths and the last round at three, each the only top-k kernel of a replay (profiler-timed)
    after nothing or after 512 MB of unrelated reads (as after the logits kernel in a model)."""
    big = torch.zeros(2**29, dtype=torch.uint8, device="cuda")
    preludes = {"nothing": lambda: None, "512 MB read": lambda: big.max()}

    def last_kernel_us(pre, launch):  # the last kernel of the replay: the one under test
        kern, _ = kernel_times(capture_graph(lambda: (pre(), launch())))
        return round(kern[max(kern)], 1)

    for nw in (8, 16):
        launch, _ = _round1(x, pos, nw, 512)
        for pre_name, pre in preludes.items():
            results.add(kernel=f"round 1, after {pre_name}", num_warps=nw, bin_c=512, us=last_kernel_us(pre, launch),
                        exact="")
    launch, kept = _round1(x, pos, 16, 512)
    launch()
    for nw in (4, 8, 16):
        run = _last_round(x, pos, kept, out, nw)
        for pre_name, pre in preludes.items():
            results.add(kernel=f"last round, after {pre_name}", num_warps=nw, bin_c="default",
                        us=last_kernel_us(pre, run), exact="")


if __name__ == "__main__":
    main()
