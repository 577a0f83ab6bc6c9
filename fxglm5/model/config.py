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

from fxglm5.errors import ConfigError

MODEL_TYPE = "glm_moe_dsa"
ARCHITECTURE = "GlmMoeDsaForCausalLM"
FP8_BLOCK = 128

# Names of the quantization_config that the GLM-5-FP8 checkpoint carries.
_DEFAULT_FP8_QUANT = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
    "modules_to_not_convert": ["model.embed_tokens", "lm_head", "model.layers.*.self_attn.indexers_proj"],
}


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
        return self.mlp_layer_types[layer] == "sparse"

    def has_indexer(self, layer: int) -> bool:
        return self.indexer_types[layer] == "full"

    # ---- validation ---------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ConfigError naming the first field that is out of range or inconsistent."""
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
            if not isinstance(value, int) or value < 0:
                raise ConfigError(f"config field {name!r} must be a non-negative integer, got {value!r}")
        for name in ["rms_norm_eps", "rope_theta", "routed_scaling_factor"]:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"config field {name!r} must be a positive number, got {value!r}")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"config field 'qk_rope_head_dim' must be even for RoPE, got {self.qk_rope_head_dim}")
        if self.num_key_value_heads != self.num_attention_heads:
            raise ConfigError(
                "config field 'num_key_value_heads' must equal 'num_attention_heads' for MLA "
                f"({self.num_key_value_heads} != {self.num_attention_heads})"
            )
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
        if self.hidden_act != "silu":
            raise ConfigError(f"config field 'hidden_act' must be 'silu', got {self.hidden_act!r}")
        if self.scoring_func != "sigmoid":
            raise ConfigError(f"config field 'scoring_func' must be 'sigmoid', got {self.scoring_func!r}")
        if self.rope_type != "default":
            raise ConfigError(f"config field 'rope_parameters.rope_type' must be 'default' for GLM-5, got {self.rope_type!r}")
        if self.tie_word_embeddings:
            raise ConfigError("config field 'tie_word_embeddings' must be false: GLM-5 has an untied lm_head")
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
            raise ConfigError(f"config field 'quantization_config.quant_method' must be 'fp8', got {q.get('quant_method')!r}")
        if q.get("fmt", "e4m3") != "e4m3":
            raise ConfigError(f"config field 'quantization_config.fmt' must be 'e4m3', got {q.get('fmt')!r}")
        if q.get("activation_scheme", "dynamic") != "dynamic":
            raise ConfigError(
                f"config field 'quantization_config.activation_scheme' must be 'dynamic', got {q.get('activation_scheme')!r}"
            )
        block = q.get("weight_block_size")
        if block != [FP8_BLOCK, FP8_BLOCK]:
            raise ConfigError(f"config field 'quantization_config.weight_block_size' must be [128, 128], got {block!r}")

    # ---- (de)serialisation -----------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "Glm5Config":
        """Build from an HF config dict; unknown keys are ignored, missing keys take GLM-5's values."""
        if raw.get("model_type", MODEL_TYPE) != MODEL_TYPE:
            raise ConfigError(f"{source}: field 'model_type' must be {MODEL_TYPE!r}, got {raw.get('model_type')!r}")
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in raw.items() if k in fields}
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if isinstance(rope, dict):
            if "rope_theta" in rope:
                kwargs["rope_theta"] = rope["rope_theta"]
            if rope.get("rope_type", rope.get("type")):
                kwargs["rope_type"] = rope.get("rope_type", rope.get("type"))
        if "indexer_types" not in raw and "index_topk_pattern" in raw:
            pattern = raw["index_topk_pattern"]
            kwargs["indexer_types"] = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
        if raw.get("torch_dtype") is None and raw.get("dtype") is not None:
            kwargs["torch_dtype"] = raw["dtype"]
        try:
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
        """'glm5': the full 78-layer GLM-5-FP8; 'tiny': 4 layers (1 dense, 3 MoE), small widths, index_topk 8."""
        if name == "glm5":
            return cls().with_fp8()
        if name == "tiny":
            return cls(
                vocab_size=512, hidden_size=256, intermediate_size=384, moe_intermediate_size=128,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=128,
                kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
                n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, first_k_dense_replace=1,
                index_topk=8, index_head_dim=64, index_n_heads=16, max_position_embeddings=4096,
                num_nextn_predict_layers=0,
            ).with_fp8()
        raise ConfigError(f"unknown preset {name!r}; choose 'glm5' or 'tiny'")
