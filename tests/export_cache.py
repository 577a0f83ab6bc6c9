"""A test-run-wide cache of ``torch.export.export``: the suite exports each distinct tiny model once.

Export is most of the suite's time (tens of seconds per tiny GLM-5 on 2 cores against ~2 s for every pass), and
most tests export the same few models again: the same tiny checkpoint through the CLI, the Runner, the artifact,
the RTP plugin. ``install()`` (called by tests/conftest.py) wraps ``torch.export.export`` so that a second export
of an identical module with identical inputs returns a copy of the first program instead of tracing again.

"Identical" is decided conservatively; anything not understood is exported for real:
- the module tree: every submodule's class (classes defined inside a function are never cached: their forward
  may close over values), its plain attributes (numbers, strings, dtypes, dataclasses such as the config; an
  object of another kind refuses the cache), no hooks; a GraphModule also by its generated code;
- every parameter, buffer and tensor attribute by name, shape, dtype, device and value (bytes hashed; meta
  tensors by shape only), so a model with other weights is another entry;
- the example inputs (shapes, dtypes, values), the dynamic shapes (dim names and ranges), every keyword and the
  FXGLM5_* environment.

A hit returns a deep copy of the cached program whose state dict and tensor constants are the calling module's
own tensors (as a real export's are), so nothing is shared between tests: a test that mutates its graph mutates
its copy. ``stats`` counts hits and misses (tests/test_export_cache.py checks the cache against real exports).
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
import hashlib
import os

import torch
from torch import fx

_real_export = torch.export.export
_programs: dict[str, torch.export.ExportedProgram] = {}
stats = {"hits": 0, "misses": 0, "uncached": 0}


class _Uncacheable(Exception):
    pass


def _tensor(t: torch.Tensor, out: list) -> None:
    out.append(("tensor", tuple(t.shape), str(t.dtype), str(t.device), t.requires_grad, type(t).__name__))
    if type(t) not in (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer):
        raise _Uncacheable(type(t).__name__)  # fake / functional / subclass tensors: no values to compare
    if t.device.type != "meta":
        data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        out.append(hashlib.blake2b(data.numpy().tobytes(), digest_size=16).hexdigest())


def _value(v, out: list) -> None:
    """Append a description of a plain value; refuse anything whose behaviour a description might not capture."""
    if v is None or isinstance(v, (bool, int, float, str, torch.dtype, torch.device, enum.Enum)):
        out.append((type(v).__name__, repr(v)))
    elif isinstance(v, torch.Tensor):
        _tensor(v, out)
    elif isinstance(v, (tuple, list)):
        out.append((type(v).__name__, len(v)))
        for x in v:
            _value(x, out)
    elif isinstance(v, dict):
        out.append(("dict", len(v)))
        for k, x in v.items():
            _value(k, out)
            _value(x, out)
    elif dataclasses.is_dataclass(v) and not isinstance(v, type):
        out.append(("dataclass", type(v).__module__, type(v).__qualname__))
        for f in dataclasses.fields(v):
            out.append(f.name)
            _value(getattr(v, f.name), out)
    elif "torch.export.dynamic_shapes" in (type(v).__module__, getattr(v, "__module__", None)):
        out.append(("dim", type(v).__name__, getattr(v, "__name__", None), getattr(v, "min", None),
                    getattr(v, "max", None), repr(v)))  # Dim, a derived Dim, Dim.AUTO / STATIC
    else:
        raise _Uncacheable(type(v).__qualname__)


_MODULE_DICT_SKIP = {"_parameters", "_buffers", "_modules", "training", "_non_persistent_buffers_set"}
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
          "_state_dict_hooks", "_load_state_dict_pre_hooks", "_forward_hooks_with_kwargs",
          "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called", "_state_dict_pre_hooks",
          "_load_state_dict_post_hooks")


def _module(m: torch.nn.Module, out: list) -> None:
    for name, sub in m.named_modules(remove_duplicate=False):
        cls = type(sub)
        if "<locals>" in cls.__qualname__:
            raise _Uncacheable(cls.__qualname__)
        out.append(("module", name, cls.__module__, cls.__qualname__, sub.training))
        if isinstance(sub, fx.GraphModule):
            out.append(sub.code)
        for k, v in sorted(vars(sub).items()):
            if k in _HOOKS:
                if v:
                    raise _Uncacheable(f"{name}: {k}")
            elif k not in _MODULE_DICT_SKIP and not (isinstance(sub, fx.GraphModule) and k in _GRAPH_MODULE_STATE):
                out.append(k)
                _value(v, out)
        for k, p in sorted(sub._parameters.items()):
            out.append(("param", k))
            _value(p, out)
        for k, b in sorted(sub._buffers.items()):
            out.append(("buffer", k, k in sub._non_persistent_buffers_set))
            _value(b, out)


# GraphModule bookkeeping whose content is its code (hashed above) or irrelevant to tracing.
_GRAPH_MODULE_STATE = {"_graph", "_code", "_lineno_map", "_prologue_start", "_tracer_cls", "_tracer_extras",
                       "meta", "_replace_hooks", "_create_node_hooks", "_erase_node_hooks", "_deepcopy_hooks",
                       "_in_spec", "_out_spec", "_codegen", "_graphmodule_cls_name", "_is_graph_module"}


def cache_key(mod, args, kwargs, dynamic_shapes, export_kwargs) -> str | None:
    """The cache key of one export call, or None where the call is not safely cacheable."""
    if not isinstance(mod, torch.nn.Module):
        return None
    out: list = []
    try:
        _module(mod, out)
        for part in (args, kwargs, dynamic_shapes, export_kwargs):
            _value(part, out)
        _value({k: v for k, v in sorted(os.environ.items()) if k.startswith("FXGLM5_")}, out)
        _value(torch.is_grad_enabled(), out)
    except _Uncacheable:
        return None
    return hashlib.blake2b(repr(out).encode(), digest_size=20).hexdigest()


def _own(path: str, mod: torch.nn.Module):
    return functools.reduce(getattr, path.split("."), mod)


def _rebound(program: torch.export.ExportedProgram, mod: torch.nn.Module) -> torch.export.ExportedProgram:
    """A deep copy of ``program`` whose state dict and tensor constants are ``mod``'s own tensors."""
    memo = {}
    for table in (program.state_dict, program.constants):
        for name, t in table.items():
            if isinstance(t, torch.Tensor):
                try:
                    mine = _own(name, mod)
                except AttributeError:
                    continue  # a constant export made itself (not an attribute of the module): copied
                memo[id(t)] = mine
    return copy.deepcopy(program, memo)


def cached_export(mod, args, kwargs=None, *, dynamic_shapes=None, **export_kwargs):
    key = cache_key(mod, args, kwargs, dynamic_shapes, export_kwargs)
    if key is None:
        stats["uncached"] += 1
        return _real_export(mod, args, kwargs, dynamic_shapes=dynamic_shapes, **export_kwargs)
    if key in _programs:
        stats["hits"] += 1
        return _rebound(_programs[key], mod)
    stats["misses"] += 1
    program = _real_export(mod, args, kwargs, dynamic_shapes=dynamic_shapes, **export_kwargs)
    _programs[key] = _rebound(program, mod)  # the stored copy shares only the module's own tensors
    return program


def install() -> None:
    torch.export.export = cached_export
