"""Tensor parallel as the README shows it (issue 37, item 3): ``make-tiny --preset tiny-tp`` writes a checkpoint that
splits over 2 and 4 ranks, a checkpoint that does not split is refused from its config.json before any rank is
spawned, and the README's ``launch(...)`` snippet runs when pasted into a script (the ranks import it again)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

import fxglm5.runtime.distributed
from fxglm5.cli import main
from fxglm5.model.config import Glm5Config
from fxglm5.parallel import Mapping

REPO = Path(__file__).resolve().parents[2]


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


def _readme_launch_snippet() -> str:
    """The README's Python API lines from the launch import to the launch call, as a user would paste them."""
    text = (REPO / "README.md").read_text()
    block = re.search(r"from fxglm5\.runtime\.distributed import launch.*?\n```", text, re.S).group(0)[:-3]
    return "from fxglm5.runtime.runner import Runner\n" + re.sub(r"\s+#.*", "", block)


def test_the_readme_launch_snippet_runs_as_a_script(tmp_path):
    assert main(["make-tiny", "--out", str(tmp_path / "tiny-tp"), "--preset", "tiny-tp"]) == 0
    script = tmp_path / "snippet.py"
    script.write_text(_readme_launch_snippet() + "\n    print(rank, len(out[0]))\n")
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "0 16"
