"""A read-only streaming kernel: the bandwidth ceiling for kernels that mostly read (the indexer logits).

``stream_read(x)`` xors every int32 word of ``x`` into one partial per program (written, so nothing is
optimized away); each program reads ``ITERS`` blocks of ``BLOCK`` words with 16-byte loads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _stream_read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * (BLOCK * ITERS)
    acc = tl.zeros([BLOCK], tl.int32)
    for i in tl.static_range(ITERS):
        offs = base + i * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(x_ptr + offs, mask=offs < n, other=0, eviction_policy="evict_first")
    tl.store(out_ptr + pid, tl.xor_sum(acc, 0))


def stream_read(x: torch.Tensor, block: int = 4096, iters: int = 8) -> torch.Tensor:
    """One int32 partial per program over the int32 tensor ``x``."""
    n = x.numel()
    grid = triton.cdiv(n, block * iters)
    out = torch.empty(grid, dtype=torch.int32, device=x.device)
    _stream_read_kernel[(grid,)](x, out, n, BLOCK=block, ITERS=iters, num_warps=8)
    return out
