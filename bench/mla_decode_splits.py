"""MLA decode at small batches against the split count (H200): what the split picker should choose.

At batch 1 a split-KV decode has one program per split; the picker used to stop at 64 splits, which leaves half
of the 132 SMs idle. For each cache dtype and (batch, context) this times the decode (CUDA-graph replays over
requests whose caches are far larger than L2, as in ``bench/kernels_attention.py``) at the picker's split count,
at the count the old 64-split cap gives, and at 32 / 64 / 128 / 256 splits, with the copy bandwidth measured in
the same run. Saves bench/results/mla_decode_splits.*.

    python bench/mla_decode_splits.py
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import kernels_attention as ka  # noqa: E402
from bench.harness import Results, copy_bandwidth_gbs, time_graph_us  # noqa: E402
from fxglm5.lowering.triton import mla  # noqa: E402
from fxglm5.lowering.triton.device import num_sms  # noqa: E402

SHAPES = [(1, 8192), (1, 32768), (1, 131072), (2, 32768), (4, 32768), (8, 32768)]


def main():
    results = Results(copy_bandwidth_gbs())
    sms = num_sms(torch.device("cuda"))
    for cdt in (torch.bfloat16, torch.uint8):
        width = 656 if cdt == torch.uint8 else 576
        name = f"mla_decode[{'fp8' if cdt == torch.uint8 else 'bf16'}]"
        for B, ctx in SHAPES:
            cache, bt = ka._paged(max(B, 32), ctx, width, cdt)
            nreq = bt.shape[0]
            q = torch.randn(B, ka.H, ka.D, device="cuda", dtype=torch.bfloat16)
            pos = torch.full((B,), ctx - 1, device="cuda", dtype=torch.int32)
            out = torch.empty(B, ka.H, ka.R, device="cuda", dtype=torch.bfloat16)
            reqs, next_reqs = ka._request_batches(B, nreq, nreq // B)
            picked = mla.pick_num_splits(B, ctx, sms)
            old = mla.pick_num_splits(B, ctx, sms, max_splits=64)
            counts = sorted({picked, old} | {s for s in (32, 64, 128, 256) if s <= ctx // 64})
            for ns in counts:
                us = time_graph_us(lambda: mla.mla_decode_paged(q, cache, bt, next_reqs(), pos, ka.SCALE,
                                                                validate=False, out=out, num_splits=ns),
                                   calls_per_graph=nreq // B)
                note = " ".join(w for w, s in (("picked", picked), ("old-cap-64", old)) if s == ns)
                ka._row(results, name, f"B={B} ctx={ctx} splits={ns}", us,
                        bytes_=B * ctx * width * cache.element_size(), note=note)
    print(results.markdown())
    print("saved", results.save("mla_decode_splits"))


if __name__ == "__main__":
    main()
