"""The GPU test suite (``tests/gpu``) in parts that each fit one device call: run the tests that no earlier part at
this commit has run, stop after the test during which ``--budget`` seconds ran out, and record every test's outcome
and duration, and the tests still to run, in one JSON file (under $OUT on the device machine).

    python bench/gpu_suite.py [--budget 540] [--after part1.json part2.json ...] [--name gpu_suite.json]
                              [--shard I/N] [--summary] [paths ...]

Why: the suite takes longer than one call may run (600 s), so a plain ``pytest tests/gpu`` under a timeout loses the
run's results when it is cut off, and the next call starts from the first test again. ``--after`` names the records
of the earlier parts (committed under bench/results/ or carried beside the tree): their tests are not run again, and
the record sums up all parts so far (``suite``): the suite has passed at a commit when a record at that commit shows
no test left to run and none failed. A record made at another commit is refused: its tests ran other code.

``--shard I/N`` runs only the I-th (from 0) of N contiguous runs of equal length of the tests left, so N processes
started side by side on one GPU share the suite (much of a GPU test's time is likely the compiling of its kernels, a
CPU's work, not measured, and the device machine has many cores): each writes its own record, and ``--after`` takes
them all. ``--summary`` runs no test: it writes the record of the suite so far (its counts and the tests left), the
one to read after shards.
``--procs N`` does both in one command: it runs the N shards as processes side by side (their records and output
in a temporary folder, each shard's output printed after all have ended) and writes the summary under ``--name``:
one record and one command for a device call that brings back only a few files.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness  # noqa: E402

OUTCOMES = ("passed", "failed", "skipped", "error")


class Budget:
    """A pytest plugin: deselects the tests ``done`` already holds, records each test's outcome and duration, and
    stops the session after the test during which ``seconds`` ran out."""

    def __init__(self, seconds: float, done: dict, shard: tuple[int, int] = (0, 1), run: bool = True):
        self.seconds, self.deadline, self.shard, self.run = seconds, None, shard, run
        self.done, self.results, self.selected, self.session = done, {}, [], None

    def pytest_sessionstart(self, session):
        self.session = session

    def pytest_collection_modifyitems(self, config, items):
        left = [item for item in items if item.nodeid not in self.done]
        self.selected = [item.nodeid for item in left]
        index, count = self.shard
        kept = left[len(left) * index // count:len(left) * (index + 1) // count] if self.run else []
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept

    def pytest_collection_finish(self, session):
        self.deadline = time.monotonic() + self.seconds  # the budget is the tests' time, collection not counted

    def pytest_runtest_logreport(self, report):
        """A test's outcome: its call's, or "skipped" where its setup skipped it, or "error" where its setup or
        teardown failed; its duration: the sum of its phases'."""
        entry = self.results.setdefault(report.nodeid, {"outcome": "passed", "s": 0.0})
        entry["s"] = round(entry["s"] + report.duration, 2)
        if report.when == "call" or report.skipped:
            if entry["outcome"] == "passed":
                entry["outcome"] = report.outcome
        elif report.failed:
            entry["outcome"] = "error"

    def pytest_runtest_logfinish(self, nodeid, location):
        if self.deadline is not None and time.monotonic() > self.deadline and self.session is not None:
            self.session.shouldstop = "bench/gpu_suite.py: the budget is spent"


def load_done(paths: list[str], commit: str) -> dict:
    """The outcomes the records at ``paths`` hold, each made at ``commit`` (a ValueError names one that was not)."""
    done = {}
    for path in paths:
        with open(path) as f:
            record = json.load(f)
        if record.get("commit") != commit:
            raise ValueError(f"--after {path}: made at commit {record.get('commit')!r}, this run is at {commit!r}; "
                             "its tests ran other code (run the suite again from its first part)")
        done.update(record["results"])
    return done


def parse_shard(text: str) -> tuple[int, int]:
    """``I/N`` -> (I, N), 0 <= I < N."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard {text!r}: expected I/N, e.g. 0/4") from None
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"--shard {text!r}: I must be in [0, N)")
    return index, count


def counts(results: dict) -> dict:
    return {outcome: sum(r["outcome"] == outcome for r in results.values()) for outcome in OUTCOMES}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="*", default=["tests/gpu"])
    parser.add_argument("--budget", type=float, default=540.0, help="seconds of tests (after collection) before the part stops")
    parser.add_argument("--after", nargs="*", default=[], help="the records of the earlier parts at this commit")
    parser.add_argument("--name", default="gpu_suite.json")
    parser.add_argument("--shard", type=parse_shard, default=(0, 1),
                        help="I/N: the I-th of N equal runs of the tests left")
    parser.add_argument("--summary", action="store_true", help="run no test; record the suite so far")
    parser.add_argument("--procs", type=int, default=1, help="run N shards side by side, then the summary")
    args = parser.parse_args(argv)
    if args.procs > 1:
        return run_shards(args)
    import pytest

    done = load_done(args.after, harness.git_commit())
    plugin = Budget(args.budget, done, args.shard, run=not args.summary)
    start = time.monotonic()
    code = pytest.main(["-q", "-p", "no:cacheprovider", "--show-capture=no", "--tb=short", "-rfE", *args.paths],
                       plugins=[plugin])
    left = [nodeid for nodeid in plugin.selected if nodeid not in plugin.results]
    suite = {**done, **plugin.results}
    record = dict(paths=args.paths, budget_s=args.budget, shard=f"{args.shard[0]}/{args.shard[1]}",
                  wall_s=round(time.monotonic() - start, 1), pytest_exit_code=int(code), part=counts(plugin.results),
                  suite=counts(suite), left=len(left), left_tests=left, after=args.after, results=suite)
    harness.write_record(os.path.join(harness.out_dir(), args.name), record, echo=False)
    print(f"gpu_suite: this part {record['part']}, the suite so far {record['suite']}, {len(left)} left to run; "
          f"saved {os.path.join(harness.out_dir(), args.name)}")
    return 1 if record["suite"]["failed"] or record["suite"]["error"] else 0


def run_shards(args) -> int:
    """``--procs N``: the N shards of the tests left as processes side by side, then the summary under ``--name``."""
    with tempfile.TemporaryDirectory() as folder:
        procs = []
        for index in range(args.procs):
            record, log = os.path.join(folder, f"shard{index}.json"), tempfile.TemporaryFile(mode="w+")
            command = [sys.executable, os.path.abspath(__file__), *args.paths, "--budget", str(args.budget),
                       "--shard", f"{index}/{args.procs}", "--name", record, "--after", *args.after]
            procs.append((record, log, subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)))
        for _, _, proc in procs:
            proc.wait()
        for index, (_, log, proc) in enumerate(procs):
            log.seek(0)
            print(f"---- shard {index}/{args.procs} (exit {proc.returncode})\n{log.read()}", flush=True)
            log.close()
        shards = [record for record, _, _ in procs if os.path.exists(record)]
        if len(shards) < args.procs:
            print(f"gpu_suite: {args.procs - len(shards)} shard(s) wrote no record (see their output above)")
        return main([*args.paths, "--summary", "--name", args.name, "--after", *args.after, *shards])


if __name__ == "__main__":
    raise SystemExit(main())
