"""Glm5ForCausalLM, loaded from the checkpoint transformers itself saved, matches transformers' own
GlmMoeDsaForCausalLM (eager) logits in float32 on small random configs.

The configs vary heads, ranks, head dims, experts, top-k, groups and depth; one has "shared" indexer
layers; prompts are longer than index_topk (so DSA really drops tokens) and batches are > 1. Weights are
re-drawn at unit scale (transformers' init leaves norms at 1 and the router bias at 0, which would hide
bugs in those tensors). >= 8 indexer heads keep the indexer scores free of exact ties.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM  # noqa: E402

from fxglm5.model.modeling import Glm5ForCausalLM  # noqa: E402

CONFIGS = [
    dict(  # every layer indexed, 1 dense + 2 MoE; small embeddings: layer 0's input norm sees mean(x^2) < eps
        hidden_size=64, num_attention_heads=2, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, num_hidden_layers=3,
        first_k_dense_replace=1, index_topk=4, index_n_heads=8, index_head_dim=16, intermediate_size=96,
        moe_intermediate_size=32, vocab_size=97, batch=2, seq=12, embed_scale=1e-3,
    ),
    dict(  # "shared" indexer layers reuse the previous full layer's top-k
        hidden_size=128, num_attention_heads=4, q_lora_rank=48, kv_lora_rank=64, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=24, n_routed_experts=8, num_experts_per_tok=3, num_hidden_layers=4,
        first_k_dense_replace=2, index_topk=6, index_n_heads=16, index_head_dim=32, intermediate_size=160,
        moe_intermediate_size=48, vocab_size=131, indexer_types=["full", "shared", "full", "shared"],
        batch=3, seq=20,
    ),
    dict(  # grouped routing, 2 shared experts, no dense layer
        hidden_size=96, num_attention_heads=3, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=24,
        qk_rope_head_dim=8, v_head_dim=32, n_routed_experts=6, num_experts_per_tok=2, n_group=2, topk_group=1,
        n_shared_experts=2, num_hidden_layers=2, first_k_dense_replace=0, index_topk=8, index_n_heads=8,
        index_head_dim=24, intermediate_size=128, moe_intermediate_size=40, vocab_size=160, batch=2, seq=40,
    ),
    dict(  # wider heads than latent ranks, top-k = all experts, rope_theta 1e6
        hidden_size=256, num_attention_heads=2, q_lora_rank=64, kv_lora_rank=48, qk_nope_head_dim=64,
        qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=5, num_experts_per_tok=5, num_hidden_layers=3,
        first_k_dense_replace=1, index_topk=5, index_n_heads=12, index_head_dim=64, intermediate_size=192,
        moe_intermediate_size=64, vocab_size=211, indexer_types=["full", "full", "shared"], rope_theta=1e6,
        batch=2, seq=16,
    ),
]

# max |logit error| / max |logit|, measured 5.2e-7..7.5e-7 over these configs (float32 reduction order); an
# RMSNorm eps 2x or 10x off moves it to >= 6e-6 even at unit-scale embeddings (case 0: by ~50%)
PARITY_TOL = 2e-6


def _randomize(model: torch.nn.Module, seed: int, embed_scale: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if "inv_freq" in name:
                continue
            noise = torch.randn(t.shape, generator=gen)
            if name.endswith("e_score_correction_bias"):
                t.copy_(0.05 * noise)
            elif t.dim() == 1:
                t.copy_(0.1 * noise if name.endswith("bias") else 1.0 + 0.1 * noise)
            elif name == "model.embed_tokens.weight":
                t.copy_(embed_scale * noise)
            else:
                t.copy_(noise * t.shape[-1] ** -0.5)


@pytest.mark.parametrize("case", range(len(CONFIGS)))
def test_logits_match_transformers(case, tmp_path):
    spec = dict(CONFIGS[case])
    batch, seq = spec.pop("batch"), spec.pop("seq")
    theta = spec.pop("rope_theta", 10000.0)
    embed_scale = spec.pop("embed_scale", 1.0)
    spec["num_key_value_heads"] = spec["num_attention_heads"]
    assert seq > spec["index_topk"]
    cfg = GlmMoeDsaConfig(**spec, rope_parameters={"rope_type": "default", "rope_theta": theta})
    cfg._attn_implementation = "eager"
    torch.manual_seed(case)
    ref = GlmMoeDsaForCausalLM(cfg).float().eval()
    _randomize(ref, seed=100 + case, embed_scale=embed_scale)
    ref.save_pretrained(tmp_path, safe_serialization=True)

    ours = Glm5ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, progress=False)
    assert ours.config.indexer_types == cfg.indexer_types

    ids = torch.randint(0, spec["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(case))
    with torch.no_grad():
        theirs = ref(input_ids=ids).logits
        got = ours(ids)
    assert got.shape == theirs.shape == (batch, seq, spec["vocab_size"])
    scale = theirs.abs().max()
    assert scale > 1.0  # non-trivial logits
    err = (got - theirs).abs().max() / scale
    assert err <= PARITY_TOL, f"max relative logit error {err:.3e}"
