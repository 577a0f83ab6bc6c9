"""Test stand-in of RTP-LLM's ``ModelConfig`` (not RTP-LLM code), checked against rtp-llm 4b8d39cd5.

- ``data_type``: the getter returns the C++ enum (``DataType.TYPE_BF16``), the setter takes a string
  (``cpp/pybind/ConfigInit.cc``); ``compute_dtype`` is the torch dtype (``config/model_config.py``, through
  ``utils/util.py:to_torch_dtype``);
- ``attn_config.kv_cache_dtype``: ``KvCacheDataType.BASE`` or ``.FP8``;
- ``attn_config.rope_config`` always exists; the fields are those RTP's own GLM-5 (``DeepSeekV2._from_hf``) fills.
Setting a field the C++ struct does not have is an AttributeError, as on RTP's pybind object.
"""

import torch

from rtp_llm.ops import DataType, KvCacheDataType

_DATA_TYPES = {"bf16": DataType.TYPE_BF16, "bfloat16": DataType.TYPE_BF16, "fp16": DataType.TYPE_FP16,
               "float16": DataType.TYPE_FP16, "fp32": DataType.TYPE_FP32, "float32": DataType.TYPE_FP32}
_TORCH = {DataType.TYPE_BF16: torch.bfloat16, DataType.TYPE_FP16: torch.float16, DataType.TYPE_FP32: torch.float32}


class _Fields:
    """Attribute bag with a fixed field set (pybind ``def_readwrite`` structs reject unknown names)."""

    _defaults = {}

    def __init__(self):
        for name, value in self._defaults.items():
            object.__setattr__(self, name, value() if callable(value) else value)

    def __setattr__(self, name, value):
        if name not in self._defaults and not isinstance(getattr(type(self), name, None), property):
            raise AttributeError(f"{type(self).__name__} has no field {name!r}")
        object.__setattr__(self, name, value)


class RopeConfig(_Fields):
    _defaults = dict(style=1, base=10000, dim=0, scale=1.0, offset=0, is_neox_style=True,
                     indexer_is_neox_style=True, max_pos=0, mscale=1.0, factor1=0.0, factor2=0.0)


class AttentionConfigs(_Fields):
    _defaults = dict(head_num=0, kv_head_num=0, size_per_head=0, use_mla=False, q_lora_rank=0, kv_lora_rank=0,
                     nope_head_dim=0, rope_head_dim=0, v_head_dim=0, rope_config=RopeConfig, softmax_extra_scale=1.0,
                     is_sparse=False, indexer_head_dim=0, indexer_head_num=0, indexer_topk=0,
                     kv_cache_dtype=KvCacheDataType.BASE, tokens_per_block=64)


class ModelConfig(_Fields):
    _defaults = dict(num_layers=0, hidden_size=0, vocab_size=0, inter_size=0, max_seq_len=0, layernorm_eps=1e-5,
                     expert_num=0, moe_k=0, moe_inter_size=0, moe_style=0, moe_layer_index=list, moe_n_group=1,
                     moe_topk_group=1, routed_scaling_factor=1.0, scoring_func=0, has_moe_norm=False,
                     norm_type="layernorm", has_post_decoder_layernorm=False, activation_type="Gelu",
                     tie_word_embeddings=False, config_dtype=None, ckpt_path="", model_type="",
                     attn_config=AttentionConfigs, _data_type=DataType.TYPE_FP16,
                     # Python-only fields of RTP's ModelConfig (config/model_config.py:55-69, 527): an MTP draft's
                     is_mtp=False, reverse_e_h_norm=False)

    @property
    def data_type(self):
        return self._data_type

    @data_type.setter
    def data_type(self, value):
        if not isinstance(value, str) or value.lower() not in _DATA_TYPES:
            raise TypeError(f"data_type setter takes a type name string, got {value!r}")
        object.__setattr__(self, "_data_type", _DATA_TYPES[value.lower()])

    @property
    def compute_dtype(self):
        return _TORCH[self._data_type]
