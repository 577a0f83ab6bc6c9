"""Compile time of the full GLM-5 (78 layers) on the meta device: torch.export + every match/fuse pass.

Prints and saves bench/results/compile_time.json: seconds for build / capture / each pass, peak
resident memory, graph size before and after, the command line, the machine. Target: < 120 s on a
2-core CPU machine. Run: ``python bench/compile_time.py [--preset glm5] [--tag NAME]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time

import torch

from fxglm5.capture import capture
from fxglm5.model.config import Glm5Config
from fxglm5.model.modeling import Glm5ForCausalLM
from fxglm5.passes import PassContext, run_pipeline

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="glm5", choices=["glm5", "tiny"])
    ap.add_argument("--tag", default="compile_time")
    args = ap.parse_args()
    cfg = Glm5Config.preset(args.preset)
    t0 = time.perf_counter()
    model = Glm5ForCausalLM(cfg, dtype=torch.bfloat16, device="meta")
    t_build = time.perf_counter() - t0
    t0 = time.perf_counter()
    gm = capture(model)
    t_capture = time.perf_counter() - t0
    nodes_before = len(gm.graph.nodes)
    t0 = time.perf_counter()
    results = run_pipeline(gm, PassContext(config=cfg, strict=True))
    t_passes = time.perf_counter() - t0
    record = {
        "command": " ".join([sys.executable.split("/")[-1], *sys.argv]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "load_avg_at_end": os.getloadavg()},
        "preset": args.preset,
        "layers": cfg.num_hidden_layers,
        "parameters_b": round(model.num_parameters() / 1e9, 2),
        "seconds": {"build_meta_model": round(t_build, 2), "capture_export": round(t_capture, 2),
                    "passes": round(t_passes, 2), "total_export_plus_passes": round(t_capture + t_passes, 2)},
        "passes": [{"name": r.name, "num_matches": r.num_matches, "expected": r.expected, "seconds": round(r.seconds, 3)}
                   for r in results],
        "graph_nodes": {"captured": nodes_before, "after_passes": len(gm.graph.nodes)},
        "peak_rss_mib": round(peak_rss_mib(), 1),
        "target_seconds": 120,
    }
    record["meets_target"] = record["seconds"]["total_export_plus_passes"] < 120
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{args.tag}.json"), "w") as f:
        json.dump(record, f, indent=2)
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
