"""The paged KV-cache runtime: RTP-layout caches, block allocation with prefix reuse, the RTP-shaped forward
context, the Runner's steps over the compiled graph, on-device sampling and the request-level engine."""

from fxglm5.runtime.block_manager import BlockManager
from fxglm5.runtime.cache import PagedCache, kernel_block_table
from fxglm5.runtime.engine import Engine, Output
from fxglm5.runtime.forward_context import ForwardContext
from fxglm5.runtime.options import RunnerOptions
from fxglm5.runtime.parts import RunnerParts, build_parts
from fxglm5.runtime.runner import Runner, Sequence
from fxglm5.runtime.sampling import SamplingParams

__all__ = ["BlockManager", "Engine", "ForwardContext", "Output", "PagedCache", "Runner", "RunnerOptions",
           "RunnerParts", "SamplingParams", "Sequence", "build_parts", "kernel_block_table"]
