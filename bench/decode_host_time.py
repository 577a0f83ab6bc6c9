"""Host time of one decode step outside the model: what a replayed CUDA graph leaves on the critical path.

The runner's work around the forward (the block manager, building and validating the forward context, loading
the static buffers, reading the next tokens back) is timed with the decode graphs' forward replaced by a stub
that returns zero logits, for B requests of ``ctx`` cached tokens. No GPU and no model weights are needed: the
runner holds a small model whose graph is never called.

    python bench/decode_host_time.py [B] [ctx]     # saves bench/results/decode_host_time.json (or $OUT)
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness  # noqa: E402
from bench.harness import save_run  # noqa: E402
from fxglm5.model.config import Glm5Config  # noqa: E402
from fxglm5.model.modeling import Glm5ForCausalLM  # noqa: E402
from fxglm5.runtime.runner import Runner, Sequence  # noqa: E402


def main():
    harness.answer_help(__doc__)
    args = [int(a) for a in sys.argv[1:3]]
    B, ctx = args if len(args) == 2 else (64, 2048)
    cfg = Glm5Config.preset("tiny").replace(num_hidden_layers=1, mlp_layer_types=None, indexer_types=None,
                                            first_k_dense_replace=1, max_position_embeddings=202752)
    runner = Runner(Glm5ForCausalLM(cfg).eval(), block_size=64, max_cache_tokens=B * (ctx + 128),
                    decode_graphs=True, max_decode_batch=max(64, B))
    runner.decode_graphs._forward = lambda bucket, width: torch.zeros(1, bucket, 8)  # the replay, stubbed
    for i in range(B):
        seq = Sequence(i, list(range(i, i + ctx)))
        runner.blocks.allocate(seq.id, seq.prompt)
        seq.cached = ctx
        seq.output.append(1)
        runner.active.append(seq)
    runner.decode()
    steps = []
    for _ in range(50):
        t0 = time.perf_counter()
        runner.decode()
        steps.append((time.perf_counter() - t0) * 1e3)
    save_run("decode_host_time.json", B=B, ctx=ctx,
             host_ms_per_step_median=round(statistics.median(steps), 3), host_ms_per_step_min=round(min(steps), 3))

if __name__ == "__main__":
    main()
