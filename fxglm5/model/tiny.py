"""A random tiny GLM-5 checkpoint for tests, demos and CI: real file format, non-degenerate logits.

Weights are drawn so activations keep unit scale through the stack (linears std 1/sqrt(fan_in),
embeddings std 1, norms near 1, small router bias): the logits then have a healthy spread and the
greedy token changes from position to position, so tests comparing two implementations are sensitive.
The FP8 variant is the block-FP8 quantization of the bf16 one (same seed), written with fewer bytes per
shard so that the sharded (index + shards) path is always exercised. The MTP layer is written as GLM-5-FP8
stores it: layer ``num_hidden_layers``, eh_proj in bf16, no ``shared_head.head`` (the model's lm_head serves).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from fxglm5.model.checkpoint import save_checkpoint
from fxglm5.model.config import Glm5Config
from fxglm5.model.layout import MTP_MODULE
from fxglm5.model.modeling import Glm5ForCausalLM
from fxglm5.model.quantize import quantize_checkpoint
from fxglm5.model.st_files import check_output_dir, new_output_dir, writing


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
            write_tiny_tokenizer(Path(tmp), cfg)
        return out_dir
    with writing(out_dir), tempfile.TemporaryDirectory(prefix="fxglm5-tiny-bf16-") as tmp:  # the bf16 source first
        save_checkpoint(state, tmp, max_shard_bytes=total // 3, config=cfg)
        write_tiny_tokenizer(Path(tmp), cfg)  # quantize copies it, as it copies a real checkpoint's
        quantize_checkpoint(tmp, out_dir, max_shard_bytes=total // 6)
    return out_dir


# The tiny tokenizer's special tokens, first in its vocabulary: [gMASK] is the config's bos (0), <|endoftext|> its
# eos (1); GLM's chat turns also end at the next <|user|>, which generation_config.json lists as an eos too.
SPECIAL_TOKENS = ["[gMASK]", "<|endoftext|>", "<sop>", "<|system|>", "<|user|>", "<|assistant|>"]
# GLM's chat template in miniature: [gMASK]<sop>, then each turn as <|role|>\n content, then the assistant's turn
CHAT_TEMPLATE = ("[gMASK]<sop>{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
_CORPUS = """GLM-5 is a mixture-of-experts language model with multi-head latent attention and sparse attention.
The indexer picks the top tokens of the cache for every query, and the experts are chosen by a router.
Weights are stored in eight-bit floating point with one scale per block of one hundred and twenty-eight.
A compiler captures the model once, rewrites the graph with passes, and lowers every op to a kernel.
Hello, world! How are you today? The quick brown fox jumps over the lazy dog. Tell me a story about a cat.
What is the capital of France? Paris is the capital of France. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.
"""


def write_tiny_tokenizer(directory: Path, config: Glm5Config) -> None:
    """A byte-level BPE tokenizer of ``config.vocab_size`` tokens (every text encodes: the 256 bytes are in it),
    trained with Hugging Face ``tokenizers`` on a few lines, with GLM's special tokens and a chat template: the
    files GLM-5-FP8 ships (tokenizer.json, tokenizer_config.json, generation_config.json), so the demo and the tests
    take the text path the real checkpoint takes. The same config gives the same files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=config.vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_CORPUS.splitlines(), trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    bos, eos = SPECIAL_TOKENS[config.bos_token_id], SPECIAL_TOKENS[1]
    (directory / "tokenizer_config.json").write_text(json.dumps(
        dict(bos_token=bos, eos_token=eos, chat_template=CHAT_TEMPLATE, model_max_length=config.max_position_embeddings),
        indent=2) + "\n")
    (directory / "generation_config.json").write_text(json.dumps(
        dict(bos_token_id=config.bos_token_id, eos_token_id=[1, SPECIAL_TOKENS.index("<|user|>")]), indent=2) + "\n")
