"""Where one tournament round of the top-k spends its time (H200, 64 rows x 32768 scores, top-2048), and which
launch width / bin size suits each round.

Round 1 cuts every row into two 16384-entry segments, one CTA each (128 CTAs). The segment kernel (``topk.py``)
loads its segment into registers (four chunks), narrows the bin holding the 2048-th key over every key until
the bin is small (the coarse steps), splits the keys above the bin to the output and the bin to scratch with
one prefix sum per chunk, resolves the remaining bits over the bin (the fine steps) and writes the bin's
selection. A copy of the kernel cut after each phase (each cut stores something that depends on the work before
it) gives the phase costs; then the package kernel at other widths and bin sizes, and round 2 (64 CTAs over 4096
candidates) at three widths. Inputs stay in L2 between the 20 calls captured per graph, as the scores do right
after the logits kernel. Every package variant is checked exact. A second table times each cut, and the package
kernel at four widths, as the only top-k kernel after other work (nothing, a sleep kernel, 512 MB of reads), as
it runs in a model after the logits kernel. Saves bench/results/topk_round_phases.*.

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
from fxglm5.lowering.triton.topk import (_bin_chunk, _narrow, _segment_chunks, _select_in_bin,  # noqa: E402
                                         _split_bin)

B, L, TOPK, SEG = 64, 32768, 2048, 16384
C = SEG // 4  # a chunk: a segment is four
PHASES = ("load", "+coarse steps", "+split", "+fine steps", "+bin placement (whole round)")


@triton.jit
def _round_cut(x_ptr, stride_xt, pos_ptr, o_ptr, ko_ptr, stride_ot, bin_ptr, L, topk, C: tl.constexpr,
               BIN_C: tl.constexpr, PHASE: tl.constexpr):
    """The package segment kernel's round-1 path (a bin that gets small: no massive ties) cut after phase PHASE
    (see PHASES)."""
    t = tl.program_id(0)
    sg = tl.program_id(1)
    t64 = t.to(tl.int64)
    n_valid = tl.minimum(tl.load(pos_ptr + t).to(tl.int32) + 1, L)
    row = x_ptr + t64 * stride_xt
    k0, i0, k1, i1, k2, i2, k3, i3 = _segment_chunks(row, row, row, sg * (4 * C), L, n_valid, False, C)
    k_eff = tl.minimum(topk, tl.minimum(n_valid - sg * (4 * C), 4 * C))
    orow = o_ptr + t64 * stride_ot + sg * topk
    okrow = ko_ptr + t64 * stride_ot + sg * topk
    if PHASE == 0:
        tl.store(orow, tl.max(tl.maximum(tl.maximum(k0, k1), tl.maximum(k2, k3)), 0).to(tl.int32, bitcast=True))
    else:
        zero = tl.zeros([], tl.int32)
        thr, n_lo, n_hi, step = _narrow(k0, k1, k2, k3, k_eff, tl.zeros([], tl.uint32), zero + 4 * C, zero, zero,
                                        4 * BIN_C)
        if PHASE == 1:
            tl.store(orow, thr.to(tl.int32, bitcast=True) + step)
        else:
            top = thr | (tl.full([], 0xFFFFFFFF, tl.uint32) >> (2 * step).to(tl.uint32))
            brow = bin_ptr + (t64 * tl.num_programs(1) + sg) * (8 * BIN_C)
            q = k_eff - n_hi
            ab, bb = _split_bin(k0, i0, thr, top, zero, n_hi, q, 0, 0, orow, okrow, brow, True, 4 * BIN_C)
            ab, bb = _split_bin(k1, i1, thr, top, zero, n_hi, q, ab, bb, orow, okrow, brow, True, 4 * BIN_C)
            ab, bb = _split_bin(k2, i2, thr, top, zero, n_hi, q, ab, bb, orow, okrow, brow, True, 4 * BIN_C)
            ab, bb = _split_bin(k3, i3, thr, top, zero, n_hi, q, ab, bb, orow, okrow, brow, True, 4 * BIN_C)
            if PHASE == 2:
                tl.store(orow + 2047, ab + bb)
            elif PHASE == 3:
                tl.debug_barrier()
                b0, j0 = _bin_chunk(brow, 0, bb, BIN_C, 4 * BIN_C)
                b1, j1 = _bin_chunk(brow, 1, bb, BIN_C, 4 * BIN_C)
                b2, j2 = _bin_chunk(brow, 2, bb, BIN_C, 4 * BIN_C)
                b3, j3 = _bin_chunk(brow, 3, bb, BIN_C, 4 * BIN_C)
                thr, n_lo, n_gt, step = _narrow(b0, b1, b2, b3, k_eff - n_hi, thr, bb, zero, step, 0)
                tl.store(orow + 2047, thr.to(tl.int32, bitcast=True) + n_gt)
            else:
                _select_in_bin(brow, bb, thr, step, k_eff, n_hi, orow, okrow, True, BIN_C)


def _exact_round1(x, kept):
    for t in range(0, B, 5):
        for g in range(L // SEG):
            ids = kept[t, g * TOPK:(g + 1) * TOPK].long()
            want = x[t, g * SEG:(g + 1) * SEG].topk(TOPK).values.sort().values
            if not torch.equal(x[t, ids].sort().values, want):
                return False
    return True


def _cut_bins():
    """The bin scratch of the round-1 cuts (16 warps, 2048-key bin)."""
    return torch.empty(B, 2, 8 * 512, dtype=torch.int32, device="cuda")


def _cut_launcher(x, pos, kept, bins, phase):
    """A launch of the round-1 cut after phase ``phase`` into ``bins`` (``_cut_bins``)."""
    return lambda: _round_cut[(B, L // SEG)](x, x.stride(0), pos, kept[0], kept[1], kept.stride(1), bins, L, TOPK,
                                             C=C, BIN_C=512, PHASE=phase, num_warps=16)


def _round1_launcher(x, pos, kept, nw, bin_c):
    """A launch of the package round-1 kernel at ``nw`` warps and 4*bin_c bin keys, with its own bin scratch;
    it writes the kept indices to ``kept[0]`` and their keys to ``kept[1]``."""
    bins = torch.empty(B, 2, 8 * bin_c, dtype=torch.int32, device="cuda")
    return lambda: topk._segment_topk_kernel[(B, L // SEG)](x, x.stride(0), kept[0], kept[1], kept.stride(1), pos,
                                                            kept[0], kept[1], kept.stride(1), bins, L, L, TOPK, C=C,
                                                            GATHER=False, KEYS_OUT=True, BIN_C=bin_c, num_warps=nw)


def _after_other_work(results, x, pos, kept):
    """Each cut, and the package kernel at four widths, as the only top-k kernel of a replay after other work,
    timed by the profiler. After 512 MB of unrelated reads the 8-warp round runs ~12 us slower, as it does after
    the logits kernel (bench/results/indexer_composed_profile.md): which phase, and why? The preludes test the
    causes: a sleep kernel (any kernel before: clocks, launch state); the load cut run after the reads (the same
    grid reads the same segments again: where the scores sit); the output and bin buffers zeroed after the
    reads (the lines the kernel writes)."""
    big = torch.zeros(2**29, dtype=torch.uint8, device="cuda")
    bins = _cut_bins()
    load_cut = _cut_launcher(x, pos, kept, bins, 0)
    preludes = {"nothing": lambda: None,
                "a 250 us sleep kernel (no memory traffic)": lambda: torch.cuda._sleep(500_000),
                "512 MB read": lambda: big.max(),
                "512 MB read, load cut": lambda: (big.max(), load_cut()),
                "512 MB read, outputs zeroed": lambda: (big.max(), kept.zero_(), bins.zero_())}

    def last_kernel_us(pre, launch):  # the last kernel of the replay: the one under test
        kern, _ = kernel_times(capture_graph(lambda: (pre(), launch())))
        return round(kern[max(kern)], 1)

    for phase, name in enumerate(PHASES):
        cut = _cut_launcher(x, pos, kept, bins, phase)
        for pre_name, pre in preludes.items():
            results.add(kernel=f"round 1 cut: {name}, after {pre_name}", num_warps=16, bin_c=512,
                        us=last_kernel_us(pre, cut), exact="")
    for nw, bin_c in ((8, 256), (16, 256), (16, 512), (4, 128)):
        run = _round1_launcher(x, pos, kept, nw, bin_c)
        for pre_name in ("nothing", "512 MB read", "512 MB read, load cut"):
            results.add(kernel=f"round 1 package kernel, after {pre_name}", num_warps=nw, bin_c=bin_c,
                        us=last_kernel_us(preludes[pre_name], run), exact="")


def main():
    torch.manual_seed(0)
    x = torch.randn(B, L, device="cuda")
    pos = torch.full((B,), L - 1, device="cuda", dtype=torch.int32)
    kept = torch.empty(2, B, 2 * TOPK, dtype=torch.int32, device="cuda")
    results = Results()
    bins = _cut_bins()
    for phase, name in enumerate(PHASES):
        us = time_graph_us(_cut_launcher(x, pos, kept, bins, phase), calls_per_graph=20)
        results.add(kernel=f"round 1 cut: {name}", num_warps=16, bin_c=512, us=round(us, 1), exact="")
    _after_other_work(results, x, pos, kept)
    for nw, bin_c in ((16, 512), (16, 256), (16, 1024), (8, 256), (8, 512), (32, 512), (32, 1024)):
        us = time_graph_us(_round1_launcher(x, pos, kept, nw, bin_c), calls_per_graph=20)
        results.add(kernel="round 1 package kernel", num_warps=nw, bin_c=bin_c, us=round(us, 1),
                    exact=_exact_round1(x, kept[0]))
    topk._launch_segments(x, None, pos, kept[0], kept[1], L, TOPK, SEG, None, False)
    want = torch.sort(torch.topk(x, TOPK, 1).indices.int(), 1).values
    out = torch.empty(B, TOPK, dtype=torch.int32, device="cuda")
    for nw in (4, 8, 16):
        us = time_graph_us(lambda: topk._launch_segments(x, (kept[0], kept[1]), pos, out, None, 2 * TOPK, TOPK,
                                                         2 * TOPK, nw, False), calls_per_graph=20)
        results.add(kernel="round 2 package kernel (4096 candidates)", num_warps=nw,
                    bin_c=min(32 * nw, 2 * TOPK // 16), us=round(us, 1),
                    exact=torch.equal(torch.sort(out, 1).values, want))
    us = time_graph_us(lambda: topk.topk_from_logits(x, pos, TOPK, out=out), calls_per_graph=20)
    results.add(kernel="topk_from_logits (both rounds)", num_warps="default", bin_c="default", us=round(us, 1),
                exact=torch.equal(torch.sort(out, 1).values, want))
    print("saved", results.save("topk_round_phases"))

if __name__ == "__main__":
    main()
