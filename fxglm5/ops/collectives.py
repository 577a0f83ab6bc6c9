"""The collective ops the shard stage emits: ``fxglm5::all_reduce`` (sum) and ``fxglm5::all_gather``.

- ``all_reduce(x, group: str, world: int) -> Tensor``: the sum of ``x`` over the ranks of the group named ``group``.
- ``all_gather(x, dim: int, group: str, world: int) -> Tensor``: the ranks' ``x`` concatenated along ``dim``
  (rank order), so ``dim`` grows ``world``-fold.

The group is a name resolved when the op runs (``fxglm5.parallel.resolve_group``), so the graph holds no c10d id.
``world`` is the number of ranks the graph was sharded for: it makes the fake implementation's shapes independent
of whatever group the tracing process has, and the op refuses to run on a group of another size (a graph sharded
for 2 ranks run by a single process would otherwise silently compute with half the heads). Both run as torch's
functional collectives (``_c10d_functional`` + ``wait_tensor``, gloo or NCCL); with no group (a single process)
and ``world == 1`` they copy ``x``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fxglm5.errors import InputError
from fxglm5.parallel import resolve_group


def _group_name(group: str, world: int) -> str | None:
    """The c10d name of the group ``group`` (None for a single process), which must have ``world`` ranks."""
    found = resolve_group(group)
    size = 1 if found is None else torch.distributed.get_world_size(found)
    if size != world:
        raise InputError(f"collective on process group {group!r}: the graph was sharded for {world} ranks, the group "
                         f"has {size}")
    return None if found is None else found.group_name


def all_reduce_c10d(x: Tensor, group: str, world: int) -> Tensor:
    """Sum over the group's ranks through ``torch.ops._c10d_functional`` (the lowered form of ``all_reduce``)."""
    name = _group_name(group, world)
    if name is None:
        return x.clone()
    c10d = torch.ops._c10d_functional
    return c10d.wait_tensor(c10d.all_reduce(x.contiguous(), "sum", name))


def all_gather_c10d(x: Tensor, dim: int, group: str, world: int) -> Tensor:
    """The ranks' ``x`` concatenated along ``dim`` through ``torch.ops._c10d_functional``."""
    name = _group_name(group, world)
    if name is None:
        return x.clone()
    c10d = torch.ops._c10d_functional
    stacked = c10d.wait_tensor(c10d.all_gather_into_tensor(x.contiguous(), world, name))  # [world * x.shape[0], ...]
    return stacked if dim % x.dim() == 0 else torch.cat(stacked.chunk(world, 0), dim=dim)


@torch.library.custom_op("fxglm5::all_reduce", mutates_args=())
def all_reduce(x: Tensor, group: str, world: int) -> Tensor:
    return all_reduce_c10d(x, group, world)


@all_reduce.register_fake
def _(x, group, world):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("fxglm5::all_gather", mutates_args=())
def all_gather(x: Tensor, dim: int, group: str, world: int) -> Tensor:
    return all_gather_c10d(x, dim, group, world)


@all_gather.register_fake
def _(x, dim, group, world):
    shape = list(x.shape)
    shape[dim] = shape[dim] * world
    return x.new_empty(shape)
