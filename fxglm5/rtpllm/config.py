"""GLM-5's config.json as RTP-LLM's ``ModelConfig``: the fields RTP's C++ side sizes the KV cache from.

RTP's field names drifted between versions, so every field is set only where the ``ModelConfig`` (or its
``attn_config``) has it, as the contract asks (``getattr`` / ``hasattr``, never a hard dependency).
"""

from __future__ import annotations

from pathlib import Path

import torch

from fxglm5.errors import ConfigError
from fxglm5.model.config import Glm5Config

COMPUTE_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
                  "float16": torch.float16, "half": torch.float16, "fp32": torch.float32, "float32": torch.float32}


def _set(obj, **fields) -> None:
    for name, value in fields.items():
        if hasattr(obj, name):
            setattr(obj, name, value)


# RTP sizes its caches from the config and the plugin's kernels read RTP's layouts, which exist for GLM-5's
# widths only: 576-value (or 656-byte ds_mla) latent rows, 132-byte indexer rows. fxglm5's own runtime pads
# narrower models' rows; RTP's allocator would not.
RTP_LAYOUT_DIMS = {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "index_head_dim": 128}


def fill_model_config(model_config, cfg: Glm5Config, ckpt_path: str | Path):
    """Write ``cfg`` into an RTP ``ModelConfig`` (and its ``attn_config``); returns it. ConfigError (naming the
    field) for a model whose cache rows would not be RTP's GLM-5 layouts."""
    for field, width in RTP_LAYOUT_DIMS.items():
        if getattr(cfg, field) != width:
            raise ConfigError(f"{Path(ckpt_path) / 'config.json'}: {field}={getattr(cfg, field)}; RTP-LLM's MLA / "
                              f"indexer cache layouts need {field}={width} (GLM-5's)")
    _set(model_config, num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
         inter_size=cfg.intermediate_size, max_seq_len=cfg.max_position_embeddings, layernorm_eps=cfg.rms_norm_eps,
         expert_num=cfg.n_routed_experts, moe_k=cfg.num_experts_per_tok, moe_inter_size=cfg.moe_intermediate_size,
         ckpt_path=str(ckpt_path))
    attn = getattr(model_config, "attn_config", None)
    if attn is None:
        raise ConfigError("RTP ModelConfig has no attn_config: cannot describe the MLA cache to RTP")
    _set(attn, head_num=cfg.num_attention_heads, kv_head_num=1, size_per_head=cfg.qk_head_dim, use_mla=True,
         q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, nope_head_dim=cfg.qk_nope_head_dim,
         rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, softmax_extra_scale=1.0,
         is_sparse=any(cfg.has_indexer(i) for i in range(cfg.num_hidden_layers)),
         indexer_head_dim=cfg.index_head_dim, indexer_head_num=cfg.index_n_heads, indexer_topk=cfg.index_topk)
    rope = getattr(attn, "rope_config", None)
    if rope is not None:
        _set(rope, base=cfg.rope_theta, dim=cfg.qk_rope_head_dim)
    return model_config


def compute_dtype(model_config) -> torch.dtype:
    """The model's compute dtype from ``data_type`` (a torch dtype or a name such as "BF16"); bf16 if unset
    (RTP forces ACT_TYPE=BF16 for block-wise FP8 weights)."""
    value = getattr(model_config, "data_type", None)
    if value is None:
        return torch.bfloat16
    if isinstance(value, torch.dtype):
        dtype = value
    else:
        dtype = COMPUTE_DTYPES.get(str(value).lower().removeprefix("torch."))
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ConfigError(f"ModelConfig.data_type: {value!r} is not a compute dtype (bf16, fp16, fp32)")
    return dtype
