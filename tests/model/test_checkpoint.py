"""Checkpoint loading/saving, block-FP8 quantization, the tiny checkpoint and GLM-5's parameter count."""

import json
import logging
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from fxglm5.model.checkpoint import save_checkpoint
from fxglm5.model.config import Glm5Config
from fxglm5.model.layers import Linear, dequantize_weight
from fxglm5.model.layout import expected_tensors, mtp_tensors
from fxglm5.model.modeling import Glm5ForCausalLM
from fxglm5.model.quantize import quantize_checkpoint, quantize_fp8_block
from fxglm5.model.st_files import INDEX, SINGLE
from fxglm5.model.tiny import make_tiny_checkpoint
from tests.helpers import assert_saturates, loop_quantize_fp8, saturating_values

PROMPT = torch.tensor([[1, 17, 42, 7, 99, 3, 250, 11, 300, 5, 64, 128, 77, 411, 2, 9, 260, 33, 480, 12, 6, 150, 91, 200]])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return make_tiny_checkpoint(root / "bf16", fp8=False), make_tiny_checkpoint(root / "fp8", fp8=True)


def e4m3_bound(src: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Max |dequantized - src| per element: half an e4m3 ulp of w/scale (3 mantissa bits: 2^-4 relative
    for normals; subnormal spacing 2^-9, half of it 2^-10), times the block scale, plus fp32 slack."""
    n, k = src.shape[-2:]
    s = scale.repeat_interleave(128, -2).repeat_interleave(128, -1)[..., :n, :k]
    q = src.abs() / s
    return torch.maximum(q * 2.0**-4, torch.full_like(q, 2.0**-10)) * s * (1 + 1e-5) + 1e-30


@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (3, 130, 257), (576, 64)])
def test_quantize_block_within_e4m3_rounding(shape):
    gen = torch.Generator().manual_seed(0)
    # blocks of very different magnitudes, one all-zero row band, tiny values that go subnormal
    w = torch.randn(shape, generator=gen) * torch.logspace(-6, 2, shape[-2])[:, None]
    w[..., :7, :] = 0.0
    w = w.to(torch.bfloat16)
    q, scale = quantize_fp8_block(w)
    nb, kb = math.ceil(shape[-2] / 128), math.ceil(shape[-1] / 128)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (*shape[:-2], nb, kb)
    src = w.float()
    deq = dequantize_weight(q, scale, torch.float32)
    assert (deq - src).abs().le(e4m3_bound(src, scale)).all()
    # scale = amax / 448 (floored): each non-zero block's largest element maps exactly to +-448
    padded = torch.nn.functional.pad(src.abs(), (0, kb * 128 - shape[-1], 0, nb * 128 - shape[-2]))
    amax = padded.view(*shape[:-2], nb, 128, kb, 128).amax(dim=(-3, -1))
    torch.testing.assert_close(scale, amax.clamp_min(1e-12) / 448, rtol=0, atol=0)
    qmax = torch.nn.functional.pad(q.float().abs(), (0, kb * 128 - shape[-1], 0, nb * 128 - shape[-2]))
    qmax = qmax.view(*shape[:-2], nb, 128, kb, 128).amax(dim=(-3, -1))
    assert torch.equal(qmax[amax > 0], torch.full_like(qmax[amax > 0], 448.0))


def test_quantize_block_matches_an_independent_loop():
    """Bit for bit the per-block Python-float quantizer (tests.helpers.loop_quantize_fp8), on 128x128 blocks far
    above 448, of amax exactly 448, of multiples of 448, zero, unit and subnormal-producing, with short edge
    blocks; every non-zero block saturates at exactly +-448."""
    w = saturating_values(390, 260, 128, torch.Generator().manual_seed(1))
    q, scale = quantize_fp8_block(w)
    q_loop, scale_loop = loop_quantize_fp8(w, 128, floor=1e-12)
    assert torch.equal(scale, scale_loop) and torch.equal(q.view(torch.uint8), q_loop.view(torch.uint8))
    assert_saturates(q, scale, w, 128)


def test_quantized_checkpoint_dequantizes_to_source(tiny):
    bf16_dir, fp8_dir = tiny
    src = Glm5ForCausalLM.from_pretrained(bf16_dir, dtype=torch.float32, progress=False)
    fp8 = Glm5ForCausalLM.from_pretrained(fp8_dir, dtype=torch.float32, progress=False)
    src_params = dict(src.named_parameters())
    checked = 0
    for name, module in fp8.named_modules():
        if isinstance(module, Linear) and module.fp8:
            ref = src_params[name + ".weight"].float()
            deq = module.dequantized_weight(torch.float32)
            assert (deq - ref).abs().le(e4m3_bound(ref, module.weight_scale_inv)).all(), name
            checked += 1
        elif name.endswith("mlp.experts"):
            for w in ("gate_up_proj", "down_proj"):
                ref = src_params[f"{name}.{w}"].float()
                scale = getattr(module, w + "_scale_inv")
                deq = dequantize_weight(getattr(module, w), scale, torch.float32)
                assert (deq - ref).abs().le(e4m3_bound(ref, scale)).all(), name
                checked += 1
    assert checked > 40
    for name, p in fp8.named_parameters():  # everything else is copied unchanged
        if p.dtype != torch.float8_e4m3fn and not name.endswith("scale_inv"):
            assert torch.equal(p, src_params[name].to(p.dtype)), name


def test_fp8_tiny_tracks_its_bf16_source(tiny):
    bf16_dir, fp8_dir = tiny
    with torch.no_grad():
        ref = Glm5ForCausalLM.from_pretrained(bf16_dir, dtype=torch.float32, progress=False)(PROMPT)[0]
        got = Glm5ForCausalLM.from_pretrained(fp8_dir, dtype=torch.float32, progress=False)(PROMPT)[0]
    assert torch.nn.functional.cosine_similarity(ref.flatten(), got.flatten(), dim=0) >= 0.99
    # the tiny model is not degenerate: spread-out logits, a top token that changes along the prompt
    assert ref.std() > 0.5 and (ref.amax(-1) - ref.amin(-1)).min() > 3.0
    assert len(set(ref.argmax(-1).tolist())) >= PROMPT.shape[1] // 2


def test_tiny_checkpoint_is_sharded_and_fp8(tiny):
    for path in tiny:
        index = json.loads((path / INDEX).read_text())
        assert len(set(index["weight_map"].values())) >= 2 and not (path / SINGLE).exists()
    config = json.loads((tiny[1] / "config.json").read_text())["quantization_config"]
    assert config == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
        "modules_to_not_convert": ["model.embed_tokens", "lm_head", "model.layers.*.self_attn.indexers_proj"],
    }
    shard = tiny[1] / json.loads((tiny[1] / INDEX).read_text())["weight_map"]["model.layers.1.mlp.experts.5.up_proj.weight"]
    tensors = load_file(shard)
    assert tensors["model.layers.1.mlp.experts.5.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors["model.layers.1.mlp.experts.5.up_proj.weight_scale_inv"].shape == (1, 2)
    assert "model.layers.1.mlp.experts.gate_up_proj" not in index["weight_map"]


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("sharded", [False, True])
def test_save_load_round_trip(tiny, tmp_path, fp8, sharded):
    model = Glm5ForCausalLM.from_pretrained(tiny[fp8], dtype=torch.bfloat16, progress=False)
    files = save_checkpoint(model, tmp_path, max_shard_bytes=2**20 if sharded else None)
    assert (len(files) >= 2) == sharded and (tmp_path / INDEX).exists() == sharded
    again = Glm5ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, progress=False)
    assert again.config == model.config
    theirs = dict(again.named_parameters())
    for name, p in model.named_parameters():
        assert theirs[name].dtype == p.dtype and torch.equal(theirs[name].float(), p.float()), name


def test_loaded_dtypes(tiny):
    model = Glm5ForCausalLM.from_pretrained(tiny[1], dtype=torch.bfloat16, progress=False)
    params = dict(model.named_parameters())
    assert params["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert params["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert params["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert params["model.layers.0.self_attn.indexer.weights_proj.weight"].dtype == torch.float32
    assert params["model.layers.2.mlp.experts.gate_up_proj"].dtype == torch.float8_e4m3fn
    assert params["model.layers.2.mlp.experts.gate_up_proj_scale_inv"].shape == (16, 2, 2)
    assert all(p.device.type == "cpu" for p in model.parameters())


def test_packed_layout_loads_and_quantizes_like_per_expert(tiny, tmp_path):
    """A raw state_dict dump (stacked experts, as transformers holds them in memory) is accepted too."""
    model = Glm5ForCausalLM.from_pretrained(tiny[0], dtype=torch.bfloat16, progress=False)
    packed = tmp_path / "packed"
    packed.mkdir()
    model.config.save(packed)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(packed / SINGLE))
    again = Glm5ForCausalLM.from_pretrained(packed, dtype=torch.bfloat16, progress=False)
    for name, p in model.named_parameters():
        assert torch.equal(dict(again.named_parameters())[name], p), name
    quantize_checkpoint(packed, tmp_path / "q", max_shard_bytes=None)
    ours = load_file(tmp_path / "q" / SINGLE)
    ref = Glm5ForCausalLM.from_pretrained(tiny[1], dtype=torch.bfloat16, progress=False)
    for name, p in ref.named_parameters():
        if p.dtype == torch.float8_e4m3fn and "experts" not in name:
            assert torch.equal(ours[name].view(torch.uint8), p.view(torch.uint8)), name
    stacked = ref.model.layers[3].mlp.experts.gate_up_proj
    assert torch.equal(ours["model.layers.3.mlp.experts.2.up_proj.weight"].view(torch.uint8), stacked[2, 128:].view(torch.uint8))


def test_mtp_tensors_are_skipped_with_one_notice(tiny, caplog):
    """The tiny checkpoint holds GLM-5's MTP layer; without mtp=True it is skipped unread, with one notice."""
    config = Glm5Config.from_json(tiny[0] / "config.json")
    mtp = mtp_tensors(config)
    assert {"model.layers.4.eh_proj.weight", "model.layers.4.shared_head.norm.weight",
            "model.layers.4.mlp.experts.15.down_proj.weight"} <= set(mtp)
    with caplog.at_level(logging.INFO, logger="fxglm5.checkpoint"):
        model = Glm5ForCausalLM.from_pretrained(tiny[0], dtype=torch.bfloat16, progress=False)
    notices = [r for r in caplog.records if "MTP" in r.getMessage()]
    assert len(notices) == 1 and f"{len(mtp)} tensors" in notices[0].getMessage()
    assert len(model.model.layers) == 4 and model.mtp is None


def test_model_parameters_are_the_checkpoint_table():
    """The model's parameters (stacked experts) are exactly the packed checkpoint table: same names/shapes."""
    cfg = Glm5Config.preset("tiny").replace(indexer_types=["full", "shared", "full", "shared"])
    model = Glm5ForCausalLM(cfg, device="meta")
    table = expected_tensors(cfg, packed=True)
    assert {n: tuple(p.shape) for n, p in model.named_parameters()} == {n: s.shape for n, s in table.items()}


def test_glm5_parameter_count():
    """743.9 B without MTP, 753.86 B with it (the published figures); FP8 scales are not counted.

    The MTP layer (index 78) is a full MoE decoder layer (9.877 B) plus enorm, hnorm, shared_head.norm
    (6144 each) and eh_proj [6144, 12288] (75.5 M); it shares embed_tokens and lm_head with the model.
    """
    cfg = Glm5Config.preset("glm5")
    model = Glm5ForCausalLM(cfg, device="meta")
    weights = {n: p.numel() for n, p in model.named_parameters() if not n.endswith("scale_inv")}
    total = sum(weights.values())
    assert total == 743_911_218_432 and round(total / 1e9, 1) == 743.9
    table = expected_tensors(cfg)
    assert sum(math.prod(s.shape) for s in table.values() if s.kind != "scale") == total
    mtp = sum(math.prod(s.shape) for s in mtp_tensors(cfg).values() if s.kind != "scale")
    assert round((total + mtp) / 1e9, 2) == 753.86
    attn = sum(p.numel() for n, p in model.model.layers[3].self_attn.named_parameters() if not n.endswith("scale_inv"))
    assert round(attn / 1e6, 1) == 174.4
    assert all(p.is_meta for p in model.parameters())


def test_packed_fp8_dump_loads(tiny, tmp_path):
    model = Glm5ForCausalLM.from_pretrained(tiny[1], dtype=torch.bfloat16, progress=False)
    model.config.save(tmp_path)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / SINGLE))
    again = dict(Glm5ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, progress=False).named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(again[name].view(torch.uint8), p.view(torch.uint8)), name
