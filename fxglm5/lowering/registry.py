"""The kernel registry: op -> implementation per backend, chosen per call by a capability check.

Backends, in order of preference on each device kind: ``aiter`` (ROCm, where ``import aiter`` works),
``triton`` (CUDA/ROCm), ``reference`` (torch, any device). ``FXGLM5_BACKEND`` (or the ``lower`` pass's
``backend`` option) puts one backend first. An implementation may refuse a call (its ``supports`` check
says no: e.g. unquantized MoE weights, a shape it has no kernel for); the call then falls to the next
backend and the fallback is logged once per (op, backend, reason).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import logging
import os
from typing import Callable, Optional

import torch

from fxglm5.errors import InputError

log = logging.getLogger(__name__)
BACKENDS = ("aiter", "triton", "reference")


@dataclasses.dataclass(frozen=True)
class Impl:
    fn: Callable
    supports: Optional[Callable[..., Optional[str]]] = None  # returns None if supported, else a reason


_IMPLS: dict[str, dict[str, Impl]] = {}
_warned: set = set()


def register(op: str, backend: str, supports: Optional[Callable[..., Optional[str]]] = None):
    """Decorator: ``fn`` implements fxglm5 op ``op`` on ``backend``."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; backends are {BACKENDS}")

    def wrap(fn):
        _IMPLS.setdefault(op, {})[backend] = Impl(fn, supports)
        return fn

    return wrap


def implementations(op: str) -> dict[str, Impl]:
    """Every backend's implementation of ``op``; ``reference`` is the custom op's own torch kernel."""
    _load_bindings()
    impls = dict(_IMPLS.get(op, {}))
    if "reference" not in impls and hasattr(torch.ops.fxglm5, op):
        impls["reference"] = Impl(getattr(torch.ops.fxglm5, op).default)
    return impls


@functools.lru_cache(maxsize=None)
def aiter_available() -> bool:
    if not getattr(torch.version, "hip", None):
        return False
    try:
        return importlib.util.find_spec("aiter") is not None
    except (ImportError, ValueError):
        return False


def preferred_backend(override: Optional[str] = None) -> Optional[str]:
    """The backend to put first: ``override`` (the ``backend`` option), else the FXGLM5_BACKEND variable, else
    None; InputError naming the option or the variable and the allowed values for anything else."""
    name, value = ("backend", override) if override else ("environment variable FXGLM5_BACKEND",
                                                         os.environ.get("FXGLM5_BACKEND") or None)
    if value is not None and value not in BACKENDS:
        allowed = ", ".join(map(repr, BACKENDS))
        raise InputError(f"{name} must be one of {allowed} (or unset: the best for the device), got {value!r}")
    return value


def backend_order(device_type: str, override: Optional[str] = None) -> list[str]:
    """Backends to try, in order, for tensors on ``device_type``."""
    override = preferred_backend(override)
    if device_type == "cuda":
        order = (["aiter"] if aiter_available() else []) + ["triton", "reference"]
    else:
        order = ["reference"]  # Triton on CPU tensors only runs interpreted: opt in with FXGLM5_BACKEND=triton
    if override:
        order = [override] + [b for b in order if b != override]
    return order


class Dispatch:
    """The callable the ``lower`` pass puts in the graph for one op: the first supporting backend wins."""

    def __init__(self, op: str, order: list[str]):
        self.op, self.order = op, order
        impls = implementations(op)
        self.candidates = [(name, impls[name]) for name in order if name in impls]
        if not self.candidates:
            raise ValueError(f"no implementation of fxglm5::{op} for backends {order}")
        self.__name__ = f"fxglm5_{op}_{'_'.join(name for name, _ in self.candidates)}"

    def __call__(self, *args):
        for name, impl in self.candidates:
            reason = impl.supports(*args) if impl.supports is not None else None
            if reason is None:
                return impl.fn(*args)
            key = (self.op, name, reason)
            if key not in _warned:
                _warned.add(key)
                log.warning("fxglm5: %s on %s falls back (%s)", self.op, name, reason)
        raise RuntimeError(f"no backend of {[n for n, _ in self.candidates]} supports this fxglm5::{self.op} call")

    def chosen(self, *args) -> str:
        """The backend a call with ``args`` would run on (for tests and reports)."""
        for name, impl in self.candidates:
            if impl.supports is None or impl.supports(*args) is None:
                return name
        return "none"


@functools.lru_cache(maxsize=None)
def _load_bindings() -> None:
    from fxglm5.lowering import bindings  # noqa: F401  (registers reference, triton and aiter impls)
