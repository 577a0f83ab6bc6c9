"""Test helpers for sharded graphs: a cheap copy of a compiled graph (to shard it for several ranks in one process)
and a launcher of gloo ranks on this machine that run given graphs and return their outputs.

The ranks are forked, so they inherit the graphs built in the test process (nothing is pickled or compiled again);
a rank that hangs in a collective is killed at the deadline and the test fails."""

from __future__ import annotations

import copy
import datetime
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import fx

from fxglm5.capture.by_kind import DERIVED
from fxglm5.compiler import compile_graph
from fxglm5.parallel import Mapping
from fxglm5.passes.pipeline import Stage


def graph_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule with ``gm``'s nodes over the same tensors; a shard pass on it narrows the copy's attributes
    only (its own modules hold them) and its own recipes table."""
    nodes = fx.Graph()
    nodes._codegen = copy.deepcopy(gm.graph._codegen)
    nodes.output(nodes.graph_copy(gm.graph, {}))
    new = fx.GraphModule(gm, nodes)
    new.meta = {**gm.meta, DERIVED: dict(gm.meta.get(DERIVED, {}))}
    return new


def sharded(gm: fx.GraphModule, config, mapping: Mapping, head: str = "logits", lower: bool = True):
    """A copy of the matched + fused ``gm`` through the shard stage for ``mapping`` (strict) and, with ``lower``,
    the fuse_kernels and lower stages; returns (graph, results)."""
    new = graph_copy(gm)
    results = compile_graph(new, config, stages=(Stage.SHARD,), strict=True, mapping=mapping, head=head)
    if lower:
        results += compile_graph(new, config, stages=(Stage.FUSE_KERNELS, Stage.LOWER), device="cpu", strict=True,
                                 mapping=mapping, head=head)
    return new, results


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, programs: list, args: tuple, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        with torch.no_grad():
            outs = {name: graph(*args) for name, graph in programs[rank].items()}
        torch.save(outs, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_ranks(programs: list[dict], args: tuple, out_dir, deadline_s: float = 120.0) -> list[dict]:
    """Run ``programs[r]`` (name -> graph) on gloo rank r of ``len(programs)``, each on ``args``; returns every
    rank's {name: output}. Fails (and kills the ranks) past ``deadline_s``."""
    world = len(programs)
    context = mp.start_processes(_rank, args=(world, free_port(), programs, args, str(out_dir)), nprocs=world,
                                 join=False, start_method="fork")
    end = time.monotonic() + deadline_s
    while not context.join(timeout=1):
        if time.monotonic() > end:
            for process in context.processes:
                process.kill()
            raise AssertionError(f"{world} gloo ranks still running after {deadline_s} s (a hung collective?)")
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]
