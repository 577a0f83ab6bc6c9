"""Block-FP8 at widths that are not multiples of 128 (short edge blocks), end to end.

A tiny GLM-5 with hidden 200, intermediate 40 and moe_intermediate 24 (every FP8 weight has a short
block along N, K or both) is quantized by ``fxglm5 quantize``, loaded and served. The expectations are
computed independently here: each weight's block scales [ceil(N/128), ceil(K/128)] expanded over its
blocks (a per-block loop), and the source model run with those dequantized weights in plain float32.
Also: malformed scale shapes are refused by name. (The Triton kernels at odd shapes, op by op:
tests/kernels/test_kernels_fp8.py.)
"""

import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fxglm5.cli import main
from fxglm5.errors import CheckpointError, InputError
from fxglm5.lowering.reference import fp8 as ref
from fxglm5.model.checkpoint import CheckpointReader, save_checkpoint
from fxglm5.model.modeling import Glm5ForCausalLM
from fxglm5.model.config import Glm5Config
from fxglm5.model.generate import greedy_generate
from fxglm5.model.st_files import scan_checkpoint
from fxglm5.model.tiny import make_tiny_checkpoint
from fxglm5.runtime.runner import Runner

ODD = dict(hidden_size=200, intermediate_size=40, moe_intermediate_size=24)
PROMPTS = [[5, 17, 300, 42, 7, 99, 3, 250, 11], [8, 1]]


@pytest.fixture(scope="module")
def odd(tmp_path_factory):
    """(bf16 source dir, FP8 dir written by ``fxglm5 quantize``)."""
    root = tmp_path_factory.mktemp("odd")
    cfg = Glm5Config.preset("tiny").replace(**ODD)
    src = make_tiny_checkpoint(root / "bf16", fp8=False, seed=4, config=cfg)
    assert main(["quantize", "--in", str(src), "--out", str(root / "fp8")]) == 0
    return src, root / "fp8"


def _all_tensors(path):
    tensors, _ = scan_checkpoint(path)
    out = {}
    for name, info in tensors.items():
        with safe_open(str(info.file), framework="pt") as f:
            out[name] = f.get_tensor(name)
    return out


def block_dequant(w, scale):
    """W_fp8 * scale, one 128x128 block at a time, cut to [N, K] (float32)."""
    n, k = w.shape
    out = torch.empty(n, k)
    for i in range(math.ceil(n / 128)):
        for j in range(math.ceil(k / 128)):
            rows, cols = slice(i * 128, (i + 1) * 128), slice(j * 128, (j + 1) * 128)
            out[rows, cols] = w[rows, cols].float() * scale[i, j]
    return out


def e4m3_bound(src, scale):
    """Max |dequantized - src| per element: half an e4m3 ulp of w / scale, times the block's scale."""
    s = block_dequant(torch.ones(src.shape, dtype=torch.float8_e4m3fn), scale)
    q = src.abs() / s
    return torch.maximum(q * 2.0**-4, torch.full_like(q, 2.0**-10)) * s * (1 + 1e-5) + 1e-30


def test_quantizer_scales_cover_partial_blocks(odd):
    src_dir, fp8_dir = odd
    src, ours = _all_tensors(src_dir), _all_tensors(fp8_dir)
    fp8 = [n for n, t in ours.items() if t.dtype == torch.float8_e4m3fn]
    edges = set()
    for name in fp8:
        w, scale = ours[name], ours[name + "_scale_inv"]
        n, k = w.shape
        assert scale.dtype == torch.float32 and tuple(scale.shape) == (math.ceil(n / 128), math.ceil(k / 128)), name
        source = src[name].float()
        deq = block_dequant(w, scale)
        assert (deq - source).abs().le(e4m3_bound(source, scale)).all(), name
        # each block's scale is its own amax / 448, the short edge blocks' amax over their real elements
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                blk = source[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
                assert scale[i, j] == blk.abs().max().clamp_min(1e-12) / 448, (name, i, j)
        edges.update({("N", n % 128), ("K", k % 128)})
    assert len(fp8) > 40 and {("N", 24), ("K", 24), ("N", 40), ("K", 40), ("N", 72), ("K", 72)} <= edges


def test_dequantization_matches_transformers(odd):
    """transformers' fine-grained FP8 dequantization (its backward-pass helper) as an oracle."""
    finegrained = pytest.importorskip("transformers.integrations.finegrained_fp8")
    ours = _all_tensors(odd[1])
    for name in ("model.layers.1.mlp.experts.3.down_proj.weight", "model.layers.1.self_attn.o_proj.weight",
                 "model.layers.0.mlp.gate_proj.weight", "model.layers.2.mlp.shared_experts.up_proj.weight"):
        w, scale = ours[name], ours[name + "_scale_inv"]
        theirs = finegrained._dequantize_fp8_weight(w, scale, [128, 128], torch.float32)
        assert torch.equal(ref.dequantize_block_fp8(w, scale), theirs), name


def _dequantized_source(fp8_dir) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with every FP8 weight replaced by its block dequantization (float32)."""
    tensors = _all_tensors(fp8_dir)
    plain = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        plain[name] = block_dequant(t, tensors[name + "_scale_inv"]) if t.dtype == torch.float8_e4m3fn else t
    return plain


def test_odd_width_checkpoint_loads_and_matches_its_dequantized_source(odd, tmp_path):
    """The loader stacks the per-expert blocks exactly: logits of the FP8 model = the dequantized source's."""
    cfg = Glm5Config.from_json(odd[1] / "config.json")
    model = Glm5ForCausalLM.from_pretrained(odd[1], dtype=torch.float32, progress=False)
    experts = model.model.layers[1].mlp.experts
    assert experts.gate_up_proj.shape == (16, 48, 200) and experts.gate_up_proj_scale_inv.shape == (16, 2, 2)
    save_file(_dequantized_source(odd[1]), str(tmp_path / "model.safetensors"))
    cfg.replace(quantization_config=None).save(tmp_path)
    plain = Glm5ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, progress=False)
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids), plain(ids), rtol=1e-5, atol=1e-5)


def test_odd_width_save_and_packed_dump_round_trip(odd, tmp_path):
    """The stacked per-half scales split back into the per-expert tensors on save, and a raw state_dict
    dump (the packed layout) loads as it was."""
    model = Glm5ForCausalLM.from_pretrained(odd[1], dtype=torch.bfloat16, progress=False)
    save_checkpoint(model, tmp_path / "saved")
    assert torch.equal(load_file(tmp_path / "saved" / "model.safetensors")["model.layers.2.mlp.experts.7.up_proj.weight_scale_inv"],
                       _all_tensors(odd[1])["model.layers.2.mlp.experts.7.up_proj.weight_scale_inv"])
    (tmp_path / "packed").mkdir()
    model.config.save(tmp_path / "packed")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "packed" / "model.safetensors"))
    for path in (tmp_path / "saved", tmp_path / "packed"):
        again = dict(Glm5ForCausalLM.from_pretrained(path, dtype=torch.bfloat16, progress=False).named_parameters())
        for name, p in model.named_parameters():
            assert torch.equal(again[name].view(torch.uint8), p.view(torch.uint8)), (path.name, name)


@pytest.mark.filterwarnings("ignore:overflow encountered in matmul:RuntimeWarning")  # MoE padding rows (never stored)
# interpreted, every step costs about the same (one launch of each kernel): Triton runs a prefill and one decode
# step, each of its kernels at the odd widths in both
@pytest.mark.parametrize("backend,prompts,steps", [("reference", PROMPTS, 6), ("triton", PROMPTS[:1], 2)])
def test_quantize_load_generate_gives_the_dequantized_source_tokens(odd, tmp_path, backend, prompts, steps, monkeypatch):
    """The paged runtime on the quantized checkpoint (every FP8 linear and MoE fused, then the reference
    ops or the Triton kernels, interpreted on CPU) generates the tokens of the source model with its
    dequantized weights, by full recompute."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    save_file(_dequantized_source(odd[1]), str(tmp_path / "model.safetensors"))
    Glm5Config.from_json(odd[1] / "config.json").replace(quantization_config=None).save(tmp_path)
    plain = Glm5ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, progress=False)
    runner = Runner(odd[1], kv_cache="bf16", block_size=16, dtype=torch.float32, max_cache_tokens=64, backend=backend)
    fused = {r.name: (r.num_matches, r.expected) for r in runner.pass_results if r.stage == "fuse"}
    assert fused["fuse_fp8_moe"] == (3, 3) and fused["fuse_fp8_linear"][0] == fused["fuse_fp8_linear"][1] > 0
    assert runner.generate(prompts, steps) == [greedy_generate(plain, prompt, steps) for prompt in prompts]


def test_floor_scale_shape_is_refused_naming_the_tensor(odd, tmp_path):
    """A scale of floor(N/128) rows (the partial block dropped) is refused from the headers, by name."""
    files = sorted(odd[1].glob("*.safetensors"))
    for f in odd[1].iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    bad = "model.layers.0.self_attn.o_proj.weight_scale_inv"  # o_proj [200, 256]: ceil -> [2, 2], floor -> [1, 2]
    for f in files:
        tensors = load_file(f)
        if bad in tensors:
            tensors[bad] = tensors[bad][:1].contiguous()
            save_file(tensors, str(tmp_path / f.name), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"scale tensor '{bad}' has shape \[1, 2\], expected \[2, 2\]"):
        CheckpointReader(tmp_path)


def test_fused_ops_refuse_floor_and_one_piece_gate_up_scales():
    w = torch.randn(200, 72).to(torch.float8_e4m3fn)
    with pytest.raises(InputError, match=r"weight_scale: shape \(1, 0\) does not fit weight \(200, 72\), expected \(2, 1\)"):
        ref.fp8_linear(torch.randn(3, 72), w, torch.ones(1, 0), None, False)
    e, inter, h = 3, 24, 200
    w13, w2 = torch.randn(e, 2 * inter, h).to(torch.float8_e4m3fn), torch.randn(e, h, inter).to(torch.float8_e4m3fn)
    ids, tw = torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, 1)
    one_piece = torch.ones(e, 1, 2)  # ceil(2I/128) rows: gate and up sharing a block, not the checkpoint's
    with pytest.raises(InputError, match=r"w13_scale: shape \(3, 1, 2\) does not fit w13 \(3, 48, 200\), expected \(3, 2, 2\)"):
        ref.moe_fp8(torch.randn(2, h), ids, tw, w13, one_piece, w2, torch.ones(e, 2, 1), False)
