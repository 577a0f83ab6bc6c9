"""A readable report of the pass pipeline on a model: per pass the matches, the expected count and the
time, then the op histogram before and after (what ``fxglm5 inspect`` prints) and, for a target device, what
runs where once lowered (``fp8_linear: triton x702``)."""

from __future__ import annotations

import time
from typing import Optional

import torch

from fxglm5.capture import capture
from fxglm5.passes import PassContext, op_histogram, run_pipeline
from fxglm5.passes.lower import placement


def pipeline_report(model: torch.nn.Module, device: Optional[str] = None) -> str:
    """Capture ``model``, run match + fuse in strict mode, and describe what happened; with ``device``
    ('cpu' / 'cuda') also lower the graph for it (without running it) and list each op's backend."""
    start = time.perf_counter()
    gm = capture(model)
    captured = time.perf_counter() - start
    before = op_histogram(gm)
    ctx = PassContext(config=model.config, strict=True)
    results = run_pipeline(gm, ctx)
    after = op_histogram(gm)
    lines = [f"capture: {captured:.1f}s, {sum(before.values())} ops"]
    lines += [r.summary() for r in results]
    names = sorted(set(before) | set(after), key=lambda k: -max(before.get(k, 0), after.get(k, 0)))
    changed = [k for k in names if before.get(k, 0) != after.get(k, 0)]
    lines.append(f"{'op (changed ones)':28s} {'before':>7s} {'after':>7s}")
    for name in changed:
        lines.append(f"{name:28s} {before.get(name, 0):7d} {after.get(name, 0):7d}")
    lines.append(f"{'total':28s} {sum(before.values()):7d} {sum(after.values()):7d}")
    if device is not None:
        ctx.extras["device"] = device
        lowered = run_pipeline(gm, ctx, stages=("lower",))[-1]
        lines.append(f"lowered for {device} (backends tried in order {lowered.details['backends']}):")
        lines += [f"  {op}: {backend} x{n}" for (op, backend), n in placement(gm).items()]
    return "\n".join(lines)
