"""Glm5Config: the HF ``config.json`` of model type ``glm_moe_dsa``, read, validated and with presets.

The config is the single source of truth for every shape in fxglm5: the model, the checkpoint checks
(name, shape and dtype of every tensor) and the cache sizes are all derived from it. Validation happens
once, here, and every error names the offending field.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from fxglm5.contracts import FP8_BLOCK
from fxglm5.errors import ConfigError

MODEL_TYPE = "glm_moe_dsa"
ARCHITECTURE = "GlmMoeDsaForCausalLM"

# Names of the quantization_config that the GLM-5-FP8 checkpoint carries.
_DEFAULT_FP8_QUANT = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
    "modules_to_not_convert": ["model.embed_tokens", "lm_head", "model.layers.*.self_attn.indexers_proj"],
}


# Fields whose other values are legal in HF configs of this family but not implemented by the model:
# (field, the name config.json gives it, the one value fxglm5 implements, what that value means).
_IMPLEMENTED_ONLY = (
    ("hidden_act", "hidden_act", "silu", "SiLU-gated MLPs"),
    ("scoring_func", "scoring_func", "sigmoid", "sigmoid router scores"),
    ("topk_method", "topk_method", "noaux_tc", "top-k by score + e_score_correction_bias"),
    ("rope_type", "rope_parameters.rope_type", "default", "RoPE without scaling, as GLM-5"),
    ("rope_interleave", "rope_interleave", True, "RoPE on interleaved pairs (2i, 2i+1), as GLM-5"),
    ("indexer_rope_interleave", "indexer_rope_interleave", True, "the indexer's RoPE on interleaved pairs, as GLM-5"),
    ("attention_bias", "attention_bias", False, "attention projections without bias"),
    ("mlp_bias", "mlp_bias", False, "MLP projections without bias"),
    ("tie_word_embeddings", "tie_word_embeddings", False, "an lm_head of its own, as GLM-5"),
)
_BOOLS = ("norm_topk_prob", "rope_interleave", "indexer_rope_interleave", "attention_bias", "mlp_bias",
          "tie_word_embeddings")
MAX_NORM_EPS = 1.0  # an epsilon this large is no guard against division by zero but a rescaling of the norm


def unsupported(field: str, value: Any, implemented: str) -> ConfigError:
    """The error for a legal value the model does not implement (as opposed to an invalid one)."""
    return ConfigError(f"config field {field!r} = {value!r} is not supported by fxglm5: it implements {implemented}")


def _indexer_types(raw: dict[str, Any]) -> list[str] | None:
    """``indexer_types`` from the keys transformers' GlmMoeDsaConfig derives it from when it is absent: a pattern
    (``index_topk_pattern``, "FSS..."), else ``index_topk_freq`` with ``index_skip_topk_offset`` (layer i is
    "full" when max(i - offset + 1, 0) % freq == 0); None (every layer "full") when neither is given."""
    pattern = raw.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
    if raw.get("index_topk_freq") is None:
        return None
    freq, offset = raw["index_topk_freq"], raw.get("index_skip_topk_offset", 2)
    layers = raw.get("num_hidden_layers", Glm5Config.num_hidden_layers)
    for name, value in (("index_topk_freq", freq), ("index_skip_topk_offset", offset), ("num_hidden_layers", layers)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"config field {name!r} must be an integer, got {value!r}")
    return ["full" if max(i - offset + 1, 0) % max(freq, 1) == 0 else "shared" for i in range(layers)]


@dataclasses.dataclass
class Glm5Config:
    """Every field of GLM-5's config.json that changes the model's math or its tensor shapes."""

    vocab_size: int = 154880
    hidden_size: int = 6144
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 78
    num_attention_heads: int = 64
    num_key_value_heads: int = 64
    q_lora_rank: int = 2048
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 192
    qk_rope_head_dim: int = 64
    v_head_dim: int = 256
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    first_k_dense_replace: int = 3
    mlp_layer_types: list[str] | None = None
    indexer_types: list[str] | None = None
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    rope_theta: float = 1_000_000.0
    rope_type: str = "default"
    rope_interleave: bool = True
    indexer_rope_interleave: bool = True
    max_position_embeddings: int = 202752
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 1
    torch_dtype: str = "bfloat16"
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    pad_token_id: int | None = None
    quantization_config: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.mlp_layer_types is None:
            n_dense = min(self.first_k_dense_replace, self.num_hidden_layers)
            self.mlp_layer_types = ["dense"] * n_dense + ["sparse"] * (self.num_hidden_layers - n_dense)
        if self.indexer_types is None:
            self.indexer_types = ["full"] * self.num_hidden_layers
        self.validate()

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk_head_dim): GLM-5 uses no YaRN mscale (rope_type 'default')."""
        return self.qk_head_dim**-0.5

    @property
    def is_fp8(self) -> bool:
        return bool(self.quantization_config) and self.quantization_config.get("quant_method") == "fp8"

    @property
    def weight_block_size(self) -> tuple[int, int]:
        block = (self.quantization_config or {}).get("weight_block_size", [FP8_BLOCK, FP8_BLOCK])
        return int(block[0]), int(block[1])

    def is_moe_layer(self, layer: int) -> bool:
        """Layer ``layer``'s MLP is the MoE; the MTP layer (index >= num_hidden_layers, past the per-layer lists,
        as in GLM-5's config.json) is a MoE layer, as GLM-5's."""
        return layer >= self.num_hidden_layers or self.mlp_layer_types[layer] == "sparse"

    def has_indexer(self, layer: int) -> bool:
        """Layer ``layer`` runs its own DSA indexer; the MTP layer always does (it has no earlier layer whose
        top-k it could share)."""
        return layer >= self.num_hidden_layers or self.indexer_types[layer] == "full"

    # ---- validation ---------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ConfigError naming the first field that is out of range or inconsistent ("must ..."), or that
        holds a legal value the model does not implement ("not supported by fxglm5")."""
        if self.q_lora_rank is None:
            raise unsupported("q_lora_rank", None, "a low-rank query (q_a_proj, q_b_proj), as GLM-5")
        positive = [
            "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
            "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "num_experts_per_tok", "n_group",
            "topk_group", "index_topk", "index_head_dim", "index_n_heads", "max_position_embeddings",
        ]
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"config field {name!r} must be a positive integer, got {value!r}")
        for name in ["n_shared_experts", "first_k_dense_replace", "num_nextn_predict_layers"]:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"config field {name!r} must be a non-negative integer, got {value!r}")
        for name in ["rms_norm_eps", "rope_theta", "routed_scaling_factor"]:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"config field {name!r} must be a positive number, got {value!r}")
        if self.rms_norm_eps >= MAX_NORM_EPS:
            raise ConfigError(f"config field 'rms_norm_eps' must be below {MAX_NORM_EPS:g} (it guards the division by "
                              f"the root mean square; GLM-5's is 1e-05), got {self.rms_norm_eps!r}")
        for name in _BOOLS:
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"config field {name!r} must be true or false, got {getattr(self, name)!r}")
        for name, shown, value, meaning in _IMPLEMENTED_ONLY:
            if getattr(self, name) != value:
                raise unsupported(shown, getattr(self, name), f"only {value!r} ({meaning})")
        if self.first_k_dense_replace > self.num_hidden_layers:
            raise ConfigError(f"config field 'first_k_dense_replace' ({self.first_k_dense_replace}) exceeds "
                              f"'num_hidden_layers' ({self.num_hidden_layers})")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"config field 'qk_rope_head_dim' must be even for RoPE, got {self.qk_rope_head_dim}")
        if self.num_key_value_heads != self.num_attention_heads:
            raise unsupported("num_key_value_heads", self.num_key_value_heads,
                              f"MLA, whose latent serves every head: num_key_value_heads = num_attention_heads "
                              f"({self.num_attention_heads})")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ConfigError(
                f"config field 'index_head_dim' ({self.index_head_dim}) must be >= 'qk_rope_head_dim' "
                f"({self.qk_rope_head_dim}): the indexer ropes its first qk_rope_head_dim dims"
            )
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(
                f"config field 'num_experts_per_tok' ({self.num_experts_per_tok}) exceeds "
                f"'n_routed_experts' ({self.n_routed_experts})"
            )
        if self.n_routed_experts % self.n_group or self.topk_group > self.n_group:
            raise ConfigError(
                f"config fields 'n_group' ({self.n_group}) / 'topk_group' ({self.topk_group}) do not divide "
                f"'n_routed_experts' ({self.n_routed_experts})"
            )
        if len(self.mlp_layer_types) != self.num_hidden_layers or set(self.mlp_layer_types) - {"dense", "sparse"}:
            raise ConfigError(
                f"config field 'mlp_layer_types' must list 'dense'/'sparse' for each of the "
                f"{self.num_hidden_layers} layers, got {self.mlp_layer_types!r}"
            )
        if len(self.indexer_types) != self.num_hidden_layers or set(self.indexer_types) - {"full", "shared"}:
            raise ConfigError(
                f"config field 'indexer_types' must list 'full'/'shared' for each of the "
                f"{self.num_hidden_layers} layers, got {self.indexer_types!r}"
            )
        if self.indexer_types[0] != "full":
            raise ConfigError("config field 'indexer_types[0]' must be 'full': a 'shared' layer reuses an earlier top-k")
        self._validate_quantization()

    def _validate_quantization(self) -> None:
        q = self.quantization_config
        if q is None:
            return
        if not isinstance(q, dict):
            raise ConfigError(f"config field 'quantization_config' must be an object, got {type(q).__name__}")
        if q.get("quant_method") != "fp8":
            raise unsupported("quantization_config.quant_method", q.get("quant_method"), "only 'fp8' (block-FP8 weights)")
        implemented = (("fmt", "e4m3", "e4m3 weights"), ("activation_scheme", "dynamic", "activations quantized per call"))
        for key, value, meaning in implemented:
            if q.get(key, value) != value:
                raise unsupported(f"quantization_config.{key}", q.get(key), f"only {value!r} ({meaning})")
        block = q.get("weight_block_size")
        if block != [FP8_BLOCK, FP8_BLOCK]:
            raise unsupported("quantization_config.weight_block_size", block, "only [128, 128] blocks, as GLM-5-FP8")

    # ---- (de)serialisation -----------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "Glm5Config":
        """Build from an HF config dict; unknown keys are ignored, missing keys take GLM-5's values."""
        if raw.get("model_type", MODEL_TYPE) != MODEL_TYPE:
            raise ConfigError(f"{source}: field 'model_type' must be {MODEL_TYPE!r}, got {raw.get('model_type')!r}")
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in raw.items() if k in fields}
        for key in ("rope_scaling", "rope_parameters"):  # the legacy name first: rope_parameters wins
            rope = raw.get(key)
            if rope is None:
                continue
            if not isinstance(rope, dict):
                raise ConfigError(f"{source}: field {key!r} must be an object, got {rope!r}")
            field = "rope_type" if "rope_type" in rope else "type"  # "type": transformers' older name
            kind = rope.get(field, "default")
            if kind != "default":
                raise ConfigError(f"{source}: {unsupported(f'{key}.{field}', kind, 'only default RoPE, as GLM-5')}")
            if "rope_theta" in rope:
                kwargs["rope_theta"] = rope["rope_theta"]
        if raw.get("torch_dtype") is None and raw.get("dtype") is not None:
            kwargs["torch_dtype"] = raw["dtype"]
        try:
            if "indexer_types" not in raw:
                kwargs["indexer_types"] = _indexer_types(raw)
            return cls(**kwargs)
        except ConfigError as err:
            raise ConfigError(f"{source}: {err}") from None
        except TypeError as err:  # a field of the wrong type deep inside __post_init__
            raise ConfigError(f"{source}: {err}") from None

    @classmethod
    def from_json(cls, path: str | Path) -> "Glm5Config":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path}: config.json not found")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}: not valid JSON ({err})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a JSON object")
        return cls.from_dict(raw, source=str(path))

    def to_dict(self) -> dict[str, Any]:
        """An HF-compatible config.json dict (loadable by transformers' GlmMoeDsaConfig too)."""
        out = dataclasses.asdict(self)
        out.pop("rope_type")
        out["rope_parameters"] = {"rope_type": self.rope_type, "rope_theta": self.rope_theta}
        out["model_type"] = MODEL_TYPE
        out["architectures"] = [ARCHITECTURE]
        if out["quantization_config"] is None:
            out.pop("quantization_config")
        return out

    def save(self, directory: str | Path) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / "config.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def replace(self, **changes: Any) -> "Glm5Config":
        return dataclasses.replace(self, **changes)

    def with_fp8(self) -> "Glm5Config":
        return self.replace(quantization_config=json.loads(json.dumps(_DEFAULT_FP8_QUANT)))

    # ---- presets ------------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str) -> "Glm5Config":
        """'glm5': the full 78-layer GLM-5-FP8; 'tiny': 4 layers (1 dense, 3 MoE) + GLM-5's MTP layer, small widths,
        index_topk 8;
        'tiny-tp': 'tiny' with widths that split over 2 and 4 ranks into whole 128-blocks (8 heads of qk 64 + 64 and
        v 128: per rank at TP4 q_b 256 rows, kv_b 384 rows, o_proj 256 columns; MLP / expert widths 512)."""
        if name == "glm5":
            return cls().with_fp8()
        if name == "tiny-tp":
            return cls.preset("tiny").replace(
                num_attention_heads=8, num_key_value_heads=8, qk_nope_head_dim=64, qk_rope_head_dim=64,
                v_head_dim=128, intermediate_size=512, moe_intermediate_size=512, n_routed_experts=8,
                index_head_dim=128, index_n_heads=4)
        if name == "tiny":
            return cls(
                vocab_size=512, hidden_size=256, intermediate_size=384, moe_intermediate_size=128,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=128,
                kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
                n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, first_k_dense_replace=1,
                index_topk=8, index_head_dim=64, index_n_heads=16, max_position_embeddings=4096,
                num_nextn_predict_layers=1,
            ).with_fp8()
        raise ConfigError(f"unknown preset {name!r}; choose 'glm5', 'tiny' or 'tiny-tp'")
