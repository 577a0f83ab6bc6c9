"""``fxglm5 generate`` on the paged runtime: one line per --prompt-ids, the same tokens as the
full-recompute backend (compute-dtype cache, float32), FP8 cache accepted, bad options rejected early."""

import pytest

from fxglm5.cli import main
from fxglm5.model.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "bf16", fp8=False, seed=1)


def lines(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out.strip().splitlines()


def test_batch_generate_paged_equals_reference(tiny_bf16, capsys):
    common = ["generate", "--model", str(tiny_bf16), "--prompt-ids", "1,2,3",
              "--prompt-ids", "9,8,7,6,5,4,3,2,1,0,11,12", "--max-new-tokens", "5"]
    paged = lines(capsys, *common, "--block-size", "4")
    reference = lines(capsys, *common, "--backend", "reference")
    assert len(paged) == 2 and paged == reference
    assert lines(capsys, *common, "--block-size", "4", "--max-step-tokens", "5") == reference  # chunked prefill
    assert all(len(line.split()) == 5 for line in paged)


@pytest.mark.parametrize("option", [["--block-size", "0"], ["--max-step-tokens", "0"]])
def test_bad_paged_options_fail_with_one_line(tiny_bf16, capsys, option):
    assert main(["generate", "--model", str(tiny_bf16), "--prompt-ids", "1,2", "--max-new-tokens", "2", *option]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fxglm5: error:")
