"""The bodies of the collective ops (``fxglm5.ops.collectives`` declares them): torch's functional collectives
(``_c10d_functional`` + ``wait_tensor``, gloo or NCCL) on the process group an op names, resolved when it runs
(``fxglm5.parallel.resolve_group``). With no group (a single process) and ``world == 1`` they copy ``x``.

:func:`gather_split_rows` is the pattern of an op whose rows each rank could compute alone (the DSA indexer's
top-k, ``fxglm5::indexer_topk`` / ``rtp_indexer`` with a group): each rank computes a share of them and one
all_gather gives every rank all of them.
"""

from __future__ import annotations

from typing import Callable

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


def all_reduce_c10d_in_place(x: Tensor, group: str, world: int) -> Tensor:
    """:func:`all_reduce_c10d` whose sum overwrites ``x`` (``_c10d_functional.all_reduce_``) and is returned: for an
    ``x`` no one else reads (the ``reduce_in_place`` pass proves it), so the functional op's copy of ``x`` into a new
    tensor before the reduction (a copy kernel an all-reduce, two a decoder layer) is gone. A non-contiguous ``x``
    takes the functional op; with no group (``world == 1``) ``x`` is the sum already."""
    name = _group_name(group, world)
    if name is None:
        return x
    if not x.is_contiguous():
        return all_reduce_c10d(x, group, world)
    c10d = torch.ops._c10d_functional
    return c10d.wait_tensor(c10d.all_reduce_(x, "sum", name))


def all_gather_c10d(x: Tensor, dim: int, group: str, world: int) -> Tensor:
    """The ranks' ``x`` concatenated along ``dim`` through ``torch.ops._c10d_functional``."""
    name = _group_name(group, world)
    if name is None:
        return x.clone()
    c10d = torch.ops._c10d_functional
    stacked = c10d.wait_tensor(c10d.all_gather_into_tensor(x.contiguous(), world, name))  # [world * x.shape[0], ...]
    return stacked if dim % x.dim() == 0 else torch.cat(stacked.chunk(world, 0), dim=dim)


# A row-split op splits a step of at least this many rows per rank (64 x world: 512 rows at TP8), so that the
# decode steps (at most 64 requests at TP8, and a few draft tokens each) never split: there each rank's saved share
# of a few rows' top-k is worth less than the all-gather's own latency (typically 10-20 us for a small NCCL call over
# 8 NVLink GPUs; not measured here), against ~0.2 us of logits + top-k per row at an 8k context on an H100 (0.73 +
# 0.72 ms for 8192 rows, issue 47). At 512 rows over 8k contexts the split saves ~80 us of a layer's indexer for one
# all-gather of 4 MB (~10 us at 400 GB/s of bus bandwidth, plus its latency); rows whose causal window fits in the
# top-k cost the kernels almost nothing, so a short fresh prompt just past the threshold gains little. A step's row
# count is its shape, the same on every rank, so every rank takes the same branch.
MIN_ROWS_PER_RANK = 64


def split_rows(rows: int, world: int) -> int:
    """The rows a step of ``rows`` is padded to when a row-split op splits it over ``world`` ranks (a multiple of
    ``world``), or 0 where it does not split (``world == 1``, or fewer than ``MIN_ROWS_PER_RANK * world`` rows)."""
    if world == 1 or rows < MIN_ROWS_PER_RANK * world:
        return 0
    return -(-rows // world) * world


def gather_split_rows(select: Callable[[Tensor], Tensor], rows: int, group: str, world: int,
                      device: torch.device) -> Tensor | None:
    """Rows ``[0, rows)`` of a row-wise result computed a share per rank of ``group``: this rank computes
    ``select(index)`` (the rows ``index`` [n] -> [n, ...]) for its rows ``rank, rank + world, rank + 2 world, ...``
    of the step padded to ``split_rows(rows, world)`` (an index >= ``rows`` is a padding row: ``select`` computes
    something cheap there, which is cut off), and one all_gather (``all_gather_c10d``, rank order) then rebuilds
    every row in row order on every rank. None where the step does not split (``split_rows`` is 0): the caller
    computes every row itself.

    Rows are dealt round-robin, not in contiguous slices: causal work grows with a row's position (the indexer's
    logits skip the keys past it, and a row whose window fits in top-k entirely), so contiguous slices would leave
    the last rank the longest rows (at a fresh 8k prompt with top-2048, rank 7 of 8 would score a quarter of all
    keys, and ranks 0-1 none); round-robin gives each rank an equal share of every stretch of positions. It costs
    one reorder of the gathered rows (a copy of the [rows, ...] result)."""
    padded = split_rows(rows, world)
    if not padded:
        return None
    _group_name(group, world)  # the group must have ``world`` ranks
    rank = torch.distributed.get_rank(resolve_group(group))
    local = select(torch.arange(rank, padded, world, device=device))
    gathered = all_gather_c10d(local, 0, group, world)  # [world * padded / world, ...]: rank r's rows r::world
    tail = local.shape[1:]
    return gathered.view(world, padded // world, *tail).transpose(0, 1).reshape(padded, *tail)[:rows]
