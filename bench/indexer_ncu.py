"""The indexer's kernels at B=64 / 32k / top-2048, launched for Nsight Compute (hardware counters, H200).

Graph-replay timing says how long each kernel takes, not what limits it. This script launches the logits
kernel (the tuned B=64 launch: 2048-key TMA programs), the two top-k rounds, and the paged read ceiling
(``bench/read_stream.py``: the logits kernel's blocks and boxes with no MMA) once each after a warm-up, for::

    ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
        --section Occupancy --section SchedulerStats --section LaunchStats --section SourceCounters \
        --print-details all -k regex:"paged_read|indexer_logits|segment_topk" --launch-skip 4 --launch-count 4 \
        python bench/indexer_ncu.py

(the kernel filter matters: the set-up launches torch kernels of its own; the warm-up is the first four matching
launches). The report is kept in ``bench/results/indexer_s7/ncu_details.txt``.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.kernels_attention import TOPK, indexer_inputs  # noqa: E402
from bench.read_stream import paged_read  # noqa: E402
from fxglm5.lowering.triton import indexer  # noqa: E402

B, CTX = 64, 32768
LOGITS_CFG = dict(BLOCK_N=64, TILES=32, USE_TMA=True, num_warps=4, num_stages=4)


def main():
    kc, bt, q, w, pos, req, logits, top = indexer_inputs(B, CTX)
    for _ in range(2):  # launch 1-4 warm up, 5-8 are profiled (ncu --launch-skip 4)
        paged_read(kc, bt)
        indexer.indexer_logits_paged(q, w, kc, bt, req, pos, out=logits, validate=False, cfg=LOGITS_CFG)
        indexer.topk_from_logits(logits, pos, TOPK, out=top, validate=False)  # round 1, round 2
    torch.cuda.synchronize()
    print("done: paged_read, logits", LOGITS_CFG, "top-k round 1, round 2")


if __name__ == "__main__":
    main()
