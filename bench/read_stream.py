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


@triton.jit
def _paged_read_kernel(kc_ptr, n_rows, bt_ptr, stride_bt, out_ptr, BS: tl.constexpr, BLOCKS: tl.constexpr,
                       USE_TMA: tl.constexpr):
    """Program (t, pb) reads blocks ``bt[t, pb*BLOCKS : (pb+1)*BLOCKS]`` of the block-major indexer cache: each
    block's BS 128-byte keys (one TMA box, or 16-byte loads) and its BS float32 scales, as the logits kernel's
    2048-key program does, with no MMA."""
    t = tl.program_id(0)
    pb = tl.program_id(1)
    WORDS: tl.constexpr = BS * 33  # a block: BS keys of 32 words, then BS scale words
    acc = tl.zeros([BS, 32], tl.int32)
    sacc = tl.zeros([BS], tl.int32)
    if USE_TMA:
        desc = tl.make_tensor_descriptor(kc_ptr, shape=[n_rows, 32], strides=[32, 1], block_shape=[BS, 32])
    for i in range(BLOCKS):
        blk = tl.load(bt_ptr + t.to(tl.int64) * stride_bt + pb * BLOCKS + i).to(tl.int64)
        if USE_TMA:
            acc ^= desc.load([(blk * (WORDS // 32)).to(tl.int32), 0])
        else:
            rows = tl.arange(0, BS)[:, None] * 32 + tl.arange(0, 32)[None, :]
            acc ^= tl.load(kc_ptr + blk * WORDS + rows, eviction_policy="evict_first")
        sacc ^= tl.load(kc_ptr + blk * WORDS + BS * 32 + tl.arange(0, BS), eviction_policy="evict_first")
    tl.store(out_ptr + t * tl.num_programs(1) + pb, tl.xor_sum(tl.xor_sum(acc, 1) ^ sacc, 0))


def paged_read(cache: torch.Tensor, block_table: torch.Tensor, blocks_per_program: int = 32,
               use_tma: bool = True) -> torch.Tensor:
    """Read every block a ``[rows, blocks]`` block table names from a block-major ``[blocks, BS, 132]`` uint8
    indexer cache, in the logits kernel's order and box shape: the ceiling for its access pattern (random 8 KB
    key runs plus 256-byte scale runs, not one sequential stream)."""
    from fxglm5.lowering.triton.device import ensure_tma_allocator

    bs = cache.shape[1]
    words = cache.view(torch.int32)
    rows, nblk = block_table.shape
    if nblk % blocks_per_program:
        raise ValueError(f"paged_read: {nblk} blocks per row is not a multiple of {blocks_per_program}")
    grid = (rows, nblk // blocks_per_program)
    out = torch.empty(grid, dtype=torch.int32, device=cache.device)
    if use_tma:
        ensure_tma_allocator()
    _paged_read_kernel[grid](words, words.numel() // 32, block_table, block_table.stride(0), out, BS=bs,
                             BLOCKS=blocks_per_program, USE_TMA=use_tma, num_warps=4, num_stages=4)
    return out
