"""Every bad input gets a typed error whose message names the file and the tensor or field at fault."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from fxglm5.cli import main
from fxglm5.errors import CheckpointError, ConfigError, InputError
from fxglm5.model.checkpoint import load_checkpoint
from fxglm5.model.st_files import INDEX
from fxglm5.model.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("src") / "tiny", fp8=True)


@pytest.fixture
def ckpt(source, tmp_path):
    return shutil.copytree(source, tmp_path / "ckpt")


def shard_of(ckpt, name):
    return ckpt / json.loads((ckpt / INDEX).read_text())["weight_map"][name]


def edit_shard(ckpt, name, edit):
    """Rewrite the shard holding ``name`` after ``edit(tensors)``; returns the shard path."""
    path = shard_of(ckpt, name)
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def edit_config(ckpt, **changes):
    path = ckpt / "config.json"
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))
    return path


def load(ckpt):
    return load_checkpoint(ckpt, dtype=torch.float32, progress=False)


def test_missing_tensor(ckpt):
    name = "model.layers.2.mlp.experts.3.up_proj.weight_scale_inv"
    edit_shard(ckpt, name, lambda t: t.pop(name))
    index = json.loads((ckpt / INDEX).read_text())
    del index["weight_map"][name]
    (ckpt / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="missing tensor") as err:
        load(ckpt)
    assert str(ckpt / INDEX) in str(err.value) and name in str(err.value)


def test_unexpected_tensor(ckpt):
    name = "model.layers.1.mlp.experts.16.down_proj.weight"  # one expert too many
    path = edit_shard(ckpt, "model.norm.weight", lambda t: t.update({name: torch.zeros(256, 128).to(torch.float8_e4m3fn)}))
    index = json.loads((ckpt / INDEX).read_text())
    index["weight_map"][name] = path.name
    (ckpt / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="unexpected tensor") as err:
        load(ckpt)
    assert str(path) in str(err.value) and name in str(err.value)


def test_unexpected_shape(ckpt):
    name = "model.layers.0.self_attn.q_a_proj.weight"
    path = edit_shard(ckpt, name, lambda t: t.update({name: t[name][:, :128].contiguous()}))
    with pytest.raises(CheckpointError, match=r"shape \[128, 128\], expected \[128, 256\]") as err:
        load(ckpt)
    assert str(path) in str(err.value) and name in str(err.value)


@pytest.mark.parametrize("name, dtype, shown", [
    ("model.layers.2.self_attn.o_proj.weight", torch.bfloat16, "BF16"),  # should be FP8
    ("model.layers.1.post_attention_layernorm.weight", torch.float64, "F64"),  # should be 16/32-bit float
])
def test_wrong_dtype(ckpt, name, dtype, shown):
    path = edit_shard(ckpt, name, lambda t: t.update({name: t[name].to(dtype)}))
    with pytest.raises(CheckpointError, match=f"dtype {shown}, expected") as err:
        load(ckpt)
    assert str(path) in str(err.value) and name in str(err.value)


def test_scale_of_wrong_shape(ckpt):
    name = "model.layers.1.mlp.shared_experts.down_proj.weight_scale_inv"
    path = edit_shard(ckpt, name, lambda t: t.update({name: torch.ones(2, 2)}))
    with pytest.raises(CheckpointError, match=r"scale tensor .* shape \[2, 2\], expected \[2, 1\]") as err:
        load(ckpt)
    assert str(path) in str(err.value) and name in str(err.value)


def test_truncated_shard(ckpt):
    path = shard_of(ckpt, "model.layers.3.mlp.experts.0.gate_proj.weight")
    data = path.read_bytes()
    path.write_bytes(data[:-1000])
    with pytest.raises(CheckpointError, match="truncated shard") as err:
        load(ckpt)
    assert str(path) in str(err.value) and "tensor 'model." in str(err.value)


def test_shard_missing_on_disk(ckpt):
    path = shard_of(ckpt, "lm_head.weight")
    path.unlink()
    with pytest.raises(CheckpointError, match="missing on disk") as err:
        load(ckpt)
    assert str(ckpt / INDEX) in str(err.value) and path.name in str(err.value) and "tensor '" in str(err.value)


def test_index_points_at_wrong_shard(ckpt):
    index = json.loads((ckpt / INDEX).read_text())
    name = "model.embed_tokens.weight"
    other = next(s for s in sorted(set(index["weight_map"].values())) if s != index["weight_map"][name])
    index["weight_map"][name] = other
    (ckpt / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="does not contain it") as err:
        load(ckpt)
    assert str(ckpt / INDEX) in str(err.value) and name in str(err.value) and other in str(err.value)


def test_config_not_json(ckpt):
    (ckpt / "config.json").write_text('{"hidden_size": 256,')
    with pytest.raises(ConfigError, match="not valid JSON") as err:
        load(ckpt)
    assert str(ckpt / "config.json") in str(err.value)


@pytest.mark.parametrize("changes, field", [
    ({"hidden_size": -1}, "'hidden_size'"),
    ({"rms_norm_eps": "small"}, "'rms_norm_eps'"),
    ({"num_experts_per_tok": 17}, "'num_experts_per_tok'"),  # > n_routed_experts (16)
    ({"mlp_layer_types": ["dense", "sparse", "sparse"]}, "'mlp_layer_types'"),  # 4 layers
    ({"indexer_types": ["shared", "full", "full", "full"]}, "'indexer_types[0]'"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}}, "'quantization_config.weight_block_size'"),
    ({"model_type": "deepseek_v3"}, "'model_type'"),
])
def test_invalid_or_inconsistent_config(ckpt, changes, field):
    path = edit_config(ckpt, **changes)
    with pytest.raises(ConfigError) as err:
        load(ckpt)
    assert str(path) in str(err.value) and field in str(err.value)


def test_config_that_no_longer_fits_the_tensors(ckpt):
    edit_config(ckpt, n_routed_experts=8)  # valid on its own, but the files hold 16 experts
    with pytest.raises(CheckpointError) as err:
        load(ckpt)
    assert "model.layers." in str(err.value) and ("mlp.gate" in str(err.value) or "experts.8." in str(err.value))


def test_modules_to_not_convert_naming_an_fp8_linear(ckpt):
    quant = json.loads((ckpt / "config.json").read_text())["quantization_config"]
    quant["modules_to_not_convert"] = quant["modules_to_not_convert"] + ["model.layers.*.self_attn.o_proj"]
    path = edit_config(ckpt, quantization_config=quant)
    with pytest.raises(ConfigError, match="modules_to_not_convert") as err:
        load(ckpt)
    assert str(path) in str(err.value) and "o_proj" in str(err.value)


def test_out_of_range_token_id_in_forward(source):
    model = load(source)
    with pytest.raises(InputError, match=r"token id 512 is out of range \[0, 512\)"):
        model(torch.tensor([[1, 2, 512]]))
    with pytest.raises(InputError, match="token id -1"):
        model(torch.tensor([[-1, 2]]))


def test_out_of_range_token_id_in_cli(source, capsys):
    code = main(["generate", "--model", str(source), "--prompt-ids", "3,999,4", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert code == 2
    assert err == "fxglm5: error: --prompt-ids: token id 999 is out of range [0, 512) (vocab_size)\n"


@pytest.mark.parametrize("args, expected", [
    (["--prompt-ids", "1,x", "--max-new-tokens", "2"], "comma-separated integers"),
    (["--prompt-ids", "1,2", "--max-new-tokens", "-3"], "max_new_tokens"),
])
def test_bad_generate_arguments(source, capsys, args, expected):
    assert main(["generate", "--model", str(source), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fxglm5: error: ") and expected in err and err.count("\n") == 1


def test_cli_error_is_one_line_exit_2_without_traceback(ckpt):
    edit_config(ckpt, hidden_size=-1)
    proc = subprocess.run(
        [sys.executable, "-m", "fxglm5.cli", "generate", "--model", str(ckpt), "--prompt-ids", "1,2", "--max-new-tokens", "1"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fxglm5: error: ")
    assert "config.json" in lines[0] and "'hidden_size'" in lines[0]
