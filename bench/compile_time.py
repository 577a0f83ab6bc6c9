"""Compile time of GLM-5 on the meta device: torch.export + every match/fuse pass, captured once per layer kind
(``fxglm5.passes.by_kind.match_and_fuse``) against the whole-model capture, at 4 layers and at the full 78 layers
of GLM-5's widths, in the same run.

Prints and saves bench/results/compile_time.json (through bench/harness.save_run: command, device, commit): per
case and path, wall and process-CPU seconds of capture + passes (CPU seconds are less sensitive than wall time
to other work on a shared CPU; the load average at start and end is recorded for the same reason), the passes'
own seconds, the match counts, and the graph size. Targets (issue 22): by kind, 78 layers <= 10 s (<= 30 s at
least) and <= 2x the cost of 4 layers. ``--skip-whole`` leaves out the whole-model capture (minutes at 78 layers).
``--artifact-layers N ...`` adds the export artifact phase (``fxglm5.artifact``: compile, export, write; then
load), which needs weights: a random FP8 checkpoint of the tiny widths with GLM-5's first N layers' kinds
(``deep_tiny_config``), with the file's and its members' sizes. ``--layers`` with no depth runs that phase alone.
Run: ``python bench/compile_time.py [--layers 4 78] [--skip-whole] [--artifact-layers 16 32] [--tag NAME]
[--note TEXT]``.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.harness import save_run  # noqa: E402
from fxglm5.artifact import export_artifact, load_artifact  # noqa: E402
from fxglm5.capture import capture  # noqa: E402
from fxglm5.capture.by_kind import truncated_config  # noqa: E402
from fxglm5.model.config import Glm5Config  # noqa: E402
from fxglm5.model.modeling import Glm5ForCausalLM  # noqa: E402
from fxglm5.model.tiny import deep_tiny_config, make_tiny_checkpoint  # noqa: E402
from fxglm5.passes import PassContext, run_pipeline  # noqa: E402
from fxglm5.passes.by_kind import match_and_fuse  # noqa: E402

TARGET_SECONDS, MINIMUM_SECONDS, DEPTH_RATIO = 10, 30, 2


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def whole_model(model):
    gm = capture(model)
    return gm, run_pipeline(gm, PassContext(config=model.config, strict=True))


def by_kind(model):
    return match_and_fuse(model, strict=True)


def measure(path, model) -> dict:
    t0, c0 = time.perf_counter(), cpu_seconds()
    gm, results = path(model)
    wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    passes = sum(r.seconds for r in results)
    return {"seconds": round(wall, 2), "cpu_seconds": round(cpu, 2), "passes_seconds": round(passes, 2),
            "matches": {r.name: r.num_matches for r in results}, "graph_nodes": len(gm.graph.nodes)}


def artifact_case(layers: int) -> dict:
    """Export (compile + export + write) and load an artifact of a random ``layers``-layer tiny-width model."""
    with tempfile.TemporaryDirectory(prefix="fxglm5-bench-artifact-") as tmp:
        ckpt = make_tiny_checkpoint(Path(tmp) / "ckpt", fp8=True, config=deep_tiny_config(layers))
        model = Glm5ForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, progress=False)
        t0, c0 = time.perf_counter(), cpu_seconds()
        path = export_artifact(model, Path(tmp) / "model.pt2")
        t1, c1 = time.perf_counter(), cpu_seconds()
        art = load_artifact(path)
        t2, c2 = time.perf_counter(), cpu_seconds()
        with zipfile.ZipFile(path) as archive:
            members = {info.filename: round(info.file_size / 2**20, 3) for info in archive.infolist()}
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        return {"export_seconds": round(t1 - t0, 2), "export_cpu_seconds": round(c1 - c0, 2),
                "load_seconds": round(t2 - t1, 2), "load_cpu_seconds": round(c2 - c1, 2),
                "format": art.record["format"], "file_mib": round(path.stat().st_size / 2**20, 3),
                "members_mib": members, "model_weights_mib": round(weights / 2**20, 3),
                "program_layers": len({n.split(".")[2] for n in art.program.state_dict
                                       if n.startswith("model.layers.")})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="*", default=[4, 78], help="depths of GLM-5 widths to compile")
    ap.add_argument("--skip-whole", action="store_true", help="leave out the whole-model capture")
    ap.add_argument("--artifact-layers", type=int, nargs="*", default=[],
                    help="depths (tiny widths, random FP8 weights) to export and load as an artifact")
    ap.add_argument("--tag", default="compile_time")
    ap.add_argument("--note", default=None, help="conditions of the run worth keeping with it (e.g. other load)")
    args = ap.parse_args()
    full = Glm5Config.preset("glm5")
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    cases = {}
    for layers in args.layers:
        model = Glm5ForCausalLM(truncated_config(full, layers), dtype=torch.bfloat16, device="meta")
        case = {"by_kind": measure(by_kind, model)}
        if not args.skip_whole:
            case["whole_model"] = measure(whole_model, model)
            assert case["whole_model"]["matches"] == case["by_kind"]["matches"], case
            assert case["whole_model"]["graph_nodes"] == case["by_kind"]["graph_nodes"], case
        print(layers, "layers:", case, flush=True)
        cases[str(layers)] = case
    artifacts = {}
    for layers in args.artifact_layers:
        artifacts[str(layers)] = artifact_case(layers)
        print(layers, "layers, export artifact:", artifacts[str(layers)], flush=True)
    record = {"note": args.note, "load_avg_1_5_15_min_at_start": load_at_start,
              "load_avg_1_5_15_min_at_end": [round(x, 2) for x in os.getloadavg()],
              "cases": cases, "export_artifact": artifacts,
              "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
              "targets": {"by_kind_full_seconds": TARGET_SECONDS, "minimum_seconds": MINIMUM_SECONDS,
                          "depth_ratio": DEPTH_RATIO}}
    if cases:
        deepest, shallowest = str(max(args.layers)), str(min(args.layers))
        seconds = cases[deepest]["by_kind"]["seconds"]
        record["by_kind_full_seconds"] = seconds
        record["depth_ratio_cpu"] = round(cases[deepest]["by_kind"]["cpu_seconds"]
                                          / cases[shallowest]["by_kind"]["cpu_seconds"], 2)
        record["meets_target"] = seconds <= TARGET_SECONDS and record["depth_ratio_cpu"] <= DEPTH_RATIO
    print("saved", save_run(f"{args.tag}.json", **record))


if __name__ == "__main__":
    main()
