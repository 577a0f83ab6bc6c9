"""RunnerOptions: every setting of a serving runner in one validated object.

The Runner took them as 19 keywords; the CLI, the benches, the server and the per-rank entry point each passed
their own subset. One frozen object, checked when it is made (before anything is loaded or compiled), travels
instead: to :class:`~fxglm5.runtime.runner.Runner`, to ``fxglm5.serve.build`` (which builds from a checkpoint
directory, an artifact, a module or a reader at any ``tp``) and, pickled, to every rank.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from fxglm5.compiler import PREFILL_STEP_TOKENS
from fxglm5.errors import InputError
from fxglm5.lowering.backend_choice import preferred_backend
from fxglm5.runtime.cache import check_options
from fxglm5.runtime.speculative import SpeculativeConfig


def _positive(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{name}: must be a positive integer, got {value!r}")


@dataclasses.dataclass(frozen=True)
class RunnerOptions:
    """``kv_cache``: "bf16" (latent rows in the compute dtype) or "fp8" (656-byte ds_mla rows); ``index_cache``
    defaults to the same kind (fxglm5.runtime.cache). The cache holds ``num_blocks`` blocks of ``block_size`` tokens
    (default: enough for ``max_cache_tokens``), viewed by the kernels in blocks of ``kernel_block_size``. ``dtype``:
    the compute dtype a checkpoint directory is loaded in. ``device``: where the program runs. ``keep_logits``: keep
    each generated token's logits row (``Sequence.logits``). ``backend``: the kernels the ``lower`` stage prefers
    ("triton", "aiter", "reference"; default: the best for ``device``, FXGLM5_BACKEND overrides).
    ``decode_graphs``: replay decode steps of up to ``max_decode_batch`` requests from CUDA graphs (default: on a
    CUDA device unless ``backend`` is "reference"; on a CPU, True runs the same padded static-buffer steps without
    capture). ``disabled_passes``: pass names the compile skips. ``tp`` > 1: this process is one of ``tp`` ranks,
    its experts in ``ep`` groups of tp / ep ranks, a divisor of tp (default ``tp``: whole experts per rank; 1: every
    expert split along its intermediate dim over all ranks; between: each group's experts split over its ranks).
    ``speculative``: a SpeculativeConfig (drafts verified in one step). ``max_step_tokens``: the most flat tokens
    one step computes (chunked prefill). ``overlap``: decode with the host one step ahead of the device.
    ``act_quant``: the FP8 GEMMs quantize their activations 1x128 to e4m3 on the fly (W8A8, the checkpoint's own
    recipe, which SGLang and vLLM run: FP8 tensor-core rate, and Hopper's warp-specialized prefill GEMM); the
    default, False, multiplies the compute-dtype activations by the e4m3 weights widened (W8A16: the bf16
    reference's math, to the GEMM's rounding)."""

    kv_cache: str = "bf16"
    index_cache: Optional[str] = None
    block_size: int = 64
    kernel_block_size: Optional[int] = None
    dtype: object = torch.float32
    num_blocks: Optional[int] = None
    max_cache_tokens: int = 8192
    device: object = "cpu"
    keep_logits: bool = False
    backend: Optional[str] = None
    decode_graphs: Optional[bool] = None
    max_decode_batch: int = 64
    disabled_passes: tuple = ()
    tp: int = 1
    ep: Optional[int] = None
    speculative: Optional[SpeculativeConfig] = None
    max_step_tokens: int = PREFILL_STEP_TOKENS
    overlap: bool = True
    act_quant: bool = False

    def __post_init__(self):
        _positive("max_step_tokens", self.max_step_tokens)
        check_options(self.block_size, self.kernel_block_size, self.kv_cache, self.index_cache)
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise InputError(f"speculative: expected a SpeculativeConfig or None, got {type(self.speculative).__name__}")
        preferred_backend(self.backend)
        _positive("max_cache_tokens", self.max_cache_tokens)
        if self.num_blocks is not None and (isinstance(self.num_blocks, bool) or not isinstance(self.num_blocks, int)
                                            or self.num_blocks < 2):
            raise InputError(f"num_blocks: must be an integer >= 2 (block 0 is reserved), got {self.num_blocks!r}")
        _positive("max_decode_batch", self.max_decode_batch)
        _positive("tp", self.tp)
        _positive("ep", self.ep, allow_none=True)
        if isinstance(self.disabled_passes, str):
            raise InputError(f"disabled_passes: expected a collection of pass names, got the string "
                             f"{self.disabled_passes!r}")
        object.__setattr__(self, "disabled_passes", tuple(self.disabled_passes))
        object.__setattr__(self, "overlap", bool(self.overlap))
        if not isinstance(self.act_quant, bool):
            raise InputError(f"act_quant: expected True (W8A8) or False (W8A16), got {self.act_quant!r}")

    @property
    def index_kind(self) -> str:
        return self.index_cache or self.kv_cache

    def replace(self, **changes) -> "RunnerOptions":
        return dataclasses.replace(self, **changes)

    @classmethod
    def given(cls, options: "RunnerOptions | None", fields: dict, who: str) -> "RunnerOptions":
        """The options a caller ``who`` took as one RunnerOptions, or as its fields given as keywords (made into
        one); InputError for both, or for ``options`` of another type."""
        if options is None:
            return cls(**fields)
        if fields:
            raise InputError(f"{who}: give a RunnerOptions or its fields as keywords, not both (got {sorted(fields)})")
        if not isinstance(options, cls):
            raise InputError(f"options: expected a RunnerOptions, got {type(options).__name__}")
        return options
