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
from tests import figures

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


# ---- the figures of the README and of every results README against the data files they name (tests/figures.py) --
README_NAMES = [os.path.relpath(p, REPO) for p in figures.readmes()]


@pytest.mark.parametrize("readme", README_NAMES)
def test_every_figure_is_the_value_of_a_data_file_it_names(readme):
    problems = figures.problems_of(os.path.join(REPO, readme))
    assert not problems, f"{readme}:\n" + "\n".join(problems)


def test_every_results_readme_is_checked():
    assert README_NAMES[:2] == ["README.md", "docs/history.md"] and len(README_NAMES) >= 10
    assert {os.path.dirname(n) for n in README_NAMES[2:]} == {
        os.path.relpath(os.path.dirname(p), REPO) for p in glob.glob(os.path.join(REPO, "bench", "results", "**",
                                                                                   "README.md"), recursive=True)}


S21 = "bench/results/rank_at_depth_fuse_kernels_5cf6615/run2_5cf6615/rank_at_depth.json"  # TPOT B=1, 2k: ms 14.187, kernel_ms_per_step 12.41


def problems(text: str, where: str = REPO) -> list[str]:
    return figures.figure_problems(text, os.path.join(REPO, where))


def test_a_figure_is_its_files_value_in_the_files_unit_at_its_own_rounding():
    assert problems(f"- TPOT 14.2 ms, of which 12.4 ms of kernels (`{S21}`)\n") == []
    assert problems(f"- TPOT 14187 us (`{S21}`)\n") == []  # ms as us: converted, the same value
    assert problems(f"- TPOT 14.19 ms (`{S21}`)\n") == []  # another rounding of it
    edited = problems(f"- TPOT 14.6 ms, of which 12.4 ms of kernels (`{S21}`)\n")  # the issue's example
    assert edited == [f"line 1: 14.6 ms is in none of ['{S21}']"]
    assert problems(f"- TPOT 14.187 us (`{S21}`)\n")[0].startswith("line 1: 14.187 us is in none of")  # ms is no us
    assert problems(f"- TPOT 14.2 % (`{S21}`)\n")[0].startswith("line 1: 14.2 % is in none of")  # nor a percent
    assert problems(f"- 2264 kernels a step (`{S21}`)\n") == []  # kernels_per_step: a count
    assert problems(f"- 2264x (`{S21}`)\n")[0].startswith("line 1: 2264 x is in none of")  # a count is no ratio
    assert problems(f"- 1.14x wall over kernel time (`{S21}`)\n") == []  # wall_over_kernel: a ratio
    assert problems(f"## At B=1 (`{S21}`): 14.2 ms\n") == []  # a heading's figures too
    assert problems(f"## At B=1 (`{S21}`): 14.6 ms\n") == [f"line 1: 14.6 ms is in none of ['{S21}']"]


def test_a_list_of_samples_holds_its_median_least_and_most_only():
    spec = "bench/results/decode_host_speculative_2d7f52e/speculative_k3_ctx2048_B64_2d7f52e.json"  # decode_step_us: 5 steps
    assert problems(f"- decode step 3733 us, 3657 to 3833 us (`{spec}`)\n") == []
    assert problems(f"- decode step 3725 us (`{spec}`)\n")[0].startswith("line 1: 3725 us is in none")  # one step's


def test_a_readme_is_the_source_only_of_what_its_data_files_hold():
    """rank_at_depth_fuse_kernels_5cf6615's README quotes issue 36's 16.41 ms; named as a source it stands for the files it names, which do
    not hold it (the old check read the README itself as data). Its own figures held by its runs pass."""
    readme = "bench/results/rank_at_depth_fuse_kernels_5cf6615/README.md"
    assert "16.41 ms" in open(os.path.join(REPO, readme)).read()
    assert problems(f"- B=1 took 16.41 ms (`{readme}`)\n")[0].startswith("line 1: 16.41 ms is in none of")
    assert problems(f"- B=1 took 14.2 ms (`{readme}`)\n") == []


def test_names_that_resolve_to_nothing_and_figures_with_no_file_fail():
    assert problems("The step took 3.1 ms.\n") == ["line 1: 3.1 ms with no data file named"]
    assert problems("- 552 us (`mla_heads_h8_0000000`)\n") == [
        "line 1: 552 us with no data file named", "line 1: names mla_heads_h8_0000000, which is not in bench/results"]
    assert "line 1: names bench/results/no_such_run.json, which is not in bench/results" in problems(
        f"- 3.1 ms (`bench/results/no_such_run.json`, `{S21}`)\n")


def test_a_results_readme_resolves_its_own_names_and_its_folder_holds_its_figures():
    where = "bench/results/rank_at_depth_fuse_kernels_5cf6615"
    assert problems("| point | ms |\n|---|---|\n| TPOT B=1 | 14.2 ms |\n", where) == []  # its own folder's runs
    assert problems("- 18.4 ms at 03379ab (`../rank_at_depth/at_03379ab/`)\n", where) == []
    assert problems("- 18.4 ms at 03379ab\n", where) == ["line 1: 18.4 ms is in none of ['bench/results/rank_at_depth_fuse_kernels_5cf6615/"
                                                          "run1_e12afa2/bench.log', 'bench/results/rank_at_depth_fuse_kernels_5cf6615/"
                                                          "run1_e12afa2/gpu_tests.log', 'bench/results/rank_at_depth_fuse_kernels_5cf6615/"
                                                          "run1_e12afa2/rank_at_depth.json', 'bench/results/"
                                                          "rank_at_depth_fuse_kernels_5cf6615/run1_e12afa2/rank_at_depth.md'] ..."]


def test_goals_bounds_approximations_derivations_and_an_issues_quotes_are_not_figures():
    assert problems("- goal: <= 5.0 ms; target 70 %; the target of 60 %; N > 1024; about 10 %; ~12 us; at least "
                    "97 %\n") == []
    assert problems(f"| point | issue 36's now | measured |\n|---|---|---|\n| B=1 | 16.41 ms | 14.2 ms |\n"
                    f"\nRuns: `{S21}`.\n") == ["line 3: 14.2 ms with no data file named"]  # (the table precedes it)
    assert problems(f"Runs: `{S21}`.\n\n| point | issue 36's now | measured |\n|---|---|---|\n"
                    f"| B=1 | 16.41 ms | 14.2 ms |\n") == []
    assert figures.DERIVED["docs/history.md"]["2.997 x"]  # the history's derivation, there only
    assert figures.figure_problems("- 2.997x faster\n", os.path.join(REPO, "docs"), "history.md") == []
    assert problems("- 2.997x faster\n", "bench/results/rank_at_depth_fuse_kernels_5cf6615")[0].startswith("line 1: 2.997 x is in none of")


def test_edited_figures_fail_in_every_readme():
    """Every figure of every README edited in its last digit by +1, -1 and +4 (14.2 -> 14.3, 14.1, 14.6): the check
    must refuse most edits in each README (the old check refused 61 % of the README's), and the README's headline
    table refuses the issue's example. An edit the check cannot see is one where a data file the figure's context
    names holds another value that rounds to the edited figure (another run's, a variant's, a neighbour shape's)."""
    caught_all = total_all = 0
    for readme in figures.readmes():
        with open(readme) as f:
            found, _ = figures.claims(f.read(), os.path.dirname(readme))
        edits = [(c, c.number[:-1] + str((int(c.number[-1]) + d) % 10)) for c in found for d in (1, -1, 4)]
        caught = sum(not figures.held(list(c.files), new, c.unit) for c, new in edits)
        print(f"{os.path.relpath(readme, REPO)}: {caught} of {len(edits)} edits refused")
        assert found and caught >= 0.55 * len(edits), os.path.relpath(readme, REPO)
        caught_all, total_all = caught_all + caught, total_all + len(edits)
    assert caught_all >= 0.7 * total_all
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    assert "| TPOT B=1, 2k context | **14.2 ms** |" in text
    assert any("14.6 ms is in none of" in p for p in figures.figure_problems(
        text.replace("| TPOT B=1, 2k context | **14.2 ms** |", "| TPOT B=1, 2k context | **14.6 ms** |")))
