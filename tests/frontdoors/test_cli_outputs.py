"""What the CLI writes and how it fails (issue 37, items 1 and 2): checkpoints are written into a temporary directory
beside --out and renamed into place, so an interrupted or concurrent run leaves nothing half-written and two runs into
one new directory cannot both succeed; shards are as readable as config.json; the machine's errors (a file where a
directory must be, a permission, Ctrl-C, a CUDA device torch does not have) are one line and an exit code, never a
traceback, and are found before the work starts where they can be."""

import os
import stat

import pytest
import torch

import fxglm5.model.tiny
from fxglm5.cli import main
from fxglm5.errors import CheckpointError
from fxglm5.model.st_files import new_output_dir


def _one_line(err: str, start: str = "fxglm5: error: ") -> bool:
    return err.startswith(start) and err.count("\n") == 1 and "Traceback" not in err


def test_two_writers_into_one_new_directory_cannot_both_succeed(tmp_path):
    out = tmp_path / "ckpt"
    with pytest.raises(CheckpointError, match="filled by another writer"):
        with new_output_dir(out) as first:
            (first / "first").write_text("1")
            with new_output_dir(out) as second:  # the second run finishes first and takes the directory
                (second / "second").write_text("2")
    assert sorted(os.listdir(out)) == ["second"]
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no .partial directory left behind


def test_an_interrupted_write_leaves_nothing_and_its_rerun_succeeds(tmp_path):
    out = tmp_path / "ckpt"
    with pytest.raises(KeyboardInterrupt):
        with new_output_dir(out) as tmp:
            (tmp / "half").write_text("x")
            raise KeyboardInterrupt
    assert os.listdir(tmp_path) == []
    assert main(["make-tiny", "--out", str(out), "--bf16"]) == 0


def test_make_tiny_writes_readable_files_into_place(tmp_path, capsys):
    out = tmp_path / "new" / "tiny"
    assert main(["make-tiny", "--out", str(out)]) == 0
    mask = os.umask(0)
    os.umask(mask)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert any(name.endswith(".safetensors") for name in modes)
    assert set(modes.values()) == {0o666 & ~mask}  # shards as readable as config.json (safetensors writes 0600)
    assert sorted(os.listdir(out.parent)) == ["tiny"]


def test_an_output_under_a_file_is_refused_before_the_work(tmp_path, capsys, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setattr(fxglm5.model.tiny, "tiny_state", lambda *a, **k: pytest.fail("the work started"))
    assert main(["make-tiny", "--out", str(blocker / "sub")]) == 2
    err = capsys.readouterr().err
    assert _one_line(err) and f"{blocker} is a file" in err


def test_demo_with_a_cache_that_is_a_file_is_one_line(tmp_path, capsys, monkeypatch):
    blocker = tmp_path / "cache"
    blocker.write_text("x")
    monkeypatch.setenv("FXGLM5_CACHE", str(blocker))
    assert main(["demo"]) == 2
    assert _one_line(capsys.readouterr().err)


@pytest.mark.parametrize("raised, code, start", [
    (PermissionError(13, "Permission denied", "/ckpt/model.safetensors"), 2, "fxglm5: error: /ckpt/model.safetensors: "
                                                                              "Permission denied"),
    (NotADirectoryError(20, "Not a directory", "/x/y"), 2, "fxglm5: error: /x/y: Not a directory"),
    (KeyboardInterrupt(), 130, "fxglm5: interrupted"),
])
def test_the_machines_errors_are_one_line(monkeypatch, capsys, raised, code, start):
    def fail(*args, **kwargs):
        raise raised

    monkeypatch.setattr(fxglm5.model.tiny, "make_tiny_checkpoint", fail)
    assert main(["make-tiny", "--out", "/nonexistent/out"]) == code
    err = capsys.readouterr().err
    assert err == start + "\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a torch without CUDA")
def test_device_cuda_without_cuda_is_refused_before_loading(tmp_path, capsys, monkeypatch):
    ckpt = tmp_path / "tiny"
    assert main(["make-tiny", "--out", str(ckpt)]) == 0
    capsys.readouterr()
    import fxglm5.model.modeling

    monkeypatch.setattr(fxglm5.model.modeling.Glm5ForCausalLM, "from_pretrained",
                        classmethod(lambda *a, **k: pytest.fail("weights were loaded")))
    assert main(["generate", "--model", str(ckpt), "--prompt-ids", "1,2", "--max-new-tokens", "1",
                 "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert _one_line(err) and "--device cuda: this torch has no CUDA device" in err
