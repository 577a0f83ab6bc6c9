"""Test stand-in of RTP-LLM's KV-cache allocator and block pool (not RTP-LLM code).

As RTP's C++ (``cpp/cache/MemoryLayoutStrategy.cc``, ``MLAKVCacheSpec.h``, ``BlockPool.cc`` at 4b8d39cd5):
- one pool per layout, viewed ``[layer, block, block_size * row]`` and sliced per layer; each layer's
  ``LayerKVCache`` tensor is the ``[kernel_blocks, kernel_block_size, row]`` view of its slice;
- MLA rows: ``kv_lora_rank + rope_head_dim`` values in the compute dtype, or for FP8_KV_CACHE the 656-element
  ``torch.float8_e4m3fn`` "ds_mla" row (``kv_lora_rank + kv_lora_rank / 128 * 4 + rope_head_dim * 2``);
- the DSA indexer rows (uint8, ``indexer_head_dim + indexer_head_dim / 128 * 4``) in ``kv_scale_base``, for
  every layer;
- physical block 0 is reserved: blocks 1..N-1 are handed out; a table's padding is 0.
"""

from collections import OrderedDict

import torch

from rtp_llm.ops import KvCacheDataType
from rtp_llm.ops.compute_ops import KVCache


def allocate_kv_cache(config, num_blocks, seq_size_per_block, kernel_seq_size_per_block, device):
    """(KVCache, pools): ``pools`` are the whole kv / scale allocations (for byte-level checks in tests)."""
    attn = config.attn_config
    if not attn.use_mla:
        raise ValueError("the stand-in allocates MLA caches only (attn_config.use_mla is False)")
    kbs = kernel_seq_size_per_block or seq_size_per_block
    if seq_size_per_block % kbs:
        raise ValueError(f"kernel block size {kbs} does not divide block size {seq_size_per_block}")
    if attn.kv_cache_dtype == KvCacheDataType.FP8:
        width, dtype = attn.kv_lora_rank + attn.kv_lora_rank // 128 * 4 + attn.rope_head_dim * 2, torch.float8_e4m3fn
    else:
        width, dtype = attn.kv_lora_rank + attn.rope_head_dim, config.compute_dtype
    layers, kernel_blocks = config.num_layers, num_blocks * (seq_size_per_block // kbs)
    pools = [torch.zeros((layers, num_blocks, seq_size_per_block * width), dtype=dtype, device=device)]
    kv = [pools[0][i].view(kernel_blocks, kbs, width) for i in range(layers)]
    scale = [None] * layers
    if attn.is_sparse:
        iw = attn.indexer_head_dim + attn.indexer_head_dim // 128 * 4
        pools.append(torch.zeros((layers, num_blocks, seq_size_per_block * iw), dtype=torch.uint8, device=device))
        scale = [pools[1][i].view(kernel_blocks, kbs, iw) for i in range(layers)]
    return KVCache(kv, scale, seq_size_per_block, kbs), pools


def kernel_block_table(physical, ratio):
    """[B, M] physical ids -> [B, M * ratio] kernel ids ``physical * ratio + j``; padding 0 stays 0."""
    j = torch.arange(ratio, dtype=physical.dtype, device=physical.device)
    kernel = physical.unsqueeze(-1) * ratio + j
    kernel = torch.where(physical.unsqueeze(-1) == 0, torch.zeros_like(kernel), kernel)
    return kernel.reshape(physical.shape[0], -1)


class BlockManager:
    """Physical blocks 1..num_blocks-1, refcounted, with a prefix cache of full blocks.

    Cache keys chain (parent key, block tokens). Finished requests' full blocks stay cached until a block
    is needed and none is free; then the least recently used unreferenced cached block is evicted.
    """

    def __init__(self, num_blocks, block_size):
        self.block_size = block_size
        self.free = list(range(1, num_blocks))
        self.refs = {}
        self.cached = OrderedDict()  # key -> block
        self.key_of = {}  # block -> key

    def alloc(self):
        if not self.free:
            idle = next((k for k, b in self.cached.items() if not self.refs.get(b)), None)
            if idle is not None:
                block = self.cached.pop(idle)
                del self.key_of[block]
                self.free.append(block)
        if not self.free:
            raise RuntimeError("KV cache exhausted: no free block (raise num_blocks)")
        block = self.free.pop(0)
        self.refs[block] = 1
        return block

    def match_prefix(self, tokens):
        """Cached blocks for the leading full blocks of ``tokens``, leaving at least one token to compute."""
        blocks, key, bs = [], None, self.block_size
        for i in range((len(tokens) - 1) // bs):
            key = (key, tuple(tokens[i * bs:(i + 1) * bs]))
            block = self.cached.get(key)
            if block is None:
                break
            self.cached.move_to_end(key)
            self.refs[block] = self.refs.get(block, 0) + 1
            blocks.append(block)
        return blocks

    def release(self, blocks, cached_tokens):
        """Cache the full blocks holding ``cached_tokens``, then drop the request's references."""
        key, bs = None, self.block_size
        for i in range(len(cached_tokens) // bs):
            key = (key, tuple(cached_tokens[i * bs:(i + 1) * bs]))
            if key not in self.cached and blocks[i] not in self.key_of:
                self.cached[key] = blocks[i]
                self.key_of[blocks[i]] = key
        for block in blocks:
            self.refs[block] -= 1
            if self.refs[block] == 0 and block not in self.key_of:
                del self.refs[block]
                self.free.append(block)
