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

from fxglm5.lowering.reference.collectives import all_gather_c10d, all_reduce_c10d


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
