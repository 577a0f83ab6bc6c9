"""Where the row top-k's time goes (H200, 64 rows x 32768 logits, top-2048).

``fxglm5/lowering/triton/indexer.py``'s row kernel does three things per row: load the row into registers as
order-preserving keys, search the k-th largest key two bits at a time (16 CTA-wide reductions), and place the
selection with one packed prefix sum per chunk. This script times the same kernel cut after each phase (each
cut writes something that depends on the work before it, so nothing is dead code), next to the full kernel
from the package, so the next optimization goes where the time is. Saves bench/results/topk_row_phases.*.

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
from fxglm5.lowering.triton.indexer import _add3, _count_ge, _row_keys, _row_place  # noqa: E402

B, L, TOPK = 64, 32768, 2048


@triton.jit
def _row_topk_cut(x_ptr, stride_xt, pos_ptr, o_ptr, stride_ot, L, topk, C: tl.constexpr, PHASE: tl.constexpr):
    """PHASE 0: load only; 1: load + threshold search; 2: + placement (the package kernel minus the -1 fill)."""
    t = tl.program_id(0)
    t64 = t.to(tl.int64)
    n_valid = tl.minimum(tl.load(pos_ptr + t).to(tl.int32) + 1, L)
    k_eff = tl.minimum(topk, n_valid)
    row = x_ptr + t64 * stride_xt
    k0 = _row_keys(row, 0, n_valid, C)
    k1 = _row_keys(row, C, n_valid, C)
    k2 = _row_keys(row, 2 * C, n_valid, C)
    k3 = _row_keys(row, 3 * C, n_valid, C)
    orow = o_ptr + t64 * stride_ot
    if PHASE == 0:
        tl.store(orow, tl.max(tl.maximum(tl.maximum(k0, k1), tl.maximum(k2, k3)), 0).to(tl.int32, bitcast=True))
    else:
        thr = tl.zeros([], tl.uint32)
        for step in tl.static_range(16):
            c1 = thr | tl.full([], 1 << (30 - 2 * step), tl.uint32)
            c2 = thr | tl.full([], 2 << (30 - 2 * step), tl.uint32)
            c3 = thr | tl.full([], 3 << (30 - 2 * step), tl.uint32)
            n1, n2, n3 = tl.reduce((_count_ge(k0, k1, k2, k3, c1), _count_ge(k0, k1, k2, k3, c2),
                                    _count_ge(k0, k1, k2, k3, c3)), 0, _add3)
            thr = tl.where(n3 >= k_eff, c3, tl.where(n2 >= k_eff, c2, tl.where(n1 >= k_eff, c1, thr)))
        if PHASE == 1:
            tl.store(orow, thr.to(tl.int32, bitcast=True))
        else:
            n_gt = tl.sum((k0 > thr).to(tl.int32) + (k1 > thr).to(tl.int32) + (k2 > thr).to(tl.int32)
                          + (k3 > thr).to(tl.int32), 0)
            quota = k_eff - n_gt
            base, eqb = _row_place(k0, thr, 0, 0, 0, quota, orow, C)
            base, eqb = _row_place(k1, thr, C, base, eqb, quota, orow, C)
            base, eqb = _row_place(k2, thr, 2 * C, base, eqb, quota, orow, C)
            base, eqb = _row_place(k3, thr, 3 * C, base, eqb, quota, orow, C)


def main():
    torch.manual_seed(0)
    logits = torch.randn(B, L, device="cuda")
    pos = torch.full((B,), L - 1, device="cuda", dtype=torch.int32)
    out = torch.empty(B, TOPK, device="cuda", dtype=torch.int32)
    results = Results()
    for nw in (8, 16):
        for phase, name in ((0, "load"), (1, "load+search"), (2, "load+search+place")):
            us = time_graph_us(lambda: _row_topk_cut[(B,)](logits, logits.stride(0), pos, out, out.stride(0), L, TOPK,
                                                          C=L // 4, PHASE=phase, num_warps=nw))
            results.add(kernel=f"cut: {name}", num_warps=nw, us=round(us, 1))
        us = time_graph_us(lambda: indexer.topk_from_logits(logits, pos, TOPK, out=out, method="row", num_warps=nw))
        exact = torch.equal(torch.sort(out, 1).values, torch.sort(torch.topk(logits, TOPK, 1).indices.int(), 1).values)
        results.add(kernel="package row kernel", num_warps=nw, us=round(us, 1), exact=exact)
    print("saved", results.save("topk_row_phases"))


if __name__ == "__main__":
    main()
