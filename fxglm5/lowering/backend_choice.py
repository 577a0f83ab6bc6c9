"""The backend choice: for each fxglm5 op node, the first backend in preference order that takes it.

Backends, in order of preference on each device kind: ``aiter`` (ROCm, where ``import aiter`` works),
``triton`` (CUDA/ROCm), ``reference`` (torch, any device). ``FXGLM5_BACKEND`` (or the ``lower`` pass's
``backend`` option) puts one backend first. The choice is made once per node, at lower time, from the node's
metadata (``node.meta['val']`` of its arguments: dtypes, shapes, which optional arguments are given), the
target device and what is importable (:func:`choose`); each implementation's ``supports`` check names why it
refuses (e.g. unquantized MoE weights). Only a node whose choice reads an argument without metadata is left to
choose per call at run time (:class:`Dispatch`, each fallback logged once per (op, backend, reason)): the paged
caches are run-time inputs (one graph serves FP8 and exact index caches), so the Triton indexer's check on the
index cache's dtype is made per call.

``inputs_validated`` (the ``lower`` pass's ``ctx.extras["inputs_validated"]``, from the compile's option): the
program's caller validates every step's forward context, so an implementation's ``unchecked`` body (the cached
ops' bodies without their own host-syncing checks) is bound where it has one.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional, Sequence

import torch

from fxglm5 import settings
from fxglm5.errors import InputError
from fxglm5.lowering import implementations as table
from fxglm5.lowering.implementations import BACKENDS, Impl, implementations

log = logging.getLogger(__name__)
_warned: set = set()


def preferred_backend(override: Optional[str] = None) -> Optional[str]:
    """The backend to put first: ``override`` (the ``backend`` option), else the FXGLM5_BACKEND variable, else
    None; InputError naming the option or the variable and the allowed values for anything else."""
    name, value = ("backend", override) if override else ("environment variable FXGLM5_BACKEND", settings.backend())
    if value is not None and value not in BACKENDS:
        allowed = ", ".join(map(repr, BACKENDS))
        raise InputError(f"{name} must be one of {allowed} (or unset: the best for the device), got {value!r}")
    return value


def backend_order(device_type: str, override: Optional[str] = None) -> list[str]:
    """Backends to try, in order, for tensors on ``device_type``."""
    override = preferred_backend(override)
    if device_type == "cuda":
        order = (["aiter"] if table.aiter_available() else []) + ["triton", "reference"]
    else:
        order = ["reference"]  # Triton on CPU tensors only runs interpreted: opt in with FXGLM5_BACKEND=triton
    if override:
        order = [override] + [b for b in order if b != override]
    return order


@dataclasses.dataclass(frozen=True)
class Choice:
    """The backend chosen for one call (or node) and why each one before it was passed over."""

    backend: str
    impl: Impl
    refused: tuple[tuple[str, str], ...] = ()  # (backend, reason)


def choose(op: str, order: Sequence[str], device_type: str, args: Sequence) -> Choice:
    """The first backend of ``order`` that implements ``op``, runs on ``device_type`` and supports ``args``
    (real tensors, or the fake / meta tensors of a node's metadata: the checks read dtypes and shapes only)."""
    impls, refused = implementations(op), []
    for name in order:
        if name not in impls:
            continue
        impl = impls[name]
        reason = table.device_supports(name, device_type)
        if reason is None and impl.supports is not None:
            reason = impl.supports(*args)
        if reason is None:
            return Choice(name, impl, tuple(refused))
        refused.append((name, reason))
    raise ValueError(f"no backend of {list(order)} supports this fxglm5::{op} call on {device_type}: {refused}")


def _body(impl: Impl, inputs_validated: bool, in_place: bool = False):
    if in_place and impl.in_place is not None:
        return impl.in_place
    return impl.unchecked if inputs_validated and impl.unchecked is not None else impl.fn


class Bound:
    """What the ``lower`` pass puts in the graph for a node whose backend it chose: that implementation."""

    def __init__(self, op: str, backend: str, fn):
        self.op, self.backend, self.fn = op, backend, fn
        self.__name__ = f"fxglm5_{op}_{backend}"

    def __call__(self, *args):
        return self.fn(*args)


class Dispatch:
    """The run-time choice for a node whose choice reads a run-time input: each call takes the first supporting
    backend (its in-place body where the node is marked so, as :func:`bind` gives a :class:`Bound`)."""

    def __init__(self, op: str, order: list[str], device_type: str, inputs_validated: bool = False,
                 in_place: bool = False):
        self.op, self.order, self.device_type, self.inputs_validated = op, order, device_type, inputs_validated
        self.in_place = in_place
        if not any(name in implementations(op) for name in order):
            raise ValueError(f"no implementation of fxglm5::{op} for backends {order}")
        self.backend = "runtime"
        self.__name__ = f"fxglm5_{op}_runtime"

    def __call__(self, *args):
        choice = choose(self.op, self.order, self.device_type, args)
        for name, reason in choice.refused:
            key = (self.op, name, reason)
            if key not in _warned:
                _warned.add(key)
                log.warning("fxglm5: %s on %s falls back (%s)", self.op, name, reason)
        return _body(choice.impl, self.inputs_validated, self.in_place)(*args)


class Undecided(Exception):
    """A ``supports`` check read an argument whose value is known only at run time."""


class _RunTimeValue:
    """Stands for a node argument without ``meta['val']`` (a run-time input such as a paged cache): reading any
    attribute of it raises :class:`Undecided`. (``is None`` checks see correctly that a node is given.)"""

    def __init__(self, node: torch.fx.Node):
        self._node = node

    def __getattr__(self, name):
        raise Undecided(f"{self._node.name}.{name}")


def _meta_args(node: torch.fx.Node) -> tuple:
    """The node's arguments with every input node replaced by its ``meta['val']`` (or a :class:`_RunTimeValue`)."""
    return tuple(torch.fx.node.map_aggregate(
        node.args, lambda a: (a.meta["val"] if "val" in a.meta else _RunTimeValue(a)) if isinstance(a, torch.fx.Node) else a))


def bind(node: torch.fx.Node, op: str, order: list[str], device_type: str, inputs_validated: bool = False):
    """The graph target for ``node`` (an fxglm5 op call): a :class:`Bound` chosen from its metadata now, or a
    :class:`Dispatch` when the choice reads an argument known only at run time. A node marked
    ``meta["fxglm5_in_place"]`` gets the chosen implementation's in-place body where it has one."""
    in_place = node.meta.get("fxglm5_in_place", False)
    try:
        choice = choose(op, order, device_type, _meta_args(node))
    except Undecided:
        return Dispatch(op, order, device_type, inputs_validated, in_place)
    return Bound(op, choice.backend, _body(choice.impl, inputs_validated, in_place))
