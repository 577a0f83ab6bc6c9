"""Block-FP8 quantization (128x128 blocks, e4m3, float32 ``weight_scale_inv``) of weights and checkpoints.

This reproduces the GLM-5-FP8 / DeepSeek-V3 weight format: per 128x128 block, scale = amax / 448 and
W ~= W_fp8 * scale (``scale_inv`` is the name the checkpoint uses for the dequantization multiplier).
``quantize_checkpoint`` turns any supported bf16 checkpoint into that format, quantizing exactly the
linears GLM-5-FP8 stores in FP8 (the table in ``fxglm5.model.layout``) and copying the rest unchanged.
"""

from __future__ import annotations

import functools
import math
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F

from fxglm5.contracts import FP8_BLOCK, FP8_MAX
from fxglm5.errors import CheckpointError
from fxglm5.model.checkpoint import CheckpointReader
from fxglm5.model.layout import FP8, SCALE_SUFFIX, check_fp8_layout, expected_tensors, mtp_tensors
from fxglm5.model.st_files import INDEX, PlannedTensor, check_output_dir, new_output_dir, write_shards

AMAX_FLOOR = 1e-12
DEFAULT_SHARD_BYTES = 5 * 2**30


def quantize_fp8_block(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [.., N, K] (any float) -> (e4m3 [.., N, K], float32 scale_inv [.., ceil(N/128), ceil(K/128)]).

    A short last block (N or K not a multiple of 128) takes its amax over the real elements only.
    """
    *lead, n, k = weight.shape
    nb, kb = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    padded = F.pad(weight.float(), (0, kb * FP8_BLOCK - k, 0, nb * FP8_BLOCK - n))
    blocks = padded.view(*lead, nb, FP8_BLOCK, kb, FP8_BLOCK)
    scale = blocks.abs().amax(dim=(-3, -1)).clamp_min(AMAX_FLOOR) / FP8_MAX
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.view(*lead, nb * FP8_BLOCK, kb * FP8_BLOCK)[..., :n, :k].to(FP8)
    return q.contiguous(), scale.contiguous()


def quantize_checkpoint(in_dir: str | Path, out_dir: str | Path, max_shard_bytes: int | None = DEFAULT_SHARD_BYTES) -> list[str]:
    """Quantize the bf16 checkpoint ``in_dir`` (any supported layout) into GLM-5-FP8 format in ``out_dir`` (a new
    or empty directory).

    Output: per-expert tensor names, FP8 weights + ``weight_scale_inv``, high-precision tensors copied in
    their stored dtype, config.json with GLM-5-FP8's quantization_config, other small files (tokenizer,
    generation_config.json) copied. An MTP layer is carried over as GLM-5-FP8 stores it: its decoder layer's
    linears in FP8, eh_proj (and the norms, any shared_head.head or embed_tokens copy) as stored. Returns the
    safetensors file names written.
    """
    in_dir, out_dir = Path(in_dir), Path(out_dir)
    reader = CheckpointReader(in_dir, mtp=None)
    if reader.config.is_fp8:
        raise CheckpointError(f"{in_dir / 'config.json'}: already an FP8 checkpoint (it has a quantization_config)")
    if in_dir.resolve() == out_dir.resolve():
        raise CheckpointError(f"{out_dir}: quantize needs an output directory different from its input")
    check_output_dir(out_dir, empty=True)
    cfg = reader.config.with_fp8()
    check_fp8_layout(cfg, str(in_dir / "config.json"))

    @functools.lru_cache(maxsize=2)
    def quantized(weight_name: str) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_fp8_block(reader.get_expert(weight_name))

    table = expected_tensors(cfg)
    if reader.mtp_layout is not None:
        table.update(mtp_tensors(cfg, reader.mtp_layout))
    planned = []
    for name, spec in table.items():
        numel = math.prod(spec.shape)
        if spec.kind == "fp8":
            planned.append(PlannedTensor(name, numel, lambda n=name: quantized(n)[0]))
        elif spec.kind == "scale":
            planned.append(PlannedTensor(name, numel * 4, lambda n=name[: -len(SCALE_SUFFIX)]: quantized(n)[1]))
        else:
            size = reader.tensors[name].dtype.itemsize
            planned.append(PlannedTensor(name, numel * size, lambda n=name: reader.get(n)))
    with reader, new_output_dir(out_dir) as tmp:
        files = write_shards(tmp, planned, max_shard_bytes)
        cfg.save(tmp)
        for extra in in_dir.iterdir():
            if extra.is_file() and extra.suffix != ".safetensors" and extra.name not in ("config.json", INDEX):
                shutil.copy2(extra, tmp / extra.name)
    return files
