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


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_the_written_directory_has_a_normal_directorys_permissions(tmp_path, capsys):
    """The temporary directory it was written into is private (mkdtemp: 0700); renamed into place, the output is
    as any directory mkdir makes: 0777 less the umask, for make-tiny and quantize alike."""
    bf16, fp8 = tmp_path / "bf16", tmp_path / "fp8"
    assert main(["make-tiny", "--out", str(bf16), "--bf16"]) == 0
    assert main(["quantize", "--in", str(bf16), "--out", str(fp8)]) == 0
    (tmp_path / "made").mkdir()
    normal = stat.S_IMODE((tmp_path / "made").stat().st_mode)
    assert normal == 0o777 & ~_umask()
    for out in (bf16, fp8):
        assert stat.S_IMODE(out.stat().st_mode) == normal, out


@pytest.mark.parametrize("command", ["make-tiny", "quantize"])
def test_a_non_empty_out_is_refused_before_the_work_and_left_as_it_was(tmp_path, capsys, monkeypatch, command):
    import fxglm5.model.quantize

    source = tmp_path / "bf16"
    assert main(["make-tiny", "--out", str(source), "--bf16"]) == 0
    capsys.readouterr()
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    monkeypatch.setattr(fxglm5.model.tiny, "tiny_state", lambda *a, **k: pytest.fail("the work started"))
    monkeypatch.setattr(fxglm5.model.quantize, "quantize_fp8_block", lambda *a, **k: pytest.fail("the work started"))
    argv = ["make-tiny", "--out", str(out)] if command == "make-tiny" else ["quantize", "--in", str(source), "--out",
                                                                            str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert _one_line(err) and f"{out}: exists and is not empty" in err
    assert os.listdir(out) == ["notes.txt"] and (out / "notes.txt").read_text() == "mine\n"
    assert sorted(os.listdir(tmp_path)) == ["bf16", "out"]  # no temporary directory left beside it


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
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:1"])
def test_device_cuda_without_cuda_is_refused_before_loading(tmp_path, capsys, monkeypatch, device):
    ckpt = tmp_path / "tiny"
    assert main(["make-tiny", "--out", str(ckpt)]) == 0
    capsys.readouterr()
    import fxglm5.model.modeling
    import fxglm5.serve.build

    monkeypatch.setattr(fxglm5.model.modeling.Glm5ForCausalLM, "from_pretrained",
                        classmethod(lambda *a, **k: pytest.fail("weights were loaded")))
    # every front door builds its Runner's parts through the builder (patching the Runner class, which the builder
    # imported by name, could see nothing)
    monkeypatch.setattr(fxglm5.serve.build, "build_parts", lambda *a, **k: pytest.fail("a Runner was built"))
    for extra in ([], ["--tp", "2"]):
        assert main(["generate", "--model", str(ckpt), "--prompt-ids", "1,2", "--max-new-tokens", "1",
                     "--device", device, *extra]) == 2
        err = capsys.readouterr().err
        assert _one_line(err) and f"--device {device}: this torch has no CUDA device" in err, err


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "cuda:-1", "cpu:0"])
def test_a_device_that_is_not_one_is_named(tmp_path, capsys, device):
    with pytest.raises(SystemExit) as exited:  # argparse's usage error: exit 2, the flag and the value named
        main(["generate", "--model", str(tmp_path), "--prompt-ids", "1,2", "--max-new-tokens", "1", "--device", device])
    assert exited.value.code == 2
    assert f"argument --device: {device!r} is not a device fxglm5 runs on (cpu, cuda or cuda:N)" in capsys.readouterr().err


def test_one_cuda_index_for_several_ranks_is_refused(tmp_path, capsys, monkeypatch):
    """With --tp each rank r runs on cuda:r, so a device index names none of them: refused by name before any rank
    starts (checked as on a machine with two CUDA devices)."""
    ckpt = tmp_path / "tiny"
    assert main(["make-tiny", "--out", str(ckpt), "--preset", "tiny-tp"]) == 0
    capsys.readouterr()
    import fxglm5.runtime.distributed

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(fxglm5.runtime.distributed, "launch", lambda *a, **k: pytest.fail("ranks were started"))
    assert main(["generate", "--model", str(ckpt), "--prompt-ids", "1,2", "--max-new-tokens", "1", "--tp", "2",
                 "--device", "cuda:1"]) == 2
    err = capsys.readouterr().err
    assert _one_line(err) and "--device cuda:1 with --tp 2: rank r runs on cuda:r; give --device cuda" in err
    assert main(["generate", "--model", str(ckpt), "--prompt-ids", "1,2", "--max-new-tokens", "1",
                 "--device", "cuda:2"]) == 2
    assert "--device cuda:2: this machine has 2 CUDA device(s)" in capsys.readouterr().err


# ---- every writer is safe (issue 50 item 1) ---------------------------------------------------------------------
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# A disk that fills: the process may write files of at most LIMIT bytes (RLIMIT_FSIZE; SIGXFSZ ignored, so a write
# past it fails with EFBIG as a full disk's fails with ENOSPC), then runs the CLI
FULL_DISK = """import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), int(sys.argv[1])))
from fxglm5.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _cli(*argv, limit=None, env=None, background=False):
    import subprocess
    import sys

    cmd = [sys.executable, "-c", FULL_DISK, str(limit), *argv] if limit else [sys.executable, "-m", "fxglm5", *argv]
    env = dict(os.environ, **(env or {}))
    if background:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("writers") / "tiny"
    assert main(["make-tiny", "--out", str(path)]) == 0
    return path


def _nothing_beside(folder, *keep):
    return sorted(p.name for p in folder.iterdir()) == sorted(keep)


def test_export_refuses_a_file_that_is_not_an_artifact_and_replaces_an_earlier_export(tiny, tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("mine\n")
    import fxglm5.model.modeling

    assert main(["export", "--model", str(tiny), "--out", str(notes)]) == 2
    err = capsys.readouterr().err
    assert _one_line(err) and f"{notes}: exists and is not an fxglm5 artifact" in err
    assert notes.read_text() == "mine\n" and _nothing_beside(tmp_path, "notes.txt")
    out = tmp_path / "a.pt2"
    assert main(["export", "--model", str(tiny), "--out", str(out)]) == 0
    assert main(["export", "--model", str(tiny), "--out", str(out), "--dtype", "bfloat16"]) == 0  # replaced
    assert "bfloat16" in capsys.readouterr().out.splitlines()[-1]
    from fxglm5.artifact import load_artifact

    assert load_artifact(out).dtype == torch.bfloat16 and _nothing_beside(tmp_path, "notes.txt", "a.pt2")
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~_umask()  # as readable as any file


def test_two_exports_of_one_path_at_once_never_both_report_a_file_that_is_not_there(tiny, tmp_path):
    """Two exports of one new path in other dtypes, started together: the one that finishes first puts its file in
    place; the other finds the path changed since it started and keeps nothing (it reported its own dtype and size
    over the other's file)."""
    out = tmp_path / "a.pt2"
    runs = [_cli("export", "--model", str(tiny), "--out", str(out), "--dtype", d, background=True)
            for d in ("float32", "bfloat16")]
    done = [(run.wait(timeout=600), *run.communicate()) for run in runs]
    from fxglm5.artifact import load_artifact

    stored = str(load_artifact(out).dtype).removeprefix("torch.")
    codes = sorted(code for code, _, _ in done)
    assert codes == [0, 2], done
    for code, stdout, stderr in done:
        if code == 0:
            assert f", {stored}, head=logits" in stdout
        else:
            assert stderr.startswith(f"fxglm5: error: {out}: written by another writer while this one ran")
    assert _nothing_beside(tmp_path, "a.pt2")  # no temporary left


@pytest.mark.parametrize("command", ["make-tiny", "export", "quantize"])
def test_a_full_disk_is_one_line_naming_the_output_and_leaves_nothing(tiny, tmp_path, command):
    source = tmp_path / "bf16"
    if command == "quantize":
        assert main(["make-tiny", "--out", str(source), "--bf16"]) == 0
    out = tmp_path / ("out.pt2" if command == "export" else "out")
    argv = {"make-tiny": ["make-tiny", "--out", str(out)],
            "export": ["export", "--model", str(tiny), "--out", str(out)],
            "quantize": ["quantize", "--in", str(source), "--out", str(out)]}[command]
    done = _cli(*argv, limit=300_000)
    assert done.returncode == 2, done.stderr[-2000:]
    assert _one_line(done.stderr) and done.stderr.startswith(f"fxglm5: error: {out}: not written ("), done.stderr
    assert not out.exists() and _nothing_beside(tmp_path, *(["bf16"] if command == "quantize" else []))


@pytest.mark.parametrize("command", ["make-tiny", "export"])
def test_a_place_that_cannot_be_written_or_a_path_under_a_file_is_one_line(tiny, tmp_path, capsys, command):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    name = "a.pt2" if command == "export" else "ckpt"
    for out, says in ((f"/proc/{name}", f"/proc/{name}: not written ("),  # procfs: no file can be made there
                      (str(blocker / name), f"{blocker} is a file")):
        argv = ["export", "--model", str(tiny)] if command == "export" else ["make-tiny"]
        assert main([*argv, "--out", out]) == 2
        err = capsys.readouterr().err
        assert _one_line(err) and err.startswith(f"fxglm5: error: {out}: ") and says in err, err
    assert _nothing_beside(tmp_path, "file")


def test_two_demos_at_once_both_succeed_one_making_the_checkpoint(tmp_path):
    """The second demo waits while the first makes the cached checkpoint, then uses it (it failed: the first's
    rename had taken the directory)."""
    env = {"FXGLM5_CACHE": str(tmp_path)}
    runs = [_cli("demo", env=env, background=True) for _ in range(2)]
    done = [(run.wait(timeout=600), *run.communicate()) for run in runs]
    assert [code for code, _, _ in done] == [0, 0], [err[-1500:] for _, _, err in done]
    firsts = sorted(out.splitlines()[0].split(" random")[0] for _, out, _ in done)
    assert firsts == ["fxglm5 demo: cached", "fxglm5 demo: made"]
    assert done[0][1].splitlines()[1:3] == done[1][1].splitlines()[1:3]  # the same text and ids
    assert _nothing_beside(tmp_path, "tiny-fp8")


def test_a_dump_dir_is_a_new_or_empty_directory_written_into_place(tmp_path, capsys):
    dump = tmp_path / "dump"
    dump.mkdir()
    (dump / "mine.txt").write_text("keep")
    import fxglm5.compiler

    assert main(["inspect", "--preset", "tiny", "--dump-dir", str(dump)]) == 2
    err = capsys.readouterr().err
    assert _one_line(err) and f"{dump}: exists and is not empty" in err and os.listdir(dump) == ["mine.txt"]
    fresh = tmp_path / "fresh"
    assert main(["inspect", "--preset", "tiny", "--dump-dir", str(fresh)]) == 0
    assert "summary.txt" in os.listdir(fresh) and any(n.endswith(".after.py") for n in os.listdir(fresh))
    assert _nothing_beside(tmp_path, "dump", "fresh")
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o777 & ~_umask()
    assert fxglm5.compiler  # (the compile it dumped is the CLI's own)


def test_a_failed_compile_keeps_its_dump_and_an_interrupted_one_does_not(tmp_path):
    """``keep_on``: what the block wrote is put in place when it raises one of those (a compile's error: the dump shows
    why), and removed on anything else."""
    from fxglm5.errors import PassError

    kept, gone = tmp_path / "kept", tmp_path / "gone"
    with pytest.raises(PassError):
        with new_output_dir(kept, keep_on=(PassError,)) as tmp:
            (tmp / "00_match.before.py").write_text("graph")
            raise PassError("strict mode")
    with pytest.raises(KeyboardInterrupt):
        with new_output_dir(gone, keep_on=(PassError,)) as tmp:
            (tmp / "00_match.before.py").write_text("graph")
            raise KeyboardInterrupt
    assert os.listdir(kept) == ["00_match.before.py"] and _nothing_beside(tmp_path, "kept")
