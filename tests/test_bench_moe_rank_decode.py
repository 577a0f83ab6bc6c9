"""bench/moe_rank_decode.py's smoke run on the CPU (tiny sizes, the Triton MoE interpreted): each row's layer routes
as many distinct local experts as the simulated busiest group it was steered to, its bytes are those experts' weights
and the fixed ones, every setting's output is compared with the first's on the same inputs, and an unknown setting is
refused before any work."""

import json
import subprocess
import sys

import pytest

from bench import moe_rank_decode as bench


def test_the_tiny_run_steers_each_layer_and_counts_its_bytes(tmp_path):
    env = {"OUT": str(tmp_path), "TRITON_INTERPRET": "1", "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "bench/moe_rank_decode.py", "--tiny", "--layers", "2", "--batches", "1,4",
                    "--configs", "default,ctas8,bn64"], check=True, env=env, capture_output=True)
    record = json.loads((tmp_path / "moe_rank_decode_tiny.json").read_text())
    rows = record["rows"]
    assert [(r["config"], r["batch"]) for r in rows] == [(c, b) for b in (1, 4) for c in ("default", "ctas8", "bn64")]
    sizes = bench.TINY
    h, inter, shared = sizes["hidden"], sizes["inter"], sizes["shared_inter"]
    expert = 2 * inter * h + h * inter + 4 * (2 * inter // 128 * h // 128 + h // 128 * inter // 128)
    fixed = 4 * (bench.EXPERTS * h + bench.EXPERTS) + 2 * shared * h + h * shared + 4 * (
        2 * shared // 128 * h // 128 + h // 128 * -(-shared // 128))
    for row in rows:
        assert row["distinct_experts"] == row["routing"]["steered_distinct_experts"]
        assert row["mb_per_layer"] == round((fixed + row["distinct_experts"] * expert) / 1e6, 2)
        assert row["max_rel_diff_vs_default"] < 1e-5  # interpreted in float32: one K split at these sizes


def test_an_unknown_setting_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["moe_rank_decode.py", "--configs", "default,bogus"])
    with pytest.raises(SystemExit):
        bench.main()
    assert "--configs: unknown ['bogus']" in capsys.readouterr().err
