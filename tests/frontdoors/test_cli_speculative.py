"""``fxglm5 generate --speculative mtp --num-speculative-tokens K``: the tokens of plain generation, then the mean
acceptance length; bad speculative options fail with one line."""

import pytest

from fxglm5.cli import main
from fxglm5.model.tiny import make_tiny_checkpoint
from tests.frontdoors.test_cli_paged import lines


@pytest.fixture(scope="module")
def tiny_fp8(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "fp8", fp8=True)


def test_speculative_generate_prints_plain_tokens_and_acceptance(tiny_fp8, capsys):
    common = ["generate", "--model", str(tiny_fp8), "--prompt-ids", "1,2,3", "--prompt-ids",
              "9,8,7,6,5,4,3,2,1,0,11,12", "--max-new-tokens", "7", "--block-size", "4"]
    plain = lines(capsys, *common)
    spec = lines(capsys, *common, "--speculative", "mtp", "--num-speculative-tokens", "3")
    assert spec[:2] == plain and len(spec) == 3
    assert spec[2].startswith("mean acceptance length: ")
    mean = float(spec[2].split()[3])
    assert 1.0 <= mean <= 4.0
    # the tiny checkpoint's MTP layer is random: when it is accepted nowhere, the line says why
    assert spec[2].endswith("predicts nothing)") == (mean < 1.005)


@pytest.mark.parametrize("extra,match", [
    (["--speculative", "mtp", "--num-speculative-tokens", "5"], "num_tokens"),
    (["--speculative", "mtp"], "--num-speculative-tokens"),
    (["--num-speculative-tokens", "2"], "only with --speculative"),
    (["--speculative", "mtp", "--num-speculative-tokens", "2", "--backend", "reference"], "paged backend"),
])
def test_bad_speculative_options_fail_with_one_line(tiny_fp8, capsys, extra, match):
    assert main(["generate", "--model", str(tiny_fp8), "--prompt-ids", "1,2", "--max-new-tokens", "2", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fxglm5: error:") and match in err[0]


def test_speculative_generate_at_tp2_prints_the_single_process_plain_tokens(tmp_path, capsys):
    """``--tp 2 --speculative mtp``: two gloo ranks, the MTP layer sharded as the target, the plain tokens of one
    process, and the acceptance line once (rank 0)."""
    assert main(["make-tiny", "--out", str(tmp_path / "tp"), "--preset", "tiny-tp"]) == 0
    capsys.readouterr()
    common = ["generate", "--model", str(tmp_path / "tp"), "--prompt-ids", "1,2,3", "--prompt-ids",
              "9,8,7,6,5,4,3,2,1,0,11,12", "--max-new-tokens", "6", "--block-size", "4"]
    plain = lines(capsys, *common)
    spec = lines(capsys, *common, "--tp", "2", "--speculative", "mtp", "--num-speculative-tokens", "2")
    assert spec[:2] == plain and len(spec) == 3 and spec[2].startswith("mean acceptance length: ")
