"""GLM-5's MTP layer: its math, its checkpoint (GLM-5-FP8's layout and variants, bad ones), and the eager
speculative-decoding reference, whose tokens must be greedy decoding's."""

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import fxglm5.model.generate as generate
from fxglm5.errors import CheckpointError, InputError
from fxglm5.model.checkpoint import save_checkpoint
from fxglm5.model.config import Glm5Config
from fxglm5.model.generate import greedy_generate, speculative_greedy_generate
from fxglm5.model.layers import Linear, rope_cos_sin
from fxglm5.model.layout import MtpLayout
from fxglm5.model.modeling import Glm5ForCausalLM, Glm5MtpDraft
from fxglm5.model.quantize import quantize_fp8_block
from fxglm5.model.st_files import INDEX, SINGLE
from fxglm5.model.tiny import make_tiny_checkpoint, tiny_state

PROMPT = [1, 17, 42, 7, 99, 3, 250, 11, 300, 5, 64, 128]  # longer than the tiny index_topk (8): DSA drops keys
NEW = 16  # 1 + 3 verify steps of k + 1 = 5 tokens


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("mtp") / "fp8", fp8=True)


@pytest.fixture(scope="module")
def model(ckpt):
    return Glm5ForCausalLM.from_pretrained(ckpt, dtype=torch.float32, progress=False, mtp=True)


@pytest.fixture(scope="module")
def greedy(model):
    return greedy_generate(model, PROMPT, NEW)


def test_tiny_checkpoint_stores_the_mtp_layer_as_glm5_fp8(ckpt, model):
    names = json.loads((ckpt / INDEX).read_text())["weight_map"]
    assert {"model.layers.4.enorm.weight", "model.layers.4.hnorm.weight", "model.layers.4.eh_proj.weight",
            "model.layers.4.shared_head.norm.weight", "model.layers.4.self_attn.indexer.wk.weight_scale_inv",
            "model.layers.4.mlp.experts.15.down_proj.weight_scale_inv"} <= set(names)
    assert "model.layers.4.eh_proj.weight_scale_inv" not in names  # bf16, as GLM-5-FP8 stores it
    assert "model.layers.4.shared_head.head.weight" not in names  # the model's lm_head is the head
    mtp = model.mtp
    assert mtp.head is model.lm_head and mtp.embed_tokens is model.model.embed_tokens
    assert mtp.layer.self_attn.indexer is not None and mtp.layer.mlp.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert not mtp.eh_proj.fp8


def test_mtp_weights_leave_the_models_random_init_unchanged():
    """make-tiny's MTP tensors come from a generator of their own: the model's weights (and so every existing
    test's tokens) are those drawn without them."""
    cfg = Glm5Config.preset("tiny").replace(quantization_config=None)
    with_mtp, without = tiny_state(cfg, mtp=True), tiny_state(cfg)
    assert {k for k in with_mtp if not k.startswith("mtp.")} == set(without)
    assert all(torch.equal(with_mtp[k], v) for k, v in without.items())
    assert "mtp.eh_proj.weight" in with_mtp and not torch.equal(with_mtp["mtp.layer.input_layernorm.weight"],
                                                                without["model.layers.3.input_layernorm.weight"])


def test_mtp_math_matches_the_formula(model):
    """logits = head(norm_s(layer(eh_proj([norm_e(embed(t)), norm_h(h)])))), RMSNorms written out here."""
    mtp, cfg = model.mtp, model.config

    def rms(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps))

    ids = torch.tensor([[5, 77, 300, 2, 411, 9, 33, 480, 12, 6, 150]])
    _, hidden = model(ids, return_hidden=True)
    tokens, h, pos = ids[:, 1:], hidden[:, :-1], torch.arange(ids.shape[1] - 1)[None] + 3
    logits, out = mtp(tokens, pos, h)

    e = rms(F.embedding(tokens, model.model.embed_tokens.weight), mtp.enorm.weight)
    x = torch.cat([e, rms(h, mtp.hnorm.weight)], -1) @ mtp.eh_proj.weight.T
    cos, sin = rope_cos_sin(pos, cfg.qk_rope_head_dim, cfg.rope_theta)
    y, _ = mtp.layer(x, cos, sin, None)
    torch.testing.assert_close(out, y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, rms(y, mtp.shared_head_norm.weight) @ model.lm_head.weight.T, rtol=1e-5, atol=1e-5)
    # the positions reach the layer (RoPE is relative: move one position against the others)
    moved = pos.clone()
    moved[0, -1] += 5
    assert not torch.allclose(mtp(tokens, moved, h)[1][0, -1], out[0, -1], atol=1e-3)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_speculative_tokens_equal_greedy(model, greedy, k):
    new = 9
    tokens, accepted = speculative_greedy_generate(model, PROMPT, new, k)
    assert tokens == greedy[:new]
    assert sum(accepted) == new - 1 and all(1 <= a <= k + 1 for a in accepted)
    assert 1 in accepted  # the random MTP's drafts get rejected: the rejection path ran


@pytest.mark.parametrize("k", [1, 3, 4])
def test_forced_acceptance_accepts_every_draft(model, greedy, monkeypatch, k):
    """Drafts that are the target's own greedy tokens are all accepted: k + 1 tokens per verify step."""
    def drafts(model_, ids, hidden, n):
        done = ids.shape[1] - len(PROMPT)
        return greedy[done:done + n]

    monkeypatch.setattr(generate, "mtp_drafts", drafts)
    steps = 3
    new = 1 + steps * (k + 1)
    tokens, accepted = speculative_greedy_generate(model, PROMPT, new, k)
    assert tokens == greedy[:new] and accepted == [k + 1] * steps


def test_speculative_bad_input(model, ckpt):
    for k in (0, 5, 1.5, True):
        with pytest.raises(InputError, match="k .speculative tokens"):
            speculative_greedy_generate(model, PROMPT, 4, k)
    plain = Glm5ForCausalLM.from_pretrained(ckpt, dtype=torch.float32, progress=False)
    with pytest.raises(InputError, match="mtp=True"):
        speculative_greedy_generate(plain, PROMPT, 4, 2)
    assert speculative_greedy_generate(model, PROMPT, 0, 2) == ([], [])


def _rewrite(ckpt, dst, edit):
    """A copy of ``ckpt`` whose tensors (all in one file) went through ``edit(tensors)``."""
    shutil.copytree(ckpt, dst)
    files = json.loads((dst / INDEX).read_text())["weight_map"].values()
    tensors = {}
    for f in sorted(set(files)):
        tensors.update(load_file(dst / f))
        (dst / f).unlink()
    (dst / INDEX).unlink()
    edit(tensors)
    save_file(tensors, str(dst / SINGLE))
    return dst


def test_checkpoint_without_mtp_layer(ckpt, tmp_path):
    bare = _rewrite(ckpt, tmp_path / "bare", lambda t: [t.pop(n) for n in list(t) if n.startswith("model.layers.4.")])
    with pytest.raises(CheckpointError, match=r"no complete MTP layer .*'model\.layers\.4\.enorm\.weight'"):
        Glm5ForCausalLM.from_pretrained(bare, progress=False, mtp=True)
    assert Glm5ForCausalLM.from_pretrained(bare, progress=False).mtp is None
    half = _rewrite(ckpt, tmp_path / "half", lambda t: t.pop("model.layers.4.mlp.experts.3.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing 1 of .*'model\.layers\.4\.mlp\.experts\.3\.up_proj\.weight'"):
        Glm5ForCausalLM.from_pretrained(half, progress=False, mtp=True)


def test_checkpoint_mtp_tensor_of_wrong_shape(ckpt, tmp_path):
    def edit(t):
        t["model.layers.4.eh_proj.weight"] = t["model.layers.4.eh_proj.weight"][:, :256].clone()

    bad = _rewrite(ckpt, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=r"'model\.layers\.4\.eh_proj\.weight' has shape \[256, 256\], expected \[256, 512\]"):
        Glm5ForCausalLM.from_pretrained(bad, progress=False, mtp=True)
    extra = _rewrite(ckpt, tmp_path / "extra", lambda t: t.update({"model.layers.4.foo.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.4\.foo\.weight'"):
        Glm5ForCausalLM.from_pretrained(extra, progress=False, mtp=True)


@pytest.mark.parametrize("nextn", [0, 2])
def test_config_without_exactly_one_mtp_layer(ckpt, tmp_path, nextn):
    dst = shutil.copytree(ckpt, tmp_path / "c")
    Glm5Config.from_json(dst).replace(num_nextn_predict_layers=nextn).save(dst)
    with pytest.raises(InputError, match=f"'num_nextn_predict_layers' = {nextn}"):
        Glm5ForCausalLM.from_pretrained(dst, progress=False, mtp=True)
    with pytest.raises(InputError, match="num_nextn_predict_layers"):
        Glm5ForCausalLM(Glm5Config.preset("tiny").replace(num_nextn_predict_layers=nextn), device="meta", mtp=True)


def test_mtp_layout_variants_round_trip(ckpt, tmp_path):
    """An FP8 eh_proj (with its weight_scale_inv) and a shared_head.head of its own (GLM-5.x) load as stored."""
    src = Glm5ForCausalLM.from_pretrained(ckpt, dtype=torch.float32, progress=False, mtp=True)
    mtp, h = src.mtp, src.config.hidden_size
    fp8 = Linear(2 * h, h, True, torch.float32)
    fp8.weight.data, fp8.weight_scale_inv.data = quantize_fp8_block(mtp.eh_proj.weight)
    mtp.eh_proj, mtp.layout = fp8, MtpLayout(eh_proj_fp8=True, own_head=True)
    mtp.head = torch.nn.Linear(h, src.config.vocab_size, bias=False)
    mtp.head.weight.data = torch.randn_like(src.lm_head.weight)
    save_checkpoint(src, tmp_path / "v")
    names = load_file(tmp_path / "v" / SINGLE)
    assert {"model.layers.4.eh_proj.weight_scale_inv", "model.layers.4.shared_head.head.weight"} <= set(names)
    back = Glm5ForCausalLM.from_pretrained(tmp_path / "v", dtype=torch.float32, progress=False, mtp=True)
    assert back.mtp.layout == MtpLayout(eh_proj_fp8=True, own_head=True) and back.mtp.head is not back.lm_head
    ids = torch.tensor([[3, 9, 27, 81, 243]])
    _, hidden = src(ids, return_hidden=True)
    args = (ids, torch.arange(5)[None], hidden)
    # the draft alone (the MTP layer and the embedding only: with a head of its own the lm_head is not loaded)
    draft = Glm5MtpDraft.from_pretrained(tmp_path / "v", dtype=torch.float32, progress=False)
    assert draft.lm_head is None and draft.mtp.layout == back.mtp.layout
    for a, b, c in zip(src.mtp(*args), back.mtp(*args), draft.mtp(*args)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(a, c, rtol=0, atol=0)
