"""A readable report of the pass pipeline on a model: per pass the matches, the expected count and the
time, then the op histogram before and after (what ``fxglm5 inspect`` prints)."""

from __future__ import annotations

import time

import torch

from fxglm5.capture import capture
from fxglm5.passes import PassContext, op_histogram, run_pipeline


def pipeline_report(model: torch.nn.Module) -> str:
    """Capture ``model``, run match + fuse in strict mode, and describe what happened."""
    start = time.perf_counter()
    gm = capture(model)
    captured = time.perf_counter() - start
    before = op_histogram(gm)
    results = run_pipeline(gm, PassContext(config=model.config, strict=True))
    after = op_histogram(gm)
    lines = [f"capture: {captured:.1f}s, {sum(before.values())} ops"]
    lines += [r.summary() for r in results]
    names = sorted(set(before) | set(after), key=lambda k: -max(before.get(k, 0), after.get(k, 0)))
    changed = [k for k in names if before.get(k, 0) != after.get(k, 0)]
    lines.append(f"{'op (changed ones)':28s} {'before':>7s} {'after':>7s}")
    for name in changed:
        lines.append(f"{name:28s} {before.get(name, 0):7d} {after.get(name, 0):7d}")
    lines.append(f"{'total':28s} {sum(before.values()):7d} {sum(after.values()):7d}")
    return "\n".join(lines)
