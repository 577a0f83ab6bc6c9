"""Per-layer paged caches in RTP's layouts, allocated for exactly the inputs a program takes (its
:class:`~fxglm5.program.CacheSpec`: which inputs, their kinds, dtypes and rows).

Layouts (``fxglm5.lowering.reference.paged``), physical shape ``[num_blocks, block_size, row]``:
- latent, ``kv_cache="bf16"``: 576 values per token in the compute dtype ("bf16" names RTP's non-FP8
  mode; the dtype is whatever the model computes in, float32 in the exactness tests);
- latent, ``kv_cache="fp8"``: uint8 rows of 656 bytes (ds_mla: e4m3 c_kv, 4 fp32 scales, bf16 k_pe);
- indexer, ``index_cache="fp8"``: uint8 ``[.., 132]``, block-major within a block (its e4m3 keys, then
  their fp32 scales: RTP's only indexer layout, as its ``indexer_k_quant_and_cache`` writes it). Being
  block-major, it is only meaningful at the granularity it was written at: every reader and writer uses the
  kernel-granularity view below;
- indexer, ``index_cache="bf16"``: 128 values in the compute dtype, for an exact top-k (the FP8 keys
  reorder near-tied scores, so only this mode reproduces the cache-less model bit for bit).
By default the indexer follows ``kv_cache``. Block 0 is reserved (never handed out), as in RTP.

Kernels may use a smaller block: ``kernel_block_size`` must divide ``block_size``; the caches are then
viewed as ``[num_blocks * ratio, kernel_block_size, row]`` (same memory, so a token's slot is the same
number at both granularities) and block tables are given at kernel granularity,
``kernel_block_id = physical * ratio + j``, padding (physical 0) staying 0.
"""

from __future__ import annotations

import os

import torch

from fxglm5.errors import InputError
from fxglm5.program import CacheSpec, check_cache_kind


def kernel_block_table(block_table: torch.Tensor, ratio: int) -> torch.Tensor:
    """[B, M] physical ids -> [B, M * ratio] kernel ids (physical * ratio + j; padding 0 stays 0)."""
    j = torch.arange(ratio, dtype=block_table.dtype, device=block_table.device)
    kernel = (block_table.unsqueeze(-1) * ratio + j).reshape(block_table.shape[0], -1)
    pad = (block_table == 0).unsqueeze(-1).expand(*block_table.shape, ratio).reshape(kernel.shape)
    return torch.where(pad, torch.zeros_like(kernel), kernel)


def check_options(block_size, kernel_block_size, kv_cache, index_cache) -> tuple[str, int]:
    """Reject bad cache options (InputError naming the option); returns (index_cache, kernel_block_size)."""
    index_cache = index_cache or kv_cache
    check_cache_kind("kv_cache", kv_cache)
    check_cache_kind("index_cache", index_cache)
    if not isinstance(block_size, int) or block_size < 1:
        raise InputError(f"block_size: must be a positive integer, got {block_size!r}")
    kernel_block_size = kernel_block_size or block_size
    if not isinstance(kernel_block_size, int) or kernel_block_size < 1 or block_size % kernel_block_size:
        raise InputError(f"kernel_block_size: {kernel_block_size!r} must be a positive divisor of block_size {block_size}")
    return index_cache, kernel_block_size


def available_memory(device) -> int | None:
    """Bytes a new allocation can take on ``device``: the GPU's free memory plus what torch's caching allocator
    holds unused, the host's MemAvailable (or its free pages where /proc/meminfo is missing); None where unknown
    (the meta device)."""
    device = torch.device(device)
    if device.type == "cuda":
        held = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + held
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_cache_size(num_blocks: int, block_size: int, spec: CacheSpec, device) -> int:
    """The bytes of ``spec``'s caches of ``num_blocks`` blocks of ``block_size`` tokens; InputError, before anything
    is allocated, when they exceed the memory available on ``device``."""
    need = num_blocks * block_size * spec.token_bytes()
    free = available_memory(device)
    if free is not None and need > free:
        raise InputError(
            f"paged cache: {num_blocks} blocks of block_size {block_size} tokens for {len(spec.signature.layers)} "
            f"layers need {need / 2**30:.1f} GiB, more than the {free / 2**30:.1f} GiB available on "
            f"{torch.device(device)}; lower block_size, num_blocks or max_cache_tokens (fewer prompts or new tokens)")
    return need


class PagedCache:
    """The caches of every attention layer; ``graph_inputs()`` lists them in the program's input order."""

    def __init__(self, spec: CacheSpec, num_blocks: int, block_size: int = 64, kernel_block_size: int | None = None,
                 device="cpu"):
        _, kernel_block_size = check_options(block_size, kernel_block_size, spec.kv_cache, spec.index_cache)
        if num_blocks < 2:
            raise InputError(f"num_blocks: need at least 2 (block 0 is reserved), got {num_blocks}")
        check_cache_size(num_blocks, block_size, spec, device)
        self.spec, self.num_blocks, self.block_size = spec, num_blocks, block_size
        self.kernel_block_size, self.ratio = kernel_block_size, block_size // kernel_block_size
        self.tensors: dict[str, torch.Tensor] = spec.allocate(num_blocks, block_size, device)

    @property
    def kv_cache(self) -> str:
        return self.spec.kv_cache

    @property
    def index_cache(self) -> str:
        return self.spec.index_cache

    @property
    def dtype(self) -> torch.dtype:
        return self.spec.dtype

    def kernel_blocks(self, tokens: int) -> int:
        """The kernel blocks a block table spans for ``tokens`` tokens (whole blocks of ``block_size``)."""
        return -(-tokens // self.block_size) * self.ratio

    def kernel_view(self, name: str) -> torch.Tensor:
        t = self.tensors[name]
        return t.view(self.num_blocks * self.ratio, self.kernel_block_size, t.shape[-1])

    def graph_inputs(self) -> list[torch.Tensor]:
        """Kernel-granularity views, in the order the program takes them."""
        return [self.kernel_view(name) for name in self.spec.names]
