"""The paged KV-cache runtime: RTP-layout caches, block allocation with prefix reuse, the RTP-shaped forward
context and the prefill / decode / generate driver over the compiled graph."""

from fxglm5.runtime.block_manager import BlockManager
from fxglm5.runtime.cache import PagedCache, kernel_block_table
from fxglm5.runtime.forward_context import ForwardContext
from fxglm5.runtime.runner import Runner, Sequence

__all__ = ["BlockManager", "ForwardContext", "PagedCache", "Runner", "Sequence", "kernel_block_table"]
