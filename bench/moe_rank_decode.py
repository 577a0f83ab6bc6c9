"""One EP8 rank's decode MoE layer at GLM-5's sizes and the busiest rank's routing, alone: each launch's device time,
the layer's bytes over the same run's copy bandwidth, and the decode MoE's settings side by side (issue 45).

    python bench/moe_rank_decode.py [--batches 1,8] [--layers 6] [--configs default,ctas8,ctas32,split1_1,...]
    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section MemoryWorkloadAnalysis --section WarpStateStats --csv --page details \
        python bench/moe_rank_decode.py --profile --batches 1 > $OUT/ncu_moe_rank_b1.csv

Why: in the whole step (``bench/rank_at_depth.py``, H100, 39 layers, bb561ff) a MoE layer's two launches take 111 us
at batch 1 (the router, the norm before it and gate|up 78.35 us; down 32.66 us) for about 100 MB of weights, and
252 us at batch 8: most of a decode layer, at a third to a half of copy speed. This bench isolates that layer, so a
setting or a kernel change is timed in seconds and profiled (``--profile``: one call between cudaProfilerStart /
Stop, for Nsight Compute) without building the 39- or 78-layer rank.

What runs: ``fxglm5::add_rms_norm_moe_router_fp8_shared``'s Triton op (:func:`moe.add_rms_norm_moe_router_fp8`: the
residual add and RMSNorm, the float32 router, the rank's 32 of 256 routed experts and the shared expert's TP8
slice, as a decode step runs them), its experts steered to one simulated busiest EP8 group's ids per layer
(``bench/routing_load.simulate``, the routing ``rank_at_depth --load busiest`` steers to; the router still runs).
``--layers`` layers of distinct random weights, so that no layer finds its weights in L2, are captured in one CUDA
graph, one call each, and timed over replays (median of 20 after 3 warm-ups): microseconds per layer. One replay
under torch.profiler gives each kernel's mean device time per layer. Bytes per layer: the distinct routed experts'
w13 and w2 with their scales, the shared expert's, the router's float32 weight and bias, summed over the layers'
own routings. Each setting's output on the same inputs is compared with the first setting's
(``max_rel_diff_vs_<first>``: a changed K split sums in another order, so not the same bits). ``--tiny``: small
sizes on the CPU (Triton interpreted, eager, no timing): a smoke run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness  # noqa: E402
from bench.routing_load import simulate  # noqa: E402

FP8 = torch.float8_e4m3fn
EXPERTS, TOP_K, EP = 256, 8, 8
GLM5 = dict(hidden=6144, inter=2048, shared_inter=2048 // EP)  # the shared expert's TP8 slice
TINY = dict(hidden=256, inter=128, shared_inter=128)
# the decode MoE's settings (moe.MOE_DECODE overrides; ctas16: one token's split before MOE_DECODE_ONE_TOKEN), the
# K splits rank_at_depth's variants try, and the expert walk
CONFIGS = {"default": {}, "ctas8": {"CTAS_PER_SM1": 8}, "ctas16": {"CTAS_PER_SM1": 16}, "ctas32": {"CTAS_PER_SM1": 32},
           "split1_1": {"SPLIT1": 1},
           "split2_1": {"SPLIT2": 1}, "split2_8": {"SPLIT2": 8}, "stages2": {"num_stages": 2},
           "stages4": {"num_stages": 4}, "warps8": {"num_warps": 8}, "bn64": {"BLOCK_N1": 64, "BLOCK_N2": 64},
           "ctas8_split2_8": {"CTAS_PER_SM1": 8, "SPLIT2": 8}, "ctas8_bn64": {"CTAS_PER_SM1": 8, "BLOCK_N1": 64},
           "ctas4": {"CTAS_PER_SM1": 4}, "walk2": {"WALK_CTAS_PER_SM": 2}, "walk4": {"WALK_CTAS_PER_SM": 4},
           "walk8": {"WALK_CTAS_PER_SM": 8}, "blocks_last": {"BLOCKS_LAST": True},
           "walk2_blocks_last": {"WALK_CTAS_PER_SM": 2, "BLOCKS_LAST": True}}


def _fp8(rows: int, cols: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random block-FP8 weights [rows, cols] and their [rows/128, cols/128] float32 scales."""
    w = (torch.randn(rows, cols, device=device) * 0.5).to(FP8)
    return w, torch.rand(-(-rows // 128), -(-cols // 128), device=device) * 1e-2 + 1e-3


class Layer:
    """One MoE layer's rank weights: the router, 32 local experts, the shared expert slice, the norm weight."""

    def __init__(self, sizes: dict, device):
        from fxglm5.lowering.triton import moe

        h, inter, shared = sizes["hidden"], sizes["inter"], sizes["shared_inter"]
        local = EXPERTS // EP
        w13 = [_fp8(2 * inter, h, device) for _ in range(local)]
        w2 = [_fp8(h, inter, device) for _ in range(local)]
        self.w13, self.s13 = torch.stack([w for w, _ in w13]), torch.stack([s for _, s in w13])
        self.w2, self.s2 = torch.stack([w for w, _ in w2]), torch.stack([s for _, s in w2])
        self.router = moe.Router(torch.randn(EXPERTS, h, device=device) * 0.02, torch.randn(EXPERTS, device=device)
                                 * 0.01, TOP_K, 1, 1, True, 2.5, torch.zeros((), dtype=torch.int32, device=device),
                                 local)
        sw13, ss13 = _fp8(2 * shared, h, device)
        sw2, ss2 = _fp8(h, shared, device)
        self.shared = moe.SharedExpert(sw13, ss13, sw2, ss2, False, shared)  # W8A16, fxglm5's default
        self.norm = torch.rand(h, device=device) + 0.5
        self.expert_bytes = sum(t[0].numel() * t.element_size() for t in (self.w13, self.s13, self.w2, self.s2))
        self.fixed_bytes = sum(t.numel() * t.element_size() for t in (self.router.weight, self.router.correction_bias,
                                                                     sw13, ss13, sw2, ss2))

    def call(self, x, residual, ids, config):
        from fxglm5.lowering.triton import moe

        return moe.add_rms_norm_moe_router_fp8(x, residual, self.norm, 1e-5, self.router, self.w13, self.s13,
                                               self.w2, self.s2, False, shared=self.shared, config=config,
                                               steered_ids=ids)


def routings(batch: int, layers: int) -> tuple[torch.Tensor, dict]:
    """Per layer the ids [batch, k] of one simulated busiest EP8 group (local ids, -1 elsewhere), and the summary."""
    sim = simulate(EXPERTS, TOP_K, EP, batch, max(4096, layers))
    return sim.busiest_ids[:layers], dict(sim.summary(), steered_distinct_experts=round(
        sim.busiest_distinct[:layers].mean().item(), 3))


def measure(layers: list[Layer], batch: int, config: dict, device, timed: bool) -> dict:
    """One setting at one batch: us per layer (CUDA-graph replays) and each kernel's device us per layer."""
    h = layers[0].norm.numel()
    ids, summary = routings(batch, len(layers))
    ids = ids.to(device)
    torch.manual_seed(batch)  # every setting's inputs alike, so that their outputs compare
    xs = [torch.randn(batch, h, device=device, dtype=torch.bfloat16) for _ in layers]
    res = [torch.randn(batch, h, device=device, dtype=torch.bfloat16) for _ in layers]
    distinct = [len(set(i.flatten().tolist()) - {-1}) for i in ids.cpu()]
    step_bytes = sum(layer.fixed_bytes + n * layer.expert_bytes for layer, n in zip(layers, distinct))

    def run():
        return [layer.call(x, r, i, config)[0] for layer, x, r, i in zip(layers, xs, res, ids)]

    row = dict(batch=batch, distinct_experts=round(statistics.mean(distinct), 3), routing=summary,
               mb_per_layer=round(step_bytes / len(layers) / 1e6, 2), outputs=run())
    if not timed:
        return row
    graph = harness.capture_graph(run)
    us = statistics.median(harness.events_us(graph.replay, 20)) / len(layers)
    kernels, span = harness.kernel_times(graph, replays=5)
    per_kernel: dict[str, float] = {}
    for (_, name), t in kernels.items():
        per_kernel[name] = per_kernel.get(name, 0.0) + t / len(layers)
    row.update(us_per_layer=round(us, 2), gbs=round(step_bytes / len(layers) / (us * 1e-6) / 1e9, 1),
               kernels_us={k: round(v, 2) for k, v in per_kernel.items()})
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--layers", type=int, default=6, help="layers of distinct weights (default: 6, 7 GB)")
    parser.add_argument("--configs", default="default,ctas8,ctas32,split1_1,split2_1,stages4,warps8",
                        help=f"of {','.join(CONFIGS)}")
    parser.add_argument("--profile", action="store_true", help="one call of the default per batch for a profiler")
    parser.add_argument("--tiny", action="store_true", help="small sizes on the CPU, interpreted: a smoke run")
    args = parser.parse_args()
    names = args.configs.split(",")
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        parser.error(f"--configs: unknown {unknown}; choose from {','.join(CONFIGS)}")
    device = torch.device("cpu" if args.tiny else "cuda")
    torch.manual_seed(0)
    layers = [Layer(TINY if args.tiny else GLM5, device) for _ in range(args.layers)]
    batches = [int(b) for b in args.batches.split(",")]
    if args.profile:
        for batch in batches:
            ids = routings(batch, 1)[0][0].to(device)
            x, r = (torch.randn(batch, layers[0].norm.numel(), device=device, dtype=torch.bfloat16) for _ in range(2))
            for _ in range(2):
                layers[0].call(x, r, ids, {})
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
            layers[0].call(x, r, ids, {})
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
        return
    copy_gbs = None if args.tiny else harness.copy_bandwidth_gbs()
    rows = []
    for batch in batches:
        first = None
        for name in names:
            row = dict(config=name, **measure(layers, batch, CONFIGS[name], device, timed=not args.tiny))
            outputs = row.pop("outputs")
            first = first or (name, outputs)
            row[f"max_rel_diff_vs_{first[0]}"] = max(  # K splits sum in other orders: not the same bits
                ((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(outputs, first[1]))
            if copy_gbs:
                row["pct_of_copy"] = round(100 * row["gbs"] / copy_gbs, 1)
            rows.append(row)
            print(row, flush=True)
    harness.save_run("moe_rank_decode_tiny.json" if args.tiny else "moe_rank_decode.json", copy_bandwidth_gbs=copy_gbs,
                     setup=f"{args.layers} MoE layers of one EP{EP} rank ({EXPERTS // EP} of {EXPERTS} experts, "
                           f"the shared expert's TP{EP} slice), busiest-group routing, add_rms_norm_moe_router_fp8",
                     rows=rows)


if __name__ == "__main__":
    main()
