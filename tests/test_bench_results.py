"""Every benchmark result says how it was made: the command, the device and the commit.

A figure that cannot be traced to the run that produced it drifts unnoticed (issue 20, item 8: 9 of 48 result
files recorded all three). These tests hold the files under bench/results/ to it and check that bench/harness's
save path, which every bench script writes through, records the three fields itself.

At the root of tests/: it checks bench/ (its results and harness), which no folder of fxglm5 mirrors.
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from bench import harness

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT_FILES = sorted(glob.glob(os.path.join(REPO, "bench", "results", "**", "*.json"), recursive=True))


@pytest.mark.parametrize("path", RESULT_FILES, ids=lambda p: os.path.relpath(p, os.path.join(REPO, "bench", "results")))
def test_every_result_file_records_command_device_and_commit(path):
    with open(path) as f:
        record = json.load(f)
    missing = [k for k in ("command", "device", "commit") if not record.get(k)]
    assert not missing, f"{os.path.relpath(path, REPO)} lacks {missing} (write 'unrecorded; ...' where unknown)"


LATEST = ["compile_backend.json", "compile_time_idle.json", "indexer_precision.json", "kernels_attention.json",
          "kernels_gemm_moe.json"]  # the latest record of each bench; older ones are quoted in docs/perf


def test_result_files_are_found():
    assert all(os.path.join(REPO, "bench", "results", name) in RESULT_FILES for name in LATEST)
    assert len(RESULT_FILES) >= 30  # the session folders' records too


def test_no_bench_script_writes_json_by_hand():
    """Only harness.py opens result files: a script that dumps JSON itself skips the provenance fields."""
    offenders = []
    for path in sorted(glob.glob(os.path.join(REPO, "bench", "*.py"))):
        if os.path.basename(path) == "harness.py":
            continue
        with open(path) as f:
            src = f.read()
        if re.search(r"json\.dump\(|open\([^)]*['\"]w['\"]", src):
            offenders.append(os.path.basename(path))
    assert not offenders, f"write results through bench.harness.save_run / Results.save: {offenders}"


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """No FXGLM5_* / TRITON_* settings, results under tmp_path, a known command line."""
    for k in list(os.environ):
        if k.startswith(("FXGLM5_", "TRITON_")):
            monkeypatch.delenv(k)
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(sys, "argv", [os.path.join(REPO, "bench", "some_bench.py"), "64", "--eager"])
    return tmp_path


def _git_head() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO,
                          check=True).stdout.strip()


def test_save_run_records_command_device_and_commit(clean_env, monkeypatch):
    monkeypatch.setenv("FXGLM5_NO_AUTOTUNE", "1")
    path = harness.save_run("run.json", B=64, rows=[1, 2])
    assert path == str(clean_env / "run.json")
    with open(path) as f:
        rec = json.load(f)
    assert list(rec)[:3] == ["command", "device", "commit"]
    assert rec["command"] == "FXGLM5_NO_AUTOTUNE=1 python bench/some_bench.py 64 --eager"
    assert rec["device"]["torch"] == torch.__version__ and rec["device"]["name"]
    assert re.fullmatch(re.escape(_git_head()) + r"(\+uncommitted)?", rec["commit"]), rec["commit"]
    assert rec["B"] == 64 and rec["rows"] == [1, 2]


def test_results_save_records_command_device_and_commit(clean_env):
    res = harness.Results(copy_gbs=4000.0)
    res.add(kernel="k", us=1.5)
    jpath, mpath = res.save("table")
    with open(jpath) as f:
        rec = json.load(f)
    assert rec["command"] == "python bench/some_bench.py 64 --eager"
    assert rec["device"]["torch"] == torch.__version__
    assert rec["commit"].startswith(_git_head())
    assert rec["rows"] == [{"kernel": "k", "us": 1.5}] and rec["copy_bandwidth_gbs"] == 4000.0
    with open(mpath) as f:
        md = f.read()
    assert f"- commit: {rec['commit']}\n" in md and "`python bench/some_bench.py 64 --eager`" in md


def test_commit_override_for_a_copied_tree(clean_env, monkeypatch):
    """A tree copied to another machine may carry a stale .git: the lead's commit, given by name, wins and is
    not repeated in the command."""
    monkeypatch.setenv(harness.COMMIT_ENV, "abc1234")
    rec = harness.write_record(str(clean_env / "r.json"), {"x": 1}, echo=False)
    assert rec["commit"] == "abc1234" and harness.COMMIT_ENV not in rec["command"]


def test_commit_marks_uncommitted_changes_and_a_missing_repository(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / "f.py").write_text("a = 1\n")
    subprocess.run([*git, "add", "f.py"], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    monkeypatch.delenv(harness.COMMIT_ENV, raising=False)
    monkeypatch.setattr(harness, "REPO", str(repo))
    assert harness.git_commit() == head
    (repo / "untracked.txt").write_text("results\n")  # new result files do not make the code uncommitted
    assert harness.git_commit() == head
    (repo / "f.py").write_text("a = 2\n")
    assert harness.git_commit() == head + "+uncommitted"
    plain = tmp_path / "plain"
    plain.mkdir()
    monkeypatch.setattr(harness, "REPO", str(plain))
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    assert harness.git_commit() == "unrecorded (no git repository)"


def test_a_result_cannot_claim_its_own_provenance(clean_env):
    with pytest.raises(ValueError, match="commit"):
        harness.save_run("bad.json", commit="deadbee")
    assert not (clean_env / "bad.json").exists()


BENCH_SCRIPTS = sorted(p for p in glob.glob(os.path.join(REPO, "bench", "*.py"))
                       if '__name__ == "__main__"' in open(p).read())
_HELP_ALL = """
import contextlib, io, json, runpy, sys
report = {}
for path in sys.argv[1:]:
    sys.argv, out = [path, "--help"], io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
        code = "returned without exiting"
    except SystemExit as e:
        code = e.code or 0
    except Exception as e:
        code = f"{type(e).__name__}: {e}"
    report[path] = [code, out.getvalue()]
print(json.dumps(report))
"""


def test_every_bench_script_answers_help_without_a_gpu():
    """``python bench/X.py --help`` prints the usage and exits 0 on a machine without CUDA, before any work:
    each script's imports must not need a GPU. One process runs them all (the imports are the slow part)."""
    assert len(BENCH_SCRIPTS) >= 9
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    run = subprocess.run([sys.executable, "-c", _HELP_ALL, *BENCH_SCRIPTS], capture_output=True, text=True,
                         cwd=REPO, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    for path, (code, out) in report.items():
        name = os.path.basename(path)
        assert code == 0, f"{name} --help: {code}"
        assert len(out.strip()) > 40 and (name in out or "python bench/" in out or "usage:" in out), (name, out)
