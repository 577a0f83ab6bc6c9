"""How much FP8 accumulation precision the indexer logits give up, per ``PROMOTE`` (H200).

Hopper's FP8 MMAs accumulate in reduced precision; Triton's ``max_num_imprecise_acc=PROMOTE`` adds the partial
sums into fp32 every PROMOTE products (each extra promotion also waits for the MMA). For each setting: the
logits' max error relative to the largest |logit| against the float reference
(``fxglm5.lowering.reference.paged.indexer_logits_paged``), and the smallest overlap, over the batch, between the
kernel's top-2048 and the reference's top-2048. Saves bench/results/indexer_precision.*.

    python bench/indexer_precision.py
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness  # noqa: E402
from bench.harness import Results, time_graph_us  # noqa: E402
from fxglm5.lowering.reference import paged as ref  # noqa: E402
from fxglm5.lowering.triton import indexer  # noqa: E402

B, CTX, HI, BS, TOPK = 8, 8192, 32, 64, 2048


def main():
    harness.answer_help(__doc__)
    torch.manual_seed(0)
    nblk = CTX // BS
    kc = torch.zeros(B * nblk + 1, BS, 132, dtype=torch.uint8, device="cuda")
    bt = (torch.arange(B * nblk, device="cuda") + 1).view(B, nblk).int()
    pos = torch.arange(CTX, device="cuda")
    for b in range(B):
        slots = ref.slots_from_positions(bt, torch.full_like(pos, b), pos, BS)
        ref.write_indexer_cache(kc, torch.randn(CTX, 128, device="cuda"), slots)
    q = torch.randn(B, HI, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(B, HI, device="cuda") * HI**-0.5 * 128**-0.5
    req = torch.arange(B, device="cuda", dtype=torch.int32)
    last = torch.full((B,), CTX - 1, device="cuda", dtype=torch.int32)
    lr = ref.indexer_logits_paged(q, w, kc, bt, req, last, max_len=CTX)
    best = [set(lr[t].topk(TOPK).indices.tolist()) for t in range(B)]
    results = Results()
    for promote in (32, 64, 128):
        cfg = dict(BLOCK_N=128, TILES=4, PROMOTE=promote, num_warps=4, num_stages=1)
        lt = indexer.indexer_logits_paged(q, w, kc, bt, req, last, cfg=cfg)
        err = ((lt - lr).abs().max() / lr.abs().max()).item()
        overlap = min(len(best[t] & set(lt[t].topk(TOPK).indices.tolist())) / TOPK for t in range(B))
        us = time_graph_us(lambda: indexer.indexer_logits_paged(q, w, kc, bt, req, last, cfg=cfg, out=lt,
                                                                   validate=False))
        results.add(PROMOTE=promote, shape=f"B={B} HI={HI} ctx={CTX}", max_rel_err=f"{err:.2e}",
                    min_top2048_overlap=round(overlap, 4), us=round(us, 2))
    print("saved", results.save("indexer_precision"))


if __name__ == "__main__":
    main()
