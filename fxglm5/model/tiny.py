"""A random tiny GLM-5 checkpoint for tests, demos and CI: real file format, non-degenerate logits.

Weights are drawn so activations keep unit scale through the stack (linears std 1/sqrt(fan_in),
embeddings std 1, norms near 1, small router bias): the logits then have a healthy spread and the
greedy token changes from position to position, so tests comparing two implementations are sensitive.
The FP8 variant is the block-FP8 quantization of the bf16 one (same seed), written with fewer bytes per
shard so that the sharded (index + shards) path is always exercised. The MTP layer is written as GLM-5-FP8
stores it: layer ``num_hidden_layers``, eh_proj in bf16, no ``shared_head.head`` (the model's lm_head serves).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from fxglm5.model.checkpoint import save_checkpoint
from fxglm5.model.config import Glm5Config
from fxglm5.model.layout import MTP_MODULE
from fxglm5.model.modeling import Glm5ForCausalLM
from fxglm5.model.quantize import quantize_checkpoint
from fxglm5.model.st_files import check_output_dir, new_output_dir


# Sublayer output projections are drawn smaller, as in trained pre-norm models whose residual stream
# dominates: a discrete choice that flips under FP8 rounding (an expert, a DSA top-k key) then moves the
# logits a little instead of chaotically, so the FP8 model tracks its bf16 source (cosine >= 0.99).
OUTPUT_GAIN = 0.3
_OUTPUT_PROJECTIONS = ("o_proj.weight", "down_proj.weight", "experts.down_proj")
MTP_SEED_OFFSET = 1  # the MTP layer's generator: seed + this


def _init(name: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    noise = torch.randn(shape, generator=gen)
    if name.endswith("e_score_correction_bias"):
        return 0.02 * noise
    if len(shape) == 1:  # norm weights (and the indexer LayerNorm bias)
        return 0.1 * noise if name.endswith("bias") else 1.0 + 0.1 * noise
    if name == "model.embed_tokens.weight":
        return noise
    if name.endswith(_OUTPUT_PROJECTIONS):
        return noise * OUTPUT_GAIN * shape[-1] ** -0.5
    return noise * shape[-1] ** -0.5


def tiny_state(config: Glm5Config, seed: int = 0, mtp: bool = False) -> dict[str, torch.Tensor]:
    """Random bf16 weights (float32 router / weights_proj) in the model's parameter naming; with ``mtp`` the MTP
    layer's too (``mtp.*``, for ``Glm5ForCausalLM(config, mtp=True)``). The MTP's are drawn from a generator of
    their own, so the model's weights are the same with or without it (the same tokens as before it was written)."""
    gen = torch.Generator().manual_seed(seed)
    model = Glm5ForCausalLM(config, dtype=torch.bfloat16, device="meta", mtp=mtp)
    params = list(model.named_parameters())
    state = {name: _init(name, p.shape, gen).to(p.dtype) for name, p in params if not name.startswith(MTP_MODULE)}
    mtp_gen = torch.Generator().manual_seed(seed + MTP_SEED_OFFSET)
    state.update({name: _init(name, p.shape, mtp_gen).to(p.dtype) for name, p in params if name.startswith(MTP_MODULE)})
    return state


def deep_tiny_config(layers: int) -> Glm5Config:
    """The tiny widths with the layer kinds of GLM-5's first ``layers`` layers (3 dense, then MoE): a deep model
    that is cheap to build with weights (an artifact of it stores GLM-5's 5-layer kind prefix)."""
    glm5 = Glm5Config.preset("glm5")
    return Glm5Config.preset("tiny").replace(num_hidden_layers=layers, first_k_dense_replace=glm5.first_k_dense_replace,
                                             mlp_layer_types=glm5.mlp_layer_types[:layers],
                                             indexer_types=glm5.indexer_types[:layers])


def make_tiny_checkpoint(out_dir: str | Path, fp8: bool = True, seed: int = 0, config: Glm5Config | None = None) -> Path:
    """Write a random tiny GLM-5 checkpoint (default ``Glm5Config.preset('tiny')``) to ``out_dir``, a new or
    empty directory."""
    out_dir = Path(out_dir)
    check_output_dir(out_dir, empty=True)  # before the work: a refusal costs nothing
    cfg = (config or Glm5Config.preset("tiny")).replace(quantization_config=None)
    state = tiny_state(cfg, seed, mtp=cfg.num_nextn_predict_layers > 0)
    total = sum(t.numel() * t.element_size() for t in state.values())
    if not fp8:
        with new_output_dir(out_dir) as tmp:
            save_checkpoint(state, tmp, max_shard_bytes=total // 3, config=cfg)
        return out_dir
    with tempfile.TemporaryDirectory(prefix="fxglm5-tiny-bf16-") as tmp:
        save_checkpoint(state, tmp, max_shard_bytes=total // 3, config=cfg)
        quantize_checkpoint(tmp, out_dir, max_shard_bytes=total // 6)
    return out_dir
