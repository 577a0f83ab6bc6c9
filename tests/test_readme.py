"""The README as a user reads it (issue 50 item 3): its Python code, pasted into a file and run in a folder of its
own, runs once and prints every result (its launch of ranks re-ran the whole script in each rank: five copies of
every output, and the ranks' result never printed); the time and counts it states for the test command are CI's
own run's (``bench/ci_time.py``: ``bench/results/ci_time.json``), with the machine and the load they were measured
at.

At the root of tests/: it checks the README, which no folder of fxglm5 mirrors."""

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def python_blocks(text: str) -> list[str]:
    """The README's fenced ```python blocks, as a user copies them."""
    return re.findall(r"^```python\n(.*?)^```$", text, re.S | re.M)


def test_the_readmes_python_runs_as_written_and_prints_every_result_once(tmp_path):
    """The Python API code, then the engine's in the same folder (it reads the checkpoint the first made). The
    OpenAI client's needs the server of the shell lines above it: tests/frontdoors/test_serve.py drives that."""
    client, api, engine = python_blocks(README)
    assert "OpenAI(base_url=" in client and "def main():" in api and "build_engine(" in engine
    script = tmp_path / "api.py"
    script.write_text(api)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, timeout=900)
    out = done.stdout.decode(errors="replace")
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-3000:]
    lines = out.splitlines()
    summaries = [line for line in lines if re.match(r"(match|fuse) +\w+ +matches=", line)]
    assert len(summaries) == 6 and len(set(summaries)) == 6  # the match and fuse passes, each once
    assert all("(expected " in line for line in summaries)
    assert lines.count("torch.Size([1, 3, 512])") == 1  # the torch.compile forward's logits, once
    assert any(line.startswith("('input_ids', 'position_ids', 'hidden', 'slot_mapping'") for line in lines)
    rank, tokens = re.fullmatch(r"(\d+) (\[\[.*\]\])", lines[-1]).groups()  # the ranks' tokens, last
    assert rank == "0" and len(json.loads(tokens)[0]) == 8
    assert sorted(p.name for p in tmp_path.iterdir()) == ["api.py", "ckpt_dir", "tiny-tp"]
    (tmp_path / "engine.py").write_text(engine)
    done = subprocess.run([sys.executable, "engine.py"], cwd=tmp_path, capture_output=True, timeout=900)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-3000:]
    steps = [line.split(" ", 3) for line in done.stdout.decode(errors="replace").splitlines()]
    assert {s[0] for s in steps} == {"0", "1"} and steps[-1][0] == "1"  # the first request, then the late one
    assert steps[-1][-1].endswith(("length", "stop"))


def test_the_test_commands_time_and_counts_are_cis_own_run_with_its_machine_and_load():
    record = json.loads((REPO / "bench" / "results" / "ci_time.json").read_text())
    sentence = re.search(r"A fresh-clone `\.ci/run` took .*?`bench/results/ci_time\.json`\)", README, re.S)
    assert sentence, "the README's statement of CI's time"
    said = " ".join(sentence.group(0).split())
    counts = record["pytest"]["counts"]
    device = record["device"]
    start = record["load_avg_1_5_15_min_at_start"][0]
    for fact in (f"took {record['wall_s']} s", f"pytest {record['pytest']['seconds']} s",
                 f"{counts['passed']} passed", f"{counts['skipped']} skipped", f"commit {record['commit']}",
                 f"{device['cpus']}-core", device["name"].removeprefix("cpu: "),
                 f"load average {start} at its start and {device['load_avg_1_5_15_min'][0]} at its end"):
        assert fact in said, (fact, said)


def test_results_and_sections_are_named_by_what_they_measure_and_the_history_is_in_docs():
    """No results folder or file is named by a running number (session21, runtime_s11, kernels_gemm_s20: a reader
    cannot tell what or when from it), no README or history section is, and the README shows where the project
    stands while the history of how it got there is docs/history.md, which it names."""
    numbered = re.compile(r"(^|_)(session\d+|s\d+)(_|$)")
    results = REPO / "bench" / "results"
    named = [str(p.relative_to(results)) for p in results.rglob("*")
             if numbered.search(p.name.split(".")[0]) and not p.name.endswith(".log")]
    assert named == []
    history = (REPO / "docs" / "history.md").read_text()
    for text in [README, history, *(p.read_text() for p in results.rglob("README.md"))]:
        titles = [line for line in text.splitlines() if line.startswith("#") or re.match(r"- (H200|CPU),", line)]
        assert not [t for t in titles if re.search(r"(?i)\bsession \d+", t)], titles
    assert "`docs/history.md`" in README and "Measured so far" not in README
    assert history.startswith("# How fxglm5 got here") and history.count("\n- H200, ") >= 8
