"""bench/ci_time.py's reading of pytest's output: the summary line it records and the FAILURES section it keeps
(an intermittent failure is seen once: the record must hold its traceback, not only the last lines)."""

from bench.ci_time import FAILURES_LINES, failures_section, pytest_summary

OUTPUT = """\
........F.                                                               [100%]
=================================== FAILURES ===================================
____________________ test_cli_generate_joins_under_torchrun ____________________
>       assert done.returncode == 0, done.stderr[-3000:]
E       AssertionError: terminate called without an active exception
---------------------------- Captured stderr call -----------------------------
W1207 rank 1 closing
=============================== warnings summary ===============================
tests/x.py: 3 warnings
=========================== short test summary info ============================
FAILED tests/multirank/test_sharded_runner.py::test_cli_generate_joins_under_torchrun
================= 1 failed, 2169 passed, 609 skipped in 1108.02s =================
""".splitlines()


def test_the_failures_section_is_kept_up_to_the_next_header():
    kept = failures_section(OUTPUT)
    assert kept[0].strip("= ") == "FAILURES" and kept[-1] == "W1207 rank 1 closing" and len(kept) == 6
    assert any("terminate called without an active exception" in line for line in kept)


def test_no_failures_section_keeps_nothing_and_a_long_one_is_cut():
    assert failures_section([line for line in OUTPUT if "FAILURES" not in line]) == []
    long = OUTPUT[:2] + ["E line"] * (2 * FAILURES_LINES) + OUTPUT[7:]
    assert len(failures_section(long)) == FAILURES_LINES


def test_the_summary_line_gives_the_counts_and_seconds():
    summary = pytest_summary(OUTPUT)
    assert summary["counts"] == {"failed": 1, "passed": 2169, "skipped": 609} and summary["seconds"] == 1108.02
