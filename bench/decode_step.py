"""One decode step (and the prefill before it) of a GLM-5-width model through the paged runtime on the Triton backend: wall time per step
and device time per kernel (torch.profiler), so that any op outside the benchmarked kernels (a float32 detour, a
copy, a torch fallback, a launch-bound chain of small ops) shows up. The prefill's wall time per chunk of
requests is recorded too (the first chunk includes compilation and autotuning).

The model is bf16 with GLM-5's widths and 2 layers (1 dense, 1 MoE: 256 experts, top-8; random FP8 block-scaled
weights), 64 requests of 2048 prompt tokens by default, FP8 indexer cache; decode steps replay CUDA graphs
(the runner's default on a GPU). Baselines over the same weights and prompts, measured in the same run:
``--without p1,p2`` builds a runner with those passes disabled (the Runner's disabled_passes), ``--eager`` one that
decodes eagerly (no CUDA graphs).

    python bench/decode_step.py [--tiny] [B] [ctx] [kv_cache] [--without pass,pass] [--eager]
"""

from __future__ import annotations

import collections
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness  # noqa: E402
from bench.harness import save_run  # noqa: E402
from bench.serving import GLM5_SERVING  # noqa: E402
from fxglm5.model.config import Glm5Config  # noqa: E402
from fxglm5.model.modeling import Glm5ForCausalLM  # noqa: E402
from fxglm5.serve.build import build_runner  # noqa: E402


def two_layer_config(tiny: bool, mtp: bool = False) -> Glm5Config:
    """2 layers, 1 dense + 1 MoE (all 256 experts, top-8), at GLM-5's widths (declaring
    GLM-5's MTP layer only with ``mtp``), or at the tiny preset's (which declares one)."""
    if tiny:
        return Glm5Config.preset("tiny").replace(num_hidden_layers=2, mlp_layer_types=None, indexer_types=None)
    return Glm5Config.preset("glm5").replace(num_hidden_layers=2, first_k_dense_replace=1, mlp_layer_types=None,
                                             indexer_types=None, num_nextn_predict_layers=int(mtp))


def random_model(cfg, dev, mtp: bool = False):
    """The bf16 model of ``cfg`` on ``dev`` with random weights (FP8 block-scaled where the checkpoint is);
    ``mtp``: with its MTP layer."""
    with torch.device(dev):
        model = Glm5ForCausalLM(cfg, dtype=torch.bfloat16, device=dev, mtp=mtp)
    g = torch.Generator(device=dev).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dtype == torch.float8_e4m3fn:
                p.copy_(torch.randn(p.shape, generator=g, device=dev).to(torch.float8_e4m3fn))
            elif name.endswith("scale_inv"):
                p.copy_((torch.rand(p.shape, generator=g, device=dev) + 0.5) / (p.shape[-1] * 128) ** 0.5)
            elif p.dim() == 1:
                p.copy_(((0.0 if "bias" in name else 1.0) + 0.1 * torch.randn(p.shape, generator=g, device=dev)).to(p.dtype))
            else:
                p.copy_((torch.randn(p.shape, generator=g, device=dev) / p.shape[-1] ** 0.5).to(p.dtype))
    return model.eval()


def measure(model, prompts, B, ctx, kv, dev, disabled: str = "", decode_graphs: bool | None = None) -> dict:
    """Prefill the prompts, then time decode steps and profile three of them, with ``disabled`` passes off."""
    t0 = time.time()
    runner = build_runner(model, GLM5_SERVING.replace(kv_cache=kv, max_cache_tokens=B * (ctx + 64), device=dev,
                                                      backend="triton", decode_graphs=decode_graphs,
                                                      disabled_passes=tuple(filter(None, disabled.split(",")))))
    print(f"runner (capture + passes, disabled: {disabled or 'none'}, decode graphs: "
          f"{runner.decode_graphs is not None}): {time.time() - t0:.1f} s", flush=True)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    chunk = max(1, 16384 // ctx)  # prefill in chunks of requests (activation memory)
    prefill_ms = []
    for i in range(0, B, chunk):
        sync()
        t0 = time.perf_counter()
        runner.prefill(prompts[i:i + chunk])
        sync()
        prefill_ms.append((time.perf_counter() - t0) * 1e3)
    for _ in range(3):  # warm-up: compiles / autotunes at the decode shapes
        runner.decode()
    sync()
    steps = []
    for _ in range(5):
        t0 = time.perf_counter()
        runner.decode()
        sync()
        steps.append((time.perf_counter() - t0) * 1e6)
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(3):
            runner.decode()
        sync()
    per = collections.defaultdict(float)
    launches = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            per[e.name[:90]] += e.device_time / 3
        elif e.name in ("cudaLaunchKernel", "cuLaunchKernelEx", "cuLaunchKernel", "cudaGraphLaunch"):
            launches += 1
    top = sorted(per.items(), key=lambda kv_: -kv_[1])[:25]
    graphs = runner.decode_graphs
    replayed = graphs is not None and graphs.disabled is None and bool(graphs.graphs)
    del runner
    return dict(disabled_passes=disabled or None, decode_graphs=replayed,
                prefill_chunk_tokens=min(chunk, B) * ctx, prefill_chunk_wall_ms=[round(m, 1) for m in prefill_ms],
                step_wall_us=[round(s, 1) for s in steps],
                device_us_per_step=round(sum(per.values()), 1), launches_per_step=launches // 3,
                kernels_us_per_step={k: round(v, 1) for k, v in top},
                host_table=prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def main():
    harness.answer_help(__doc__)
    argv = sys.argv[1:]
    tiny = "--tiny" in argv
    without = argv[argv.index("--without") + 1] if "--without" in argv else None
    args = [a for a in argv if not a.startswith("--") and a != without]
    B, ctx = (int(args[0]), int(args[1])) if len(args) >= 2 else ((2, 24) if tiny else (64, 2048))
    kv = args[2] if len(args) >= 3 else "fp8"
    dev = "cpu" if tiny else "cuda"
    cfg = two_layer_config(tiny)
    model = random_model(cfg, dev)
    prompts = torch.randint(0, cfg.vocab_size, (B, ctx), generator=torch.Generator().manual_seed(1)).tolist()
    runs = [measure(model, prompts, B, ctx, kv, dev)]
    if without:
        runs.append(measure(model, prompts, B, ctx, kv, dev, disabled=without))
    if "--eager" in argv:
        runs.append(measure(model, prompts, B, ctx, kv, dev, decode_graphs=False))
    res = dict(B=B, ctx=ctx, kv_cache=kv, layers="tiny" if tiny else "1 dense + 1 MoE (GLM-5 widths)",
               no_autotune=os.environ.get("FXGLM5_NO_AUTOTUNE") == "1", runs=runs)
    for run in runs:
        print(f"== passes disabled: {run['disabled_passes']}, decode graphs: {run['decode_graphs']}\n"
              f"{run.pop('host_table')}", flush=True)
    print("saved", save_run(f"decode_step_{kv}_B{B}_ctx{ctx}.json", **res))


if __name__ == "__main__":
    main()
