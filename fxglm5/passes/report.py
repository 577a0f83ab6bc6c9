"""A readable report of the pass pipeline on a model: per pass the matches, the expected count and the
time, then the op histogram before and after (what ``fxglm5 inspect`` prints)."""

from __future__ import annotations

import time

import torch

from fxglm5.passes import op_histogram
from fxglm5.passes.by_kind import captured_histogram, match_and_fuse


def pipeline_report(model: torch.nn.Module) -> str:
    """Capture ``model`` (once per layer kind), run match + fuse in strict mode, and describe what happened."""
    start = time.perf_counter()
    gm, results = match_and_fuse(model, strict=True)
    elapsed = time.perf_counter() - start
    before, after = captured_histogram(gm), op_histogram(gm)
    passes = sum(r.seconds for r in results)
    lines = [f"capture: {elapsed - passes:.1f}s, {sum(before.values())} ops"]
    lines += [r.summary() for r in results]
    names = sorted(set(before) | set(after), key=lambda k: -max(before.get(k, 0), after.get(k, 0)))
    changed = [k for k in names if before.get(k, 0) != after.get(k, 0)]
    lines.append(f"{'op (changed ones)':28s} {'before':>7s} {'after':>7s}")
    for name in changed:
        lines.append(f"{name:28s} {before.get(name, 0):7d} {after.get(name, 0):7d}")
    lines.append(f"{'total':28s} {sum(before.values()):7d} {sum(after.values()):7d}")
    return "\n".join(lines)
