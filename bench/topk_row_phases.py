"""Where the top-k's time goes (H200, 64 rows x 32768 logits, top-2048), and what the tournament buys.

``fxglm5/lowering/triton/topk.py``'s segment kernel loads a segment into registers as order-preserving keys,
searches the k-th largest key two bits at a time (CTA-wide reductions) and places the selection with one
packed prefix sum per chunk. The cut kernel here searches over every key with no bin (since session 5 the package
kernel stops once the bin is small and finishes over the bin's keys: bench/topk_round_phases.py); since session 7
that search, like the package's, also stops once exactly k keys are at or above the bin (the committed results
predate that).
With one segment per row (``chunk=32768``, the row kernel of earlier sessions) this script times the kernel cut
after each phase (each cut writes something that depends on the work before it, so nothing is dead code). Then
the package's top-k per segment length: 32768 is one round of 64 CTAs; 16384 (the default) is a round of 128
CTAs that keeps up to 2 x 4096 candidates per row (session 7; 2 x 2048 in the committed results), then a round of
64 CTAs over those; 8192 and 4096 cut finer. Every
package row is checked exact against ``torch.topk``. Saves bench/results/topk_row_phases.*.

    python bench/topk_row_phases.py
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.harness import Results, time_graph_us  # noqa: E402
from fxglm5.lowering.triton import indexer  # noqa: E402
from fxglm5.lowering.triton.topk import _narrow, _place, _segment_chunks  # noqa: E402

B, L, TOPK = 64, 32768, 2048


@triton.jit
def _row_topk_cut(x_ptr, stride_xt, pos_ptr, o_ptr, stride_ot, L, topk, C: tl.constexpr, PHASE: tl.constexpr):
    """One segment per row. PHASE 0: load only; 1: load + threshold search; 2: + placement (the package kernel
    minus the -1 fill)."""
    t = tl.program_id(0)
    t64 = t.to(tl.int64)
    n_valid = tl.minimum(tl.load(pos_ptr + t).to(tl.int32) + 1, L)
    k_eff = tl.minimum(topk, n_valid)
    row = x_ptr + t64 * stride_xt
    k0, i0, k1, i1, k2, i2, k3, i3 = _segment_chunks(row, row, row, 0, L, n_valid, False, C)
    orow = o_ptr + t64 * stride_ot
    if PHASE == 0:
        tl.store(orow, tl.max(tl.maximum(tl.maximum(k0, k1), tl.maximum(k2, k3)), 0).to(tl.int32, bitcast=True))
    else:
        zero = tl.zeros([], tl.int32)
        # cap 0: the search over every key with no bin (sessions 2-4: all 16 steps; now it also stops once
        # exactly k_eff keys are >= thr, and the placement below then writes all of them)
        thr, n_lo, n_gt, step = _narrow(k0, k1, k2, k3, k_eff, tl.zeros([], tl.uint32), zero + 4 * C, zero, zero, 0)
        if PHASE == 1:
            tl.store(orow, thr.to(tl.int32, bitcast=True))
        else:
            quota = k_eff - n_gt
            base, eqb = _place(k0, i0, thr, 0, 0, quota, orow, orow, False)
            base, eqb = _place(k1, i1, thr, base, eqb, quota, orow, orow, False)
            base, eqb = _place(k2, i2, thr, base, eqb, quota, orow, orow, False)
            base, eqb = _place(k3, i3, thr, base, eqb, quota, orow, orow, False)


def main():
    torch.manual_seed(0)
    logits = torch.randn(B, L, device="cuda")
    pos = torch.full((B,), L - 1, device="cuda", dtype=torch.int32)
    out = torch.empty(B, TOPK, device="cuda", dtype=torch.int32)
    results = Results()
    ref = torch.sort(torch.topk(logits, TOPK, 1).indices.int(), 1).values
    for phase, name in ((0, "load"), (1, "load+search"), (2, "load+search+place")):
        us = time_graph_us(lambda: _row_topk_cut[(B,)](logits, logits.stride(0), pos, out, out.stride(0), L, TOPK,
                                                      C=L // 4, PHASE=phase, num_warps=16))
        results.add(kernel=f"one segment per row, cut: {name}", num_warps=16, us=round(us, 1))
    for chunk, nw in ((32768, 16), (16384, None), (8192, None), (8192, 4), (4096, None)):
        us = time_graph_us(lambda: indexer.topk_from_logits(logits, pos, TOPK, out=out, chunk=chunk, num_warps=nw))
        results.add(kernel=f"package segments chunk={chunk}", num_warps=nw or "default", us=round(us, 1),
                    exact=torch.equal(torch.sort(out, 1).values, ref))
    us = time_graph_us(lambda: indexer.topk_from_logits(logits, pos, TOPK, out=out, method="multi"))
    results.add(kernel="package multi (global radix)", num_warps="default", us=round(us, 1),
                exact=torch.equal(torch.sort(out, 1).values, ref))
    us = time_graph_us(lambda: torch.topk(logits, TOPK, 1))
    results.add(kernel="torch.topk", num_warps="", us=round(us, 1))
    print("saved", results.save("topk_row_phases"))


if __name__ == "__main__":
    main()
