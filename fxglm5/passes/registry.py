"""The pass registry: every pass module registers its function under the stage
:mod:`fxglm5.passes.pipeline` declares for it; :func:`passes_for` gives them in the declared order.

A pass's :attr:`PassSpec.source_hash` covers its own module and the fxglm5 helper modules it imports
(transitively, within ``fxglm5.passes`` and ``fxglm5.ops``): the key under which an artifact records which
version of each pass made it.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib.util
import inspect
from typing import Callable, Optional

from torch import fx

from fxglm5.errors import PassError
from fxglm5.passes.pipeline import DECLARED, PIPELINE, STAGES, Stage, stages_of

HASHED_PACKAGES = ("fxglm5.passes", "fxglm5.ops")  # helper modules whose source is part of a pass's hash
# ``import fxglm5.passes`` (as run_pipeline does) registers every pass: not a helper, or each pass's hash would
# change with every other pass
NOT_HELPERS = ("fxglm5.passes",)


@dataclasses.dataclass(frozen=True)
class PassSpec:
    name: str
    stage: Stage
    fn: Callable  # (gm, ctx) -> PassOutcome | int
    expected: Optional[Callable] = None  # (ctx) -> int | None: matches the model must give

    @property
    def source_hash(self) -> str:
        """Hash of the pass's module and of every helper module it imports (see :func:`helper_modules`)."""
        digest = hashlib.sha256()
        for name in helper_modules(self.fn.__module__):
            digest.update(f"{name}\0{module_source(name)}\0".encode())
        return digest.hexdigest()[:16]


REGISTRY: dict[str, PassSpec] = {}


def register_pass(stage: str | Stage, expected: Optional[Callable] = None):
    """Decorator: register ``fn(gm, ctx)`` under its own name in ``stage``, which must be the stage the
    pipeline declares for that name."""
    stage = stages_of((stage,))[0]

    def wrap(fn: Callable[[fx.GraphModule, object], object]):
        name = fn.__name__
        if name in REGISTRY:
            raise ValueError(f"pass {name!r} registered twice")
        if DECLARED.get(name) != stage:
            where = f"under stage {DECLARED[name].value!r}" if name in DECLARED else "in no stage"
            raise ValueError(f"pass {name!r} registered in stage {stage.value!r}; fxglm5.passes.pipeline declares it {where}")
        REGISTRY[name] = PassSpec(name, stage, fn, expected)
        return fn

    return wrap


def passes_for(stages) -> list[PassSpec]:
    """The passes of ``stages``, in the declared order (stage by stage, then as PIPELINE lists them)."""
    chosen = stages_of(stages)
    missing = [name for stage in chosen for name in PIPELINE[stage] if name not in REGISTRY]
    if missing:
        raise PassError(f"fxglm5.passes.pipeline declares {missing}, which no module registered (import fxglm5.passes)")
    return [REGISTRY[name] for stage in chosen for name in PIPELINE[stage]]


def module_source(name: str) -> str:
    return inspect.getsource(importlib.import_module(name))


def helper_modules(name: str) -> list[str]:
    """``name`` and the modules of HASHED_PACKAGES it imports, directly or through one another, sorted."""
    seen, todo = set(), [name]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        todo += [m for m in _imports(current) if m not in NOT_HELPERS and _hashed(m)]
    return sorted(seen)


def _hashed(name: str) -> bool:
    return any(name == package or name.startswith(package + ".") for package in HASHED_PACKAGES)


def _imports(name: str) -> list[str]:
    """The modules ``name``'s source imports: ``from P import x`` names P.x where that is a module, else P."""
    found = []
    for node in ast.walk(ast.parse(module_source(name))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{alias.name}" for alias in node.names]
            modules = [sub for sub in subs if _hashed(sub) and _is_module(sub)]
            found += modules if len(modules) == len(subs) else [node.module, *modules]
    return found


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
