"""`fxglm5 inspect`: per-pass matches and the op histogram before/after, on a checkpoint and a preset."""

from fxglm5.cli import main


def test_inspect_checkpoint(tmp_path, capsys):
    assert main(["make-tiny", "--out", str(tmp_path / "tiny")]) == 0
    capsys.readouterr()
    assert main(["inspect", "--model", str(tmp_path / "tiny"), "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "match_sparse_mla       matches=4 (expected 4)" in out
    assert "fuse_fp8_linear        matches=36 (expected 36)" in out
    assert "fuse_fp8_moe           matches=3 (expected 3)" in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith(("aten.", "fxglm5."))}
    assert rows["fxglm5.sparse_mla"] == ["0", "4"] and rows["fxglm5.moe_fp8"] == ["0", "3"]
    assert rows["aten.softmax"][1] == "0" and rows["aten.einsum"][1] == "0"


def test_inspect_preset_on_meta(capsys):
    assert main(["inspect", "--preset", "tiny"]) == 0
    assert "fuse_fp8_moe           matches=3 (expected 3)" in capsys.readouterr().out
