"""Host time of one decode step, and the step's wall time against its device time with CUDA graphs.

CPU (default): the runner's work around the forward (the block manager, building and validating the forward
context, loading the static buffers through the host staging buffers, reading the next tokens back) is timed with
the decode graphs' forward replaced by a stub that returns zero logits, for B requests of ``ctx`` cached tokens,
per step of the overlapped loop and of the step-by-step one.
No GPU and no model weights are needed: the runner holds a small model whose graph is never called.

``--cuda``: the 2-layer GLM-5-width FP8 model of bench/decode_step.py (bf16, 1 dense + 1 MoE layer, random
weights, FP8 caches) prefilled with B prompts of ``ctx`` tokens, then decode steps replayed from CUDA graphs. Per
step: the wall time and the device time of the step (CUDA events recorded on the stream around the decode
graphs' run: the input copies, the replay and the logits' copy). The goal: wall <= 1.05 x device.
Both loops of ``Runner.decode_steps`` are timed in one run, after ``Runner.warm_up`` captured their graphs: the
step-by-step one (each step's tokens read before the next is built) and the overlapped one (the default; the host
one step ahead): per loop, the wall time per step (the loop's time over its steps, synchronized at both ends),
the host's launch-to-launch period and the median device time per step.

    python bench/decode_host_time.py [B] [ctx]           # CPU; saves bench/results/decode_host_time.json (or $OUT)
    python bench/decode_host_time.py --cuda [B] [ctx]    # GPU; saves decode_host_time_cuda.json
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
from bench.serving import GLM5_SERVING  # noqa: E402
from fxglm5.model.config import Glm5Config  # noqa: E402
from fxglm5.model.modeling import Glm5ForCausalLM  # noqa: E402
from fxglm5.program import Outputs  # noqa: E402
from fxglm5.runtime.options import RunnerOptions  # noqa: E402
from fxglm5.runtime.runner import Sequence  # noqa: E402
from fxglm5.serve.build import build_runner  # noqa: E402


def host_only(B: int, ctx: int) -> None:
    cfg = Glm5Config.preset("tiny").replace(num_hidden_layers=1, mlp_layer_types=None, indexer_types=None,
                                            first_k_dense_replace=1, max_position_embeddings=202752)
    runner = build_runner(Glm5ForCausalLM(cfg).eval(), RunnerOptions(block_size=64, max_cache_tokens=B * (ctx + 128),
                                                                      decode_graphs=True, max_decode_batch=max(64, B)))
    logits = torch.zeros(max(64, B), 8)
    runner.decode_graphs._forward = lambda bucket, width, q=1: Outputs(logits[:bucket], None)  # the replay, stubbed
    for i in range(B):
        seq = Sequence(i, list(range(i, i + ctx)))
        runner.blocks.allocate(seq.id, seq.prompt)
        seq.cached, seq.decoding = ctx, True  # prefilled (as the engine marks it): the overlapped loop steps it
        seq.output.append(1)
        runner.active.append(seq)
    runner.decode()
    per_step = {}
    for overlap in (False, True):  # the step-by-step loop, then the overlapped one (the runner's default)
        runner.overlap, times = overlap, []
        for _ in range(5):
            done = len(runner.active[0].output)
            t0 = time.perf_counter()
            runner.decode_steps(done + 20)
            times.append((time.perf_counter() - t0) * 1e3 / 20)
        per_step[overlap] = times
    save_run("decode_host_time.json", B=B, ctx=ctx, load_average=os.getloadavg()[0],
             host_ms_per_step_median=round(statistics.median(per_step[True]), 3),
             host_ms_per_step_min=round(min(per_step[True]), 3),
             stepwise_host_ms_per_step_median=round(statistics.median(per_step[False]), 3))


def with_graphs(B: int, ctx: int, steps: int = 20) -> None:
    from bench.decode_step import random_model, two_layer_config

    model = random_model(two_layer_config(False), "cuda")
    runner = build_runner(model, GLM5_SERVING.replace(max_cache_tokens=B * (ctx + 64 + steps), device="cuda",
                                                      backend="triton"))
    prompts = torch.randint(0, model.config.vocab_size, (B, ctx), generator=torch.Generator().manual_seed(1)).tolist()
    chunk = max(1, 16384 // ctx)
    for i in range(0, B, chunk):
        runner.prefill(prompts[i:i + chunk])
    graphs = runner.decode_graphs
    t0 = time.perf_counter()
    # the graphs the timed loops replay: batch B's bucket, the width buckets from ctx to its last step (warming every
    # smaller batch and width too, as Runner.warm_up does for serving, takes minutes at GLM-5 widths)
    widths = [runner.cache.kernel_blocks(tokens) for tokens in (ctx + 1, ctx + 4 * steps + 8)]
    first = graphs.key(B, widths[0])
    warmed = graphs.warm([k for k in graphs.keys(B, widths[1]) if k[0] == first[0] and k[1] >= first[1] and k[2] == 1])
    warm_s = time.perf_counter() - t0
    events, launches, run = [], [], graphs.run

    def timed_run(input_ids, fctx, per_request=1):
        launches.append(time.perf_counter())
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = run(input_ids, fctx, per_request)
        end.record()
        events.append((start, end))
        return out

    graphs.run = timed_run
    runner.decode_steps(len(runner.active[0].output) + 3)  # compiles and autotunes whatever warm_up did not
    result = {}
    for overlap in (False, True):  # the step-by-step loop, then the overlapped one (the runner's default), same run
        runner.overlap = overlap
        torch.cuda.synchronize()
        events.clear()
        launches.clear()
        t0 = time.perf_counter()
        runner.decode_steps(len(runner.active[0].output) + steps)
        torch.cuda.synchronize()
        total = (time.perf_counter() - t0) * 1e3
        device = [start.elapsed_time(end) for start, end in events]
        period = [(b - a) * 1e3 for a, b in zip(launches, launches[1:])]  # launch to launch: the host's period
        result["overlapped" if overlap else "stepwise"] = dict(
            steps=len(events), wall_ms_per_step=round(total / len(events), 3),
            launch_period_ms_median=round(statistics.median(period), 3),
            device_ms_median=round(statistics.median(device), 3),
            wall_over_device=round(total / len(events) / statistics.median(device), 3),
            launch_period_ms=[round(p, 3) for p in period], device_ms=[round(d, 3) for d in device])
    save_run("decode_host_time_cuda.json", B=B, ctx=ctx, replayed=graphs.disabled is None and bool(graphs.graphs),
             layers="1 dense + 1 MoE (GLM-5 widths)", kv_cache="fp8", warm_up_graphs=warmed,
             warm_up_s=round(warm_s, 2), **result)


def main():
    harness.answer_help(__doc__)
    args = [int(a) for a in sys.argv[1:] if not a.startswith("--")]
    B, ctx = args[:2] if len(args) >= 2 else (64, 2048)
    (with_graphs if "--cuda" in sys.argv else host_only)(B, ctx)


if __name__ == "__main__":
    main()
