"""Host time the RTP-LLM plugin adds to one CUDA-graph decode step: ``prepare_cuda_graph`` (RTP calls it
outside the graph before every replay: it validates the live rows from RTP's host fields and refills the
plugin's static position / slot buffers).

B live requests of ``ctx`` cached tokens in a bucket of B, with RTP's static block table (width
ceil(max_seq_len / block) = 3168 blocks for GLM-5's 202752 positions) and, for comparison in the same run,
a table only as wide as the requests need. CPU only: RTP's bare-named fields are host tensors.

    python bench/rtpllm_host_time.py [B] [ctx]     # saves bench/results/rtpllm_host_time.json (or $OUT)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.harness import save_run  # noqa: E402
from fxglm5.rtpllm.context import CacheLayout, StepMetadata  # noqa: E402
from fxglm5.runtime.cache import kernel_block_table  # noqa: E402

BLOCK, MAX_POS = 64, 202752


def static_inputs(B: int, ctx: int, width: int) -> SimpleNamespace:
    """RTP's static decode inputs after it copied B live rows in (the fields prepare_cuda_graph reads)."""
    table = torch.zeros(B, width, dtype=torch.int32)
    per = -(-(ctx + 1) // BLOCK)
    table[:, :per] = 1 + torch.arange(B * per, dtype=torch.int32).view(B, per)
    seq = torch.full((B,), ctx, dtype=torch.int32)
    return SimpleNamespace(is_prefill=False, input_lengths=seq.clone(), prefix_lengths=torch.zeros(0, dtype=torch.int32),
                           sequence_lengths=seq, kv_cache_block_id=table, kv_cache_kernel_block_id=kernel_block_table(table, 1),
                           kv_cache_kernel_block_id_device=kernel_block_table(table, 1))


def time_prepare(B: int, ctx: int, width: int, n: int = 50) -> dict:
    attn = static_inputs(B, ctx, width)
    layout = CacheLayout(BLOCK, BLOCK, B * (-(-(ctx + 1) // BLOCK)) + 1, MAX_POS)
    meta = StepMetadata(attn, layout, "cpu", static=True)
    steps = []
    for _ in range(n):
        t0 = time.perf_counter()
        meta.prepare_cuda_graph(attn)
        steps.append((time.perf_counter() - t0) * 1e3)
    return dict(table_width=width, ms_median=round(statistics.median(steps), 3), ms_min=round(min(steps), 3))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("B", type=int, nargs="?", default=64, help="live requests in a bucket of B (default 64)")
    ap.add_argument("ctx", type=int, nargs="?", default=2048, help="cached tokens per request (default 2048)")
    args = ap.parse_args()
    B, ctx = args.B, args.ctx
    rows = [time_prepare(B, ctx, -(-MAX_POS // BLOCK)), time_prepare(B, ctx, -(-(ctx + 1) // BLOCK))]
    save_run("rtpllm_host_time.json", B=B, ctx=ctx, torch_threads=torch.get_num_threads(),
             prepare_cuda_graph=rows)

if __name__ == "__main__":
    main()
