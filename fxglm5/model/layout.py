"""The checkpoint's tensor table, derived from the config: every name with its shape and allowed dtypes.

The loader, the quantizer and the writer all work from this one table so that a checkpoint is checked
(names, shapes, dtypes, scale shapes) from its headers alone, before any tensor is read. Names are the
GLM-5-FP8 ones: routed experts as separate tensors per expert. A "packed" variant (transformers' in-memory
``mlp.experts.gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I], also what ``state_dict()`` of our model
holds) is accepted too.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re

import torch

from fxglm5.contracts import scale_shape
from fxglm5.errors import ConfigError
from fxglm5.model.config import Glm5Config

FP8 = torch.float8_e4m3fn
HIGH_PRECISION = frozenset({torch.bfloat16, torch.float16, torch.float32})
SCALE_SUFFIX = "_scale_inv"

# safetensors header dtype names <-> torch dtypes (only those a GLM-5 checkpoint can hold, plus the
# common ones so that a wrong dtype is reported by name rather than as "unknown").
ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
    "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_PACKED_RE = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)$")


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """What one checkpoint tensor must look like. ``kind``: 'fp8' weight, 'scale', or 'hp' (any float)."""

    shape: tuple[int, ...]
    dtypes: frozenset
    kind: str


def _weight(table: dict, name: str, shape: tuple[int, ...], fp8: bool, scale_name: str | None = None,
            halves: bool = False) -> None:
    if fp8:
        table[name] = TensorSpec(shape, frozenset({FP8}), "fp8")
        spec = TensorSpec(scale_shape(shape, halves), frozenset({torch.float32}), "scale")
        table[scale_name or name + SCALE_SUFFIX] = spec
    else:
        table[name] = TensorSpec(shape, HIGH_PRECISION, "hp")


def _hp(table: dict, name: str, shape: tuple[int, ...]) -> None:
    table[name] = TensorSpec(shape, HIGH_PRECISION, "hp")


def layer_tensors(cfg: Glm5Config, prefix: str, moe: bool, indexer: bool, packed: bool) -> dict[str, TensorSpec]:
    """One decoder layer's tensors under ``prefix`` (e.g. 'model.layers.3.')."""
    fp8, h = cfg.is_fp8, cfg.hidden_size
    t: dict[str, TensorSpec] = {}
    _hp(t, prefix + "input_layernorm.weight", (h,))
    a = prefix + "self_attn."
    _weight(t, a + "q_a_proj.weight", (cfg.q_lora_rank, h), fp8)
    _hp(t, a + "q_a_layernorm.weight", (cfg.q_lora_rank,))
    _weight(t, a + "q_b_proj.weight", (cfg.num_attention_heads * cfg.qk_head_dim, cfg.q_lora_rank), fp8)
    _weight(t, a + "kv_a_proj_with_mqa.weight", (cfg.kv_lora_rank + cfg.qk_rope_head_dim, h), fp8)
    _hp(t, a + "kv_a_layernorm.weight", (cfg.kv_lora_rank,))
    kv_b_rows = cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    _weight(t, a + "kv_b_proj.weight", (kv_b_rows, cfg.kv_lora_rank), fp8)
    _weight(t, a + "o_proj.weight", (h, cfg.num_attention_heads * cfg.v_head_dim), fp8)
    if indexer:
        ix, d = a + "indexer.", cfg.index_head_dim
        _weight(t, ix + "wq_b.weight", (cfg.index_n_heads * d, cfg.q_lora_rank), fp8)
        _weight(t, ix + "wk.weight", (d, h), fp8)
        _hp(t, ix + "k_norm.weight", (d,))
        _hp(t, ix + "k_norm.bias", (d,))
        _hp(t, ix + "weights_proj.weight", (cfg.index_n_heads, h))
    _hp(t, prefix + "post_attention_layernorm.weight", (h,))
    m = prefix + "mlp."
    if not moe:
        _mlp(t, m, h, cfg.intermediate_size, fp8)
        return t
    e, i = cfg.n_routed_experts, cfg.moe_intermediate_size
    _hp(t, m + "gate.weight", (e, h))
    _hp(t, m + "gate.e_score_correction_bias", (e,))
    if packed:
        _weight(t, m + "experts.gate_up_proj", (e, 2 * i, h), fp8, m + "experts.gate_up_proj" + SCALE_SUFFIX, halves=True)
        _weight(t, m + "experts.down_proj", (e, h, i), fp8, m + "experts.down_proj" + SCALE_SUFFIX)
    else:
        for j in range(e):
            _mlp(t, f"{m}experts.{j}.", h, i, fp8)
    if cfg.n_shared_experts:
        _mlp(t, m + "shared_experts.", h, i * cfg.n_shared_experts, fp8)
    return t


def _mlp(t: dict, prefix: str, h: int, inter: int, fp8: bool) -> None:
    _weight(t, prefix + "gate_proj.weight", (inter, h), fp8)
    _weight(t, prefix + "up_proj.weight", (inter, h), fp8)
    _weight(t, prefix + "down_proj.weight", (h, inter), fp8)


def expected_tensors(cfg: Glm5Config, packed: bool = False) -> dict[str, TensorSpec]:
    """name -> TensorSpec for every tensor of the main model (the MTP layer excluded), in file order."""
    table: dict[str, TensorSpec] = {}
    _hp(table, "model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size))
    for i in range(cfg.num_hidden_layers):
        table.update(layer_tensors(cfg, f"model.layers.{i}.", cfg.is_moe_layer(i), cfg.has_indexer(i), packed))
    _hp(table, "model.norm.weight", (cfg.hidden_size,))
    _hp(table, "lm_head.weight", (cfg.vocab_size, cfg.hidden_size))
    return table


def mtp_tensors(cfg: Glm5Config) -> dict[str, TensorSpec]:
    """The MTP (next-token prediction) layers' tensors, DeepSeek-V3 style: a full MoE decoder layer plus
    enorm, hnorm, eh_proj [H, 2H] and shared_head.norm; embed_tokens and the head are shared with the
    main model. Used to count parameters: 743.9 B + this = the published 753.86 B for GLM-5."""
    table: dict[str, TensorSpec] = {}
    h = cfg.hidden_size
    for j in range(cfg.num_nextn_predict_layers):
        p = f"model.layers.{cfg.num_hidden_layers + j}."
        table.update(layer_tensors(cfg, p, moe=True, indexer=True, packed=False))
        _hp(table, p + "enorm.weight", (h,))
        _hp(table, p + "hnorm.weight", (h,))
        _weight(table, p + "eh_proj.weight", (h, 2 * h), cfg.is_fp8)
        _hp(table, p + "shared_head.norm.weight", (h,))
    return table


def is_mtp_tensor(name: str, cfg: Glm5Config) -> bool:
    """A tensor of a layer past the decoder stack: the MTP layer(s) (index num_hidden_layers, ...)."""
    match = _LAYER_RE.match(name)
    if not match:
        return False
    layer = int(match.group(1))
    return cfg.num_hidden_layers <= layer < cfg.num_hidden_layers + max(cfg.num_nextn_predict_layers, 1)


def is_packed_expert(name: str) -> bool:
    base = name[: -len(SCALE_SUFFIX)] if name.endswith(SCALE_SUFFIX) else name
    return bool(_PACKED_RE.match(base))


def check_fp8_layout(cfg: Glm5Config, source: str) -> None:
    """Reject ``modules_to_not_convert`` lists naming a module GLM-5-FP8 stores in FP8.

    They may only name modules that are high precision anyway: this model has no per-module switch. The
    ``...self_attn.indexers_proj`` quirk stands for ``indexer.weights_proj``. Any width is fine: blocks at
    an edge are short, and stacked experts keep each gate / up half's own blocks (``scale_shape``).
    """
    if not cfg.is_fp8:
        return
    patterns = cfg.quantization_config.get("modules_to_not_convert") or []
    if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
        raise ConfigError(f"{source}: config field 'quantization_config.modules_to_not_convert' must be a list of names")
    if not patterns:
        return
    fp8_modules = [n[: -len(".weight")] for n, s in expected_tensors(cfg).items() if s.kind == "fp8"]
    for pattern in patterns:
        pattern = pattern.replace("self_attn.indexers_proj", "self_attn.indexer.weights_proj")
        hit = next((m for m in fp8_modules if fnmatch.fnmatchcase(m, pattern) or m.startswith(pattern + ".")), None)
        if hit is not None:
            raise ConfigError(
                f"{source}: config field 'quantization_config.modules_to_not_convert' entry {pattern!r} names "
                f"{hit!r}, which GLM-5-FP8 stores in FP8; mixed-precision linears are not supported"
            )
