"""The torch.compile front door against torch's own, in one run: the forward (logits) of the 2-layer GLM-5-width
FP8 model of ``bench/decode_step.py`` (1 dense + 1 MoE layer, all 256 experts, top-8; bf16 activations, random
block-FP8 weights) at batch 1 x 2048 tokens (prefill) and 64 x 1 token (decode), run by torch eager,
``torch.compile(backend="inductor")`` and ``torch.compile(backend="fxglm5")``.

Each compiled model is built fresh per shape (``dynamic=False``); its compile time is the wall time of the first
call (Dynamo, export / Inductor, passes, kernel compilation, one forward). Then warm-up calls and the median of
synchronized repeats. Each row also records the largest logit difference from eager, relative to eager's scale.

    python bench/compile_backend.py [--tiny] [--repeats N] [--modes eager,inductor,fxglm5]

``--tiny`` runs the tiny preset's 2 layers on the CPU (fxglm5 then runs its torch reference ops), to check the
script; figures come from the GPU run. Both shapes keep the sequence within the indexer's top-k (2048 at GLM-5's
widths, 8 in the tiny preset), so every causal key is selected: bf16 rounding cannot change a top-k choice, and the
difference from eager stays a rounding difference.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.decode_step import random_model, two_layer_config  # noqa: E402
from bench.harness import Results, save_run  # noqa: E402
from fxglm5.backend import fxglm5_backend  # noqa: E402

MODES = ("eager", "inductor", "fxglm5")


def build(mode: str, model, cfg):
    if mode == "eager":
        return model
    if mode == "inductor":
        return torch.compile(model, backend="inductor", dynamic=False)
    # The callable rather than the name: the name is registered by the installed package's entry point, and the
    # device machine runs a copy of the tree that is not installed.
    return torch.compile(model, backend=fxglm5_backend, dynamic=False, options={"config": cfg})


def measure(fn, ids, pos, sync, warmup: int, repeats: int) -> tuple[float, float, torch.Tensor]:
    """(first-call seconds, median ms of the repeats, the logits)."""
    sync()
    t0 = time.perf_counter()
    out = fn(ids, pos)
    sync()
    first = time.perf_counter() - t0
    for _ in range(warmup):
        fn(ids, pos)
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn(ids, pos)
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return first, statistics.median(times), out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--modes", default=",".join(MODES))
    args = ap.parse_args()
    modes = args.modes.split(",")
    if set(modes) - set(MODES):
        ap.error(f"--modes: each of {MODES}")
    dev = "cpu" if args.tiny else "cuda"
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    cfg = two_layer_config(args.tiny)
    model = random_model(cfg, dev)
    shapes = [(1, 8), (4, 1)] if args.tiny else [(1, 2048), (64, 1)]
    res = Results()
    for batch, seq in shapes:
        ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1)).to(dev)
        pos = torch.arange(seq, device=dev)[None].expand(batch, seq)
        eager_ms = reference = None
        for mode in modes:
            torch._dynamo.reset()
            with torch.no_grad():
                first, ms, out = measure(build(mode, model, cfg), ids, pos, sync, args.warmup, args.repeats)
            if mode == "eager":
                eager_ms, reference = ms, out
            err = None if reference is None else ((out.float() - reference.float()).abs().max()
                                                  / reference.float().abs().max()).item()
            res.add(shape=f"{batch}x{seq}", mode=mode, first_call_s=round(first, 2), median_ms=round(ms, 3),
                    speedup_vs_eager=None if eager_ms is None else round(eager_ms / ms, 2), max_rel_diff_vs_eager=err)
            del out
    name = "compile_backend_tiny" if args.tiny else "compile_backend"
    path = save_run(f"{name}.json", model="tiny preset, 2 layers" if args.tiny else
                    "GLM-5 widths, 2 layers: 1 dense + 1 MoE (256 experts, top-8), random block-FP8 weights, bf16",
                    experts=cfg.n_routed_experts, repeats=args.repeats, warmup=args.warmup, rows=res.rows)
    with open(path) as f:
        run = json.load(f)
    with open(path[:-len(".json")] + ".md", "w") as f:
        f.write(f"# {name}\n\n- command: `{run['command']}`\n- device: {json.dumps(run['device'])}\n"
                f"- commit: {run['commit']}\n- model: {run['model']}\n\n{res.markdown()}")

if __name__ == "__main__":
    main()
