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


# ---- the README's figures against the results files it names (issue 40) -------------------------------------------
#
# Every measured figure the README quotes (a number with a unit: us, ms, s, min, %, x, TFLOPS, GB/s, TB/s, GB, MiB,
# tokens/s, kernels, launches, tests, passed, skipped) must be held by a results file its text names: a file or
# folder under bench/results/ (a path, a path inside bench/results/, or a file's stem such as `kernels_gemm_s20`), or
# a docs/perf page. A list item inherits the files its parent items name, a table row those of the paragraph above
# the table. A number counts as held when one of those files holds it at the README's precision (a percentage may be
# stored as a fraction, ms as us, TB/s as GB/s); a folder, or a folder's README.md, stands for every file under it.
# A list item also inherits the files of the paragraph that leads into its list.
# Targets and goals ("target 70 %", "<= 5.0 ms") are not figures. So a figure edited in the README without its file,
# a figure with no file named, and a named file that was removed all fail.

UNITS = r"(?:us|ms|s|min|%|x|TFLOPS|GB/s|TB/s|GB|MiB|tokens/s|kernels|launches|tests|passed|skipped)"
NUMBER = r"\d+(?:[ ,]\d{3})*(?:\.\d+)?"
JOIN = r"\s*(?:->|-|/|to|against|and|or|,)\s*"  # figures sharing one unit: "1.21-1.79x", "14.5 against 14.2 ms"
FIGURE = re.compile(rf"(?<![\w.=<>/^-])((?:{NUMBER}{JOIN})*{NUMBER})\s?({UNITS})(?![\w/])")
NOT_A_FIGURE = re.compile(r"(?:target|goal|<=|>=|~|issue)[ :,]*$")
RESULTS = os.path.join(REPO, "bench", "results")
# Figures the README derives in its own text, each with how (not measurements, so no results file holds them).
DERIVED = {
    "7.5 MiB": "2 blocks x 64 rows x (656 + 132) bytes x 78 layers: the scratch cache's size",
    "12 KB": "a row's hidden state, 6144 bf16 values: the all-reduce's payload",
    "38 KB": "a rank's 19 395 logits of 154 880 / 8 in bf16: the all-gather's payload",
    "2.997 x": "206.99 / 69.066 ms, eager over fxglm5 in compile_backend.json (which rounds it to 3.0)",
}


def doc_blocks(text: str):
    """(kind, nesting, text, line) of each list item, paragraph, table row and heading outside code blocks."""
    blocks, current, fence = [], None, False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fence, current = not fence, None
            continue
        if fence or not line.strip():
            current = None
            continue
        item = re.match(r"^(\s*)(?:[-*]|\d+\.)\s+(.*)", line)
        if item:
            current = ["item", len(item.group(1)) // 2, item.group(2), number]
            blocks.append(current)
        elif line.startswith("    ") and current is None:
            continue  # an indented code block
        elif line.startswith(("|", "#")):
            blocks.append(["row" if line.startswith("|") else "heading", 0, line, number])
            current = None
        elif current is None:
            current = ["paragraph", 0, line, number]
            blocks.append(current)
        else:
            current[2] += " " + line.strip()
    return blocks


def named_files(text: str) -> tuple[list[str], list[str]]:
    """(the results files and docs/perf pages ``text`` names, the names that look like results files but resolve
    to nothing)."""
    files, missing = [], []
    every = [p for p in glob.glob(os.path.join(RESULTS, "**", "*"), recursive=True) if os.path.isfile(p)]
    for name in re.findall(r"`([^`\s]+)`", text):
        name = name.rstrip(",;:.")
        if name.startswith(("bench/results", "docs/perf/")):
            path = os.path.join(REPO, name)
            if os.path.basename(path) == "README.md" and name.startswith("bench/results"):
                path = os.path.dirname(path)
            if os.path.isdir(path):
                files += [p for p in every if p.startswith(path.rstrip("/") + "/")]
            elif os.path.isfile(path):
                files.append(path)
            else:
                missing.append(name)
            continue
        stem = re.sub(r"\.(\{json,md\}|json|md|log)$", "", name)
        if not re.fullmatch(r"[\w\-/]+", stem) or stem.split("/")[-1] == "README":
            continue
        found = [p for p in every if os.path.relpath(p, RESULTS).startswith(stem + ".")
                 or os.path.basename(p).split(".")[0] == stem.split("/")[-1]]
        if found:
            files += found
        elif stem != name or re.search(r"_(s\d+|[0-9a-f]{7})$", stem):
            missing.append(name)
    return files, missing


_NUMBERS: dict[str, list[float]] = {}


def _numbers(path: str) -> list[float]:
    if path not in _NUMBERS:
        with open(path, errors="replace") as f:
            _NUMBERS[path] = [float(x) for x in re.findall(r"\d+(?:\.\d+)?(?:e[-+]?\d+)?", f.read())]
    return _NUMBERS[path]


def holds(files: list[str], figure: str) -> bool:
    """Whether one of ``files`` holds ``figure`` at its precision (also x100: a fraction, x1000 / 1000: a unit)."""
    value = float(figure.replace(" ", "").replace(",", ""))
    places = len(figure.split(".")[1]) if "." in figure else 0
    tolerance = 0.5 * 10 ** -places + 1e-9
    return any(abs(x * scale - value) <= tolerance for path in files for x in _numbers(path)
               for scale in (1, 100, 1000, 0.001))


def figure_problems(text: str) -> list[str]:
    """What of ``text`` (markdown) breaks the rule above: one line per figure or name, with its line number."""
    problems, parents, paragraph = [], [], ""
    for kind, depth, body, line in doc_blocks(text):
        if kind == "heading":
            parents, paragraph = [], ""
            continue
        if kind == "item":
            parents = [p for p in parents if p[0] < depth] + [(depth, body)]
            context = " ".join([paragraph, *(p[1] for p in parents)])
        elif kind == "paragraph":
            parents, paragraph, context = [], body, body
        else:
            context = paragraph + " " + body
        figures = []
        for match in FIGURE.finditer(body):
            if NOT_A_FIGURE.search(body[max(0, match.start() - 12):match.start()]):
                continue
            figures += [f"{n} {match.group(2)}" for n in re.split(JOIN, match.group(1)) if n]
        figures = [f for f in figures if f not in DERIVED]
        if not figures:
            continue
        files, missing = named_files(context)
        problems += [f"line {line}: names {name}, which is not in bench/results" for name in missing]
        if not files:
            problems.append(f"line {line}: {', '.join(figures)} with no results file named")
            continue
        problems += [f"line {line}: {f} is in none of {sorted({os.path.relpath(p, REPO) for p in files})[:4]}"
                     for f in figures if not holds(files, f.rsplit(" ", 1)[0])]
    return problems


def test_every_readme_figure_is_held_by_the_results_file_it_names():
    with open(os.path.join(REPO, "README.md")) as f:
        problems = figure_problems(f.read())
    assert not problems, "\n".join(problems)


def test_the_figure_check_fails_on_an_edited_figure_a_missing_file_and_an_unnamed_source(tmp_path):
    """The check itself, on text it must refuse: each kind of break is found, the figures held pass."""
    good = ("- H200 (`bench/results/session20/README.md`): the default 8-head bf16 launch timed 640.6 us (91.2 % "
            "of copy) first and 568.4 us last\n  - nested, same files: 4 splits 568.5 us\n")
    assert figure_problems(good) == []
    edited = figure_problems(good.replace("640.6 us", "604.6 us"))
    assert len(edited) == 1 and edited[0].startswith("line 1: 604.6 us is in none of ['bench/results/session20/")
    assert figure_problems("The step took 3.1 ms.\n") == ["line 1: 3.1 ms with no results file named"]
    gone = figure_problems("- 552 us (`mla_heads_h8_0000000`)\n")
    assert gone[0] == "line 1: names mla_heads_h8_0000000, which is not in bench/results"
    assert figure_problems("- goal: <= 5.0 ms; target 70 %\n") == []
