"""The floors a persistent decode layer rests on, measured alone (docs/perf/persistent_decode_layer.md, "What to
measure before building it"; issue 45, item 7):

- ``launch``: the cost of one kernel inside a captured CUDA graph, an empty Triton kernel launched N times in one
  graph, over one CTA and over one CTA per SM: what a launch costs the step, the most that joining launches wins.
- ``stream``: the bandwidth one persistent grid reaches streaming weights once: ``ctas`` CTAs an SM walk
  [rows, 128]-byte tiles of a buffer of a decoder layer's bytes (and of 1 GB) with a ``stages``-deep software
  pipeline and sum them (a checksum, so no load is dead), against a device-to-device copy measured in the same run:
  the ceiling of a persistent kernel's weight streaming.
- ``hop``: the cost of one dependency between tasks through a counter in global memory: N CTAs each take a task
  id (an atomic queue, as ``fxglm5.lowering.triton.tasks`` does), spin until the counter reaches their id (acquire)
  and add one (release): a chain of N hops in one launch, us per hop, the granularity a task table can afford.

    python bench/decode_floors.py [--only launch,stream,hop] [--layer-mb 160]
    python bench/decode_floors.py --tiny     # CPU, Triton interpreted: the kernels' checks only, no timing

Results: ``decode_floors.json`` under ``harness.out_dir()``, with the command, device and commit.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness  # noqa: E402
from fxglm5.lowering.triton.device import interpreter_compat  # noqa: E402

interpreter_compat()  # runtime loop bounds under TRITON_INTERPRET with numpy >= 2.3

STREAM_SHAPES = ((1, 64, 3), (2, 64, 3), (2, 128, 3), (4, 64, 2), (1, 128, 4), (2, 128, 4))  # (ctas / SM, rows, stages)


@triton.jit
def _empty_kernel(flag_ptr):
    """Nothing, unless the flag (never set) asks for a store: a launch's fixed cost alone."""
    if tl.load(flag_ptr) == 12345:
        tl.store(flag_ptr, 0)


@triton.jit
def _stream_kernel(w_ptr, out_ptr, n_tiles, rounds, ROWS: tl.constexpr, STAGES: tl.constexpr):
    """Program p sums tiles p, p + P, p + 2P ... (``rounds`` of them, the last ones past ``n_tiles`` masked) of the
    [n_tiles * ROWS, 128] bytes at ``w_ptr`` (a loop the compiler pipelines ``STAGES`` deep) and stores its sum: every
    byte is read once, by one persistent grid of P programs."""
    pid, grid = tl.program_id(0), tl.num_programs(0)
    offs = tl.arange(0, ROWS)[:, None] * 128 + tl.arange(0, 128)[None, :]
    acc = tl.zeros((ROWS, 128), dtype=tl.int32)
    for i in tl.range(0, rounds, num_stages=STAGES):
        tile = pid + i * grid
        acc += tl.load(w_ptr + tile.to(tl.int64) * (ROWS * 128) + offs, mask=tile < n_tiles, other=0,
                       eviction_policy="evict_first").to(tl.int32)
    tl.store(out_ptr + pid, tl.sum(tl.sum(acc, axis=1), axis=0))


@triton.jit
def _hop_kernel(counters_ptr):
    """A chain of tasks: take an id from the queue (counters[0]), wait until the chain (counters[1]) reaches it, then
    advance it by one: task i runs after task i - 1, one dependency through global memory a task. Ids are taken in
    the order CTAs arrive, so a waiting task's predecessor is already running (tasks' module doc): no deadlock."""
    task = tl.atomic_add(counters_ptr, 1, sem="relaxed", scope="gpu")
    while tl.atomic_add(counters_ptr + 1, 0, sem="acquire", scope="gpu") < task:
        pass
    tl.atomic_add(counters_ptr + 1, 1, sem="release", scope="gpu")


def stream(w: torch.Tensor, out: torch.Tensor, rows: int, stages: int) -> None:
    """:func:`_stream_kernel` over ``w`` (uint8, a multiple of rows x 128 bytes), one program per entry of ``out``."""
    tiles, programs = w.numel() // (rows * 128), out.numel()
    _stream_kernel[(programs,)](w, out, tiles, triton.cdiv(tiles, programs), ROWS=rows, STAGES=stages)


def stream_sum(w: torch.Tensor, programs: int, rows: int, stages: int) -> int:
    """The byte sum of ``w`` by :func:`stream` over ``programs`` programs."""
    out = torch.zeros(programs, dtype=torch.int32, device=w.device)
    stream(w, out, rows, stages)
    return int(out.sum().item())


def hop_chain(tasks: int, device) -> torch.Tensor:
    """Counters after a chain of ``tasks`` hops: [tasks taken, hops done], both ``tasks``."""
    counters = torch.zeros(2, dtype=torch.int32, device=device)
    _hop_kernel[(tasks,)](counters)
    return counters


def bench_launch(record: dict, sms: int, launches: int = 1000) -> None:
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    for name, grid in (("one_cta", 1), ("one_cta_per_sm", sms)):
        us = harness.time_graph_us(lambda grid=grid: _empty_kernel[(grid,)](flag), calls_per_graph=launches)
        record["launch"][name] = dict(grid=grid, launches_per_graph=launches, us_per_launch=round(us, 3))
        print("launch", name, record["launch"][name], flush=True)


def bench_stream(record: dict, sms: int, layer_mb: float, copy_gbs: float) -> None:
    for label, mb in (("layer", layer_mb), ("1gb", 1000.0)):
        rows_bytes = 256 * 128
        w = torch.randint(0, 256, (int(mb * 1e6) // rows_bytes * rows_bytes,), dtype=torch.uint8, device="cuda")
        for ctas, rows, stages in STREAM_SHAPES:
            out = torch.empty(ctas * sms, dtype=torch.int32, device="cuda")  # the timed launch alone: no sync, no sum
            us = statistics.median(harness.events_us(lambda w=w, out=out, rows=rows, stages=stages:
                                                     stream(w, out, rows, stages), 10))
            gbs = w.numel() / (us * 1e-6) / 1e9
            row = dict(buffer=label, mb=round(w.numel() / 1e6, 1), ctas_per_sm=ctas, rows=rows, stages=stages,
                       us=round(us, 2), gbs=round(gbs, 1), pct_of_copy=round(100 * gbs / copy_gbs, 1))
            record["stream"].append(row)
            print("stream", row, flush=True)
        del w


def bench_hop(record: dict) -> None:
    for tasks in (100, 1000):
        us = statistics.median(harness.events_us(lambda tasks=tasks: hop_chain(tasks, "cuda"), 10))
        record["hop"].append(dict(tasks=tasks, us=round(us, 2), us_per_hop=round(us / tasks, 3)))
        print("hop", record["hop"][-1], flush=True)


def check_tiny() -> dict:
    """The kernels' results on the CPU (interpreted): the stream's checksum against torch's, the chain's counters."""
    w = torch.randint(0, 256, (8 * 16 * 128,), dtype=torch.uint8)
    sums = {f"{programs}x{rows}": stream_sum(w, programs, rows, 2) for programs, rows in ((1, 16), (3, 16), (2, 32))}
    expect = int(w.to(torch.int64).sum())
    if any(s != expect for s in sums.values()):
        raise AssertionError(f"stream checksums {sums}, torch {expect}")
    counters = hop_chain(37, "cpu").tolist()
    if counters != [37, 37]:
        raise AssertionError(f"hop chain counters {counters}, expected [37, 37]")
    _empty_kernel[(1,)](torch.zeros(1, dtype=torch.int32))
    return dict(stream_checksums=sums, torch_checksum=expect, hop_counters=counters)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="launch,stream,hop")
    parser.add_argument("--layer-mb", type=float, default=160.0,
                        help="the streamed buffer of a layer (default: 160 MB, a decode layer's bytes at B=1 on the "
                             "busiest EP8 rank: 6.22 GB over 39 layers in bench/results/decode_default_h100_bb561ff/)")
    parser.add_argument("--tiny", action="store_true", help="CPU, interpreted: check the kernels, time nothing")
    args = parser.parse_args()
    parts = args.only.split(",")
    unknown = sorted(set(parts) - {"launch", "stream", "hop"})
    if unknown:
        parser.error(f"--only: unknown {unknown}; choose from launch,stream,hop")
    if args.tiny:
        harness.save_run("decode_floors_tiny.json", checks=check_tiny())
        return
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    copy_gbs = harness.copy_bandwidth_gbs()
    record = dict(copy_bandwidth_gbs=round(copy_gbs, 1), sms=sms, launch={}, stream=[], hop=[])
    if "launch" in parts:
        bench_launch(record, sms)
    if "stream" in parts:
        bench_stream(record, sms, args.layer_mb, copy_gbs)
    if "hop" in parts:
        bench_hop(record)
    harness.save_run("decode_floors.json", **record)


if __name__ == "__main__":
    main()
