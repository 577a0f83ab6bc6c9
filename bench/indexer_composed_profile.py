"""Where the composed indexer call (logits + top-k) loses time against its parts timed alone (H200).

The attention table times ``indexer_topk_paged`` (logits, then the top-k rounds) and each part on its own,
each as a CUDA-graph replay; the composed call has measured more than the sum of its parts in every run so
far. This script captures the three graphs (logits alone, top-k alone, composed) at B=64 / 32k / top-2048,
replays each under ``torch.profiler`` and lists every kernel's device time per replay, plus the replay's span
(first kernel start to last kernel end) and the event-timed replay. Comparing the same kernel across graphs
shows which one slows down when composed, and the span minus the summed kernels shows the gaps between
kernels. Two more graphs run the top-k after 512 MB of unrelated reads or writes, to tell an L2 effect from
an interaction with the logits kernel, and two read the 8 MB of scores once more right before the top-k (after
the 512 MB read, and after the logits kernel), to tell whether it is the scores that left L2. Saves
bench/results/indexer_composed_profile.*.

    python bench/indexer_composed_profile.py
"""

from __future__ import annotations

import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.harness import Results, capture_graph, events_us, kernel_times  # noqa: E402
from bench.kernels_attention import TOPK, indexer_inputs  # noqa: E402
from fxglm5.lowering.triton import indexer  # noqa: E402

B, CTX, REPLAYS = 64, 32768, 20


def main():
    kc, bt, q, w, pos, req, logits, top = indexer_inputs(B, CTX)
    big = torch.zeros(2**29, dtype=torch.uint8, device="cuda")  # 512 MB: several times L2

    def topk():
        indexer.topk_from_logits(logits, pos, TOPK, out=top, validate=False)

    graphs = {
        "logits": capture_graph(lambda: indexer.indexer_logits_paged(q, w, kc, bt, req, pos, out=logits,
                                                                     validate=False)),
        "topk": capture_graph(topk),
        "composed": capture_graph(lambda: indexer.indexer_topk_paged(q, w, kc, bt, req, pos, TOPK, validate=False,
                                                                     logits_buf=logits, out=top)),
        # the top-k after 512 MB of other traffic, without the logits kernel: is the composed slowdown L2?
        "512 MB read, then topk": capture_graph(lambda: (big.max(), topk())),
        "512 MB write, then topk": capture_graph(lambda: (big.zero_(), topk())),
        # the same two with the scores read once more just before the top-k (back in L2): data or not?
        "512 MB read, scores re-read, then topk": capture_graph(lambda: (big.max(), logits.sum(), topk())),
        "logits, scores re-read, then topk": capture_graph(
            lambda: (indexer.indexer_logits_paged(q, w, kc, bt, req, pos, out=logits, validate=False), logits.sum(),
                     topk())),
    }
    results = Results()
    for name, graph in graphs.items():
        replay_us = statistics.median(events_us(graph.replay, REPLAYS))
        kern, span = kernel_times(graph, REPLAYS)
        for (i, kname), us in sorted(kern.items()):
            results.add(graph=name, item=f"kernel {i}: {kname}", us=round(us, 1))
        results.add(graph=name, item="sum of kernels", us=round(sum(kern.values()), 1))
        results.add(graph=name, item="span (first start to last end)", us=round(span, 1))
        results.add(graph=name, item="replay (events)", us=round(replay_us, 1))
    print(results.markdown())
    print("saved", results.save("indexer_composed_profile"))


if __name__ == "__main__":
    main()
