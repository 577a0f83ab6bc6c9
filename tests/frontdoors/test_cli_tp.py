"""Tensor parallel as the README shows it (issue 37, item 3): ``make-tiny --preset tiny-tp`` writes a checkpoint that
splits over 2 and 4 ranks, and a checkpoint that does not split is refused from its config.json before any rank is
spawned. (The README's ``launch(...)`` in its Python code, run as a script: tests/test_readme.py.)"""

import pytest

import fxglm5.runtime.distributed
from fxglm5.cli import main
from fxglm5.model.config import Glm5Config
from fxglm5.parallel import Mapping


def test_make_tiny_tp_splits_over_2_and_4_ranks(tmp_path, capsys):
    assert main(["make-tiny", "--out", str(tmp_path / "tp"), "--preset", "tiny-tp"]) == 0
    config = Glm5Config.from_json(tmp_path / "tp" / "config.json")
    for tp in (2, 4):
        for ep in (1, tp):
            Mapping(tp=tp, ep=ep).check(config)  # raises on a width that does not split
    assert "wrote tiny-tp GLM-5 FP8 checkpoint" in capsys.readouterr().out


def test_a_checkpoint_that_does_not_split_is_refused_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    assert main(["make-tiny", "--out", str(tmp_path / "tiny")]) == 0
    capsys.readouterr()
    monkeypatch.setattr(fxglm5.runtime.distributed, "launch", lambda *a, **k: pytest.fail("ranks were started"))
    assert main(["generate", "--model", str(tmp_path / "tiny"), "--prompt-ids", "1,2", "--max-new-tokens", "2",
                 "--tp", "8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fxglm5: error: the model does not split over tp=8, ep=8: num_attention_heads = 4")
    assert err.count("\n") == 1
