"""Every bad input gets a typed error whose message names the file and the tensor or field at fault."""

import json
import re
import shutil
import struct
import subprocess
import sys

import pytest
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from fxglm5.cli import main, parse_token_ids
from fxglm5.errors import CheckpointError, ConfigError, InputError
from fxglm5.model.modeling import Glm5ForCausalLM
from fxglm5.model.config import Glm5Config
from fxglm5.model.quantize import quantize_checkpoint
from fxglm5.model.st_files import INDEX
from fxglm5.model.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("src") / "tiny", fp8=True)


@pytest.fixture(scope="module")
def bf16_source(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("src") / "bf16", fp8=False)


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
    return Glm5ForCausalLM.from_pretrained(ckpt, dtype=torch.float32, progress=False)


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
    # the first tensor the files hold that 8 experts lack: the router's or one of experts 8..15 (file order)
    assert re.search(r"model\.layers\.\d+\.mlp\.(gate|experts\.(8|9|1[0-5])\.)", str(err.value))


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


def test_prompt_ids_split_at_spaces_and_commas():
    """'1 2 3' is three tokens (it was read as the one token 123), and so are '1, 2, 3' and '1 2,3'."""
    assert [parse_token_ids(text, 512) for text in ("1 2 3", " 1, 2, 3 ", "1 2,3", "123")] == [[1, 2, 3]] * 3 + [[123]]


def test_negative_prompt_id_is_named(source, capsys):
    """``--prompt-ids -1,2`` ended in argparse's usage text; the id check now names the id."""
    assert main(["generate", "--model", str(source), "--prompt-ids", "-1,2", "--max-new-tokens", "2"]) == 2
    assert capsys.readouterr().err == "fxglm5: error: --prompt-ids: token id -1 is out of range [0, 512) (vocab_size)\n"


@pytest.mark.parametrize("args, expected", [
    (["--prompt-ids", "1,x", "--max-new-tokens", "2"], "separated by commas or spaces"),
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


# ---- safetensors headers whose data_offsets do not tile the data ------------------------------------
def rewrite_header(path, edit, insert=b""):
    """Rewrite the JSON header of safetensors file ``path`` after ``edit(header)``; ``insert`` (bytes) goes
    between the first tensor's data and the rest."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header, body = json.loads(data[8:8 + n]), data[8 + n:]
    first = min((v["data_offsets"][1], k) for k, v in header.items() if k != "__metadata__")[0]
    edit(header)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body[:first] + insert + body[first:])


def spans(header):
    return sorted((v["data_offsets"], k) for k, v in header.items() if k != "__metadata__")


def overlap(header):  # the second tensor starts inside the first
    (a, _), (b, name) = spans(header)[:2]
    header[name]["data_offsets"] = [a[0] + 4, a[0] + 4 + b[1] - b[0]]


def negative(header):
    _, name = spans(header)[0]
    size = header[name]["data_offsets"][1] - header[name]["data_offsets"][0]
    header[name]["data_offsets"] = [-size, 0]


def hole(header):  # 16 bytes inserted after the first tensor and every later offset moved past them
    for offsets, name in spans(header)[1:]:
        header[name]["data_offsets"] = [offsets[0] + 16, offsets[1] + 16]


@pytest.mark.parametrize("edit, insert, expected", [
    (overlap, b"", "overlap tensor"),
    (negative, b"", "negative offsets"),
    (hole, bytes(16), "leaving a hole of 16 bytes after tensor"),
    (lambda header: None, bytes(8), "the file holds"),  # trailing bytes no tensor covers
])
def test_data_offsets_that_do_not_tile_the_data(ckpt, capsys, edit, insert, expected):
    path = shard_of(ckpt, "model.layers.1.self_attn.kv_b_proj.weight")
    rewrite_header(path, edit, insert)
    with pytest.raises(SafetensorError):  # the format's own reader refuses the file too, naming no tensor
        safe_open(str(path), framework="pt")
    assert main(["generate", "--model", str(ckpt), "--prompt-ids", "1,2", "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fxglm5: error: {path}: ") and expected in err and err.count("\n") == 1
    assert "data_offsets" in err


# ---- shards outside the checkpoint directory -----------------------------------------------------
def point_entry(ckpt, name, shard):
    index = json.loads((ckpt / INDEX).read_text())
    index["weight_map"][name] = shard
    (ckpt / INDEX).write_text(json.dumps(index))


def test_weight_map_entries_that_leave_the_directory(ckpt, tmp_path):
    name = "model.layers.0.mlp.gate_proj.weight"
    original = shard_of(ckpt, name)
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(original, outside / original.name)  # a valid shard, but not this checkpoint's
    for shard in [f"../outside/{original.name}", str(outside / original.name)]:
        point_entry(ckpt, name, shard)
        with pytest.raises(CheckpointError, match="leaves the checkpoint directory") as err:
            load(ckpt)
        assert str(ckpt / INDEX) in str(err.value) and name in str(err.value) and shard in str(err.value)
    point_entry(ckpt, name, original.name)
    original.unlink()
    original.symlink_to(outside / original.name)
    with pytest.raises(CheckpointError, match="a symlink to .*outside the checkpoint directory") as err:
        load(ckpt)  # named by the first entry listing that shard
    assert str(err.value).startswith(f"{ckpt / INDEX}: weight_map entry 'model.") and repr(original.name) in str(err.value)


def test_hub_cache_snapshot_symlinks_into_its_blobs_load(source, tmp_path):
    """The Hugging Face cache keeps snapshots/<rev>/<file> as symlinks to ../../blobs/<sha>: that is inside."""
    repo = tmp_path / "models--zai-org--tiny"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, f in enumerate(sorted(source.iterdir())):
        shutil.copy(f, blobs / f"blob{i}")
        (snapshot / f.name).symlink_to(f"../../blobs/blob{i}")
    expected = load(source).state_dict()
    for key, value in load(snapshot).state_dict().items():
        assert torch.equal(value.view(torch.uint8), expected[key].view(torch.uint8)), key


# ---- values: NaN, Inf, absurd magnitudes, non-positive block scales --------------------------------
def set_first(name, value):
    def edit(tensors):
        t = tensors[name]
        if t.dtype == torch.float8_e4m3fn:
            t.view(torch.uint8).view(-1)[0] = value
        else:
            t.view(-1)[0] = value
    return edit


@pytest.mark.parametrize("name, value, expected", [
    ("model.layers.0.self_attn.q_a_proj.weight", 0x7F, "holds NaN"),  # an e4m3 NaN code
    ("model.layers.2.mlp.experts.5.up_proj.weight", 0xFF, "holds NaN"),  # stacked into the experts' tensor
    ("model.embed_tokens.weight", float("inf"), "holds Inf"),
    ("model.embed_tokens.weight", 1e30, "holds 1e+30, beyond float16's largest value 65504"),
    ("model.layers.1.input_layernorm.weight", -1e30, "holds -1e+30"),
    ("model.layers.3.mlp.gate.weight", float("nan"), "holds NaN"),
    ("model.layers.0.self_attn.o_proj.weight_scale_inv", float("nan"), "holds NaN"),
    ("model.layers.0.self_attn.o_proj.weight_scale_inv", 1e30, "holds 1e+30; block scales must lie in (0, 146.2]"),
    ("model.layers.1.mlp.experts.0.down_proj.weight_scale_inv", 0.0, "holds 0; block scales must lie in"),
    ("model.layers.1.mlp.shared_experts.gate_proj.weight_scale_inv", -0.01, "holds -0.01; block scales"),
])
def test_non_finite_or_absurd_values_are_refused_at_load(ckpt, name, value, expected):
    path = edit_shard(ckpt, name, set_first(name, value))
    with pytest.raises(CheckpointError, match=re.escape(expected)) as err:
        load(ckpt)
    assert str(err.value).startswith(f"{path}: ") and repr(name) in str(err.value)


def test_absurd_weight_in_cli_is_one_line_not_zeros(ckpt, capsys):
    name = "lm_head.weight"
    path = edit_shard(ckpt, name, set_first(name, 1e30))
    assert main(["generate", "--model", str(ckpt), "--prompt-ids", "1,2", "--max-new-tokens", "4"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith(f"fxglm5: error: {path}: tensor {name!r} holds 1e+30")


def test_bf16_source_with_nan_is_refused_by_quantize(bf16_source, tmp_path):
    src = shutil.copytree(bf16_source, tmp_path / "bf16")
    name = "model.layers.2.mlp.experts.1.gate_proj.weight"
    path = edit_shard(src, name, set_first(name, float("nan")))
    with pytest.raises(CheckpointError, match="holds NaN") as err:
        quantize_checkpoint(src, tmp_path / "fp8")
    assert str(err.value).startswith(f"{path}: ") and repr(name) in str(err.value)


# ---- config fields the model does not implement, or values out of range ----------------------------
@pytest.mark.parametrize("changes, field", [
    ({"rope_interleave": False}, "rope_interleave"),
    ({"indexer_rope_interleave": False}, "indexer_rope_interleave"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ({"q_lora_rank": None}, "q_lora_rank"),
    ({"topk_method": "greedy"}, "topk_method"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, "rope_parameters.rope_type"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.type"),
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}},
     "quantization_config.activation_scheme"),
])
def test_legal_but_unsupported_config_values(ckpt, changes, field):
    path = edit_config(ckpt, **changes)
    with pytest.raises(ConfigError, match=f"config field '{re.escape(field)}' = .* is not supported by fxglm5") as err:
        load(ckpt)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("changes, field, expected", [
    ({"rms_norm_eps": 1e30}, "rms_norm_eps", "must be below 1"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps", "must be a positive number"),
    ({"first_k_dense_replace": 5}, "first_k_dense_replace", "exceeds 'num_hidden_layers' (4)"),
    ({"rope_interleave": "yes"}, "rope_interleave", "must be true or false"),
    ({"norm_topk_prob": 1}, "norm_topk_prob", "must be true or false"),
    ({"rope_parameters": "default"}, "rope_parameters", "must be an object"),
])
def test_invalid_config_values_are_not_called_unsupported(ckpt, changes, field, expected):
    path = edit_config(ckpt, **changes)
    with pytest.raises(ConfigError) as err:
        load(ckpt)
    message = str(err.value)
    assert str(path) in message and f"'{field}'" in message and expected in message
    assert "not supported" not in message


@pytest.mark.parametrize("raw", [
    {"num_hidden_layers": 7, "index_topk_freq": 2},
    {"num_hidden_layers": 9, "index_topk_freq": 3, "index_skip_topk_offset": 4},
    {"num_hidden_layers": 5, "index_topk_pattern": "FSFSS"},
    {"num_hidden_layers": 4},
])
def test_indexer_types_derived_as_transformers_derives_them(raw):
    hf = pytest.importorskip("transformers.models.glm_moe_dsa.configuration_glm_moe_dsa")
    raw = {**raw, "first_k_dense_replace": 1}
    assert Glm5Config.from_dict(raw).indexer_types == hf.GlmMoeDsaConfig(**raw).indexer_types


# ---- make-tiny / quantize --out: never into a file or over what is stored -------------------------
def test_make_tiny_out_an_existing_file_or_non_empty_directory(tmp_path, capsys):
    existing = tmp_path / "notes.txt"
    existing.write_text("keep me")
    stored = tmp_path / "stored"
    stored.mkdir()
    (stored / "weights.bin").write_bytes(b"keep me too")
    for out, expected in [(existing, "exists and is not a directory"), (stored, "exists and is not empty")]:
        assert main(["make-tiny", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"fxglm5: error: {out}: {expected}") and err.count("\n") == 1
    assert existing.read_text() == "keep me" and [p.name for p in stored.iterdir()] == ["weights.bin"]


def test_quantize_out_a_non_empty_directory(bf16_source, source, capsys):
    before = sorted((p.name, p.stat().st_mtime_ns) for p in source.iterdir())
    assert main(["quantize", "--in", str(bf16_source), "--out", str(source)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fxglm5: error: {source}: exists and is not empty") and err.count("\n") == 1
    assert sorted((p.name, p.stat().st_mtime_ns) for p in source.iterdir()) == before


# ---- generate: sizes checked before anything is allocated ----------------------------------------
def test_huge_block_size_is_refused_up_front(source, capsys):
    code = main(["generate", "--model", str(source), "--prompt-ids", "1,2", "--max-new-tokens", "4",
                 "--block-size", "1000000"])
    err = capsys.readouterr().err
    assert code == 2
    assert err == ("fxglm5: error: block_size: 1000000 exceeds max_position_embeddings (4096): a block longer than "
                   "the longest sequence is never filled\n")


def test_too_many_new_tokens_are_refused_before_the_cache_is_sized(source, capsys, monkeypatch):
    import fxglm5.serve.build as build

    monkeypatch.setattr(build, "build_parts", lambda *a, **k: pytest.fail("a Runner was built: its cache sized"))
    code = main(["generate", "--model", str(source), "--prompt-ids", "1,2", "--prompt-ids", "3",
                 "--max-new-tokens", "100000"])
    err = capsys.readouterr().err
    assert code == 2
    assert err == ("fxglm5: error: prompt 0: 2 tokens + max_new_tokens 100000 exceed max_position_embeddings "
                   "(4096)\n")


def test_unknown_kernel_backend_variable_in_cli(source, capsys, monkeypatch):
    monkeypatch.setenv("FXGLM5_BACKEND", "nonsense")
    assert main(["generate", "--model", str(source), "--prompt-ids", "1,2", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err == ("fxglm5: error: environment variable FXGLM5_BACKEND must be one of 'aiter', 'triton', 'reference' "
                   "(or unset: the best for the device), got 'nonsense'\n")
