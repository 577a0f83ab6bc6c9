"""PassManager: runs the declared passes (:mod:`fxglm5.passes.pipeline`) stage by stage over a captured GraphModule.

After every pass: dead code is removed and the graph is linted, and (with ``dump_dir``) the graph before and
after is written as readable Python plus one summary line; the graph's Python code is regenerated once, after the
last pass (no pass calls the module or reads its code, and regenerating a whole GLM-5's code takes a
third of a second). A pass that finds another number of
matches than the model must have is a PassError with ``strict=True`` and a logged warning without it (the
serving path goes on with the graph as it is, but says which rewrite it lacks). ``PassContext.disabled`` skips
passes by name: an A/B switch for measuring what a pass buys in the same run, and a way around a pass
suspected of a miscompile.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Optional

import torch
from torch import fx

from fxglm5.errors import PassError
from fxglm5.parallel import Mapping
from fxglm5.passes.pipeline import STAGES
from fxglm5.passes.registry import PassSpec, passes_for

log = logging.getLogger(__name__)


@dataclasses.dataclass
class PassContext:
    """What passes may consult: the model config (for expected scales and counts) and the options."""

    config: Any = None  # Glm5Config or None for arbitrary modules
    act_quant: bool = False  # W8A8 (dynamic 1x128 activation quantization) in fused FP8 GEMMs
    strict: bool = False
    backend: Optional[str] = None  # lower stage: "triton" | "aiter" | "reference" | None (auto)
    disabled: tuple[str, ...] = ()  # pass names to skip
    mapping: Mapping = Mapping()  # shard stage: this rank's tensor / expert-parallel place (world 1: no-op)
    extras: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class PassOutcome:
    """What a pass function returns: its match count and optional details for the summary."""

    num_matches: int
    details: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class PassResult:
    name: str
    stage: str
    num_matches: int
    seconds: float
    expected: Optional[int]
    details: dict
    ops_before: dict
    ops_after: dict

    def summary(self) -> str:
        exp = "" if self.expected is None else f" (expected {self.expected})"
        extra = "".join(f", {k}={v}" for k, v in self.details.items())
        return f"{self.stage:5s} {self.name:22s} matches={self.num_matches}{exp} time={self.seconds * 1e3:.1f}ms{extra}"


def op_histogram(gm: fx.GraphModule) -> dict[str, int]:
    """Count of call_function targets by name (``aten.linear``, ``fxglm5.mla``, ...)."""
    counts: collections.Counter = collections.Counter()
    for node in gm.graph.nodes:
        if node.op == "call_function":
            counts[_op_name(node.target)] += 1
    return dict(counts)


def _op_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}"
    lowered = getattr(target, "op", None)  # a lowering Dispatch counts as the op it implements
    if isinstance(lowered, str):
        return f"fxglm5.{lowered}"
    return getattr(target, "__name__", str(target))


def cleanup(gm: fx.GraphModule, recompile: bool = True) -> None:
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    if recompile:
        gm.recompile()


class PassManager:
    def __init__(self, ctx: PassContext | None = None, stages=STAGES[:2], dump_dir: str | Path | None = None):
        self.ctx = ctx or PassContext()
        disabled = set(self.ctx.disabled)
        unknown = disabled - {spec.name for spec in passes_for(STAGES)}
        if unknown:
            raise PassError(f"disabled passes: no pass named {sorted(unknown)}")
        self.passes: list[PassSpec] = [spec for spec in passes_for(stages) if spec.name not in disabled]
        self.dump_dir = Path(dump_dir) if dump_dir else None

    def run(self, gm: fx.GraphModule) -> list[PassResult]:
        results = []
        try:
            for index, spec in enumerate(self.passes):
                results.append(self.run_one(gm, spec, index, recompile=False))
        finally:
            gm.recompile()
        return results

    def run_one(self, gm: fx.GraphModule, spec: PassSpec, index: int = 0, recompile: bool = True) -> PassResult:
        """Run one pass; ``recompile=False`` leaves the module's Python code stale (``run`` regenerates it after
        the last pass)."""
        before = op_histogram(gm)
        if self.dump_dir:
            self._dump(gm, f"{index:02d}_{spec.name}.before.py")
        start = time.perf_counter()
        outcome = spec.fn(gm, self.ctx)
        if not isinstance(outcome, PassOutcome):
            outcome = PassOutcome(int(outcome))
        cleanup(gm, recompile)
        seconds = time.perf_counter() - start
        expected = spec.expected(self.ctx) if spec.expected is not None and self.ctx.config is not None else None
        result = PassResult(spec.name, spec.stage, outcome.num_matches, seconds, expected, outcome.details, before, op_histogram(gm))
        if self.dump_dir:
            self._dump(gm, f"{index:02d}_{spec.name}.after.py")
            with open(self.dump_dir / "summary.txt", "a") as f:
                f.write(result.summary() + "\n")
        if expected is not None and outcome.num_matches != expected:
            if self.ctx.strict:
                raise PassError(f"pass {spec.name}: found {outcome.num_matches} matches, the model needs {expected} (strict mode)")
            log.warning("fxglm5 pass %s: found %d matches, the model needs %d; the graph goes on without the rest",
                        spec.name, outcome.num_matches, expected)
        return result

    def _dump(self, gm: fx.GraphModule, name: str) -> None:
        self.dump_dir.mkdir(parents=True, exist_ok=True)
        gm.recompile()
        (self.dump_dir / name).write_text(gm.code)


def run_pipeline(gm: fx.GraphModule, ctx: PassContext | None = None, stages=STAGES[:2],
                 dump_dir: str | Path | None = None) -> list[PassResult]:
    """Run every declared pass of ``stages`` in order on ``gm`` (in place)."""
    import fxglm5.passes  # noqa: F401  (registers the passes)

    return PassManager(ctx, stages, dump_dir).run(gm)
