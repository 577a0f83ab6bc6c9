"""Shared benchmark harness: CUDA-graph timing, copy bandwidth, cold-weight rotation, result files.

Why CUDA graphs: decode kernels run for 5-60 us, so launch overhead would dominate eager timing; serving
replays graphs, so graph replay is the honest measurement. Why rotation: a 60 MB L2 would hold a decode
weight and turn a bandwidth measurement into an L2 measurement; ``rotating`` builds enough input copies
(> 3x L2 in total) that each replay in one graph reads a different copy, as real layer-after-layer decode
does. Every figure written by ``Results.save`` was measured in that run, next to the device's measured
copy bandwidth, so percentages are relative to the same machine on the same day.
"""

from __future__ import annotations

import collections
import json
import os
import platform
import statistics
import subprocess
import sys
from typing import Any, Callable, Sequence

import torch

L2_BYTES = 60 * 2**20
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(REPO, "bench", "results")
COMMIT_ENV = "FXGLM5_BENCH_COMMIT"  # names the commit where the tree is a copy (see git_commit)


def answer_help(doc: str) -> None:
    """``-h`` / ``--help``: print the script's docstring (its usage) and exit, before any device work. For the
    scripts that read ``sys.argv`` themselves; argparse scripts answer ``--help`` on their own."""
    if "-h" in sys.argv[1:] or "--help" in sys.argv[1:]:
        print(doc.strip())
        raise SystemExit(0)


def device_info() -> dict:
    """Name, memory, SM count and software versions of the current CUDA device; on a host without one, the
    CPU's model, its core count and the load average at the time of the call (a shared CPU's figures depend
    on it)."""
    info: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version()}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        info.update(
            name=p.name,
            capability=f"{p.major}.{p.minor}",
            sms=p.multi_processor_count,
            memory_gib=round(p.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
        )
    else:
        info.update(name=_cpu_model(), cpus=os.cpu_count(), platform=platform.platform(),
                    load_avg_1_5_15_min=[round(x, 2) for x in os.getloadavg()])
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return "cpu: " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu: " + (platform.processor() or platform.machine() or "unknown")


def command_line() -> str:
    """The command as it was typed, for re-running it: the FXGLM5_* / TRITON_* settings in the environment,
    ``python``, the script relative to the repository and its arguments."""
    env = [f"{k}={v}" for k, v in sorted(os.environ.items())
           if k.startswith(("FXGLM5_", "TRITON_")) and k != COMMIT_ENV]
    script = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if script.startswith(REPO + os.sep):
        script = os.path.relpath(script, REPO)
    return " ".join([*env, "python", script or "-c", *sys.argv[1:]])


def git_commit() -> str:
    """The commit the run measured. ``$FXGLM5_BENCH_COMMIT`` wins when set: a copy of the tree on another
    machine may carry a stale ``.git`` (bench/results/rtpllm_host_time_85137ad/README.md). Otherwise ``git`` HEAD, with
    ``+uncommitted`` when tracked files differ from it, or ``unrecorded (no git repository)``."""
    if os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV]

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=REPO)

    try:
        head = git("rev-parse", "--short", "HEAD")
    except OSError:
        return "unrecorded (git not found)"
    if head.returncode:
        return "unrecorded (no git repository)"
    dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    return head.stdout.strip() + ("+uncommitted" if dirty else "")


def provenance() -> dict:
    """The three fields every result file starts with: command, device, commit."""
    return {"command": command_line(), "device": device_info(), "commit": git_commit()}


def out_dir() -> str:
    """Where results go: $OUT when set (the device machine sends back only that folder), else bench/results."""
    return os.environ.get("OUT") or RESULTS_DIR


def write_record(path: str, result: dict, echo: bool = True) -> dict:
    """Write ``result`` as JSON at ``path`` after :func:`provenance`'s fields (a ``result`` key of the same
    name is refused: the record says how it was made, not what a caller claims); returns the record."""
    clash = sorted(set(result) & {"command", "device", "commit"})
    if clash:
        raise ValueError(f"write_record: {path}: result sets {clash}, which provenance() records")
    rec = {**provenance(), **result}
    if echo:
        print(json.dumps(rec, indent=1), flush=True)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(rec, f, indent=1)
    return rec


def save_run(filename: str, **result) -> str:
    """Print and save one run's JSON (command, device, commit, then ``result``) under :func:`out_dir`;
    returns the path."""
    path = os.path.join(out_dir(), filename)
    write_record(path, result)
    return path


def events_us(fn: Callable[[], Any], n_iters: int) -> list[float]:
    times = []
    for _ in range(n_iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    return times


def copy_bandwidth_gbs(nbytes: int = 2**31, n_iters: int = 10) -> float:
    """Device-to-device copy rate in GB/s, counting bytes read + written, median over repeats."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    us = statistics.median(events_us(lambda: dst.copy_(src), n_iters))
    del src, dst
    return 2 * (nbytes // 2) / (us * 1e-6) / 1e9


def capture_graph(fn: Callable[[], Any], n_warmup: int = 3, calls_per_graph: int = 1) -> "torch.cuda.CUDAGraph":
    """A CUDA graph of ``calls_per_graph`` calls of ``fn``, after ``n_warmup`` eager calls on a side stream
    (Triton compiles / autotunes there), replayed once."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(n_warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls_per_graph):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def time_graph_us(fn: Callable[[], Any], n_warmup: int = 3, n_iters: int = 20, calls_per_graph: int = 1) -> float:
    """Median microseconds of one ``fn()`` call, timed by replaying a CUDA graph that captured it.

    ``fn`` is captured ``calls_per_graph`` times (pass a ``fn`` that cycles weight copies so each captured
    call reads a different copy) by :func:`capture_graph` and replayed ``n_iters`` times; the result is per
    call.
    """
    graph = capture_graph(fn, n_warmup, calls_per_graph)
    return statistics.median(events_us(graph.replay, n_iters)) / calls_per_graph


def kernel_times(graph: "torch.cuda.CUDAGraph", replays: int = 20) -> tuple[dict, float]:
    """Per-kernel mean device us per replay of ``graph`` (keyed by (position in the replay, name)), and the median
    replay span (first kernel start to last kernel end), in us, from ``torch.profiler`` over ``replays``
    synchronized replays. Which kernel of a composed graph slows down, and the gaps between kernels."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
            torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0]
    kernels.sort(key=lambda e: e.time_range.start)
    per_replay = len(kernels) // replays
    names = collections.defaultdict(list)
    spans = []
    for r in range(replays):
        chunk = kernels[r * per_replay:(r + 1) * per_replay]
        spans.append(chunk[-1].time_range.end - chunk[0].time_range.start)
        for i, e in enumerate(chunk):
            names[(i, e.name[:60])].append(e.device_time)
    return {k: statistics.mean(v) for k, v in names.items()}, statistics.median(spans)


def rotating(make_inputs: Callable[[int], Any], n_copies: int | None = None, bytes_per_copy: int | None = None):
    """Build input copies so that successive calls read different memory; returns ``(copies, next_fn)``.

    ``make_inputs(i)`` returns the i-th copy (a tuple of tensors, typically the weights). When
    ``n_copies`` is None it is chosen so that the copies total more than 3x L2 (needs ``bytes_per_copy``).
    ``next_fn()`` returns the next copy round-robin; capture ``calls_per_graph = len(copies)`` calls so
    every copy is read once per replay.
    """
    if n_copies is None:
        if bytes_per_copy is None:
            raise ValueError("rotating: give n_copies or bytes_per_copy")
        n_copies = max(2, -(-3 * L2_BYTES // max(1, bytes_per_copy)) + 1)
    copies = [make_inputs(i) for i in range(n_copies)]
    state = {"i": 0}

    def next_fn():
        c = copies[state["i"] % len(copies)]
        state["i"] += 1
        return c

    return copies, next_fn


class Results:
    """Rows of dicts, written as JSON (with provenance) and as a markdown table."""

    def __init__(self, copy_gbs: float | None = None):
        self.rows: list[dict] = []
        self.copy_gbs = copy_gbs

    def add(self, **row) -> dict:
        self.rows.append(row)
        print(" | ".join(f"{k}={_fmt(v)}" for k, v in row.items()), flush=True)
        return row

    def extend(self, rows: Sequence[dict]) -> None:
        for r in rows:
            self.add(**r)

    def markdown(self) -> str:
        cols: list[str] = []
        for r in self.rows:
            cols += [k for k in r if k not in cols]
        lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for r in self.rows:
            lines.append("| " + " | ".join(_fmt(r.get(c, "")).replace("|", "\\|") for c in cols) + " |")
        return "\n".join(lines) + "\n"

    def save(self, name: str, directory: str | None = None, notes: str = "") -> tuple[str, str]:
        """Write ``name``.json (provenance, copy bandwidth, rows) and ``name``.md under ``directory``
        (default :func:`out_dir`), ``notes`` (markdown) after its table."""
        directory = directory or out_dir()
        jpath = os.path.join(directory, f"{name}.json")
        mpath = os.path.join(directory, f"{name}.md")
        rec = write_record(jpath, {"copy_bandwidth_gbs": self.copy_gbs, "rows": self.rows}, echo=False)
        with open(mpath, "w") as f:
            f.write(f"# {name}\n\n")
            f.write(f"- command: `{rec['command']}`\n- device: {json.dumps(rec['device'])}\n"
                    f"- commit: {rec['commit']}\n")
            if self.copy_gbs is not None:
                f.write(f"- measured copy bandwidth: {self.copy_gbs:.0f} GB/s (read+write)\n")
            f.write("\n" + self.markdown() + notes)
        return jpath, mpath


SECTIONS: dict[str, Callable[["Results", Any], None]] = {}


def section(name: str):
    """Register a benchmark section ``fn(results, args)`` under ``name`` (``bench/kernels.py --only name``)."""

    def deco(fn):
        SECTIONS[name] = fn
        return fn

    return deco


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)
