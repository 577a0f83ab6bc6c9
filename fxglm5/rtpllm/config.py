"""GLM-5's config.json as RTP-LLM's ``ModelConfig``: the fields RTP's C++ side sizes the KV cache from, and
the ones RTP's own GLM-5 (``DeepSeekV2._from_hf``, rtp-llm 4b8d39cd5) fills, with its values.

Every field is set only where the ``ModelConfig`` (or its ``attn_config`` / ``rope_config``) has it: RTP's
pybind structs reject unknown names, and field sets drift between RTP versions.
"""

from __future__ import annotations

import functools
import importlib
from pathlib import Path

import torch

from fxglm5 import settings
from fxglm5.contracts import INDEX_DIM, KV_LORA_RANK, ROPE_DIM
from fxglm5.errors import ConfigError
from fxglm5.model.config import Glm5Config

COMPUTE_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
                  "float16": torch.float16, "half": torch.float16, "fp32": torch.float32, "float32": torch.float32}

# RTP's max_seq_len when MAX_SEQ_LEN is unset (its DeepSeekV2 / GLM-5 class sets 8192; build_model_config lets
# MAX_SEQ_LEN override it). It sizes the CUDA-graph tables and the default warm-up prefill (max_seq_len - 1
# tokens): GLM-5's max_position_embeddings (202752) there would be a 202751-token warm-up.
RTP_DEFAULT_MAX_SEQ_LEN = 8192


@functools.lru_cache(maxsize=None)
def rtp_symbol(*paths: str):
    """The first importable ``module:name`` (RTP moved these between versions), looked up once."""
    for path in paths:
        module, name = path.split(":")
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    raise ImportError(f"rtp_llm provides none of {paths}")


def fp8_kv_cache(model_config) -> bool:
    """FP8_KV_CACHE=1: RTP's kv_cache_dtype is float8_e4m3fn (an enum or a name in some versions)."""
    kv_dtype = getattr(getattr(model_config, "attn_config", None), "kv_cache_dtype", None)
    text = str(kv_dtype).lower()
    return kv_dtype is not None and ("float8" in text or text.endswith("fp8"))


def act_quant() -> bool:
    """Whether the plugin compiles W8A8 FP8 GEMMs: ``FXGLM5_RTP_ACT_QUANT=1`` (``fxglm5.settings``), else W8A16,
    fxglm5's default. RTP-LLM's config has no setting to map: GLM-5-FP8's ``quantization_config`` (fp8,
    ``weight_block_size`` [128, 128]) becomes its ``Fp8BlockWiseQuantConfig`` ("FP8_PER_BLOCK",
    ``rtp_llm/config/quant_config.py``), which names the weights' format only; RTP's own block-FP8 linears always
    quantize their activations per 128-group (``sgl_per_token_group_quant_fp8`` before DeepGEMM), i.e. W8A8."""
    return settings.rtp_act_quant()


def no_weight_info_cls():
    """RTP's weight-info class for a model that loads its checkpoint itself (its ``load()``): RTP's loader, which
    would read it, is bypassed."""
    base = rtp_symbol("rtp_llm.model_loader.model_weight_info:ModelDeployWeightInfo")
    return type("Fxglm5NoWeightInfo", (base,), {"__doc__": "fxglm5 loads the checkpoint itself (load())."})


def _set(obj, **fields) -> None:
    for name, value in fields.items():
        if hasattr(obj, name):
            setattr(obj, name, value)


# RTP sizes its caches from the config and the plugin's kernels read RTP's layouts, which exist for GLM-5's
# widths only: 576-value (or 656-byte ds_mla) latent rows, 132-byte indexer rows. fxglm5's own runtime pads
# narrower models' rows; RTP's allocator would not.
RTP_LAYOUT_DIMS = {"kv_lora_rank": KV_LORA_RANK, "qk_rope_head_dim": ROPE_DIM, "index_head_dim": INDEX_DIM}
SCORING_FUNCS = {"softmax": 0, "sigmoid": 1}  # RTP's ModelConfig.scoring_func codes


def fill_model_config(model_config, cfg: Glm5Config, ckpt_path: str | Path):
    """Write ``cfg`` into an RTP ``ModelConfig`` (and its ``attn_config``); returns it. ConfigError (naming the
    field) for a model whose cache rows would not be RTP's GLM-5 layouts."""
    for field, width in RTP_LAYOUT_DIMS.items():
        if getattr(cfg, field) != width:
            raise ConfigError(f"{Path(ckpt_path) / 'config.json'}: {field}={getattr(cfg, field)}; RTP-LLM's MLA / "
                              f"indexer cache layouts need {field}={width} (GLM-5's)")
    layers = cfg.num_hidden_layers
    _set(model_config, num_layers=layers, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
         inter_size=cfg.n_shared_experts * cfg.moe_intermediate_size,
         max_seq_len=min(RTP_DEFAULT_MAX_SEQ_LEN, cfg.max_position_embeddings), layernorm_eps=cfg.rms_norm_eps,
         expert_num=cfg.n_routed_experts, moe_k=cfg.num_experts_per_tok, moe_inter_size=cfg.moe_intermediate_size,
         moe_style=2, moe_layer_index=[i for i in range(layers) if cfg.is_moe_layer(i)], moe_n_group=cfg.n_group,
         moe_topk_group=cfg.topk_group, routed_scaling_factor=cfg.routed_scaling_factor,
         scoring_func=SCORING_FUNCS.get(cfg.scoring_func, 1), has_moe_norm=cfg.norm_topk_prob, norm_type="rmsnorm",
         has_post_decoder_layernorm=True, activation_type="SiGLU", tie_word_embeddings=cfg.tie_word_embeddings,
         config_dtype=cfg.torch_dtype, ckpt_path=str(ckpt_path))
    attn = getattr(model_config, "attn_config", None)
    if attn is None:
        raise ConfigError("RTP ModelConfig has no attn_config: cannot describe the MLA cache to RTP")
    _set(attn, head_num=cfg.num_attention_heads, kv_head_num=cfg.num_key_value_heads, size_per_head=cfg.qk_head_dim,
         use_mla=True, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, nope_head_dim=cfg.qk_nope_head_dim,
         rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, softmax_extra_scale=1.0,
         is_sparse=any(cfg.has_indexer(i) for i in range(layers)),
         indexer_head_dim=cfg.index_head_dim, indexer_head_num=cfg.index_n_heads, indexer_topk=cfg.index_topk)
    rope = getattr(attn, "rope_config", None)
    if rope is not None:  # style 0 for MLA, rope after the nope dims; GLM-5's interleave flags
        _set(rope, base=cfg.rope_theta, dim=cfg.qk_rope_head_dim, style=0, offset=cfg.qk_nope_head_dim,
             is_neox_style=not cfg.rope_interleave, indexer_is_neox_style=not cfg.indexer_rope_interleave)
    return model_config


def compute_dtype(model_config) -> torch.dtype:
    """The compute dtype: RTP's ``ModelConfig.compute_dtype`` (a torch dtype), else ``data_type`` (RTP's C++
    enum ``DataType.TYPE_BF16``, or a name such as "bf16"); bf16 if neither is set."""
    dtype = getattr(model_config, "compute_dtype", None)
    if not isinstance(dtype, torch.dtype):
        value = getattr(model_config, "data_type", None)
        if value is None:
            return torch.bfloat16
        name = getattr(value, "name", None) or str(value)
        dtype = value if isinstance(value, torch.dtype) else COMPUTE_DTYPES.get(
            str(name).lower().removeprefix("torch.").removeprefix("type_"))
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ConfigError(f"ModelConfig.data_type: {getattr(model_config, 'data_type', None)!r} is not a compute "
                          "dtype (bf16, fp16, fp32)")
    return dtype
