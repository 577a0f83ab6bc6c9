"""Ranks for tensor / expert parallel serving: start or join them, and make them agree before they communicate.

:func:`launch` runs ``fn(rank_info, *args)`` on every rank of a group of ``world`` ranks. Under an external
launcher (``torchrun``: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR / MASTER_PORT in the environment) this process
is one rank and joins the group; otherwise it spawns ``world`` local ranks (torch.multiprocessing, ``spawn``,
on 127.0.0.1 and a free port) and waits for them. The group is gloo on the CPU and NCCL on CUDA (each rank on
``cuda:{local_rank}``), registered under the name ``"tp"`` (``fxglm5.parallel.register_group``), which the
graph's collectives resolve at run time.

A rank that raises while the others wait in a collective would hang them, so what every rank must see alike is
checked with one all-gather before anything can diverge: :func:`agree` compares a value (the hash of the sharded
graph and plan at start-up, the request before each run) and raises :class:`RankMismatchError` on every rank
when any differs. Validation that follows it then sees identical inputs everywhere and raises everywhere.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import math
import os
import pickle
import queue as queue_module
import socket
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist

from fxglm5.errors import Fxglm5Error, InputError

GROUP = "tp"
ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")  # what torchrun sets for each rank
GRACE_SECONDS = 30.0  # how long the others may take to report after one rank failed, before they are stopped


class RankMismatchError(Fxglm5Error, RuntimeError):
    """The ranks of one group hold different programs or requests; running them would hang the collectives."""


@dataclasses.dataclass(frozen=True)
class RankInfo:
    rank: int
    world: int
    local_rank: int
    device: torch.device


def joined() -> bool:
    """True under an external launcher: torchrun gave this process its rank in the environment."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def device_for(device_type: str, local_rank: int) -> torch.device:
    if device_type not in ("cpu", "cuda"):
        raise InputError(f"device: {device_type!r} is not supported for several ranks (cpu or cuda)")
    if device_type == "cuda":
        if not torch.cuda.is_available() or local_rank >= torch.cuda.device_count():
            found = torch.cuda.device_count() if torch.cuda.is_available() else 0
            raise InputError(f"device: cuda:{local_rank} is needed for local rank {local_rank}, {found} CUDA devices found")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def leave() -> None:
    """Destroy this process's group and forget the name it was registered under, so that nothing afterwards in the
    process (another Runner, a single-rank compile) resolves "tp" to a destroyed group."""
    from fxglm5.parallel import register_group

    register_group(GROUP, None)
    dist.destroy_process_group()


def init(rank: int, world: int, local_rank: int, device_type: str, init_method: str = "env://") -> RankInfo:
    """Join the process group (gloo on the CPU, NCCL on CUDA) and register it as ``"tp"``."""
    from fxglm5.parallel import register_group

    device = device_for(device_type, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    options = dict(device_id=device) if device.type == "cuda" else {}
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init_method, rank=rank,
                            world_size=world, timeout=datetime.timedelta(minutes=10), **options)
    register_group(GROUP, dist.group.WORLD)
    return RankInfo(rank, world, local_rank, device)


def _env_int(name: str) -> int:
    value = os.environ.get(name, "")
    if not value.isdigit():
        raise InputError(f"environment: {name}={value!r} is not a non-negative integer (set by torchrun)")
    return int(value)


def launch(fn: Callable, world: int, *args, device: str = "cpu", timeout: float | None = None) -> tuple[int, Any]:
    """Run ``fn(rank_info, *args)`` on each of ``world`` ranks. Returns ``(rank, value)``: joined (torchrun), this
    rank's; spawned, rank 0's (in the parent). An Fxglm5Error on a spawned rank is raised again in the parent (the
    lowest rank's); any other failure, or ``timeout`` seconds passing, is a RuntimeError naming the ranks."""
    if not isinstance(world, int) or world < 1:
        raise InputError(f"--tp: the number of ranks must be a positive integer, got {world!r}")
    if joined():
        size = _env_int("WORLD_SIZE")
        if size != world:
            raise InputError(f"--tp {world}: the external launcher started WORLD_SIZE={size} ranks")
        info = init(_env_int("RANK"), size, _env_int("LOCAL_RANK") if "LOCAL_RANK" in os.environ else 0, device)
        try:
            value = fn(info, *args)
            # every rank done before any leaves: a gloo worker thread still releasing the last collective's tensors
            # when the interpreter shuts down aborts the process ("terminate called without an active exception"),
            # though its output was right (torchrun -m fxglm5 generate --tp 2: 2 runs in 20 before, none in 40 after)
            dist.barrier()
        finally:
            leave()
        return info.rank, value
    device_for(device, world - 1)  # every local rank needs a device: refused here, before any process starts
    return 0, spawn(fn, world, *args, device=device, timeout=timeout)[0]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn: Callable, world: int, *args, device: str = "cpu", timeout: float | None = None) -> list:
    """Start ``world`` local ranks running ``fn(rank_info, *args)`` (``fn`` importable by name: the ranks are new
    interpreters); every rank's value in rank order, or the failure :func:`launch` describes."""
    context = torch.multiprocessing.get_context("spawn")
    results = context.Queue()
    method = f"tcp://127.0.0.1:{free_port()}"
    procs = [context.Process(target=_rank_main, args=(rank, world, device, method, fn, args, results), daemon=True)
             for rank in range(world)]
    for p in procs:
        p.start()
    values, errors = {}, {}
    deadline = math.inf if timeout is None else time.monotonic() + timeout
    grace = False
    try:
        while len(values) + len(errors) < world:
            if errors and not grace:  # a rank stuck in a collective with the failed one would never report
                deadline, grace = min(deadline, time.monotonic() + GRACE_SECONDS), True
            if time.monotonic() > deadline:
                break
            report = _next(results, procs, values.keys() | errors.keys())
            if report is not None:
                rank, ok, value = report
                (values if ok else errors)[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join()
    if errors:  # the cause: an Fxglm5Error before the others' "connection closed by peer", else the first report
        raise next((e for e in errors.values() if isinstance(e, Fxglm5Error)), next(iter(errors.values())))
    if len(values) < world:
        missing = sorted(set(range(world)) - set(values))
        raise RuntimeError(f"ranks {missing} did not finish within {timeout} s (a hang in a collective?)")
    return [values[r] for r in range(world)]


def _next(results, procs, reported):
    """The next rank's report ``(rank, ok, value)`` within half a second, else None; a rank that died without
    reporting is reported as a failure."""
    try:
        return pickle.loads(results.get(timeout=0.5))
    except queue_module.Empty:
        pass
    for rank, p in enumerate(procs):
        if rank not in reported and p.exitcode is not None and p.exitcode != 0:
            return rank, False, RuntimeError(f"rank {rank} died with exit code {p.exitcode}")
    return None


def _rank_main(rank: int, world: int, device: str, init_method: str, fn: Callable, args: tuple, results) -> None:
    """One spawned rank: join the group, run ``fn``, report its value or error to the parent."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # the ranks share this host's cores
    try:
        info = init(rank, world, rank, device, init_method)
        report = (rank, True, fn(info, *args))
    except Fxglm5Error as err:
        report = (rank, False, err)
    except BaseException:  # noqa: BLE001 - reported to the parent with its traceback, never swallowed
        report = (rank, False, RuntimeError(f"rank {rank} failed:\n{traceback.format_exc()}"))
    try:  # by value (plain pickle): torch's queue pickler would share tensors through this exiting process
        results.put(pickle.dumps(report))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def agree(value: str, what: str, group: str = GROUP) -> None:
    """All-gather ``value`` over ``group`` and raise RankMismatchError on every rank unless all ranks hold it."""
    from fxglm5.parallel import resolve_group

    handle = resolve_group(group)
    values: list = [None] * dist.get_world_size(handle)
    dist.all_gather_object(values, value, group=handle)
    differ = [r for r, v in enumerate(values) if v != values[0]]
    if differ:
        raise RankMismatchError(f"{what}: rank {differ[0]} has {values[differ[0]]}, rank 0 has {values[0]}; every "
                                "rank must run the same program on the same inputs (their collectives would hang)")


def digest(*parts) -> str:
    """A short hash of ``repr(parts)``: what :func:`agree` compares for a request."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]
