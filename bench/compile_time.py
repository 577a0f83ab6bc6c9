"""Compile time of the full GLM-5 (78 layers) on the meta device: torch.export + every match/fuse pass.

Prints and saves bench/results/compile_time.json (through bench/harness.save_run: command, device, commit):
wall seconds for build / capture / each pass, the process's CPU seconds (less sensitive than wall time to
other work on a shared CPU; the load average at start and end is recorded for the same reason), peak resident
memory, graph size before and after. Target: < 120 s on a 2-core CPU machine.
Run: ``python bench/compile_time.py [--preset glm5] [--tag NAME] [--note TEXT]``.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.harness import save_run  # noqa: E402
from fxglm5.capture import capture  # noqa: E402
from fxglm5.model.config import Glm5Config  # noqa: E402
from fxglm5.model.modeling import Glm5ForCausalLM  # noqa: E402
from fxglm5.passes import PassContext, run_pipeline  # noqa: E402


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="glm5", choices=["glm5", "tiny"])
    ap.add_argument("--tag", default="compile_time")
    ap.add_argument("--note", default=None, help="conditions of the run worth keeping with it (e.g. other load)")
    args = ap.parse_args()
    cfg = Glm5Config.preset(args.preset)
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    t0 = time.perf_counter()
    model = Glm5ForCausalLM(cfg, dtype=torch.bfloat16, device="meta")
    t_build = time.perf_counter() - t0
    t0, c0 = time.perf_counter(), cpu_seconds()
    gm = capture(model)
    t_capture, c_capture = time.perf_counter() - t0, cpu_seconds() - c0
    nodes_before = len(gm.graph.nodes)
    t0, c0 = time.perf_counter(), cpu_seconds()
    results = run_pipeline(gm, PassContext(config=cfg, strict=True))
    t_passes, c_passes = time.perf_counter() - t0, cpu_seconds() - c0
    record = {
        "note": args.note,
        "load_avg_1_5_15_min_at_start": load_at_start,
        "preset": args.preset,
        "layers": cfg.num_hidden_layers,
        "parameters_b": round(model.num_parameters() / 1e9, 2),
        "seconds": {"build_meta_model": round(t_build, 2), "capture_export": round(t_capture, 2),
                    "passes": round(t_passes, 2), "total_export_plus_passes": round(t_capture + t_passes, 2)},
        "cpu_seconds": {"capture_export": round(c_capture, 2), "passes": round(c_passes, 2),
                        "total_export_plus_passes": round(c_capture + c_passes, 2)},
        "passes": [{"name": r.name, "num_matches": r.num_matches, "expected": r.expected, "seconds": round(r.seconds, 3)}
                   for r in results],
        "graph_nodes": {"captured": nodes_before, "after_passes": len(gm.graph.nodes)},
        "peak_rss_mib": round(peak_rss_mib(), 1),
        "target_seconds": 120,
    }
    record["meets_target"] = record["seconds"]["total_export_plus_passes"] < 120
    print("saved", save_run(f"{args.tag}.json", **record))


if __name__ == "__main__":
    main()
