"""The pass registry: every pass registers itself with its stage; stages run in a fixed order.

Stages: ``match`` (generic math -> canonical ops), ``fuse`` (FP8 dequantization into GEMMs / MoE),
``cache`` (canonical attention -> paged RTP ops), ``lower`` (ops -> backend kernels). Within a stage
passes run in registration order (the order of imports in ``fxglm5.passes``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
from typing import Callable, Optional

from torch import fx

STAGES = ("match", "fuse", "cache", "lower")


@dataclasses.dataclass(frozen=True)
class PassSpec:
    name: str
    stage: str
    fn: Callable  # (gm, ctx) -> PassOutcome | int
    expected: Optional[Callable] = None  # (ctx) -> int | None: matches the model must give (strict mode)

    @property
    def source_hash(self) -> str:
        """Hash of the pass's source file: a key for caching compiled artifacts per pass version."""
        return hashlib.sha256(inspect.getsource(inspect.getmodule(self.fn)).encode()).hexdigest()[:16]


REGISTRY: dict[str, PassSpec] = {}


def register_pass(stage: str, expected: Optional[Callable] = None):
    """Decorator: register ``fn(gm, ctx)`` under its own name in ``stage``."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; stages are {STAGES}")

    def wrap(fn: Callable[[fx.GraphModule, object], object]):
        if fn.__name__ in REGISTRY:
            raise ValueError(f"pass {fn.__name__!r} registered twice")
        REGISTRY[fn.__name__] = PassSpec(fn.__name__, stage, fn, expected)
        return fn

    return wrap


def passes_for(stages) -> list[PassSpec]:
    return [spec for stage in STAGES if stage in stages for spec in REGISTRY.values() if spec.stage == stage]
