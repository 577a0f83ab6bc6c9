"""Fused FP8 MoE in Triton: router top-k, expert alignment, grouped gate_up+SiLU GEMM, down GEMM, combine.

Semantics are those of :mod:`fxglm5.lowering.reference.fp8` (``moe_route``, ``moe_fp8``).

Layout. The T*k (token, slot) entries are stably sorted by expert and each expert's run is padded to a
multiple of BLOCK_M, so every BLOCK_M-row block of the sorted list belongs to one expert
(``block_expert``, -1 past the end). Buffers are sized by the worst case ``T*k + min(E, T*k)*(BLOCK_M-1)``
rows, never by the data, so there is no host sync and the whole MoE can be captured in a CUDA graph;
blocks past the real end return at once. Padding rows carry the sentinel T*k. Up to BLOCK_M tokens (decode) no
align kernel runs (:func:`scans`): a token picks an expert at most once, so each expert fits one block, and each
GEMM CTA finds its block's expert (the b-th picked one in id order) and entries (in entry order) from the ids
itself, the align kernel's layout exactly, over min(E, T*k) blocks, and the down launch combines (each token's
output tile written by the CTA whose ticket completes it, :func:`_combine_tickets`): a MoE call is then two launches
(gate|up, down), not four, and with a shared expert (``fxglm5::moe_fp8_shared``) its two GEMMs run as extra CTAs of
those two (fp8_gemm's tile function and launch plan: the bits of their own launches), not two launches more. With
its router too (``fxglm5::moe_router_fp8_shared``, :func:`moe_router_fp8`) the router's GEMV tiles are the first
tasks of the gate|up launch (:func:`_router_gate_up_kernel`, :mod:`fxglm5.lowering.triton.tasks`): the MoE layer,
router included, is still two launches; and with the residual add and RMSNorm before it
(``fxglm5::add_rms_norm_moe_router_fp8_shared``, :func:`add_rms_norm_moe_router_fp8`) the norm's rows are the first
tasks of that launch: two launches still.

Kernels. One grouped GEMM kernel serves both projections: ``GATED`` loads the gate and the up tile of
the same output columns side by side and writes ``silu(g) * u`` (fp32, in sorted row order; w13's scales
hold the gate half's ceil(I/128) block rows, then the up half's, so a tile of either half meets one block
per K step whatever I is); the down projection reads those rows back and writes each entry's expert
output to its own (token, slot) row, optionally split over K (``SPLIT2``: more CTAs when only a few
experts are touched). The gated GEMM can be split over K too (``SPLIT1``, decode): its splits write fp32
gate|up partials and the last split to finish each tile sums them in a fixed order and applies the gate (the
split-K fixup of :mod:`fxglm5.lowering.triton.fp8_gemm`, counters from ``tile_counters``); the combine sums the
splits and the k slots with the routing weights in a fixed order (deterministic; ids of -1, expert-parallel
padding, are skipped), in its own kernel or, up to BLOCK_M tokens, in the down launch. The A/B scaling scheme is the one of
:mod:`fxglm5.lowering.triton.fp8_gemm` (BLOCK_K = 128, one scale pair per K step), and so is the choice
to load padding rows (a real row, never stored) instead of masking them; only a K tail (H or I not a
multiple of 128) is masked, and only where it exists (``NO_K_MASK``). Decode (few tokens) is bound
by reading the touched experts' weights: 16-row blocks, activations quantized in registers. Prefill
quantizes activations once and uses 64-row blocks. Alignment runs in one CTA (Triton sort) up to 4096
entries and with torch ops (sort, scatter, searchsorted; all capture-safe) above.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fxglm5 import settings
from fxglm5.errors import InputError
from fxglm5.lowering.reference import fp8 as ref
from fxglm5.lowering.reference import fused as ref_fused
from fxglm5.lowering.reference.fused import validate_add_rms_norm
from fxglm5.lowering.triton import tasks
from fxglm5.lowering.triton.device import num_sms, pdl, pdl_prologue
from fxglm5.lowering.triton.f32_linear import (
    f32_linear, finish_tile, gemv_launch, gemv_tile_start, gemv_tile_sum, is_gemv,
)
from fxglm5.lowering.triton.fp8_gemm import (
    GemmLaunch, _ab_scale, _b_scale, fp8_linear, gemm_tile, lone_launch, quantize_act_1x128, row_chunk,
)
from fxglm5.lowering.triton.fp8_parts import _dot, _quant_rows, tile_counters
from fxglm5.lowering.triton.norm_rope import DTYPE_CODES, add_rms_norm, add_rms_norm_launch, add_rms_norm_row, round_to


# ----------------------------------------------------------------------------------------- routing
# The rows the router kernel's last CTA routes at once. Compiled for sm_90 at GLM-5's 256 experts (4 warps, 16-byte
# aligned pointers, as launched) the kernel takes 48 / 96 / 128 registers a thread at 1 / 8 / 16 tokens, none
# spilled; 16 rows routed at once took 221, which leaves room for two CTAs an SM where its GEMV wants CTAS_PER_SM of
# them on every SM at a step's start (tests/kernels/test_moe_router_compile.py).
ROUTE_ROWS = 8


@triton.jit
def _route_rows(logits_ptr, rows, row_mask, bias_ptr, w_ptr, ids_ptr, offset_ptr, E, num_local, scaling,
                TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, RENORM: tl.constexpr,
                LOCAL: tl.constexpr):
    """Route the token rows ``rows`` [R] (``row_mask``: the real ones) of the float32 logits [T, E]: sigmoid,
    + correction bias, top-k by repeated argmax (the lowest index among ties), unbiased weights, renormalized by
    their sum, times ``scaling``; with LOCAL the ids are written local to the experts [offset, offset + num_local)
    of this rank, -1 for the others. A slot's weight is the sigmoid of its logit loaded again by its id (the same
    float32 operations on the same value as the scores'), and the weights are summed in slot order: a fixed order
    whatever the layout of R rows, so :func:`_route_kernel` (one row a program) and :func:`_router_kernel` (all
    rows in one CTA) give the same bits; and no score array is live across the selection, nor a reduction spent
    on each weight (GLM-5's 256 experts at 16 rows: no spills). Logits are read from L2 (.cg): the router
    kernel's were written by other CTAs of its grid."""
    eo = tl.arange(0, BLOCK_E)[None, :]
    emask = eo < E
    row_ptrs = logits_ptr + rows.to(tl.int64) * E
    x = tl.load(row_ptrs[:, None] + eo, mask=row_mask[:, None] & emask, other=0.0, cache_modifier=".cg")
    bias = tl.load(bias_ptr + eo, mask=emask, other=0.0).to(tl.float32)
    choice = tl.where(emask, 1.0 / (1.0 + tl.exp(-x)) + bias, float("-inf"))
    ko = tl.arange(0, BLOCK_K)[None, :]
    ids = tl.zeros((rows.shape[0], BLOCK_K), dtype=tl.int32)
    ws = tl.zeros((rows.shape[0], BLOCK_K), dtype=tl.float32)
    total = tl.zeros((rows.shape[0],), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(choice, axis=1)
        idx = tl.min(tl.where(choice == best[:, None], eo, BLOCK_E), axis=1)
        wj = 1.0 / (1.0 + tl.exp(-tl.load(row_ptrs + idx, mask=row_mask, other=0.0, cache_modifier=".cg")))
        ids = tl.where(ko == j, idx[:, None], ids)
        ws = tl.where(ko == j, wj[:, None], ws)
        total += wj
        choice = tl.where(eo == idx[:, None], float("-inf"), choice)
    if RENORM:
        ws = ws / (total + 1e-20)[:, None]
    kmask = row_mask[:, None] & (ko < TOP_K)
    out = rows.to(tl.int64)[:, None] * TOP_K + ko
    tl.store(w_ptr + out, ws * scaling, mask=kmask)
    if LOCAL:
        ids = ids - tl.load(offset_ptr)
        ids = tl.where((ids >= 0) & (ids < num_local), ids, -1)
    tl.store(ids_ptr + out, ids, mask=kmask)


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, offset_ptr, E, num_local, scaling, TOP_K: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, RENORM: tl.constexpr, LOCAL: tl.constexpr,
                  PDL: tl.constexpr):
    """One token per program: :func:`_route_rows` of its row."""
    pdl_prologue(PDL)
    t = tl.program_id(0) + tl.arange(0, 1)
    _route_rows(logits_ptr, t, t >= 0, bias_ptr, w_ptr, ids_ptr, offset_ptr, E, num_local, scaling, TOP_K, BLOCK_E,
                BLOCK_K, RENORM, LOCAL)


@triton.jit
def _router_tile(x_ptr, part_ptr, logits_ptr, cnt_ptr, bias_ptr, w_ptr, ids_ptr, offset_ptr, task_ptr, M, E, K,
                 stride_xm, num_local, scaling, pid_n, pid_k, tiles, offs_n, w_rows, w, STEPS: tl.constexpr,
                 SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, TOP_K: tl.constexpr,
                 BLOCK_E: tl.constexpr, BLOCK_TOPK: tl.constexpr, ROUTE_ROWS: tl.constexpr, RENORM: tl.constexpr,
                 LOCAL: tl.constexpr, SIGNAL: tl.constexpr, X_CACHE: tl.constexpr = None):
    """Expert tile ``pid_n`` (of ``tiles``) x K split ``pid_k`` of the router, after the PDL wait (``w``: its first
    weight tile, :func:`gemv_tile_start`): f32_linear's GEMV of the M rows of x by the router weight [E, K], the
    tile's last split summing the partials in split order (``f32_linear._f32_gemv_kernel``'s sums, bit for bit,
    into the [M, E] logits), then a ticket on the step's counter ``cnt[tiles]`` (after the tiles' own) taken by
    each tile's finishing CTA once its logits are stored; the CTA that takes the last routes every row
    (:func:`_route_rows`, as :func:`_route_kernel` does), resets the counter, so the next call and a CUDA-graph
    replay start from zero, and with SIGNAL publishes the routing to the tasks that wait on it (``tasks.signal`` of
    dependency 0 of ``task_ptr``). ``X_CACHE``: x's loads' cache modifier (".cg" where the launch's norm tasks wrote
    x)."""
    acc, tile, mask = gemv_tile_sum(x_ptr, stride_xm, M, E, K, offs_n, w_rows, w, pid_k, STEPS, BLOCK_M, BLOCK_K,
                                    X_CACHE)
    if finish_tile(acc, part_ptr, logits_ptr, cnt_ptr, tile, mask, pid_n, pid_k, M * E, 1.0, 1.0, 1.0, 1.0, 0,
                   SPLIT):
        tl.debug_barrier()  # the tile's logits stored before its arrival is published (as the split partials are)
        if tl.atomic_add(cnt_ptr + tiles, 1, sem="acq_rel", scope="gpu") == tiles - 1:
            for r0 in tl.static_range(0, BLOCK_M, ROUTE_ROWS):
                rows = r0 + tl.arange(0, ROUTE_ROWS)
                _route_rows(logits_ptr, rows, rows < M, bias_ptr, w_ptr, ids_ptr, offset_ptr, E, num_local,
                            scaling, TOP_K, BLOCK_E, BLOCK_TOPK, RENORM, LOCAL)
            tl.atomic_xchg(cnt_ptr + tiles, 0, sem="relaxed", scope="gpu")
            if SIGNAL:
                tasks.signal(task_ptr, 0)


@triton.jit
def _router_kernel(x_ptr, rw_ptr, part_ptr, logits_ptr, cnt_ptr, bias_ptr, w_ptr, ids_ptr, offset_ptr, M, E, K,
                   stride_xm, stride_rw, num_local, scaling, STEPS: tl.constexpr, SPLIT: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TOP_K: tl.constexpr,
                   BLOCK_E: tl.constexpr, BLOCK_TOPK: tl.constexpr, ROUTE_ROWS: tl.constexpr, RENORM: tl.constexpr,
                   LOCAL: tl.constexpr, PDL: tl.constexpr):
    """The router in one launch (up to MAX_GEMV_ROWS tokens): one :func:`_router_tile` a program, its first weight
    tile requested before the PDL wait."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n, w_rows, w = gemv_tile_start(rw_ptr, E, K, stride_rw, pid_n, pid_k, STEPS, BLOCK_N, BLOCK_K)
    pdl_prologue(PDL)
    _router_tile(x_ptr, part_ptr, logits_ptr, cnt_ptr, bias_ptr, w_ptr, ids_ptr, offset_ptr, cnt_ptr, M, E, K,
                 stride_xm, num_local, scaling, pid_n, pid_k, tl.num_programs(0), offs_n, w_rows, w, STEPS, SPLIT,
                 BLOCK_M, BLOCK_K, TOP_K, BLOCK_E, BLOCK_TOPK, ROUTE_ROWS, RENORM, LOCAL, False)


def _route_launch(top_k: int, e: int, renormalize: bool, expert_offset) -> dict:
    """The routing's launch keywords, shared by the route kernel and the router kernel."""
    return dict(TOP_K=top_k, BLOCK_E=triton.next_power_of_2(e), RENORM=bool(renormalize),
                LOCAL=expert_offset is not None)


def moe_route(router_logits, correction_bias, top_k, n_group, topk_group, renormalize, scaling_factor,
              expert_offset=None, num_local=0):
    """GLM-5 router (see the reference); n_group > 1 (group-limited selection) uses the reference. With
    ``expert_offset`` (an int32 scalar tensor) the ids come out local to experts [offset, offset + num_local)
    (``fxglm5::moe_route_local``)."""
    ref.check_route_inputs(router_logits, correction_bias, top_k, n_group, topk_group)
    local = expert_offset is not None
    if n_group > 1:
        weights, ids = ref.moe_route(router_logits, correction_bias, top_k, n_group, topk_group, renormalize,
                                     scaling_factor)
        return (weights, ref_fused.local_expert_ids(ids, expert_offset, num_local)) if local else (weights, ids)
    t, e = router_logits.shape
    ref._check(e <= 1024, f"router_logits: {e} experts, the Triton router handles at most 1024")
    logits = router_logits.contiguous()
    w = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=logits.device)
    if t:
        _route_kernel[(t,)](logits, correction_bias.contiguous(), w, ids, expert_offset if local else ids, e,
                            int(num_local), float(scaling_factor), BLOCK_K=triton.next_power_of_2(top_k),
                            **_route_launch(top_k, e, renormalize, expert_offset), **pdl(logits.device))
    return w, ids


def router_fuses(rows: int, n_group: int) -> bool:
    """Whether :func:`moe_router` over ``rows`` tokens runs in one launch: up to MAX_GEMV_ROWS tokens (decode), where
    the logits are f32_linear's GEMV. Every CTA of the GEMV covers every row of its expert tile (one weight load
    serves them all), so all rows' logits are done at the same moment, in the last tile's finishing CTA: one ticket
    a step (a counter per row would fire in that same CTA), and that CTA routes the rows ROUTE_ROWS at a time,
    each pass as long as one program of the route kernel. It saves the route kernel's launch and its gap (the align
    kernel's came to 2.6 us a layer at batch 1 on an H100: :func:`scans`) for one atomic per expert tile. Past it
    the logits are the tensor-core GEMM's row tiles, and the route kernel's program per token does in parallel what
    one CTA would do in sequence. Group-limited routing (n_group > 1) is the reference's (:func:`moe_route`)."""
    return is_gemv(rows) and n_group == 1


class Router(NamedTuple):
    """A MoE layer's router, as ``fxglm5::moe_router`` takes it: the float32 weight [E, H], the correction bias and
    the routing's settings; ``expert_offset`` (an int32 scalar tensor, or None) makes the ids local to experts
    [offset, offset + num_local)."""
    weight: torch.Tensor
    correction_bias: torch.Tensor
    top_k: int
    n_group: int
    topk_group: int
    renormalize: bool
    scaling: float
    expert_offset: torch.Tensor | None = None
    num_local: int = 0


class RouterLaunch(NamedTuple):
    """The router's launch (:func:`_router_tile`'s arguments, its constexprs and its (expert tiles, K splits) grid)
    writing the routing weights ``w`` and ``ids``."""
    grid: tuple[int, int]
    args: tuple
    meta: dict
    w: torch.Tensor
    ids: torch.Tensor


def _router_launch(x, router: Router, counter_offset: int = 0, out=None) -> RouterLaunch | None:
    """The one-launch router's arguments over ``x`` (checked as :func:`moe_router` checks them), its expert tiles'
    counters and the step's ``counter_offset`` into :func:`tile_counters`, writing into ``out`` (weights, ids) if
    given; None where it does not fuse (:func:`router_fuses`)."""
    weight = router.weight
    ref_fused.validate_f32_linear(x, weight, [])
    e, k = weight.shape
    rows = x.numel() // k
    if not router_fuses(rows, router.n_group):
        return None
    logits = torch.empty(rows, e, dtype=torch.float32, device=x.device)
    ref.check_route_inputs(logits, router.correction_bias, router.top_k, router.n_group, router.topk_group)
    ref._check(e <= 1024, f"weight: {e} experts, the Triton router handles at most 1024")
    x2, weight = x.reshape(rows, k).contiguous(), weight.contiguous()
    w, ids = routing_outputs(rows, router.top_k, x.device) if out is None else out
    grid, cfg = gemv_launch(e, k, rows, num_sms(x.device))
    part = torch.empty(cfg["SPLIT"], rows, e, dtype=torch.float32, device=x.device) if cfg["SPLIT"] > 1 else logits
    counters = tile_counters(x.device, counter_offset + grid[0] + 1)[counter_offset:]  # the tiles', the step's
    local = router.expert_offset is not None
    args = (x2, weight, part, logits, counters, router.correction_bias.contiguous(), w, ids,
            router.expert_offset if local else ids, rows, e, k, x2.stride(0), weight.stride(0), int(router.num_local),
            float(router.scaling))
    meta = dict(BLOCK_TOPK=triton.next_power_of_2(router.top_k), ROUTE_ROWS=min(cfg["BLOCK_M"], ROUTE_ROWS),
                **_route_launch(router.top_k, e, router.renormalize, router.expert_offset), **cfg)
    return RouterLaunch(grid, args, meta, w, ids)


def routing_outputs(rows: int, top_k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (weights float32 [rows, k], ids int32 [rows, k]) of a routing."""
    return (torch.empty(rows, top_k, dtype=torch.float32, device=device),
            torch.empty(rows, top_k, dtype=torch.int32, device=device))


def moe_router(x, weight, correction_bias, top_k, n_group, topk_group, renormalize, scaling_factor,
               expert_offset=None, num_local=0):
    """``fxglm5::moe_router``: the router's float32 logits ``x.float() @ weight.T`` routed as :func:`moe_route` does
    (ids local to experts [offset, offset + num_local) with ``expert_offset``); one launch where
    :func:`router_fuses`, else f32_linear's kernel then the route kernel."""
    launch = _router_launch(x, Router(weight, correction_bias, top_k, n_group, topk_group, renormalize,
                                      scaling_factor, expert_offset, num_local))
    if launch is None:
        return moe_route(f32_linear(x, weight, [], validate=False), correction_bias, top_k, n_group, topk_group,
                         renormalize, scaling_factor, expert_offset, num_local)
    _router_kernel[launch.grid](*launch.args, **launch.meta, **pdl(x.device))
    return launch.w, launch.ids


# --------------------------------------------------------------------------------------- alignment
def align_capacity(n: int, e: int, block_m: int) -> int:
    """Number of row blocks that can hold n entries over e experts, each expert padded to block_m."""
    return triton.cdiv(n + min(e, n) * (block_m - 1), block_m)


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, scratch_ptr, n, E, num_blocks,
                  BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, MAX_BLOCKS: tl.constexpr,
                  BLOCK_B: tl.constexpr, PDL: tl.constexpr):
    """Single CTA: histogram, padded prefix sums, stable sort by (expert, entry), scatter, block map.

    Compile-time bounds depend only on the power-of-two bucket of n, so varying T reuses the binary.
    """
    pdl_prologue(PDL)
    offs = tl.arange(0, BLOCK_N)
    ids = tl.load(ids_ptr + offs, mask=offs < n, other=-1).to(tl.int32)
    key = tl.where(ids >= 0, ids, E)  # -1 and padding lanes -> bucket E, dropped
    eo = tl.arange(0, BLOCK_E)
    counts = tl.where(eo < E, tl.histogram(key, BLOCK_E), 0)
    padded = (counts + BM - 1) // BM * BM
    pend = tl.cumsum(padded, 0)
    tl.store(scratch_ptr + eo, pend - padded)
    tl.store(scratch_ptr + BLOCK_E + eo, tl.cumsum(counts, 0) - counts)
    for r0 in tl.static_range(0, MAX_BLOCKS * BM, BLOCK_N):
        ro = r0 + offs
        tl.store(sorted_ptr + ro, tl.full((BLOCK_N,), 0, tl.int32) + n, mask=ro < num_blocks * BM)
    for b0 in tl.static_range(0, MAX_BLOCKS, BLOCK_B):
        bo = b0 + tl.arange(0, BLOCK_B)
        ex = tl.sum((pend[None, :] <= (bo * BM)[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + bo, tl.where(ex < E, ex, -1), mask=bo < num_blocks)
    tl.debug_barrier()
    srt = tl.sort(key * BLOCK_N + offs)
    sk = srt // BLOCK_N
    valid = sk < E
    rank = offs - tl.load(scratch_ptr + BLOCK_E + sk, mask=valid, other=0)
    dest = tl.load(scratch_ptr + sk, mask=valid, other=0) + rank
    tl.store(sorted_ptr + dest, srt % BLOCK_N, mask=valid)


def _align_torch(flat_ids, e, block_m, num_blocks):
    """Same layout with torch ops (large n, where one CTA would sort too slowly); capture-safe."""
    n = flat_ids.numel()
    dev = flat_ids.device
    key = torch.where(flat_ids < 0, e, flat_ids.long())
    sk, order = torch.sort(key, stable=True)
    counts = torch.zeros(e + 1, dtype=torch.long, device=dev).scatter_add_(0, key, torch.ones_like(key))
    counts = counts * (torch.arange(e + 1, device=dev) < e)  # drop the -1 bucket (no host scalar writes)
    padded = (counts + block_m - 1) // block_m * block_m
    pend = torch.cumsum(padded, 0)
    rank = torch.arange(n, device=dev) - (torch.cumsum(counts, 0) - counts)[sk]
    cap = num_blocks * block_m
    dest = torch.where(sk < e, (pend - padded)[sk] + rank, cap)
    sorted_ids = torch.full((cap + 1,), n, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    rows = torch.arange(num_blocks, device=dev) * block_m
    ex = torch.searchsorted(pend[:e].contiguous(), rows, right=True)
    return sorted_ids[:cap], torch.where(ex < e, ex, -1).to(torch.int32)


def align_by_expert(topk_ids: torch.Tensor, e: int, block_m: int, use_triton: bool | None = None):
    """``(sorted_ids [num_blocks*block_m] int32, block_expert [num_blocks] int32)``, see module doc."""
    flat = topk_ids.reshape(-1).contiguous()
    n = flat.numel()
    num_blocks = align_capacity(n, e, block_m)
    if use_triton is None:
        use_triton = n <= 4096
    if not use_triton:
        return _align_torch(flat, e, block_m, num_blocks)
    block_n = max(16, triton.next_power_of_2(n))
    block_e = triton.next_power_of_2(e + 1)
    max_blocks = align_capacity(block_n, e, block_m)
    sorted_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=flat.device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=flat.device)
    scratch = torch.empty(2 * block_e, dtype=torch.int32, device=flat.device)
    _align_kernel[(1,)](flat, sorted_ids, block_expert, scratch, n, e, num_blocks, BM=block_m, BLOCK_N=block_n,
                        BLOCK_E=block_e, MAX_BLOCKS=max_blocks, BLOCK_B=16, num_warps=8, **pdl(flat.device))
    return sorted_ids, block_expert


# -------------------------------------------------------------------------------------- grouped GEMM
@triton.jit
def _picked_experts(ids_ptr, n_entries, E, BLOCK_IDS: tl.constexpr, BLOCK_E: tl.constexpr):
    """(entry offsets, the [T*k] ids, expert offsets, picked [BLOCK_E]: whether some entry picks each expert) of a
    scanning launch (:func:`scans`), the ids read from L2: in the router's launch another CTA wrote them
    (:func:`_router_gate_up_kernel`)."""
    offs_i = tl.arange(0, BLOCK_IDS)
    ids = tl.load(ids_ptr + offs_i, mask=offs_i < n_entries, other=-1, cache_modifier=".cg")
    key = tl.where(ids >= 0, ids, E)  # -1 (no local expert) and padding lanes -> bucket E, never picked
    eo = tl.arange(0, BLOCK_E)
    return offs_i, ids, eo, (tl.histogram(key, BLOCK_E) > 0) & (eo < E)


@triton.jit
def _grouped_cta(
    pid_b, pid_n, pid_k, num_n, num_k,
    a_ptr, as_ptr, w_ptr, ws_ptr, sorted_ptr, block_expert_ptr, ids_ptr, c_ptr, h_ptr, cnt_ptr,
    tw_ptr, add_ptr, out_ptr, tcnt_ptr, n_entries, E, N, K, KG, UP_SB,
    stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_cm, stride_cs, stride_hm,
    num_blocks, s_a_ptr, s_as_ptr, s_b_ptr, s_bs_ptr, s_bias_ptr, s_c_ptr, s_out_ptr, s_cnt_ptr, s_up_ptr,
    S_M, S_N, S_K, S_KG, S_KG_PER_SPLIT: tl.constexpr,
    s_stride_am, s_stride_asm, s_stride_bn, s_stride_bsn, s_stride_cm, s_stride_cs, s_stride_um,
    TOP_K: tl.constexpr, GATED: tl.constexpr, SPLIT_K: tl.constexpr, A_MODE: tl.constexpr, DOT_F32: tl.constexpr,
    INTERPRET: tl.constexpr, K_PER_SPLIT: tl.constexpr, NO_K_MASK: tl.constexpr, SCALAR_SB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCAN: tl.constexpr, BLOCK_IDS: tl.constexpr,
    BLOCK_E: tl.constexpr, SHARED: tl.constexpr, S_A_MODE: tl.constexpr, S_GATED_A: tl.constexpr,
    S_DT: tl.constexpr, S_DOT_F32: tl.constexpr, S_INTERPRET: tl.constexpr, S_HAS_BIAS: tl.constexpr,
    S_SPLIT_K: tl.constexpr, S_FIXUP: tl.constexpr, S_NO_K_MASK: tl.constexpr, S_SCALAR_SB: tl.constexpr,
    S_BLOCK_M: tl.constexpr, S_BLOCK_N: tl.constexpr, S_GROUP_M: tl.constexpr, COMBINE: tl.constexpr,
    ADD: tl.constexpr, DT: tl.constexpr, A_CACHE: tl.constexpr = None, WALK: tl.constexpr = False, walk_splits=1,
    SHARED_ONLY: tl.constexpr = False,
):
    """One CTA of the grouped GEMM: (pid_b, pid_n, pid_k) of a (blocks [+ shared rows], num_n, num_k) grid, as
    :func:`_moe_gemm_kernel` launches it or :func:`_router_gate_up_kernel` numbers its tasks.
    GATED: c[row] = silu(A W_g^T) * (A W_u^T) with A rows gathered from x (token = entry // TOP_K),
    c in sorted row order. GATED over SPLIT_K > 1 splits: c[split, row] = this split's partial [A W_g^T | A W_u^T],
    and the last split to finish a (block, column tile) sums the tile's partials in split order, applies the gate
    and writes h[row] (the gated output), then resets the tile's counter ``cnt[pid_b * num_n + pid_n]``; the fold
    of the gate into the GEMM saves a launch per MoE call (decode, where the gate|up GEMM is split).
    Not GATED: c[split, entry] = partial A W^T over this split's K groups, A in sorted row order (the GATED
    output); the combine (its kernel, or this launch with COMBINE) sums the splits.
    Block b's expert and rows come from the align kernel (``block_expert``, ``sorted_ids``) or, with SCAN (at most
    BLOCK_M tokens, so each expert fills at most one block), from the [T*k] ids: the b-th expert in id order that
    some entry picks, and its entries in entry order, padded with the sentinel ``n_entries``: the same layout.
    SHARED: the CTAs past the ``num_blocks`` row blocks run the shared expert's GEMM (the ``s_`` / ``S_`` arguments:
    ``fp8_gemm._gemm_kernel``'s, its tiles and K splits numbered across those CTAs, the surplus returning at once)
    with that kernel's own tile function, so its output has the bits of its own launch (:func:`moe_fp8`).
    COMBINE (not GATED, at most BLOCK_M tokens): the combine runs in this launch (:func:`_combine_tickets`): each
    (block, column tile)'s last K split (an acq_rel ticket on ``cnt``, as the gated fold's) and each finished shared
    tile take a ticket per token on ``tcnt``, and the CTA that completes a token's count writes ``out`` from the
    partials c, the routing weights ``tw`` and, with ADD, ``add`` (the shared expert's output, or a given addend);
    CTA (0, j, 0) writes column tile j of the tokens with nothing to wait for (no local expert, no shared one).
    ``A_CACHE``: the A tiles' cache modifier, the routed and the shared ones (".cg" where the norm tasks of
    :func:`_router_gate_up_kernel` wrote A in the same launch).
    WALK (GATED, a routed CTA of :func:`_router_gate_up_kernel`'s expert walk): the K split is the run-time
    ``walk_splits`` of ceil(KG / walk_splits) K steps each (the last one shorter), always folded by the last split,
    and the partials are packed: block b's split s at rows ``(b * walk_splits + s) * BLOCK_M`` of c. SHARED_ONLY:
    the shared expert's CTAs only (the walk's other role), so that the routed body is not compiled twice."""
    if SHARED:
        if pid_b >= num_blocks:
            cta = ((pid_b - num_blocks) * num_n + pid_n) * num_k + pid_k
            tiles = tl.cdiv(S_M, S_BLOCK_M) * tl.cdiv(S_N, S_BLOCK_N)
            if cta < tiles * S_SPLIT_K:
                finished = gemm_tile(s_a_ptr, s_as_ptr, s_b_ptr, s_bs_ptr, s_bias_ptr, s_c_ptr, s_out_ptr, s_cnt_ptr,
                                     s_up_ptr, cta % tiles, cta // tiles, S_M, S_N, S_K, S_KG, S_KG_PER_SPLIT,
                                     s_stride_am, s_stride_asm, s_stride_bn, s_stride_bsn, s_stride_cm, s_stride_cs,
                                     s_stride_um, S_A_MODE, S_GATED_A, S_DT, S_DOT_F32, S_INTERPRET, S_HAS_BIAS,
                                     S_SPLIT_K, S_FIXUP, S_NO_K_MASK, S_SCALAR_SB, S_BLOCK_M, S_BLOCK_N, S_GROUP_M,
                                     A_CACHE=A_CACHE)
                if COMBINE:  # one M tile, the routed tiles' columns (moe_fp8 checks): tile = column tile
                    if finished:
                        tokens = tl.arange(0, BLOCK_M)
                        cols = (cta % tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
                        _combine_tickets(tcnt_ptr, tokens, tokens < S_M, cta % tiles, num_n, c_ptr, ids_ptr, tw_ptr,
                                         add_ptr, out_ptr, cols, cols < N, N, stride_cs, TOP_K, SPLIT_K, ADD, DT, True)
            return
    if SHARED_ONLY:  # a caller whose routed blocks take another path (the expert walk): no routed code compiled
        return
    if COMBINE and not SHARED:
        if (pid_b == 0) & (pid_k == 0):
            tokens = tl.arange(0, BLOCK_M)
            real = tokens < n_entries // TOP_K
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            _combine_rows(c_ptr, ids_ptr, tw_ptr, add_ptr, out_ptr, tokens,
                          real & (_local_slots(ids_ptr, tokens, real, TOP_K) == 0), cols, cols < N, N, stride_cs,
                          TOP_K, SPLIT_K, ADD, DT)
    rows = pid_b * BLOCK_M + tl.arange(0, BLOCK_M)
    if SCAN:
        offs_i, ids, eo, picked = _picked_experts(ids_ptr, n_entries, E, BLOCK_IDS, BLOCK_E)
        nth = tl.cumsum(picked.to(tl.int32), 0) - 1
        e = tl.min(tl.where(picked & (nth == pid_b), eo, E), axis=0)
        if e == E:  # fewer than pid_b + 1 experts picked
            return
        hit = ids == e
        slot = tl.cumsum(hit.to(tl.int32), 0) - 1  # a stable sort's order: entry order within the expert
        match = hit[None, :] & (slot[None, :] == tl.arange(0, BLOCK_M)[:, None])
        entry = tl.min(tl.where(match, offs_i[None, :], n_entries), axis=1)
    else:
        e = tl.load(block_expert_ptr + pid_b)
        if e < 0:
            return
        entry = tl.load(sorted_ptr + rows)
    valid = entry < n_entries
    # Padding rows read a real row (token T-1, or their own unused sorted row) instead of being masked.
    a_rows = tl.minimum(entry, n_entries - 1) // TOP_K if GATED else rows
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows_b = tl.minimum(offs_n, N - 1)
    offs_k = tl.arange(0, 128)
    a_ptrs = a_ptr + a_rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    w_base = w_ptr + e.to(tl.int64) * stride_we
    b_ptrs = w_base + rows_b[:, None] * stride_wn + offs_k[None, :]
    if SCALAR_SB:  # the tile meets one weight-scale block per K step
        bs_ptrs = ws_ptr + e * stride_wse + (pid_n * BLOCK_N // 128) * stride_wsn
    else:
        bs_ptrs = ws_ptr + e * stride_wse + (rows_b // 128) * stride_wsn
    if GATED:  # the up half: rows N.., its own scale blocks from row UP_SB of the scales (see module doc)
        u_ptrs = b_ptrs + N * stride_wn
        us_ptrs = bs_ptrs + UP_SB * stride_wsn
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if WALK:  # the walk's run-time split; its K steps never pass KG, so NO_K_MASK holds where K is whole groups
        k_per = tl.cdiv(KG, walk_splits)
        n_split = walk_splits
        k_steps = tl.minimum(k_per, KG - pid_k * k_per)
    else:
        k_per: tl.constexpr = K_PER_SPLIT
        n_split: tl.constexpr = SPLIT_K
        k_steps: tl.constexpr = K_PER_SPLIT
    for i in range(0, k_steps):
        kg = pid_k * k_per + i
        if NO_K_MASK:
            a = tl.load(a_ptrs + kg * 128, cache_modifier=A_CACHE)
            b = tl.load(b_ptrs + kg * 128)
            s_b = tl.load(bs_ptrs + kg)
            if GATED:
                bu = tl.load(u_ptrs + kg * 128)
                s_u = tl.load(us_ptrs + kg)
        else:
            k_mask = offs_k < K - kg * 128
            a = tl.load(a_ptrs + kg * 128, mask=k_mask[None, :], other=0.0, cache_modifier=A_CACHE)
            b = tl.load(b_ptrs + kg * 128, mask=k_mask[None, :], other=0.0)
            s_b = tl.load(bs_ptrs + kg, mask=kg < KG, other=0.0)
            if GATED:
                bu = tl.load(u_ptrs + kg * 128, mask=k_mask[None, :], other=0.0)
                s_u = tl.load(us_ptrs + kg, mask=kg < KG, other=0.0)
        if A_MODE == 2:
            acc += _dot(a, tl.trans(b.to(a.dtype)), DOT_F32) * _b_scale(s_b, SCALAR_SB)
            if GATED:
                acc_u += _dot(a, tl.trans(bu.to(a.dtype)), DOT_F32) * _b_scale(s_u, SCALAR_SB)
        else:
            if A_MODE == 0:
                q = a
                s_a = tl.load(as_ptr + a_rows * stride_asm + kg, mask=kg < KG, other=0.0)
            else:
                q, s_a = _quant_rows(a.to(tl.float32), INTERPRET)
            acc += _dot(q, tl.trans(b), INTERPRET) * _ab_scale(s_a, s_b, SCALAR_SB)
            if GATED:
                acc_u += _dot(q, tl.trans(bu), INTERPRET) * _ab_scale(s_a, s_u, SCALAR_SB)
    if GATED and (SPLIT_K > 1 or WALK):
        # fp8_gemm's FIXUP: barrier + acq_rel atomic publish this CTA's partial stores GPU-wide; the last-arriving
        # split reads every split's partial back from L2 (.cg) and sums them in split order (deterministic: the
        # order and fp32 math of a separate reduce-and-gate kernel, bit for bit).
        if WALK:
            c_rows = pid_b * n_split * BLOCK_M + tl.arange(0, BLOCK_M)
            split_stride = BLOCK_M * stride_cm
        else:
            c_rows = rows
            split_stride = stride_cs
        c_ptrs = c_ptr + c_rows.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        c_mask = valid[:, None] & n_mask[None, :]
        tl.store(c_ptrs + pid_k * split_stride, acc, mask=c_mask)
        tl.store(c_ptrs + pid_k * split_stride + N, acc_u, mask=c_mask)
        tl.debug_barrier()
        cnt = cnt_ptr + pid_b * num_n + pid_n
        if tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == n_split - 1:
            gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for sp in range(0, n_split):
                gate += tl.load(c_ptrs + sp * split_stride, mask=c_mask, other=0.0, cache_modifier=".cg")
                up += tl.load(c_ptrs + sp * split_stride + N, mask=c_mask, other=0.0, cache_modifier=".cg")
            out = gate / (1.0 + tl.exp(-gate)) * up
            tl.store(h_ptr + rows.to(tl.int64)[:, None] * stride_hm + offs_n[None, :],
                     out.to(h_ptr.dtype.element_ty), mask=c_mask)
            tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")
        return
    if GATED:
        out = acc / (1.0 + tl.exp(-acc)) * acc_u
        c_rows = rows
    else:
        out = acc
        c_rows = entry
    c_ptrs = c_ptr + pid_k * stride_cs + c_rows.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])
    if COMBINE:
        last = True
        if SPLIT_K > 1:  # the tile's last split takes its tokens' tickets once every split's partial is stored
            tl.debug_barrier()
            cnt = cnt_ptr + pid_b * num_n + pid_n
            last = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1
            if last:
                tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")
        if last:
            _combine_tickets(tcnt_ptr, entry // TOP_K, valid, pid_n, num_n, c_ptr, ids_ptr, tw_ptr, add_ptr,
                             out_ptr, offs_n, n_mask, N, stride_cs, TOP_K, SPLIT_K, ADD, DT, SHARED)


@triton.jit
def _moe_gemm_kernel(
    a_ptr, as_ptr, w_ptr, ws_ptr, sorted_ptr, block_expert_ptr, ids_ptr, c_ptr, h_ptr, cnt_ptr,
    tw_ptr, add_ptr, out_ptr, tcnt_ptr, n_entries, E, N, K, KG, UP_SB,
    stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_cm, stride_cs, stride_hm,
    num_blocks, s_a_ptr, s_as_ptr, s_b_ptr, s_bs_ptr, s_bias_ptr, s_c_ptr, s_out_ptr, s_cnt_ptr, s_up_ptr,
    S_M, S_N, S_K, S_KG, S_KG_PER_SPLIT: tl.constexpr,
    s_stride_am, s_stride_asm, s_stride_bn, s_stride_bsn, s_stride_cm, s_stride_cs, s_stride_um,
    TOP_K: tl.constexpr, GATED: tl.constexpr, SPLIT_K: tl.constexpr, A_MODE: tl.constexpr, DOT_F32: tl.constexpr,
    INTERPRET: tl.constexpr, K_PER_SPLIT: tl.constexpr, NO_K_MASK: tl.constexpr, SCALAR_SB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCAN: tl.constexpr, BLOCK_IDS: tl.constexpr,
    BLOCK_E: tl.constexpr, SHARED: tl.constexpr, S_A_MODE: tl.constexpr, S_GATED_A: tl.constexpr,
    S_DT: tl.constexpr, S_DOT_F32: tl.constexpr, S_INTERPRET: tl.constexpr, S_HAS_BIAS: tl.constexpr,
    S_SPLIT_K: tl.constexpr, S_FIXUP: tl.constexpr, S_NO_K_MASK: tl.constexpr, S_SCALAR_SB: tl.constexpr,
    S_BLOCK_M: tl.constexpr, S_BLOCK_N: tl.constexpr, S_GROUP_M: tl.constexpr, COMBINE: tl.constexpr,
    ADD: tl.constexpr, DT: tl.constexpr, PDL: tl.constexpr, BLOCKS_LAST: tl.constexpr = False,
):
    """The grouped GEMM launch: one :func:`_grouped_cta` a program, over a (blocks, column tiles, splits) grid, or
    with BLOCKS_LAST (:data:`MOE_DECODE`) its reverse, (splits, column tiles, blocks): the GPU hands out CTAs in
    grid order with the first axis fastest, so that a block's CTAs then go out together, the picked blocks' before
    the ones that find no expert and exit (at B=1 most of them), instead of every wave mixing the two."""
    pdl_prologue(PDL)
    if BLOCKS_LAST:
        pid_b, pid_n, pid_k = tl.program_id(2), tl.program_id(1), tl.program_id(0)
        num_n, num_k = tl.num_programs(1), tl.num_programs(0)
    else:
        pid_b, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        num_n, num_k = tl.num_programs(1), tl.num_programs(2)
    _grouped_cta(pid_b, pid_n, pid_k, num_n, num_k,
                a_ptr, as_ptr, w_ptr, ws_ptr, sorted_ptr, block_expert_ptr, ids_ptr, c_ptr, h_ptr, cnt_ptr,
                tw_ptr, add_ptr, out_ptr, tcnt_ptr, n_entries, E, N, K, KG, UP_SB, stride_am, stride_asm,
                stride_we, stride_wn, stride_wse, stride_wsn, stride_cm, stride_cs, stride_hm, num_blocks,
                s_a_ptr, s_as_ptr, s_b_ptr, s_bs_ptr, s_bias_ptr, s_c_ptr, s_out_ptr, s_cnt_ptr, s_up_ptr, S_M,
                S_N, S_K, S_KG, S_KG_PER_SPLIT, s_stride_am, s_stride_asm, s_stride_bn, s_stride_bsn,
                s_stride_cm, s_stride_cs, s_stride_um, TOP_K, GATED, SPLIT_K, A_MODE, DOT_F32, INTERPRET,
                K_PER_SPLIT, NO_K_MASK, SCALAR_SB, BLOCK_M, BLOCK_N, SCAN, BLOCK_IDS, BLOCK_E, SHARED, S_A_MODE,
                S_GATED_A, S_DT, S_DOT_F32, S_INTERPRET, S_HAS_BIAS, S_SPLIT_K, S_FIXUP, S_NO_K_MASK,
                S_SCALAR_SB, S_BLOCK_M, S_BLOCK_N, S_GROUP_M, COMBINE, ADD, DT)


@triton.jit
def _router_gate_up_kernel(
    x_ptr, rw_ptr, part_ptr, logits_ptr, rcnt_ptr, bias_ptr, rids_ptr, offset_ptr, task_ptr, R_E, stride_xm,
    stride_rw, num_local, scaling, num_n, num_k, shared_rows,
    n_x_ptr, n_r_ptr, n_w_ptr, n_out_ptr, n_sum_ptr, n_stride_x, n_stride_r, n_d, n_eps, n_rows,
    a_ptr, as_ptr, w_ptr, ws_ptr, sorted_ptr, block_expert_ptr, ids_ptr, c_ptr, h_ptr, cnt_ptr,
    tw_ptr, add_ptr, out_ptr, tcnt_ptr, n_entries, E, N, K, KG, UP_SB,
    stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_cm, stride_cs, stride_hm,
    num_blocks, s_a_ptr, s_as_ptr, s_b_ptr, s_bs_ptr, s_bias_ptr, s_c_ptr, s_out_ptr, s_cnt_ptr, s_up_ptr,
    S_M, S_N, S_K, S_KG, S_KG_PER_SPLIT: tl.constexpr,
    s_stride_am, s_stride_asm, s_stride_bn, s_stride_bsn, s_stride_cm, s_stride_cs, s_stride_um,
    TOP_K: tl.constexpr, GATED: tl.constexpr, SPLIT_K: tl.constexpr, A_MODE: tl.constexpr, DOT_F32: tl.constexpr,
    INTERPRET: tl.constexpr, K_PER_SPLIT: tl.constexpr, NO_K_MASK: tl.constexpr, SCALAR_SB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCAN: tl.constexpr, BLOCK_IDS: tl.constexpr,
    BLOCK_E: tl.constexpr, SHARED: tl.constexpr, S_A_MODE: tl.constexpr, S_GATED_A: tl.constexpr,
    S_DT: tl.constexpr, S_DOT_F32: tl.constexpr, S_INTERPRET: tl.constexpr, S_HAS_BIAS: tl.constexpr,
    S_SPLIT_K: tl.constexpr, S_FIXUP: tl.constexpr, S_NO_K_MASK: tl.constexpr, S_SCALAR_SB: tl.constexpr,
    S_BLOCK_M: tl.constexpr, S_BLOCK_N: tl.constexpr, S_GROUP_M: tl.constexpr, COMBINE: tl.constexpr,
    ADD: tl.constexpr, DT: tl.constexpr,
    R_TILES: tl.constexpr, R_STEPS: tl.constexpr, R_SPLIT: tl.constexpr, R_BLOCK_M: tl.constexpr,
    R_BLOCK_N: tl.constexpr, R_BLOCK_K: tl.constexpr, R_BLOCK_E: tl.constexpr, R_BLOCK_TOPK: tl.constexpr,
    ROUTE_ROWS: tl.constexpr, RENORM: tl.constexpr, LOCAL: tl.constexpr, NORM: tl.constexpr,
    N_CHUNK: tl.constexpr, N_STEPS: tl.constexpr, N_LEVELS: tl.constexpr, N_DT: tl.constexpr, PDL: tl.constexpr,
    WALK: tl.constexpr = False, walkers=1,
):
    """The router and the gated grouped GEMM in one launch (up to BLOCK_M tokens, :func:`moe_fp8` with a
    ``router``), a launch of tasks (:mod:`fxglm5.lowering.triton.tasks`): each CTA takes a task id. With NORM the
    first ``n_rows`` tasks are the residual add and RMSNorm before the MoE (:func:`moe_fp8`'s ``norm``,
    ``fxglm5::add_rms_norm_moe_router_fp8_shared``), one token row each (``norm_rope.add_rms_norm_row``, the ``n_``
    arguments: the standalone kernel's program, bit for bit), writing the sum (the next residual) and the normed row
    (the MoE's x, ``n_out_ptr``, the memory of ``x_ptr``, ``a_ptr`` and ``s_a_ptr``), then signalling dependency 1.
    Then tasks [0, R_TILES * R_SPLIT) (counted after the norm's) are the router's expert tiles x K splits
    (:func:`_router_tile`; the CTA that routes writes the weights ``tw`` and the ids ``rids``, the ``ids`` the GEMMs
    read unless a benchmark steers them, and signals dependency 0); then the shared expert's gate|up CTAs
    (``shared_rows`` rows of num_n x num_k tasks, :func:`_grouped_cta` past ``num_blocks``), which need no routing;
    then the routed blocks' CTAs, which wait for the routing before they read the ids (from L2) to find their
    expert; with WALK the routed part is ``walkers`` CTAs instead (at least one per block and column tile), an
    expert walk: once routed, each counts the picked experts P, sizes a K split S that gives P x num_n x S tiles, at
    most ``walkers`` (the most splits up to ``walkers // (P x num_n)``), and takes the tile of its own index, if
    there is one (:func:`_grouped_cta` with WALK): the K split follows the routing, so no CTA streams for a block
    nobody picked and each streams as many K steps as the picked experts leave it (:data:`MOE_DECODE`'s
    WALK_CTAS_PER_SM). With NORM the router's tiles (after requesting their first weight tile)
    and the shared CTAs wait for
    every norm task's signal, and every reader of the normed rows reads them from L2 (.cg); the routed CTAs wait
    for the routing, which the router signals only after it waited for the norm (release / acquire is transitive).
    Every task waits only on tasks before it, so the launch cannot deadlock (tasks' module doc). The PDL wait comes
    first: a task's weights are known only once its id is taken."""
    pdl_prologue(PDL)
    task = tasks.take(task_ptr)
    norm_task = False
    if NORM:
        norm_task = task < n_rows
    if norm_task:
        add_rms_norm_row(n_x_ptr, n_r_ptr, n_w_ptr, n_out_ptr, n_sum_ptr, task, n_stride_x, n_stride_r, n_d, n_eps,
                         N_CHUNK, N_STEPS, N_LEVELS, N_DT)
        tasks.signal(task_ptr, 1)
    else:
        x_cache: tl.constexpr = ".cg" if NORM else ""
        task -= n_rows
        if task < R_TILES * R_SPLIT:
            pid_n, pid_k = task % R_TILES, task // R_TILES
            offs_n, w_rows, w = gemv_tile_start(rw_ptr, R_E, K, stride_rw, pid_n, pid_k, R_STEPS, R_BLOCK_N,
                                                R_BLOCK_K)
            if NORM:
                tasks.wait(task_ptr, 1, n_rows)
            _router_tile(x_ptr, part_ptr, logits_ptr, rcnt_ptr, bias_ptr, tw_ptr, rids_ptr, offset_ptr, task_ptr,
                         n_entries // TOP_K, R_E, K, stride_xm, num_local, scaling, pid_n, pid_k, R_TILES, offs_n,
                         w_rows, w, R_STEPS, R_SPLIT, R_BLOCK_M, R_BLOCK_K, TOP_K, R_BLOCK_E, R_BLOCK_TOPK,
                         ROUTE_ROWS, RENORM, LOCAL, True, x_cache)
        else:
            cta = task - R_TILES * R_SPLIT
            row = cta // (num_n * num_k)
            routed = row >= shared_rows
            if routed:
                tasks.wait(task_ptr, 0, 1)
            elif NORM:
                tasks.wait(task_ptr, 1, n_rows)
            if WALK and routed:
                walker = cta - shared_rows * num_n * num_k
                picked = tl.sum(_picked_experts(ids_ptr, n_entries, E, BLOCK_IDS, BLOCK_E)[3].to(tl.int32), 0)
                splits = tl.maximum(1, tl.minimum(KG, walkers // tl.maximum(picked * num_n, 1)))
                k_per = tl.cdiv(KG, splits)
                splits = tl.cdiv(KG, k_per)
                if walker < picked * num_n * splits:  # at most one tile a walker (walkers >= blocks x num_n)
                    _grouped_cta(walker // (num_n * splits), walker // splits % num_n, walker % splits, num_n, splits,
                                 a_ptr, as_ptr, w_ptr, ws_ptr, sorted_ptr, block_expert_ptr, ids_ptr, c_ptr, h_ptr,
                                 cnt_ptr, tw_ptr, add_ptr, out_ptr, tcnt_ptr, n_entries, E, N, K, KG, UP_SB,
                                 stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_cm,
                                 stride_cs, stride_hm, num_blocks, s_a_ptr, s_as_ptr, s_b_ptr, s_bs_ptr, s_bias_ptr,
                                 s_c_ptr, s_out_ptr, s_cnt_ptr, s_up_ptr, S_M, S_N, S_K, S_KG, S_KG_PER_SPLIT,
                                 s_stride_am, s_stride_asm, s_stride_bn, s_stride_bsn, s_stride_cm, s_stride_cs,
                                 s_stride_um, TOP_K, GATED, SPLIT_K, A_MODE, DOT_F32, INTERPRET, K_PER_SPLIT,
                                 NO_K_MASK, SCALAR_SB, BLOCK_M, BLOCK_N, SCAN, BLOCK_IDS, BLOCK_E, SHARED, S_A_MODE,
                                 S_GATED_A, S_DT, S_DOT_F32, S_INTERPRET, S_HAS_BIAS, S_SPLIT_K, S_FIXUP,
                                 S_NO_K_MASK, S_SCALAR_SB, S_BLOCK_M, S_BLOCK_N, S_GROUP_M, COMBINE, ADD, DT,
                                 x_cache, True, splits)
            else:
                pid_b = tl.where(routed, row - shared_rows, num_blocks + row)
                _grouped_cta(pid_b, cta % (num_n * num_k) // num_k, cta % num_k, num_n, num_k,
                        a_ptr, as_ptr, w_ptr, ws_ptr, sorted_ptr, block_expert_ptr, ids_ptr, c_ptr, h_ptr, cnt_ptr,
                        tw_ptr, add_ptr, out_ptr, tcnt_ptr, n_entries, E, N, K, KG, UP_SB, stride_am, stride_asm,
                        stride_we, stride_wn, stride_wse, stride_wsn, stride_cm, stride_cs, stride_hm, num_blocks,
                        s_a_ptr, s_as_ptr, s_b_ptr, s_bs_ptr, s_bias_ptr, s_c_ptr, s_out_ptr, s_cnt_ptr, s_up_ptr,
                        S_M, S_N, S_K, S_KG, S_KG_PER_SPLIT, s_stride_am, s_stride_asm, s_stride_bn, s_stride_bsn,
                        s_stride_cm, s_stride_cs, s_stride_um, TOP_K, GATED, SPLIT_K, A_MODE, DOT_F32, INTERPRET,
                        K_PER_SPLIT, NO_K_MASK, SCALAR_SB, BLOCK_M, BLOCK_N, SCAN, BLOCK_IDS, BLOCK_E, SHARED,
                        S_A_MODE, S_GATED_A, S_DT, S_DOT_F32, S_INTERPRET, S_HAS_BIAS, S_SPLIT_K, S_FIXUP,
                        S_NO_K_MASK, S_SCALAR_SB, S_BLOCK_M, S_BLOCK_N, S_GROUP_M, COMBINE, ADD, DT, x_cache,
                        SHARED_ONLY=WALK)
    if NORM:
        tasks.finish(task_ptr, 2)
    else:
        tasks.finish(task_ptr, 1)


@triton.jit
def _combine_rows(y_ptr, ids_ptr, w_ptr, add_ptr, out_ptr, tokens, rows, cols, col_mask, H, stride_ys,
                  TOP_K: tl.constexpr, SPLIT: tl.constexpr, ADD: tl.constexpr, DT: tl.constexpr):
    """out[t, cols] for the tokens ``tokens`` [R] (``rows``: the ones to write) = sum_j w[t, j] * sum_s y[s, t*k + j]
    over the slots with id >= 0, in that fixed order (deterministic); with ``ADD``, rounded to the output dtype and
    then + add[t] (the shared expert's row), the unfused graph's two rounding points. Every element's operations
    are the same whatever R and the column count, so :func:`_combine_kernel` (one token a program) and the down
    launch's combining CTAs (a tile's tokens at once, :func:`_combine_tickets`) give the same bits. Loads from L2
    (.cg): in the down launch y and add were written by other CTAs of the grid."""
    t64 = tokens.to(tl.int64)
    mask = rows[:, None] & col_mask[None, :]
    acc = tl.zeros((tokens.shape[0], cols.shape[0]), dtype=tl.float32)
    for j in range(TOP_K):  # a loop, not unrolled: every slot's loads issued at once would take 255 registers
        ok = tl.load(ids_ptr + tokens * TOP_K + j, mask=rows, other=-1) >= 0
        wj = tl.load(w_ptr + tokens * TOP_K + j, mask=rows, other=0.0)
        y = tl.zeros((tokens.shape[0], cols.shape[0]), dtype=tl.float32)
        for sp in tl.static_range(SPLIT):
            y += tl.load(y_ptr + sp * stride_ys + (t64 * TOP_K + j)[:, None] * H + cols[None, :],
                         mask=mask & ok[:, None], other=0.0, cache_modifier=".cg")
        acc += tl.where(ok, wj, 0.0)[:, None] * y
    if ADD:
        extra = tl.load(add_ptr + t64[:, None] * H + cols[None, :], mask=mask, other=0.0,
                        cache_modifier=".cg").to(tl.float32)
        acc = round_to(round_to(acc, DT) + extra, DT)
    tl.store(out_ptr + t64[:, None] * H + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _local_slots(ids_ptr, tokens, rows, TOP_K: tl.constexpr):
    """[R] the slots of each token of ``tokens`` whose expert this rank holds (id >= 0), 0 past ``rows``."""
    n = tl.zeros(tokens.shape, dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        n += (tl.load(ids_ptr + tokens * TOP_K + j, mask=rows, other=-1) >= 0).to(tl.int32)
    return n


@triton.jit
def _combine_tickets(cnt_ptr, tokens, rows, tile, num_n, y_ptr, ids_ptr, w_ptr, add_ptr, out_ptr, cols, col_mask, H,
                     stride_ys, TOP_K: tl.constexpr, SPLIT: tl.constexpr, ADD: tl.constexpr, DT: tl.constexpr,
                     SHARED: tl.constexpr):
    """The down launch's combine (no combine launch, no waiting): this CTA has just written its part of column tile
    ``tile`` (of ``num_n``) of the tokens ``tokens`` [R] (``rows``: the real ones): an expert's rows for those
    tokens, all K splits summed, or the shared expert's output. Publish it (barrier, then an acq_rel add: the split-K FIXUP's pattern)
    as one ticket on each token's counter ``cnt[t, tile]``; a token's output tile is complete after its local slots'
    tiles and, with ``SHARED``, the shared expert's, so the CTA whose ticket completes that count combines the
    token's tile (:func:`_combine_rows`, reading the others' rows from L2) and resets its counter for the next call
    and CUDA-graph replay (no one else touches it in this launch)."""
    tl.debug_barrier()
    counters = cnt_ptr + tokens * num_n + tile
    taken = tl.atomic_add(counters, 1, mask=rows, sem="acq_rel", scope="gpu")
    last = rows & (taken == _local_slots(ids_ptr, tokens, rows, TOP_K) + SHARED - 1)
    if tl.max(last.to(tl.int32), axis=0) > 0:
        _combine_rows(y_ptr, ids_ptr, w_ptr, add_ptr, out_ptr, tokens, last, cols, col_mask, H, stride_ys, TOP_K,
                      SPLIT, ADD, DT)
        tl.atomic_xchg(counters, 0, mask=last, sem="relaxed", scope="gpu")


@triton.jit
def _combine_kernel(y_ptr, ids_ptr, w_ptr, add_ptr, out_ptr, H, stride_ys, TOP_K: tl.constexpr, SPLIT: tl.constexpr,
                    BLOCK_H: tl.constexpr, ADD: tl.constexpr, DT: tl.constexpr, PDL: tl.constexpr):
    """The combine of token ``program_id(0)``'s columns ``program_id(1)`` (:func:`_combine_rows`): its own launch
    where the down GEMM does not combine (past the scan's tokens, or shared tiles that do not line up)."""
    pdl_prologue(PDL)
    t = tl.program_id(0) + tl.arange(0, 1)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    _combine_rows(y_ptr, ids_ptr, w_ptr, add_ptr, out_ptr, t, t >= 0, offs, offs < H, H, stride_ys, TOP_K, SPLIT,
                  ADD, DT)


# Regime defaults, the winners of the H200 sweeps (decode: docs/perf/fp8_gemm_moe.md, kernels_gemm_moe_v2; both:
# bench/results/gluon_gemm_moe_mla_h8_a4d0c02/kernels_moe_a4d0c02, moe_sweep rows);
# moe_fp8(config=...) overrides keys (``scan=False``, for tests, keeps the align kernel: see scans). The gate|up
# GEMM's K split is derived (``SPLIT1`` overrides it): enough splits for CTAS_PER_SM1 CTAs per SM over the blocks
# that can exist (batch 1 touches 8 experts: 8 blocks x 16 column tiles would leave one CTA per SM, each streaming
# 48 K steps).
# CTAS_PER_SM1 16 / SPLIT2 4: a rank of EP8 touches about one of its 32 experts at batch 1, so the splits sized for
# the 8 blocks that can exist left most SMs idle (bench/results/rank_at_depth_fuse_kernels_5cf6615: 1.0 ms less kernel time per 78-layer
# step at batch 1 and at batch 64)
# WALK_CTAS_PER_SM: where the router joins the gate|up launch, that many CTAs an SM walk the picked experts' tiles
# instead of a CTA per (block, column tile, split) (:func:`_router_gate_up_kernel`); 0, the default, until a GPU
# times it (at B=1 most of the 16 CTAs an SM found no expert: bench/results/decode_h100_bd118d2/ncu_moe_rank.csv).
# BLOCKS_LAST: the grouped GEMM launches (the down, and gate|up without the router) over a reversed grid, so that
# the picked blocks' CTAs go out first (:func:`_moe_gemm_kernel`); off until a GPU times it.
MOE_DECODE = dict(BLOCK_M=16, BLOCK_N1=128, BLOCK_N2=128, SPLIT2=4, CTAS_PER_SM1=16, num_warps=4, num_stages=3,
                  fused_quant=True, WALK_CTAS_PER_SM=0, BLOCKS_LAST=False)
# One token: CTAS_PER_SM1 8. The busiest EP8 rank holds about 2.6 of a token's experts (bench/routing_load.py), yet
# the splits are sized for the 8 blocks that can exist, so most CTAs of 16 an SM find no expert and the busy ones
# stream 3 K steps each. Half as many, streaming 6 each, took the MoE's first launch from 70.96 to 56.62 us at GLM-5's
# sizes (bench/moe_rank_decode.py) and the 39-layer step from 8.50 to 8.21 ms, both on one H100 at bd118d2
# (bench/results/decode_h100_bd118d2/); at 8 tokens the same setting was slower (14.9 against 14.3 ms), so it
# stays one token's.
MOE_DECODE_ONE_TOKEN = dict(CTAS_PER_SM1=8)
MOE_PREFILL = dict(BLOCK_M=64, BLOCK_N1=128, BLOCK_N2=128, SPLIT2=1, SPLIT1=1, num_warps=4, num_stages=4,
                   fused_quant=False)


def pick_moe_config(t: int, k: int, e: int, config: dict | None = None) -> dict:
    """Decode (a few entries per expert): 16-row blocks, activations quantized in registers, optional
    split-K of the down GEMM, and one token's own K split (:data:`MOE_DECODE_ONE_TOKEN`). Prefill: 64-row blocks,
    activations quantized once."""
    decode = t * k <= 2 * 16 * e
    cfg = dict(MOE_DECODE if decode else MOE_PREFILL)
    if decode and t == 1:
        cfg.update(MOE_DECODE_ONE_TOKEN)
    cfg.update(config or {})
    return cfg


def scans(t: int, cfg: dict) -> bool:
    """Whether ``moe_fp8`` over ``t`` tokens lets its GEMMs find their rows themselves (``SCAN``) instead of launching
    the align kernel: where t <= BLOCK_M. A token picks an expert at most once, so an expert then holds at most
    BLOCK_M entries, one block, and a CTA can find its block's expert and entries from the T*k ids alone (a histogram
    over the experts and a [BLOCK_M, T*k] compare, cheap at decode sizes); it saves a launch and its gap per MoE
    call (2.6 us a layer at batch 1 on an H100, issue 45). Above it an expert spans blocks that only a sort finds.
    ``cfg["scan"] = False`` (tests only) keeps the align kernel, whose layout the scan reproduces exactly."""
    return t <= cfg["BLOCK_M"] and cfg.get("scan", True)


class Blocks(NamedTuple):
    """Where the GEMMs' BLOCK_M-row blocks find their expert and entries: ``count`` blocks, from the align kernel's
    ``sorted_ids`` / ``block_expert`` or (``scan``) from the [T*k] ``ids`` over ``experts`` experts."""
    count: int
    scan: bool
    ids: torch.Tensor
    experts: int
    sorted_ids: torch.Tensor | None = None
    block_expert: torch.Tensor | None = None


def num_blocks(t: int, k: int, e: int, cfg: dict) -> int:
    """The row blocks a MoE call over ``t`` tokens launches: with the scan one per expert that can be picked,
    min(E, T*k); else the align kernel's capacity."""
    return min(e, t * k) if scans(t, cfg) else align_capacity(t * k, e, cfg["BLOCK_M"])


def expert_blocks(topk_ids: torch.Tensor, e: int, cfg: dict) -> Blocks:
    """The row blocks of a MoE call over ``topk_ids`` [T, k] (see :func:`scans`)."""
    t, k = topk_ids.shape
    ids = topk_ids.reshape(-1).contiguous()
    if scans(t, cfg):
        return Blocks(num_blocks(t, k, e, cfg), True, ids, e)
    sorted_ids, block_expert = align_by_expert(ids, e, cfg["BLOCK_M"], cfg.get("triton_align"))
    return Blocks(block_expert.numel(), False, ids, e, sorted_ids, block_expert)


def _shared_arguments(shared: GemmLaunch | None, dummy: torch.Tensor) -> tuple[tuple, dict]:
    """The ``s_`` / ``S_`` arguments of :func:`_moe_gemm_kernel`: the shared expert's launch (``fp8_gemm``'s
    ``_gemm_kernel`` arguments and constexprs, renamed), or, without one, placeholders no CTA reads."""
    if shared is None:
        return (dummy,) * 9 + (1,) * 5 + (0,) * 7, dict(SHARED=False, S_A_MODE=2, S_GATED_A=False, S_DT=0,
                                                       S_DOT_F32=False, S_INTERPRET=False, S_HAS_BIAS=False,
                                                       S_SPLIT_K=1, S_FIXUP=False, S_NO_K_MASK=True,
                                                       S_SCALAR_SB=True, S_BLOCK_M=16, S_BLOCK_N=16, S_GROUP_M=1)
    return shared.args, dict(SHARED=True, **{f"S_{key}": value for key, value in shared.meta.items()})


class Combine(NamedTuple):
    """The combine run by the down launch (:func:`_combine_tickets`): the routing weights [T, k], the addend [T, H]
    (the shared expert's output, or None) and the output [T, H]."""
    weights: torch.Tensor
    addend: torch.Tensor | None
    out: torch.Tensor


def _grouped(a, a_s, mode, w, w_s, blocks, c, n_entries, top_k, gated, cfg, dot_f32, split=1, h=None, shared=None,
             combine=None, router=None, norm=None, walkers=0):
    """One grouped GEMM launch over ``blocks``. A gated launch with ``split > 1`` writes its [split, rows, 2I] fp32
    partials to c and its gated output to ``h`` (the last split of each tile reduces them, counted in
    :func:`tile_counters`, the first blocks x column tiles of them). ``shared`` (a ``fp8_gemm.GemmLaunch``): the
    shared expert's GEMM runs as extra rows of CTAs after the blocks' (its tiles x splits over as many rows of
    column tiles x splits as they fill; its counters follow the blocks'). ``combine`` (the down launch, a
    :class:`Combine`): the launch writes the MoE's output itself, its (block, column tile) counters first in
    :func:`tile_counters`, then a [T, column tiles] of token counters (:func:`combine_counters`), then the shared
    expert's. ``router`` (the gated launch over the scan, a :class:`RouterLaunch` writing ``blocks.ids``): the
    router's tiles run first in the same launch (:func:`_router_gate_up_kernel`); ``norm`` (a :class:`ResidualNorm`
    writing ``a``, with a ``router`` only): its rows before them, the launch's first tasks. ``walkers`` (with a
    ``router``): the routed blocks' CTAs are that many walkers of the picked experts' tiles instead
    (:func:`_router_gate_up_kernel`'s WALK), c their packed [rows, 2I] partials (:func:`walk_partial_rows`) and
    ``split`` only the shared expert's task numbering."""
    n = w.shape[1] // 2 if gated else w.shape[1]
    kdim = w.shape[2]
    kg = triton.cdiv(kdim, 128)
    k_per_split = triton.cdiv(kg, split)
    split = triton.cdiv(kg, k_per_split)
    bn = cfg["BLOCK_N1"] if gated else cfg["BLOCK_N2"]
    grid = (blocks.count, triton.cdiv(n, bn), split)
    fold = gated and (split > 1 or walkers > 0)
    ids = blocks.ids
    shared_args, shared_meta = _shared_arguments(shared, c)
    if shared is not None:
        grid = (grid[0] + triton.cdiv(shared.grid[0] * shared.grid[1], grid[1] * grid[2]), grid[1], grid[2])
    cnt = tcnt = c
    if fold:
        cnt = tile_counters(a.device, blocks.count * grid[1])
    if combine is not None:
        cnt = tile_counters(a.device, combine_counters(blocks.count, n_entries // top_k, grid[1]))
        tcnt = cnt[blocks.count * grid[1]:]
    tw, addend, out = combine if combine is not None else (c if router is None else router.w, None, c)
    args = (a, a_s, w, w_s, ids if blocks.scan else blocks.sorted_ids, ids if blocks.scan else blocks.block_expert,
            ids, c, h if fold else c, cnt, tw, out if addend is None else addend, out, tcnt,
            n_entries, blocks.experts, n, kdim, kg, triton.cdiv(n, 128),
            a.stride(0), a_s.stride(0), w.stride(0), w.stride(1), w_s.stride(0), w_s.stride(1),
            c.stride(-2), c.stride(0) if c.dim() == 3 else 0, h.stride(0) if fold else 0, blocks.count, *shared_args)
    meta = dict(TOP_K=top_k, GATED=gated, SPLIT_K=split, A_MODE=mode, DOT_F32=dot_f32,
                INTERPRET=settings.triton_interpret(), K_PER_SPLIT=k_per_split,
                NO_K_MASK=kdim % 128 == 0 and k_per_split * split == kg, SCALAR_SB=bn <= 128,
                BLOCK_M=cfg["BLOCK_M"], BLOCK_N=bn, SCAN=blocks.scan,
                BLOCK_IDS=max(16, triton.next_power_of_2(n_entries)),
                BLOCK_E=triton.next_power_of_2(blocks.experts + 1), **shared_meta, COMBINE=combine is not None,
                ADD=combine is not None and addend is not None,
                DT=DTYPE_CODES[out.dtype] if combine is not None else 0,
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if router is None:
        blocks_last = bool(cfg.get("BLOCKS_LAST")) and blocks.scan
        _moe_gemm_kernel[grid[::-1] if blocks_last else grid](*args, **meta, **pdl(a.device), BLOCKS_LAST=blocks_last)
        return split
    x2, rw, part, logits, rcnt, bias, _, rids, offset, _, e, _, stride_xm, stride_rw, num_local, scaling = router.args
    if norm is None:
        norm_rows, norm_args, norm_meta = 0, (c,) * 5 + (0, 0, 1, 0.0), dict(CHUNK=1, STEPS=1, LEVELS=0, DT=0)
    else:
        norm_rows, norm_args, norm_meta = norm.launch()
    routed_tasks = walkers if walkers else blocks.count * grid[1] * grid[2]
    _router_gate_up_kernel[(norm_rows + router.grid[0] * router.grid[1] + (grid[0] - blocks.count) * grid[1] * grid[2]
                            + routed_tasks,)](
        x2, rw, part, logits, rcnt, bias, rids, offset, tasks.counters(a.device, 2), e, stride_xm, stride_rw,
        num_local, scaling, grid[1], grid[2], grid[0] - blocks.count, *norm_args, norm_rows, *args,
        R_TILES=router.grid[0],
        **{f"R_{key}": router.meta[key] for key in ("STEPS", "SPLIT", "BLOCK_M", "BLOCK_N", "BLOCK_K", "BLOCK_E",
                                                    "BLOCK_TOPK")},
        ROUTE_ROWS=router.meta["ROUTE_ROWS"], RENORM=router.meta["RENORM"], LOCAL=router.meta["LOCAL"],
        NORM=norm is not None, **{f"N_{key}": value for key, value in norm_meta.items()}, **meta, **pdl(a.device),
        WALK=walkers > 0, walkers=max(walkers, 1))
    return split


def walk_partial_rows(blocks: int, column_tiles: int, walkers: int) -> int:
    """The BLOCK_M-row slots of the expert walk's packed partials: P picked blocks x S splits, where S is at most
    ``walkers // (P x column_tiles)`` (:func:`_router_gate_up_kernel`; walkers >= blocks x column tiles, so S >= 1),
    so at most ``walkers // column_tiles``."""
    return max(blocks, walkers // column_tiles)


def combine_counters(blocks: int, t: int, column_tiles: int) -> int:
    """The counters of a combining down launch: a (block, column tile)'s K splits, then a (token, column tile)'s
    tickets (the shared expert's FIXUP counters follow them)."""
    return (blocks + t) * column_tiles


def _splits(kg: int, want: int) -> int:
    """The number of K splits of ``kg`` groups closest to ``want`` that tiles them without an empty split."""
    return triton.cdiv(kg, triton.cdiv(kg, max(1, min(kg, want))))


def _split2(inter: int, cfg: dict) -> int:
    """The down GEMM's K splits (each writes its own [T*k, H] fp32 partial)."""
    return _splits(triton.cdiv(inter, 128), cfg["SPLIT2"])


def _split1(num_blocks: int, h: int, inter: int, cfg: dict, sms: int) -> int:
    """The gate|up GEMM's K splits: ``SPLIT1`` if given, else CTAS_PER_SM1 CTAs per SM over the ``num_blocks``
    row blocks that can exist (an upper bound known without a host sync)."""
    want = cfg.get("SPLIT1")
    if want is None:
        want = round(cfg["CTAS_PER_SM1"] * sms / (num_blocks * triton.cdiv(inter, cfg["BLOCK_N1"])))
    return _splits(triton.cdiv(h, 128), want)


def _moe_elements(t: int, k: int, e: int, h: int, inter: int, config) -> int:
    """The most elements a tensor of ``moe_fp8`` over ``t`` tokens holds: the gated GEMM's padded sorted rows x 2I
    (its gate|up weight rows), or the down GEMM's split partials [SPLIT2, T*k, H] (GLM-5: k=8, H=6144, 2I=4096,
    so the partials pass 2^31 from 43691 tokens on), or the gate|up GEMM's K-split partials [SPLIT1, rows, 2I]
    where ``SPLIT1`` is given. A derived SPLIT1 is never the largest: it exceeds 1 only where few blocks exist and
    is sized for CTAS_PER_SM1 CTAs per SM, so those partials hold about 2 * CTAS_PER_SM1 * SMs * BLOCK_M *
    BLOCK_N1 elements (a few million) plus at most rows * I."""
    cfg = pick_moe_config(t, k, e, config)
    rows = align_capacity(t * k, e, cfg["BLOCK_M"]) * cfg["BLOCK_M"]
    split1 = _splits(triton.cdiv(h, 128), cfg["SPLIT1"]) if cfg.get("SPLIT1") else 1
    return max(rows * 2 * inter * split1, _split2(inter, cfg) * t * k * h)


class SharedExpert(NamedTuple):
    """A MoE layer's shared expert (``fxglm5::moe_fp8_shared``): its stacked gate|up GEMM ``w13`` [R, H] (block-FP8,
    ``w13_scale``), whose output's first ``inter`` columns are the gate and the ``inter`` from ``up_start`` the up
    half, and its down GEMM ``w2`` [H, inter], both with ``act_quant``; under tensor parallelism the rank's slices
    of its intermediate features (its own widths, not the routed experts')."""
    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    act_quant: bool
    up_start: int

    def halves(self, gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate, up): the column slices of the gate|up GEMM's output [T, R] the down GEMM reads."""
        return ref_fused.shared_halves(gate_up, self.w2.shape[1], self.up_start)

    def check(self, x: torch.Tensor) -> None:
        """Both GEMMs' inputs checked as ``fp8_linear`` checks them, and the down GEMM's output x's width."""
        ref.check_linear_inputs(x, self.w13, self.w13_scale, None)
        gate, _ = self.halves(x.new_empty(0, self.w13.shape[0]))
        ref.check_linear_inputs(gate, self.w2, self.w2_scale, None)
        ref._check(self.w2.shape[0] == x.shape[-1], f"shared w2: {self.w2.shape[0]} output features, the tokens "
                   f"have {x.shape[-1]}")


def shared_expert(x: torch.Tensor, shared: SharedExpert) -> torch.Tensor:
    """The shared expert's output [T, H] by its own launches: the gate|up GEMM, then the down GEMM that applies the
    gate as it loads its A tiles (``fp8_linear(..., up=...)``)."""
    gate, up = shared.halves(fp8_linear(x, shared.w13, shared.w13_scale, None, shared.act_quant))
    return fp8_linear(gate, shared.w2, shared.w2_scale, None, shared.act_quant, up=up)


def _shared_launches(x, shared: SharedExpert, counter_offsets: tuple[int, int], cfg: dict):
    """(gate|up launch, down launch, the down's output [T, H]) of the shared expert over ``x`` as the MoE's two
    grouped GEMM launches run them (fp8_gemm's launches, the ones ``shared_expert`` would make, bit for bit; their
    split-K counters from ``counter_offsets``, past the routed launches' own); None where ``shared_expert``
    launches anything else (the GEMV, a quant or silu kernel, the split-K reduce kernel) or at another warp count."""
    shared = shared._replace(**{name: getattr(shared, name).contiguous() for name in ("w13", "w13_scale", "w2",
                                                                                     "w2_scale")})
    gate_up = torch.empty(x.shape[0], shared.w13.shape[0], dtype=x.dtype, device=x.device)
    out = torch.empty_like(x)
    first = lone_launch(x, None, shared.w13, shared.w13_scale, shared.act_quant, gate_up, counter_offsets[0])
    second = lone_launch(*shared.halves(gate_up), shared.w2, shared.w2_scale, shared.act_quant, out,
                         counter_offsets[1])
    if first is None or second is None or {first[1]["num_warps"], second[1]["num_warps"]} != {cfg["num_warps"]}:
        return None
    return first[0], second[0], out


def _lines_up(down: GemmLaunch, h: int, cfg: dict) -> bool:
    """Whether the shared expert's down tiles are the routed down's column tiles (one M tile, the same width), so
    that a finished shared tile can take the tickets of the down launch's combine."""
    return down.meta["BLOCK_N"] == cfg["BLOCK_N2"] and down.grid[0] == triton.cdiv(h, cfg["BLOCK_N2"])


def moe_fp8(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, act_quant=True, *, config=None, addend=None,
            shared=None, router=None, router_ids=None, norm=None):
    """Routed FP8 experts (see module doc); ``config`` overrides :func:`pick_moe_config`. ``addend`` [T, H] (x's
    dtype): added to the routed sum in the combine kernel (``fxglm5::moe_fp8_add``: the shared expert's output).
    Up to BLOCK_M tokens (decode) the GEMMs scan the ids for their rows and no align kernel runs, and the down
    launch combines (:func:`_combine_tickets`, the combine kernel's bits): two launches, not four (:func:`scans`:
    every expert then fits one block; above it only a sort finds an expert's blocks). ``shared`` (a
    :class:`SharedExpert`, ``fxglm5::moe_fp8_shared``): the shared expert of x is the addend; where the GEMMs scan,
    its two GEMMs run as extra CTAs of theirs (:func:`_grouped`; the shared expert's own launches' bits,
    :func:`_shared_launches`), so a decode MoE call is still two launches (its down tiles take the combine's tickets
    where they are the routed down's column tiles, :func:`_lines_up`; else the combine kernel runs), and elsewhere
    :func:`shared_expert` runs first. ``router`` (a :class:`Router`, only where :func:`router_joins`):
    ``topk_ids`` and ``topk_weights`` are empty and the router fills them in the gate|up launch
    (:func:`_router_gate_up_kernel`), which its expert tiles wait for: a decode MoE layer, router included, in two
    launches (:func:`moe_router_fp8`); ``router_ids`` (default ``topk_ids``): where the router writes its ids (a
    steered benchmark gives ids of its own as ``topk_ids``, and the router's go to a buffer no one reads).
    ``norm`` (a :class:`ResidualNorm` whose ``normed`` rows are x, which holds nothing yet): the residual add and
    RMSNorm that make x, as the first tasks of the router's launch where the router joins it, its shared expert's
    GEMMs join the MoE's launches and x is quantized in registers (:func:`add_rms_norm_moe_router_fp8`); else its
    own kernel first."""
    t, e, h, inter = ref.check_moe_inputs(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, router is None)
    k = topk_ids.shape[1]
    if addend is not None and shared is not None:
        raise InputError("moe_fp8: an addend or a shared expert, not both")
    if shared is not None:
        shared.check(x)
    if addend is not None and (addend.shape != x.shape or addend.dtype != x.dtype):
        raise InputError(f"moe_fp8 addend: {addend.dtype} {tuple(addend.shape)}, the tokens are {x.dtype} "
                         f"{tuple(x.shape)}")
    cfg = pick_moe_config(t, k, e, config)
    x = x.contiguous()
    joined = None
    if shared is not None and t > 0 and k > 0 and scans(t, cfg):
        blocks_max = num_blocks(t, k, e, cfg)
        joined = _shared_launches(x, shared, (blocks_max * triton.cdiv(inter, cfg["BLOCK_N1"]),
                                              combine_counters(blocks_max, t, triton.cdiv(h, cfg["BLOCK_N2"]))), cfg)
    if norm is not None and (router is None or (shared is not None and joined is None)
                             or (act_quant and not cfg["fused_quant"])):
        norm.run()  # x is read before the gate|up launch (the shared expert's own launches, the quant kernel)
        norm = None
    if shared is not None:
        addend = shared_expert(x, shared) if joined is None else joined[2]
    out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    if t == 0 or k == 0:
        return out.zero_() if addend is None else out.copy_(addend)
    chunk = row_chunk(t, lambda r: _moe_elements(r, k, e, h, inter, config))
    if chunk < t:  # tokens are routed independently: chunks of them are independent MoE calls
        for i in range(0, t, chunk):
            out[i:i + chunk] = moe_fp8(x[i:i + chunk], topk_ids[i:i + chunk], topk_weights[i:i + chunk], w13,
                                       w13_scale, w2, w2_scale, act_quant, config=config,
                                       addend=None if addend is None else addend[i:i + chunk])
        return out
    ids = topk_ids.contiguous()
    w13, w13_scale, w2, w2_scale = (z.contiguous() for z in (w13, w13_scale, w2, w2_scale))
    blocks = expert_blocks(ids, e, cfg)
    rows = blocks.count * cfg["BLOCK_M"]
    dot_f32 = x.dtype == torch.float32 or settings.triton_interpret()
    h_dtype = torch.float32 if (act_quant or x.dtype == torch.float32) else x.dtype
    hmid = torch.empty(rows, inter, dtype=h_dtype, device=x.device)
    split = _split2(inter, cfg)
    split1 = _split1(blocks.count, h, inter, cfg, num_sms(x.device))
    y = torch.empty(split, t * k, h, dtype=torch.float32, device=x.device)
    first, second = (None, None) if joined is None else joined[:2]
    if router is not None:  # the router's counters follow the gate|up launch's (the routed tiles', the shared's)
        offset = blocks.count * triton.cdiv(inter, cfg["BLOCK_N1"]) + (0 if first is None else first.grid[0])
        router = _router_launch(x, router, offset, (topk_weights, ids if router_ids is None else router_ids))
        if router is None or not blocks.scan:
            raise ValueError("moe_fp8: a router where it does not join the gate|up launch (see router_joins)")
    if act_quant and not cfg["fused_quant"]:
        a, a_s, mode = *quantize_act_1x128(x), 0
    else:
        a, a_s, mode = x, x, (1 if act_quant else 2)
    walkers = cfg.get("WALK_CTAS_PER_SM", 0) * num_sms(x.device) if router is not None else 0
    if walkers:  # at least a walker a block and column tile, so that none takes two tiles
        walkers = max(walkers, blocks.count * triton.cdiv(inter, cfg["BLOCK_N1"]))
        g = torch.empty(walk_partial_rows(blocks.count, triton.cdiv(inter, cfg["BLOCK_N1"]), walkers) * cfg["BLOCK_M"],
                        2 * inter, dtype=torch.float32, device=x.device)
        _grouped(a, a_s, mode, w13, w13_scale, blocks, g, t * k, k, True, cfg, dot_f32, split1, hmid, first,
                 router=router, norm=norm, walkers=walkers)
    elif split1 > 1:
        g = torch.empty(split1, rows, 2 * inter, dtype=torch.float32, device=x.device)
        _grouped(a, a_s, mode, w13, w13_scale, blocks, g, t * k, k, True, cfg, dot_f32, split1, hmid, first,
                 router=router, norm=norm)
    else:
        _grouped(a, a_s, mode, w13, w13_scale, blocks, hmid, t * k, k, True, cfg, dot_f32, shared=first,
                 router=router, norm=norm)
    combine = None
    if blocks.scan and (joined is None or _lines_up(second, h, cfg)):
        combine = Combine(topk_weights.contiguous(), None if addend is None else addend.contiguous(), out)
    if mode == 0:
        hq, hs = quantize_act_1x128(hmid)
        _grouped(hq, hs, 0, w2, w2_scale, blocks, y, t * k, k, False, cfg, dot_f32, split, shared=second,
                 combine=combine)
    else:
        _grouped(hmid, hmid, mode, w2, w2_scale, blocks, y, t * k, k, False, cfg,
                 dot_f32 or h_dtype == torch.float32, split, shared=second, combine=combine)
    if combine is not None:
        return out
    block_h = 1024
    _combine_kernel[(t, triton.cdiv(h, block_h))](y, ids, topk_weights.contiguous(),
                                                  out if addend is None else addend.contiguous(), out, h, y.stride(0),
                                                  TOP_K=k, SPLIT=split, BLOCK_H=block_h, ADD=addend is not None,
                                                  DT=DTYPE_CODES[x.dtype], **pdl(x.device))
    return out


def router_joins(x: torch.Tensor, router: Router, e: int, config=None) -> bool:
    """Whether :func:`moe_router_fp8` runs the router in the gate|up launch: where the router is one launch
    (:func:`router_fuses`: up to MAX_GEMV_ROWS tokens, n_group 1) and the expert GEMMs scan the ids (up to
    BLOCK_M tokens) at the GEMV's warp count (a launch has one), with tokens and slots to route. Elsewhere (prefill,
    group-limited routing) the router keeps its own launch(es)."""
    t, k = x.shape[0], router.top_k
    if t == 0 or k == 0 or not router_fuses(t, router.n_group) or not settings.joins("moe_router"):
        return False
    cfg = pick_moe_config(t, k, e, config)
    gemv_warps = gemv_launch(router.weight.shape[0], x.shape[1], t, num_sms(x.device))[1]["num_warps"]
    return scans(t, cfg) and gemv_warps == cfg["num_warps"]


def moe_router_fp8(x, router: Router, w13, w13_scale, w2, w2_scale, act_quant=True, *, shared=None, config=None,
                   steered_ids=None, norm=None):
    """``fxglm5::moe_router_fp8_shared`` (with ``shared``): the router (:func:`moe_router`) and the routed experts
    with the shared expert (:func:`moe_fp8`) over the same tokens x [T, H]. Where :func:`router_joins` (decode), two
    launches: the router's tiles, the shared expert's gate|up and the routed gate|up in one launch of tasks
    (:func:`_router_gate_up_kernel`), then the down GEMMs with the combine; each piece has its own launches' bits.
    Elsewhere the router's launch(es), then :func:`moe_fp8`'s. ``steered_ids`` (int32 [T, k], benchmarks only:
    bench/routing_load.py): the experts take these ids instead of the router's, the router still running in its
    launch (its weights are used). ``norm`` (a :class:`ResidualNorm` making x): see :func:`moe_fp8`; its own kernel
    first where the router does not join."""
    if not router_joins(x, router, w13.shape[0], config):
        if norm is not None:
            norm.run()
        weights, ids = moe_router(x, *router)
        ids = ids if steered_ids is None else steered_ids
        return moe_fp8(x, ids, weights, w13, w13_scale, w2, w2_scale, act_quant, config=config, shared=shared)
    weights, ids = routing_outputs(x.shape[0], router.top_k, x.device)
    if steered_ids is None:
        return moe_fp8(x, ids, weights, w13, w13_scale, w2, w2_scale, act_quant, config=config, shared=shared,
                       router=router, norm=norm)
    return moe_fp8(x, steered_ids, weights, w13, w13_scale, w2, w2_scale, act_quant, config=config, shared=shared,
                   router=router, router_ids=ids, norm=norm)


class ResidualNorm(NamedTuple):
    """The residual add and RMSNorm before a MoE layer (``fxglm5::add_rms_norm_moe_router_fp8_shared``): the sum
    x + residual into ``total`` (the next residual) and its RMSNorm by ``weight`` into ``normed`` (the MoE's tokens),
    both contiguous in x's shape, as ``norm_rope.add_rms_norm`` writes them."""
    x: torch.Tensor
    residual: torch.Tensor
    weight: torch.Tensor
    eps: float
    normed: torch.Tensor
    total: torch.Tensor

    def launch(self) -> tuple[int, tuple, dict]:
        """``norm_rope.add_rms_norm_launch``'s (rows, arguments of ``add_rms_norm_row`` but the row, constexprs)."""
        return add_rms_norm_launch(self.x, self.residual, self.weight, self.eps, (self.normed, self.total))

    def run(self) -> None:
        """Its own kernel (``norm_rope.add_rms_norm``), where it does not join the MoE's first launch."""
        add_rms_norm(self.x, self.residual, self.weight, self.eps, validate=False, out=(self.normed, self.total))


def add_rms_norm_moe_router_fp8(x, residual, norm_weight, eps, router: Router, w13, w13_scale, w2, w2_scale,
                                act_quant=True, *, shared=None, config=None, steered_ids=None):
    """``fxglm5::add_rms_norm_moe_router_fp8_shared`` (with ``shared``): ``(moe_router_fp8(normed.reshape(-1, H)),
    total)`` of ``normed, total = add_rms_norm(x, residual, norm_weight, eps)``, x and residual [..., H] of one dtype.
    Where the MoE's first launch is a launch of tasks with the router (:func:`router_joins`: up to 16 tokens, decode)
    and the shared expert's gate|up GEMM joins it, the add and norm are its first tasks, a token row each
    (:func:`_router_gate_up_kernel`): a decode MoE layer, its norm included, in two launches, each output the bits
    of the separate launches (``add_rms_norm``'s kernel shares its row function, whose sums run in an order no warp
    count changes). Elsewhere (prefill) ``add_rms_norm``'s kernel, then :func:`moe_router_fp8`'s launches.
    ``steered_ids``: :func:`moe_router_fp8`'s (benchmarks only)."""
    validate_add_rms_norm(x, residual, norm_weight, eps)
    if x.dtype != residual.dtype:
        raise InputError(f"add_rms_norm_moe_router_fp8: x is {x.dtype}, the residual {residual.dtype} (one dtype: "
                         f"the MoE's tokens)")
    normed, total = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for _ in range(2))
    norm = ResidualNorm(x, residual, norm_weight, float(eps), normed, total)
    out = moe_router_fp8(normed.view(-1, x.shape[-1]), router, w13, w13_scale, w2, w2_scale, act_quant,
                         shared=shared, config=config, steered_ids=steered_ids, norm=norm)
    return out, total
