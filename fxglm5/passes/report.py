"""A readable report of a compile: per pass the matches, the expected count and the time, then the op histogram
before and after (what ``fxglm5 inspect`` prints of :func:`fxglm5.compiler.compile_model`'s result) and, when the
graph was also lowered for a device, what runs where (``fp8_linear: triton x390``)."""

from __future__ import annotations

from torch import fx

from fxglm5.passes.by_kind import captured_histogram
from fxglm5.passes.lower import placement
from fxglm5.passes.manager import PassResult, op_histogram


def pipeline_report(graph: fx.GraphModule, results: list[PassResult], capture_seconds: float,
                    lowered: PassResult | None = None, device: str | None = None) -> str:
    """Describe what ``results`` did to ``graph`` (as it is after them), captured in ``capture_seconds``;
    ``lowered``: the result of the lower stage run on ``graph`` afterwards for ``device`` (the backends it chose)."""
    after = op_histogram(graph)
    before = captured_histogram(graph)
    lines = [f"capture: {capture_seconds:.1f}s, {sum(before.values())} ops"]
    lines += [r.summary() for r in results]
    names = sorted(set(before) | set(after), key=lambda k: -max(before.get(k, 0), after.get(k, 0)))
    changed = [k for k in names if before.get(k, 0) != after.get(k, 0)]
    lines.append(f"{'op (changed ones)':28s} {'before':>7s} {'after':>7s}")
    for name in changed:
        lines.append(f"{name:28s} {before.get(name, 0):7d} {after.get(name, 0):7d}")
    lines.append(f"{'total':28s} {sum(before.values()):7d} {sum(after.values()):7d}")
    if lowered is not None:
        lines.append(f"lowered for {device} (backends tried in order {lowered.details['backends']}):")
        lines += [f"  {op}: {backend} x{n}" for (op, backend), n in placement(graph).items()]
    return "\n".join(lines)
