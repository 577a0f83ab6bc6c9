"""How long one segment's first top-k round takes when streamed from L2 (H200), the building block the indexer's
logits kernel runs in the program that finishes a segment last.

``select_segment_streamed`` selects the top-2048 of a 16384-entry segment of a float32 row that sits in L2,
narrowing the bin in passes over the segment (TILE entries per load round) and resolving the bin in registers.
Here it runs alone, one program per segment (64 rows x 2 segments = 128 programs, one per SM), so the time is
one selection's latency; the register kernel's first round (``topk_from_logits``' segment kernel, 16 warps,
the segment in registers) is timed beside it. Every variant is checked: each segment's kept entries are
exactly its top-2048 values. Also prints the registers and spills of every compiled logits kernel (with and
without the fused round). Saves bench/results/topk_streamed_select.*.

    python bench/topk_streamed_select.py
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.harness import Results, time_graph_us  # noqa: E402
from bench.kernels_attention import HI, _paged  # noqa: E402
from fxglm5.lowering.triton import indexer, topk  # noqa: E402
from fxglm5.lowering.triton.topk import select_segment_streamed  # noqa: E402

B, L, SEG, TOPK = 64, 32768, 16384, 2048


@triton.jit
def _select_kernel(x_ptr, stride_xt, pos_ptr, kept_ptr, keys_ptr, stride_kt, bin_ptr, L, topk, SEG: tl.constexpr,
                   TILE: tl.constexpr, BIN_C: tl.constexpr):
    t = tl.program_id(0)
    g = tl.program_id(1)
    t64 = t.to(tl.int64)
    n_valid = tl.minimum(tl.load(pos_ptr + t) + 1, L)
    slot = t64 * stride_kt + g * topk
    select_segment_streamed(x_ptr + t64 * stride_xt, g * SEG, n_valid, topk, kept_ptr + slot, keys_ptr + slot,
                            bin_ptr + (t64 * tl.num_programs(1) + g) * (8 * BIN_C), SEG, TILE, BIN_C)


def _exact(x, kept):
    for t in range(0, B, 7):
        for g in range(L // SEG):
            ids = kept[t, g * TOPK:(g + 1) * TOPK].long()
            want = x[t, g * SEG:(g + 1) * SEG].topk(TOPK).values.sort().values
            if not torch.equal(x[t, ids].sort().values, want):
                return False
    return True


def _exact_rows(scores, top, pos):
    return all(torch.equal(scores[t, top[t].long()].sort().values,
                           scores[t, :int(pos[t]) + 1].topk(TOPK).values.sort().values)
               for t in range(0, B, 7))


def _print_regs(fn, label):
    try:
        for dev_cache in fn.device_caches.values():
            for k in dev_cache[0].values():
                consts = {n: v for n, v in k.src.constants.items() if isinstance(n, str) and n.isupper()}
                print(label, "n_regs", k.n_regs, "n_spills", k.n_spills, consts)
    except Exception as e:  # noqa: BLE001 - a Triton without these attributes: skip the listing
        print(label, "registers unavailable:", type(e).__name__, e)


def main():
    torch.manual_seed(0)
    x = torch.randn(B, L, device="cuda")
    pos = torch.full((B,), L - 1, device="cuda", dtype=torch.int32)
    results = Results()
    for tile, nw in ((1024, 4), (2048, 4), (4096, 4), (1024, 8), (4096, 8)):
        bin_c = 256
        kept = torch.empty(2, B, 2 * TOPK, dtype=torch.int32, device="cuda")
        bins = torch.empty(B, 2, 8 * bin_c, dtype=torch.int32, device="cuda")

        def run():
            _select_kernel[(B, L // SEG)](x, x.stride(0), pos, kept[0], kept[1], kept.stride(1), bins, L, TOPK,
                                          SEG=SEG, TILE=tile, BIN_C=bin_c, num_warps=nw)

        us = time_graph_us(run, calls_per_graph=10)
        results.add(kernel="streamed first round", tile=tile, num_warps=nw, us=round(us, 1), exact=_exact(x, kept[0]))
    _print_regs(_select_kernel, "select")
    kept = torch.empty(2, B, 2 * TOPK, dtype=torch.int32, device="cuda")
    us = time_graph_us(lambda: topk._launch_segments(x, None, pos, kept[0], kept[1], L, TOPK, SEG, None, False),
                       calls_per_graph=10)
    results.add(kernel="register first round (segment kernel)", tile="", num_warps=16, us=round(us, 1),
                exact=_exact(x, kept[0]))
    # the composed call with the round inside the logits kernel, per streaming tile; the logits kernel's registers
    kc, bt = _paged(B, L, 132, torch.uint8)
    q = torch.randn(B, HI, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(B, HI, device="cuda")
    req = torch.arange(B, device="cuda", dtype=torch.int32)
    logits = torch.empty(B, L, device="cuda")
    top = torch.empty(B, TOPK, device="cuda", dtype=torch.int32)
    init = indexer._FirstRound.__init__
    for tile in (1024, 2048, 4096):
        def with_tile(self, *a, _tile=tile, **k):
            init(self, *a, **k)
            self.tile = _tile
        indexer._FirstRound.__init__ = with_tile
        us = time_graph_us(lambda: indexer.indexer_topk_paged(q, w, kc, bt, req, pos, TOPK, validate=False,
                                                              logits_buf=logits, out=top), calls_per_graph=4)
        results.add(kernel="composed indexer_topk_paged (round 1 in the logits kernel)", tile=tile, num_warps="",
                    us=round(us, 1), exact=_exact_rows(logits, top, pos))
    indexer._FirstRound.__init__ = init
    us = time_graph_us(lambda: (indexer.indexer_logits_paged(q, w, kc, bt, req, pos, out=logits, validate=False),
                                topk.topk_from_logits(logits, pos, TOPK, out=top)), calls_per_graph=4)
    results.add(kernel="composed: logits, then topk_from_logits", tile="", num_warps="", us=round(us, 1),
                exact=_exact_rows(logits, top, pos))
    _print_regs(indexer._indexer_logits_kernel, "logits")
    print("saved", results.save("topk_streamed_select"))


if __name__ == "__main__":
    main()
