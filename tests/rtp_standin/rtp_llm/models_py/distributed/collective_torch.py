"""Test stand-in of ``rtp_llm/models_py/distributed/collective_torch.py`` (rtp-llm 4b8d39cd5; not RTP-LLM code).

What RTP's ``BackendManager.start`` does before it builds the model when ``world_size > 1``:
``init_distributed_environment`` initializes torch.distributed over all ranks (WORLD = ``Group.DP_AND_TP``) and,
where the TP or DP groups are not WORLD, creates them with ``new_group`` (keys ``"TP{dp_rank}"`` /
``"DP{tp_rank}"``); ``_get_group`` resolves a ``Group`` to this rank's process group, as RTP's does.
Differs: gloo on the CPU (RTP asserts NCCL), no symmetric memory, no C++ comm-op registration (the stand-in's
engine calls :func:`all_gather` / :func:`broadcast` / :func:`all_reduce` where RTP's C++ calls back into them).
"""

from __future__ import annotations

from datetime import timedelta
from enum import Enum

import torch
import torch.distributed


class Group(Enum):
    DP = "DP"
    TP = "TP"
    DP_AND_TP = "DP_AND_TP"


_group_map: dict = {}
_parallelism_config = None
_initialized = False


def init_distributed_environment(parallelism_config, nccl_comm_config, nccl_init_port, backend="gloo", timeout=None):
    global _parallelism_config, _initialized
    pc = parallelism_config
    torch.distributed.init_process_group(backend=backend, init_method=f"tcp://{nccl_comm_config.nccl_ip}:{nccl_init_port}",
                                         world_size=pc.world_size, rank=pc.world_rank,
                                         timeout=timedelta(seconds=timeout or 7200))
    _group_map[Group.DP_AND_TP] = torch.distributed.group.WORLD
    if pc.dp_size > 1 and pc.world_size != pc.dp_size:
        for tp_rank in range(pc.tp_size):
            ranks = [r for r in range(pc.world_size) if r % pc.tp_size == tp_rank]
            group = torch.distributed.new_group(ranks=ranks, backend=backend)
            if pc.world_rank in ranks:
                _group_map[Group.DP.name + str(tp_rank)] = group
    if pc.tp_size > 1 and pc.world_size != pc.tp_size:
        for dp_rank in range(pc.dp_size):
            ranks = [r for r in range(pc.world_size) if r // pc.tp_size == dp_rank]
            group = torch.distributed.new_group(ranks=ranks, backend=backend)
            if pc.world_rank in ranks:
                _group_map[Group.TP.name + str(dp_rank)] = group
    _parallelism_config, _initialized = pc, True


def distributed_environment_initialized() -> bool:
    return torch.distributed.is_initialized()


def destroy_distributed_environment():
    global _parallelism_config, _initialized
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    _group_map.clear()
    _parallelism_config, _initialized = None, False


def _get_group(group: Group):
    if not torch.distributed.is_initialized() or not _initialized:
        raise RuntimeError("Distributed environment is not initialized. Call init_distributed_environment first.")
    pc = _parallelism_config
    if group == Group.DP and pc.dp_size > 1 and pc.world_size != pc.dp_size:
        key = Group.DP.name + str(torch.distributed.get_rank() % pc.tp_size)
    elif group == Group.TP and pc.tp_size > 1 and pc.world_size != pc.tp_size:
        key = Group.TP.name + str(torch.distributed.get_rank() // pc.tp_size)
    else:
        key = Group.DP_AND_TP
    if key not in _group_map:
        raise ValueError(f"Process group {key} not found. Make sure init_distributed_environment() was called.")
    return _group_map[key]


def broadcast(tensor, src, group):
    torch.distributed.broadcast(tensor, src, group=_get_group(group))


def all_reduce(tensor, group, *, inplace=False, op=torch.distributed.ReduceOp.SUM):
    torch.distributed.all_reduce(tensor, op=op, group=_get_group(group))
    return tensor


def all_gather(tensor, group):
    """The ranks' ``tensor`` concatenated along dim 0, in rank order."""
    process_group = _get_group(group)
    out = torch.zeros([torch.distributed.get_world_size(process_group) * tensor.shape[0]] + list(tensor.shape)[1:],
                      device=tensor.device, dtype=tensor.dtype)
    torch.distributed.all_gather_into_tensor(out, tensor.contiguous(), group=process_group)
    return out
