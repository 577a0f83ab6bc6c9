"""The bodies of the collective ops (``fxglm5.ops.collectives`` declares them): torch's functional collectives
(``_c10d_functional`` + ``wait_tensor``, gloo or NCCL) on the process group an op names, resolved when it runs
(``fxglm5.parallel.resolve_group``). With no group (a single process) and ``world == 1`` they copy ``x``."""

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
