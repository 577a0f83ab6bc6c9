"""Shared set-up for the paged-runtime tests: small random GLM-5 models, compiled once per process.

Capture + passes take seconds per model, so each config is built once (``lru_cache``) and every Runner
reuses the compiled graph (it holds no cache). Weights come from ``fxglm5.model.tiny.tiny_state``: unit
activations and small sublayer outputs, so logits are spread and greedy tokens change step to step.
"""

from __future__ import annotations

import functools

import torch

from fxglm5.model.config import Glm5Config
from fxglm5.model.modeling import Glm5ForCausalLM
from fxglm5.model.tiny import tiny_state
from fxglm5.runtime.runner import Runner

# 16 indexer heads keep most scores distinct; "ties" has 2, so relu leaves many keys at a score of exactly 0
# and the tie rule (the lower position wins) decides which of them the paged runtime and the model keep.
_SMALL = dict(vocab_size=256, hidden_size=128, intermediate_size=192, num_attention_heads=2, num_key_value_heads=2,
              q_lora_rank=64, n_routed_experts=8, num_experts_per_tok=2, index_n_heads=16,
              max_position_embeddings=256, quantization_config=None, mlp_layer_types=None, indexer_types=None,
              num_nextn_predict_layers=0)  # the tiny preset has an MTP layer now; these models are built without it
CONFIGS = {
    # dense + MoE layers; layer 1 reuses layer 0's top-k ("shared"); index_topk 8 < most sequences
    "exact": dict(num_hidden_layers=3, first_k_dense_replace=1, index_topk=8, **{**_SMALL, "indexer_types": ["full", "shared", "full"]}),
    # FP8 comparison: dense MLPs and a wider top-k, because on random weights a flipped discrete choice
    # (an expert, a boundary key under a diffuse softmax) moves logits far more than trained models do;
    # GLM-5's latent rank 512, so all four 128-wide groups of a 656-byte FP8 row hold data
    "fp8": dict(num_hidden_layers=2, first_k_dense_replace=2, index_topk=24, **{**_SMALL, "kv_lora_rank": 512}),
    # 2 indexer heads: many keys tie at a score of 0.0 (tests/ops/test_dsa_tie_rule.py)
    "ties": dict(num_hidden_layers=2, first_k_dense_replace=2, index_topk=8, **{**_SMALL, "index_n_heads": 2}),
    # tiny positions limit, for the error tests
    "short": dict(num_hidden_layers=1, first_k_dense_replace=1, index_topk=8, **{**_SMALL, "max_position_embeddings": 24}),
}


def make_config(name: str) -> Glm5Config:
    return Glm5Config.preset("tiny").replace(**CONFIGS[name])


@functools.lru_cache(maxsize=None)
def model_and_graph(name: str):
    cfg = make_config(name)
    model = Glm5ForCausalLM(cfg, dtype=torch.float32)
    model.load_state_dict(tiny_state(cfg, seed=0), strict=True)
    model.eval()
    runner = Runner(model, block_size=4, max_cache_tokens=64)
    return model, runner.program


def runner(name: str, **kwargs) -> Runner:
    model, graph = model_and_graph(name)
    kwargs.setdefault("keep_logits", True)
    return Runner(model, program=graph, **kwargs)


@torch.no_grad()
def reference_logits(model, seq) -> torch.Tensor:
    """Full-recompute logits [n_generated, V] for each step of ``seq`` (teacher-forced on its own tokens)."""
    tokens = seq.prompt + seq.output
    logits = model(torch.tensor([tokens]))[0].float()
    start = len(seq.prompt) - 1
    return logits[start:start + len(seq.output)]


def prompts(gen: torch.Generator, lengths, vocab: int = 256) -> list[list[int]]:
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]
