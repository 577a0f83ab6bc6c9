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
from fxglm5.errors import CheckpointError, ConfigError, InputError
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


@dataclasses.dataclass(frozen=True)
class MtpLayout:
    """How a checkpoint stores its MTP layer where checkpoints differ: ``eh_proj_fp8`` (block-FP8 with a
    ``weight_scale_inv``; GLM-5-FP8 keeps eh_proj in bf16, as DeepSeek-V3 does), ``own_head`` (a
    ``shared_head.head`` of its own, GLM-5.x variants; else the model's lm_head is the head), ``embed_copy`` (a copy
    of ``embed_tokens`` under the layer; never read, the model's is used)."""

    eh_proj_fp8: bool = False
    own_head: bool = False
    embed_copy: bool = False


# Glm5MTP's parameters (``mtp.<sub>``) -> their names under the checkpoint's ``model.layers.{L}.``.
_MTP_NAMES = (("layer.", ""), ("shared_head_norm.", "shared_head.norm."), ("head.", "shared_head.head."),
              ("enorm.", "enorm."), ("hnorm.", "hnorm."), ("eh_proj.", "eh_proj."))
MTP_MODULE = "mtp."


def check_mtp_config(cfg: Glm5Config) -> None:
    """The MTP needs exactly one next-token layer in the config (GLM-5's); anything else is an InputError."""
    n = cfg.num_nextn_predict_layers
    if n != 1:
        what = "has no MTP layer" if n == 0 else f"has {n} MTP layers; fxglm5 supports one (GLM-5's)"
        raise InputError(f"config field 'num_nextn_predict_layers' = {n}: the model {what}")


def mtp_prefix(cfg: Glm5Config) -> str:
    """The checkpoint prefix of the (one supported) MTP layer: ``model.layers.{num_hidden_layers}.``."""
    return f"model.layers.{cfg.num_hidden_layers}."


def checkpoint_name(name: str, cfg: Glm5Config) -> str:
    """The checkpoint name of the model parameter ``name``: itself, or for the MTP module's (``mtp.layer.mlp...``)
    its name under the MTP layer (``model.layers.{L}.mlp...``)."""
    if not name.startswith(MTP_MODULE):
        return name
    rest = name[len(MTP_MODULE):]
    for ours, theirs in _MTP_NAMES:
        if rest.startswith(ours):
            return mtp_prefix(cfg) + theirs + rest[len(ours):]
    raise CheckpointError(f"model parameter {name!r} has no checkpoint name")


def mtp_layout(names, cfg: Glm5Config) -> MtpLayout:
    """The MtpLayout of a checkpoint holding the tensors ``names``."""
    p = mtp_prefix(cfg)
    return MtpLayout(eh_proj_fp8=cfg.is_fp8 and p + "eh_proj.weight" + SCALE_SUFFIX in names,
                     own_head=p + "shared_head.head.weight" in names, embed_copy=p + "embed_tokens.weight" in names)


def mtp_tensors(cfg: Glm5Config, layout: MtpLayout = MtpLayout(), packed: bool = False) -> dict[str, TensorSpec]:
    """The MTP (next-token prediction) layers' tensors, DeepSeek-V3 style: a full MoE decoder layer with its own
    indexer plus enorm, hnorm, eh_proj [H, 2H] and shared_head.norm (and what ``layout`` adds). Also counts
    parameters: 743.9 B + this = the published 753.86 B for GLM-5."""
    table: dict[str, TensorSpec] = {}
    h = cfg.hidden_size
    for j in range(cfg.num_nextn_predict_layers):
        p = f"model.layers.{cfg.num_hidden_layers + j}."
        if layout.embed_copy:
            _hp(table, p + "embed_tokens.weight", (cfg.vocab_size, h))
        _hp(table, p + "enorm.weight", (h,))
        _hp(table, p + "hnorm.weight", (h,))
        _weight(table, p + "eh_proj.weight", (h, 2 * h), layout.eh_proj_fp8)
        table.update(layer_tensors(cfg, p, moe=True, indexer=True, packed=packed))
        _hp(table, p + "shared_head.norm.weight", (h,))
        if layout.own_head:
            _hp(table, p + "shared_head.head.weight", (cfg.vocab_size, h))
    return table


def mtp_shared_tensors(cfg: Glm5Config, layout: MtpLayout) -> dict[str, TensorSpec]:
    """The model's tensors that its MTP layer uses too: the embedding, and the lm_head unless the layer has a head
    of its own (``layout.own_head``)."""
    table: dict[str, TensorSpec] = {}
    _hp(table, "model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size))
    if not layout.own_head:
        _hp(table, "lm_head.weight", (cfg.vocab_size, cfg.hidden_size))
    return table


def is_mtp_draft_tensor(name: str, cfg: Glm5Config) -> bool:
    """A tensor that a draft model serving the MTP layer alone may read: the MTP layer's, the embedding, the
    lm_head."""
    return name in ("model.embed_tokens.weight", "lm_head.weight") or is_mtp_tensor(name, cfg)


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
