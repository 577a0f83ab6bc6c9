"""CI's wall time and test counts, as the README quotes them: clone this repository's HEAD into a fresh directory,
run ``.ci/run`` there (the README's two set-up commands in a new virtualenv, the whole test suite included), and
record the wall time, the pytest summary line it printed (passed / skipped / failed, pytest's own time) and the
number of tests ``tests/gpu`` holds (collected, not run: they skip without CUDA), with the command, the machine
(CPU model, cores, load average at the start and at the end) and the measured commit, in bench/results/ci_time.json (or $OUT).

    python bench/ci_time.py [--command "bash .ci/run"] [--no-clone] [--name ci_time.json]

``--no-clone`` runs the command in this working tree instead (uncommitted changes included: the record's commit
says so). The command's output streams through; the JSON keeps its last lines and, when tests failed, pytest's
FAILURES section (the tracebacks: an intermittent failure is seen once, so the record must hold its cause).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness  # noqa: E402

SUMMARY = re.compile(r"^=*\s*((?:\d+ \w+(?:, )?)+) in ([\d.]+)s")


def pytest_summary(lines: list[str]) -> dict | None:
    """The counts and seconds of the last pytest summary line in ``lines`` ("959 passed, 321 skipped in 385.1s")."""
    for line in reversed(lines):
        m = SUMMARY.match(line.strip())
        if m:
            counts = {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", m.group(1))}
            return {"line": line.strip(), "counts": counts, "seconds": float(m.group(2))}
    return None


FAILURES_LINES = 600  # at most this many lines of the FAILURES section are kept


def failures_section(lines: list[str]) -> list[str]:
    """pytest's "= FAILURES =" section in ``lines``, up to the next "= ... =" header (at most FAILURES_LINES), or []."""
    header = re.compile(r"^=+ .+ =+$")
    start = next((i for i, line in enumerate(lines) if header.match(line.strip()) and " FAILURES " in line), None)
    if start is None:
        return []
    end = next((i for i in range(start + 1, len(lines)) if header.match(lines[i].strip())), len(lines))
    return lines[start:end][:FAILURES_LINES]


def collected(repo: str, path: str) -> int:
    """How many tests pytest collects under ``path`` of ``repo`` (``--collect-only``, nothing run)."""
    env = dict(os.environ, PYTHONPATH=repo)
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", path],
                         cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    m = re.search(r"(\d+) tests? collected", run.stdout)
    if m is None:
        raise SystemExit(f"ci_time: collecting {path} printed no count:\n{run.stdout[-2000:]}{run.stderr[-2000:]}")
    return int(m.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--command", default="bash .ci/run")
    parser.add_argument("--no-clone", action="store_true", help="run in this working tree, not a fresh clone")
    parser.add_argument("--name", default="ci_time.json")
    args = parser.parse_args()
    repo = harness.REPO
    if args.no_clone:
        where = repo
    else:
        where = os.path.join(tempfile.mkdtemp(prefix="fxglm5-ci-"), "fxglm5")
        subprocess.run(["git", "clone", "-q", repo, where], check=True)
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=where, capture_output=True, text=True,
                              check=True).stdout.strip()
        os.environ[harness.COMMIT_ENV] = head  # the record's commit: the code the clone ran
    load_at_start = [round(x, 2) for x in os.getloadavg()]  # the record's device holds the load at its end
    start = time.monotonic()
    proc = subprocess.Popen(args.command, shell=True, cwd=where, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines = []
    for line in proc.stdout:
        sys.stdout.write(line)
        lines.append(line.rstrip("\n"))
    code = proc.wait()
    wall = time.monotonic() - start
    summary = pytest_summary(lines)
    harness.save_run(args.name, ci_command=args.command, fresh_clone=not args.no_clone, returncode=code,
                     wall_s=round(wall, 1), load_avg_1_5_15_min_at_start=load_at_start, pytest=summary,
                     gpu_tests_collected=collected(where, "tests/gpu"),
                     tail=lines[-25:], failures=failures_section(lines))
    if code != 0:
        raise SystemExit(code)


if __name__ == "__main__":
    main()
