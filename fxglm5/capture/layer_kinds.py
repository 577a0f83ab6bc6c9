"""Which decoder layers are the same kind, and the shortest leading run of layers that shows every kind in
every context it occurs in (the part of the model ``capture.by_kind`` exports).

Two layers are the same kind only when that can be proven from the module objects: the same module tree
(names and classes), the same plain (non-tensor) attributes except the layer index (other objects, such as
the config, must be the very same object, and not beside a layer index, which could look itself up in it), the same parameter and
buffer names, shapes, dtypes and devices, no instance-level ``forward`` and no hooks anywhere (nor global
module hooks). Anything that cannot be compared (an attribute holding a config object, a callable, ...) is
:class:`Unprovable`, and the caller captures the whole model instead.

A layer's graph can depend on the layers before it (GLM-5's "shared" indexer layer reuses the previous
layer's selection; a first MoE layer follows a dense one), so layers are grouped by their *context*: the kinds
of the ``depth`` layers before it and its own. The prefix is the shortest leading run that holds every context
of the model and ends with the model's last ``depth`` kinds (the final norm reads the last layer), and every
layer copies the first prefix position with its context.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

LAYER_INDEX_NAMES = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number"})
_PLAIN = (int, float, str, bool, type(None), torch.dtype, torch.device)
_MODULE_INTERNALS = frozenset(vars(nn.Module()))
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")


class Unprovable(Exception):
    """Layers cannot be proven to be the same kind (or a rewritten layer cannot be copied): capture the whole
    model. The message says why."""


def decoder_layers(model: nn.Module, path: str = "model.layers") -> nn.ModuleList:
    """The ``model.layers`` ModuleList of a causal LM (the loop capture-by-kind shortens)."""
    try:
        layers = model.get_submodule(path)
    except AttributeError:
        raise Unprovable(f"the model has no {path}") from None
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise Unprovable(f"{path} is not a non-empty ModuleList")
    return layers


def _plain(value, shared: list):
    """A comparable stand-in for an attribute: plain data as itself, any other object by identity (layers are
    the same kind only if they hold the very same object, e.g. one config; ``shared`` collects them)."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (tuple, list)):
        return tuple(_plain(v, shared) for v in value)
    shared.append(value)
    return ("object", type(value).__qualname__, id(value))


def _tensors(tensors: dict, kind: str) -> tuple:
    return tuple((kind, name, tuple(t.shape), t.dtype, t.device.type, type(t).__name__)
                 for name, t in tensors.items() if t is not None)


def layer_key(layer: nn.Module, where: str = "layer") -> tuple:
    """Everything that decides a layer's graph except its tensors' values and its index; raises Unprovable
    where it cannot tell (a hook, an instance ``forward``, an attribute that is not plain data)."""
    for name in _GLOBAL_HOOKS:
        if getattr(nn.modules.module, name, None):
            raise Unprovable(f"a global module hook ({name}) is registered")
    parts, shared, indexed = [], [], []
    for name, module in layer.named_modules(remove_duplicate=False):
        at = f"{where}.{name}" if name else where
        if any(getattr(module, hooks, None) for hooks in _HOOK_DICTS):
            raise Unprovable(f"{at} has a forward or backward hook")
        if "forward" in vars(module):
            raise Unprovable(f"{at} has an instance-level forward")
        indexed += [f"{at}.{k}" for k in vars(module) if k in LAYER_INDEX_NAMES]
        attrs = tuple(sorted((k, _plain(v, shared)) for k, v in vars(module).items()
                             if k not in _MODULE_INTERNALS and k not in LAYER_INDEX_NAMES))
        tensors = _tensors(module._parameters, "parameter") + _tensors(module._buffers, "buffer")
        persistent = tuple(sorted(module._non_persistent_buffers_set))
        parts.append((name, type(module), module.training, attrs, tensors, persistent))
    if indexed and shared:
        raise Unprovable(f"{indexed[0]} is a layer index and the layer holds a shared "
                         f"{type(shared[0]).__name__}: its forward could look itself up in it")
    return tuple(parts)


@dataclasses.dataclass(frozen=True)
class KindPlan:
    """``kinds[i]``: layer i's kind (numbered in order of first appearance); ``prefix``: how many leading layers
    are exported; ``source[i]``: the prefix position whose rewritten graph layer i copies; ``depth``: how many
    preceding layers' kinds a context includes."""

    kinds: tuple[int, ...]
    prefix: int
    source: tuple[int, ...]
    depth: int

    def multiplicity(self, position: int) -> int:
        """How many layers of the model copy prefix position ``position``."""
        return self.source.count(position)


def plan_kinds(keys: list, depth: int = 1) -> KindPlan:
    """The plan for layers whose keys (:func:`layer_key`) are ``keys``."""
    ids: dict = {}
    kinds = tuple(ids.setdefault(key, len(ids)) for key in keys)
    total = len(kinds)

    def kind(i: int):
        return kinds[i] if i >= 0 else None

    def context(i: int) -> tuple:
        return tuple(kind(i - e) for e in range(depth, -1, -1))

    needed = {context(i) for i in range(total)}
    seen: dict[tuple, int] = {}
    for n in range(1, total + 1):
        seen.setdefault(context(n - 1), n - 1)
        if len(seen) == len(needed) and all(kind(n - e) == kind(total - e) for e in range(1, depth + 1)):
            break
    return KindPlan(kinds, n, tuple(seen[context(i)] for i in range(total)), depth)


def model_plan(model: nn.Module, depth: int = 1, path: str = "model.layers") -> KindPlan:
    """The kind plan of ``model``'s decoder layers (raises Unprovable where a layer cannot be keyed)."""
    layers = decoder_layers(model, path)
    return plan_kinds([layer_key(layer, f"{path}.{i}") for i, layer in enumerate(layers)], depth)
