"""bench/decode_floors.py's kernels: on the CPU (interpreted) the persistent stream's checksum equals torch's over
several grids and tile heights, and the chain of hops ends with every task taken and done; compiled for sm_90
without a GPU, the stream loop is software-pipelined (asynchronous copies to shared memory at 3 stages) without
spills, and the hop's wait is an acquire load and its signal a release add at GPU scope (what tests/gpu cannot see)."""

import re
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

from tests.kernels.sm90_reports import ptxas_report, report_each, reports_from_subprocess  # noqa: E402

VARIANTS = [("stream", 64, 3), ("stream", 128, 2), ("hop", 0, 0)]


def test_the_tiny_checks_pass_interpreted(tmp_path):
    run = subprocess.run([sys.executable, "bench/decode_floors.py", "--tiny"], capture_output=True, text=True,
                         env={"OUT": str(tmp_path), "TRITON_INTERPRET": "1", "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert '"hop_counters": [\n   37,\n   37\n  ]' in (tmp_path / "decode_floors_tiny.json").read_text()


def test_a_wrong_checksum_is_caught(monkeypatch):
    """The tiny check is a check: a stream that skips a tile fails it."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from bench import decode_floors

    real = decode_floors.stream_sum
    monkeypatch.setattr(decode_floors, "stream_sum", lambda w, p, r, s: real(w[: w.numel() - r * 128], p, r, s))
    with pytest.raises(AssertionError, match="stream checksums"):
        decode_floors.check_tiny()


def _compile(kind: str, rows: int, stages: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from bench import decode_floors

    if kind == "hop":
        src = ASTSource(decode_floors._hop_kernel, {"counters_ptr": "*i32"}, {}, {(0,): [["tt.divisibility", 16]]})
    else:
        sig = {"w_ptr": "*u8", "out_ptr": "*i32", "n_tiles": "i32", "rounds": "i32", "ROWS": "constexpr",
               "STAGES": "constexpr"}
        src = ASTSource(decode_floors._stream_kernel, sig, {"ROWS": rows, "STAGES": stages},
                        {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]})
    return ptxas_report(triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}))


def _reports_of_every_variant() -> dict[str, dict]:
    return report_each(VARIANTS, _compile)


@pytest.fixture(scope="module")
def reports():
    return reports_from_subprocess("tests.test_bench_decode_floors")


@pytest.mark.parametrize("variant", VARIANTS[:2], ids=["rows64_3stages", "rows128_2stages"])
def test_the_stream_compiles_pipelined_without_spills(reports, variant):
    r = reports[repr(variant)]
    assert "error" not in r, r.get("error")
    assert re.search(r"\b0 bytes spill stores, 0 bytes spill loads", r["ptxas"]), r["ptxas"]
    assert "cp.async" in r["ptx"], "the loop's loads go through the pipeliner's asynchronous copies"


def test_the_hop_waits_with_acquire_and_signals_with_release(reports):
    r = reports[repr(VARIANTS[2])]
    assert "error" not in r, r.get("error")
    # the wait's add of zero becomes an acquire load (no read-modify-write while it spins)
    assert re.search(r"ld\.global\.gpu\.acquire\.b32", r["ptx"]), r["ptx"][-3000:]
    assert re.search(r"atom\.global\.gpu\.release\.add", r["ptx"]), r["ptx"][-3000:]
