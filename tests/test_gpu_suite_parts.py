"""bench/gpu_suite.py on a made-up suite on the CPU: a part stops after the test during which its budget ran out,
records each test's outcome (setup errors and teardown failures as "error") and what is left, and the next part
(``--after``) runs only what is left and sums up the suite; a record from another commit is refused."""

import json
import sys

import pytest

from bench import gpu_suite, harness

SUITE = '''
import time
import pytest

@pytest.fixture
def broken():
    raise RuntimeError("setup")

@pytest.fixture
def bad_teardown():
    yield
    raise RuntimeError("teardown")

def test_a_passes():
    pass

def test_b_is_slow():
    time.sleep(0.5)

def test_c_fails():
    assert 1 == 2

@pytest.mark.skip(reason="no GPU")
def test_d_skips():
    pass

def test_e_setup_error(broken):
    pass

def test_f_teardown_fails(bad_teardown):
    pass
'''


@pytest.fixture
def suite(tmp_path, monkeypatch):
    (tmp_path / "test_made_up.py").write_text(SUITE)
    monkeypatch.delitem(sys.modules, "test_made_up", raising=False)  # an earlier test's, from its own tmp_path
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    monkeypatch.setenv(harness.COMMIT_ENV, "abc1234")
    (tmp_path / "out").mkdir()
    return tmp_path


def _record(suite, name):
    return json.loads((suite / "out" / name).read_text())


def test_a_part_stops_after_its_budget_and_the_next_runs_only_what_is_left(suite):
    path = str(suite / "test_made_up.py")
    assert gpu_suite.main([path, "--budget", "0.3", "--name", "part1.json"]) == 0
    first = _record(suite, "part1.json")
    assert [k.rsplit("::", 1)[1] for k in first["results"]] == ["test_a_passes", "test_b_is_slow"]
    assert first["part"]["passed"] == 2 and first["left"] == 4 and first["commit"] == "abc1234"
    assert all(r["outcome"] == "passed" for r in first["results"].values())
    assert first["results"][next(k for k in first["results"] if k.endswith("test_b_is_slow"))]["s"] >= 0.5
    assert gpu_suite.main([path, "--after", str(suite / "out" / "part1.json"), "--name", "part2.json"]) == 1
    second = _record(suite, "part2.json")
    outcomes = {k.rsplit("::", 1)[1]: r["outcome"] for k, r in second["results"].items()}
    assert outcomes == {"test_a_passes": "passed", "test_b_is_slow": "passed", "test_c_fails": "failed",
                        "test_d_skips": "skipped", "test_e_setup_error": "error", "test_f_teardown_fails": "error"}
    assert second["part"] == {"passed": 0, "failed": 1, "skipped": 1, "error": 2}
    assert second["suite"] == {"passed": 2, "failed": 1, "skipped": 1, "error": 2} and second["left"] == 0


def test_a_record_from_another_commit_is_refused(suite, monkeypatch):
    path = str(suite / "test_made_up.py")
    gpu_suite.main([path, "--budget", "0", "--name", "part1.json"])
    monkeypatch.setenv(harness.COMMIT_ENV, "def5678")
    with pytest.raises(ValueError, match="made at commit 'abc1234', this run is at 'def5678'"):
        gpu_suite.main([path, "--after", str(suite / "out" / "part1.json")])


def test_shards_split_the_tests_left_and_a_summary_sums_them_up(suite):
    path = str(suite / "test_made_up.py")
    for index in range(3):
        gpu_suite.main([path, "--shard", f"{index}/3", "--name", f"shard{index}.json"])
    shards = [_record(suite, f"shard{index}.json") for index in range(3)]
    ran = [[k.rsplit("::", 1)[1] for k in shard["results"]] for shard in shards]
    assert ran == [["test_a_passes", "test_b_is_slow"], ["test_c_fails", "test_d_skips"],
                   ["test_e_setup_error", "test_f_teardown_fails"]]
    assert [shard["left"] for shard in shards] == [4, 4, 4] and shards[1]["shard"] == "1/3"
    after = [str(suite / "out" / f"shard{index}.json") for index in range(3)]
    assert gpu_suite.main([path, "--summary", "--after", *after, "--name", "summary.json"]) == 1
    summary = _record(suite, "summary.json")
    assert summary["part"] == {"passed": 0, "failed": 0, "skipped": 0, "error": 0} and summary["left"] == 0
    assert summary["suite"] == {"passed": 2, "failed": 1, "skipped": 1, "error": 2}
    gpu_suite.main([path, "--summary", "--after", *after[:2], "--name", "partial.json"])
    assert _record(suite, "partial.json")["left_tests"] == [k for k in shards[2]["results"]]


@pytest.mark.parametrize("text", ["1", "3/3", "-1/2", "a/b"])
def test_a_malformed_shard_is_refused(text):
    with pytest.raises(SystemExit):
        gpu_suite.main(["--shard", text])


def test_procs_run_the_shards_side_by_side_and_record_their_summary(suite):
    path = str(suite / "test_made_up.py")
    assert gpu_suite.main([path, "--procs", "3", "--name", "summary.json"]) == 1
    summary = _record(suite, "summary.json")
    assert summary["suite"] == {"passed": 2, "failed": 1, "skipped": 1, "error": 2} and summary["left"] == 0
    assert summary["part"] == {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
    assert len(summary["after"]) == 3 and sorted(k.rsplit("::", 1)[1] for k in summary["results"])[0] == "test_a_passes"
