"""RTP-LLM's per-step inputs as the compiled graph's inputs.

- :func:`bind_caches`: the per-layer caches RTP allocated for its one cache group (``kv_cache_base``: latent
  rows, the compute dtype or RTP's ``float8_e4m3fn`` ds_mla rows; ``kv_scale_base``: the indexer's 132-byte
  rows), checked against the program's :class:`~fxglm5.program.CacheSpec`, in its input order.
- :class:`StepMetadata`: positions, slots, request of every token and the kernel block table of one step,
  from a ``PyAttentionInputs`` (tensors RTP leaves unset are None). Host fields are read, so an eager step
  validates with :meth:`ForwardContext.validate` (errors name the field) before any kernel runs.

A decode row is padding, computed but writing nothing (position 0, slot -1), unless its host
``sequence_lengths`` entry is positive and its kernel block table row starts with a real block. That is what
RTP guarantees for padding: before a CUDA-graph replay it zeroes host ``sequence_lengths`` past the batch
but NOT the host block-table rows, which still hold an earlier, larger batch's blocks (the per-size static
inputs are slices of one max-batch buffer); its capture inputs and its decode-role warm-up have real lengths
and all-zero tables (``fakeInitKVBlock``). Static CUDA-graph metadata lives in device buffers refilled by
:meth:`StepMetadata.prepare_cuda_graph` before each replay.
"""

from __future__ import annotations

import dataclasses

import torch

from fxglm5.errors import InputError
from fxglm5.model.decoder import check_input_ids
from fxglm5.program import CacheSpec, StepInputs
from fxglm5.runtime.cache import PagedCache
from fxglm5.runtime.forward_context import ForwardContext


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    block_size: int  # physical (SEQ_SIZE_PER_BLOCK)
    kernel_block_size: int  # KERNEL_SEQ_SIZE_PER_BLOCK
    num_blocks: int  # physical blocks
    max_position_embeddings: int


def bind_caches(kv_cache, spec: CacheSpec, max_position_embeddings: int):
    """RTP's ``KVCache`` -> (the program's cache inputs in order, :class:`CacheLayout`); InputError naming the layer
    and RTP's field. RTP's cache methods take the group's tag; GLM-5's MLA layers are one group. FP8 latent rows come
    as RTP's ``float8_e4m3fn`` view of the bytes the program reads as uint8."""
    tags = list(kv_cache.group_tags)
    if len(tags) != 1:
        raise InputError(f"kv_cache: cache groups {tags}; GLM-5's MLA layers form one group")
    tag = tags[0]
    block_size = int(kv_cache.get_seq_size_per_block(tag))
    kbs = int(kv_cache.get_kernel_seq_size_per_block(tag) or block_size)
    if kbs < 1 or block_size % kbs:
        raise InputError(f"kv_cache: kernel block size {kbs} does not divide the block size {block_size}")
    layers = int(kv_cache.layer_count)
    if layers < len(spec.signature.layers):
        raise InputError(f"kv_cache: {layers} layers, the model has {len(spec.signature.layers)} attention layers")
    inputs, where = [], []
    for layer, (_, index_name) in enumerate(spec.signature.layers):
        lc = kv_cache.get_layer_cache(layer, tag)
        kv = lc.kv_cache_base
        fp8_view = isinstance(kv, torch.Tensor) and kv.dtype == torch.float8_e4m3fn
        inputs.append(kv.view(torch.uint8) if fp8_view else kv)
        where.append(f"kv_cache layer {layer} kv_cache_base")
        if index_name is not None:
            inputs.append(lc.kv_scale_base)
            where.append(f"kv_cache layer {layer} kv_scale_base (indexer keys)")
    first = inputs[0] if inputs else None
    kernel_blocks = first.shape[0] if isinstance(first, torch.Tensor) and first.dim() == 3 else 0
    spec.check(inputs, kernel_blocks, kbs, where=where.__getitem__)
    ratio = block_size // kbs
    if kernel_blocks % ratio or kernel_blocks // ratio < 2:
        raise InputError(f"kv_cache: {kernel_blocks} kernel blocks is not a whole number (>= 2) of physical blocks "
                         f"of {ratio}")
    return inputs, CacheLayout(block_size, kbs, kernel_blocks // ratio, max_position_embeddings)


def _host(attn, name: str):
    t = getattr(attn, name, None)
    return None if t is None else t.detach().to("cpu")


def _lengths_and_starts(attn):
    """(input_lengths, first position of each request's tokens this step): the prefix length in a prefill
    (unset or empty = no prefix), the cached length in a decode (``sequence_lengths``, else from its device
    mirror)."""
    lengths = _host(attn, "input_lengths")
    if lengths is None:
        raise InputError("input_lengths: unset")
    if bool(attn.is_prefill):
        starts = _host(attn, "prefix_lengths")
        return lengths, torch.zeros_like(lengths) if starts is None or starts.numel() == 0 else starts
    starts = _host(attn, "sequence_lengths")
    if starts is None or starts.numel() == 0:
        plus_1 = _host(attn, "sequence_lengths_plus_1_device")
        if plus_1 is None:
            raise InputError("sequence_lengths: unset in a decode step (and no sequence_lengths_plus_1_device)")
        starts = plus_1 - 1
    return lengths, starts


def _check_device_lengths(attn, starts) -> None:
    """An eager decode step's device lengths must say what the host ones say (RTP's own kernels read them)."""
    dev = _host(attn, "sequence_lengths_plus_1_device")
    if dev is None or _host(attn, "sequence_lengths") is None:
        return
    if dev.shape != starts.shape or not torch.equal(dev.long() - 1, starts.long()):
        bad = next((i for i in range(min(len(dev), len(starts))) if int(dev[i]) - 1 != int(starts[i])), None)
        raise InputError(f"sequence_lengths_plus_1_device: {dev.tolist()} disagrees with sequence_lengths "
                         f"{starts.tolist()} + 1" + ("" if bad is None else f" (request {bad})"))


def _tables(attn, layout: CacheLayout):
    """(physical, kernel) host block tables; the physical one follows from the kernel one where RTP leaves it
    unset (its CUDA-graph static inputs)."""
    kernel = _host(attn, "kv_cache_kernel_block_id")
    if kernel is None:
        raise InputError("kv_cache_kernel_block_id: unset in a step on RTP's cache")
    table = _host(attn, "kv_cache_block_id")
    if table is None:
        ratio = layout.block_size // layout.kernel_block_size
        table = kernel[:, ::ratio] // ratio
    return table, kernel


def _context(attn, rows, layout: CacheLayout) -> ForwardContext:
    """The step's :class:`ForwardContext` over ``rows`` of the batch (host tensors, validated)."""
    prefill = bool(attn.is_prefill)
    lengths, starts = (t[rows] for t in _lengths_and_starts(attn))
    empty = torch.zeros(0, dtype=torch.int32)
    prefix, seq = (starts, empty) if prefill else (empty, starts)
    # only the blocks the step reaches are read: RTP's static table is ceil(max_seq_len / block) wide, and
    # validating all of it cost 5 ms a step at B=64 (bench/rtpllm_host_time.py); past them a reused CUDA-graph
    # row also holds what an earlier, longer request left there
    table, kernel = _tables(attn, layout)
    last = (prefix + lengths - 1) if prefill else seq
    cols = min(table.shape[1], int(last.max()) // layout.block_size + 1) if last.numel() else table.shape[1]
    table, kernel = table[:, :cols][rows], kernel[:, :cols * (layout.block_size // layout.kernel_block_size)][rows]
    ctx = ForwardContext(prefill, lengths, prefix, seq, table, kernel, layout.block_size, layout.kernel_block_size,
                         layout.num_blocks, layout.max_position_embeddings)
    cu = _host(attn, "cu_seqlens")
    if prefill and cu is not None and cu.numel() == lengths.shape[0] + 1:
        ctx.cu_seqlens = cu  # checked against the lengths
    return ctx.validate()


def _decode_rows(attn, layout: CacheLayout):
    """(positions, slots) [B] of a decode step: the live rows validated, padding rows (see the module
    docstring) at position 0 writing nothing."""
    _, starts = _lengths_and_starts(attn)
    _, kernel = _tables(attn, layout)
    first = kernel[:, 0] if kernel.shape[1] else torch.zeros_like(starts)
    live = torch.nonzero((starts > 0) & (first != 0)).flatten()
    positions = torch.zeros(starts.shape[0], dtype=torch.int64)
    slots = torch.full((starts.shape[0],), -1, dtype=torch.int64)
    if live.numel():
        ctx = _context(attn, live, layout)
        positions[live], slots[live] = ctx.positions, ctx.slot_mapping
    return positions, slots


class StepMetadata:
    """The graph's step inputs (``positions``, ``slot_mapping``, ``block_table``, ``req_idx``,
    ``logits_indices``) and, without an RTP cache (warm-up), private scratch caches (``caches``)."""

    def __init__(self, attn, layout: CacheLayout | None, device, *, static: bool = False, scratch=None):
        self.static, self.device, self.layout, self.caches = static, device, layout, None
        if static:
            rows = _host(attn, "input_lengths").shape[0]
            self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
            self.slot_mapping = torch.full((rows,), -1, dtype=torch.int64, device=device)
            self.req_idx = torch.arange(rows, device=device)
            self.logits_indices = self.req_idx
            self.block_table = attn.kv_cache_kernel_block_id_device  # RTP's static buffer: its address is fixed
            self.prepare_cuda_graph(attn)
            return
        if layout is None:  # no RTP cache yet (the warm-up): a private scratch cache, written nowhere
            ctx, self.caches = scratch(attn)
            positions, slots, req = ctx.positions, ctx.slot_mapping, ctx.req_idx
            table = ctx.kernel_block_table
        elif bool(attn.is_prefill):
            ctx = _context(attn, slice(None), layout)
            positions, slots, req, table = ctx.positions, ctx.slot_mapping, ctx.req_idx, ctx.kernel_block_table
        else:
            _check_device_lengths(attn, _lengths_and_starts(attn)[1])
            positions, slots = _decode_rows(attn, layout)
            req, table = torch.arange(positions.shape[0]), _tables(attn, layout)[1]
        self.positions, self.slot_mapping, self.req_idx = (t.to(device) for t in (positions, slots, req))
        given = getattr(attn, "kv_cache_kernel_block_id_device", None) if layout is not None else None
        self.block_table = given if given is not None else table.to(device)
        self.logits_indices = torch.arange(self.positions.shape[0], device=device)

    def inputs(self, rows: slice | None = None) -> StepInputs:
        """The step as the program takes it; ``rows``: a run of its token rows (a chunk of a long prefill), which
        keeps the returned rows among them."""
        if rows is None:
            return StepInputs(self.positions, self.slot_mapping, self.block_table, self.req_idx, self.logits_indices)
        li = self.logits_indices
        return StepInputs(self.positions[rows], self.slot_mapping[rows], self.block_table, self.req_idx[rows],
                          li[(li >= rows.start) & (li < rows.stop)] - rows.start)

    def prepare_cuda_graph(self, attn) -> None:
        """Refill the static buffers from RTP's static inputs before a replay (outside the graph)."""
        if self.layout is None:
            raise InputError("CUDA-graph decode before initialize() was given RTP's KV cache")
        positions, slots = _decode_rows(attn, self.layout)
        self.positions.copy_(positions)
        self.slot_mapping.copy_(slots)


SCRATCH_BLOCKS = 2  # the warm-up's private cache: block 0 (reserved) and block 1, which every table entry names


def scratch_step(attn, spec: CacheSpec, device, max_position_embeddings: int, block_size: int = 64):
    """A step before RTP hands over its cache (its no-cache prefill warm-up): (context, caches) on a private
    cache of :data:`SCRATCH_BLOCKS` blocks whatever the step's length, so that RTP's cache is never written.

    RTP reserves the warm-up's peak device memory as runtime memory before it sizes the KV cache
    (``MemoryEvaluationHelper.cc:110``) and uses nothing else of it: ``NormalEngine::prefillWarmUp``
    (``NormalEngine.cc:332-351``, rtp-llm 4b8d39cd5) drops the stream ``preRun`` returns (line 342) and keeps
    only ``max_consumed_bytes`` and the free memory (lines 343-349). A cache for every warm-up token would be
    counted in that peak and so taken from the KV budget (computed for GLM-5's 78 layers at 8191 tokens: 0.51 GB
    with FP8 rows, 0.83 GB with bf16 ones; now 7.5 / 12.2 MiB), while a real prefill writes into RTP's cache.
    So every token's slot is -1 (the ops write nothing) and every table entry it reaches names block 1 (the
    ops' reads stay inside the two blocks and see zeros: finite outputs); the activations, the peak RTP means
    to measure, are those of a real prefill of that length. The lengths are validated as a real step's,
    against contiguous tables of the blocks such a step would need."""
    prefill = bool(attn.is_prefill)
    lengths, starts = (t.tolist() for t in _lengths_and_starts(attn))
    ends = [s + n for s, n in zip(starts, lengths)] if prefill else [s + 1 for s in starts]
    tables, nxt = [], 1
    for end in ends:
        n = -(-end // block_size)
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    ctx = ForwardContext.build(prefill, lengths, starts, tables, block_size=block_size,
                               kernel_block_size=block_size, num_blocks=nxt,
                               max_position_embeddings=max_position_embeddings,
                               prompt_lengths=lengths, device="cpu").validate()
    table = (ctx.block_table != 0).to(ctx.block_table.dtype)
    ctx = dataclasses.replace(ctx, block_table=table, kernel_block_table=table, num_blocks=SCRATCH_BLOCKS,
                              slot_mapping=torch.full_like(ctx.slot_mapping, -1))
    return ctx, PagedCache(spec, SCRATCH_BLOCKS, block_size, None, device).graph_inputs()


def step_prologue(model, inputs, fmha_impl):
    """What every forward of a plugin model does first: its step metadata (prepared now unless RTP gives it), the
    input ids checked against it (their values too, unless a CUDA graph replays the step: its ids come from RTP's
    sampler and reading them would sync), and the caches the step runs on (RTP's, or the warm-up's scratch).
    ``model``: a plugin ``GptModelBase`` with ``prepare_fmha_impl``, ``glm5_config`` and the bound ``caches``."""
    impl = fmha_impl if fmha_impl is not None else model.prepare_fmha_impl(inputs)
    ids = inputs.input_ids
    rows = impl.positions.shape[0]
    if ids.dim() != 1 or ids.shape[0] != rows:
        raise InputError(f"input_ids: expected {rows} tokens, got {tuple(ids.shape)}")
    if not impl.static:
        check_input_ids(ids[None], model.glm5_config.vocab_size)
    caches = impl.caches if impl.caches is not None else model.caches
    if caches is None:
        raise InputError("kv_cache: this step was prepared for RTP's cache, but initialize() holds none now")
    return impl, ids.long(), caches
