"""Block-FP8 GEMM for Hopper prefill in Gluon: y = x @ W.T with pre-quantized e4m3 activations (1x128 scales)
and e4m3 W (128x128 block scales), the semantics of :mod:`fxglm5.lowering.reference.fp8` (W8A8 path).

Why it exists: the Triton kernel (:mod:`fxglm5.lowering.triton.fp8_gemm`) must wait for each K step's MMA
result and scale it by ``s_a[m] * s_b`` before the next step's MMA may start, so the tensor cores idle during
every promotion. Here the MMAs are asynchronous and the promotion of step i overlaps the MMA of step i+1:

- **Two temporaries.** Step i's wgmma writes ``tmp0``, step i+1's ``tmp1``; after issuing step i+1 the warps
  ``warpgroup_mma_wait(num_outstanding=1)`` (step i done, i+1 still running) and promote
  ``acc += tmp0 * s_a[row] * s_b``, then issue step i+2 into ``tmp0`` and so on. The K loop is unrolled by two
  so each temporary keeps its registers (a loop that swapped them would move in-flight accumulators, and ptxas
  serializes the MMAs then: warnings C7514 / C7515, checked by tests/kernels/test_fp8_gemm_hopper_compile.py),
  and no MMA is in flight across the loop's back edge (that too serialized all of them): a trip runs UNROLL=4
  K steps, so K must be a multiple of 512 (:func:`supported`); every GLM-5 K is.
- **Without warp specialization** (``WS=False``, and the only form of 64-row tiles). All warps issue loads and MMAs: a TMA copy is one instruction of one
  thread and the ring keeps up to ``STAGES`` K steps in flight. The tile is 128 x BLOCK_N over two warpgroups,
  64 rows each (``warps_per_cta=[8, 1]``); a 64-row tile runs on one. The cost: both warpgroups meet a CTA
  barrier at every K step before a stage is refilled, so the faster one waits for the slower.
- **Warp-specialized variant** (config ``WS=True``, 128-row tiles, the default at every width;
  :func:`_fp8_gemm_hopper_ws_kernel`: 1.55x faster than the form above on o_proj at M=4096). One
  load warp runs the ring alone: it waits on a stage's ``empty`` mbarrier, issues the A and W copies, which land
  on its ``ready`` mbarrier. Each 64-row half of the tile is its own MMA warpgroup (the default partition and a
  4-warp worker) running the same two-temporary schedule and releasing a stage with one arrival on ``empty``
  (count 2) once its wait shows the MMA that read it retired, so nothing in the K loop joins the two
  warpgroups; each stores its half of the output tile itself. setmaxnreg gives the MMA warpgroups 240
  registers a thread (acc, tmp0, tmp1 are 192) and the load warp 24 (``MMA_REGS``, ``LOAD_REGS``).
- **TMA ring.** A [BLOCK_M, 128] and W [BLOCK_N, 128] tiles arrive by TMA into a ``STAGES``-deep ring, one
  mbarrier per stage; a stage is refilled once both warpgroups have retired the MMA that read it (the wait
  above, then a CTA barrier). Rows past M or N read as zeros (TMA out-of-bounds fill) and are never stored:
  the output goes out through shared memory by a TMA store, which clips them.
- **Persistent, grouped.** One program per SM walks the tiles ``pid, pid + P, ...`` in grouped (L2-friendly)
  order; the load ring runs over the flattened (tile, K step) sequence, so the first K steps of the next tile
  are already in flight while this tile's epilogue (bias, cast, TMA store) runs.
- **One scale block per step.** BLOCK_N is 64 or 128 and tiles start at multiples of BLOCK_N, so a tile meets
  one weight-scale block per K step: the factor is ``s_a[row] * s_b``, one FMA per accumulator element. The
  activation scales are read per K step from the [M, K/128] scales of ``quantize_act_1x128`` (L2-resident),
  issued before the wait so their latency hides behind the running MMA.

Gluon kernels do not run under ``TRITON_INTERPRET=1``: this path is checked on the GPU (tests/gpu/test_gpu_fp8.py,
against the reference op and the Triton kernel) and compiled for sm_90 in CI; the Triton kernel stays the
CPU-tested path and the fallback for every other shape, dtype and device.
"""

from __future__ import annotations

from typing import Optional

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from fxglm5 import settings
from fxglm5.lowering.triton.device import capability, ensure_tma_allocator, num_sms

__all__ = ["supported", "launch", "pick_config", "MIN_M"]

MIN_M = 512  # prefill only: at fewer rows the Triton kernel's split-K / smaller tiles serve better
BLOCK_K = 128
# Defaults per N (tiles, ring depth, group size, K steps per loop trip, warp specialization), from the H200 sweeps
# of session 20 (bench/results/kernel_goals_ncu_17c1af7/kernels_gluon_ws_17c1af7.md, kernels_gemm_07ef67b.md). Every width takes the
# warp-specialized kernel (WS=True, 128-row tiles): at M=4096 it ran o_proj in 698 against 1084 us, dense gate_up
# in 967 against 1527 us, kv_a (N=576) in 72 against 108 us and the indexer's wk (N=128) in 45 against 53 us of
# the kernel without it (64-row tiles at the narrow widths). 4 stages of 32 KB plus the 32 KB output tile at
# 128 x 128 (5 were no faster, 3 slower); deeper rings where the tiles are narrower. UNROLL=4 (2 exposes every
# other promotion at the loop's back edge).
WIDE = dict(BLOCK_M=128, BLOCK_N=128, STAGES=4, GROUP_M=8, UNROLL=4, WS=True)
NARROW = dict(BLOCK_M=128, BLOCK_N=128, STAGES=6, GROUP_M=8, UNROLL=4, WS=True)  # N <= 1024 (kv_a's 576)
SMALL = dict(BLOCK_M=128, BLOCK_N=64, STAGES=8, GROUP_M=8, UNROLL=4, WS=True)  # N <= 256 (the indexer's wk, 128)
# The WS kernel's register split (setmaxnreg): 12 warps (the default MMA warpgroup, the worker MMA warpgroup, the
# load warp padded to a warpgroup) share 64K registers; each MMA thread holds acc, tmp0 and tmp1 (192 of them),
# the load warp only scalars. The default partition gets what is left (also 240).
MMA_REGS = 240
LOAD_REGS = 24


def pick_config(m: int, n: int, config: Optional[dict] = None) -> dict:
    """Tile shape, ring depth and kernel variant of a launch; ``config`` overrides any key (benchmark sweeps)."""
    cfg = dict(SMALL if n <= 256 else NARROW if n <= 1024 else WIDE)
    cfg.update({k: v for k, v in (config or {}).items() if k in WIDE})
    if cfg["BLOCK_M"] not in (64, 128) or cfg["BLOCK_N"] not in (64, 128) or cfg["UNROLL"] not in (2, 4):
        raise ValueError(f"fp8_gemm_hopper: BLOCK_M and BLOCK_N must be 64 or 128, UNROLL 2 or 4, got {cfg}")
    if cfg["WS"] and cfg["BLOCK_M"] != 128:
        raise ValueError(f"fp8_gemm_hopper: WS=True needs BLOCK_M=128 (one 64-row half per MMA warpgroup), got {cfg}")
    return cfg


def supported(x: torch.Tensor, weight: torch.Tensor, act_quant: bool) -> bool:
    """Inputs the Hopper kernel serves (everything else takes the Triton kernel): an sm_90 CUDA device outside
    the interpreter, the W8A8 path, bf16/fp16 activations of more than MIN_M rows, K a multiple of 512 (the K loop
    takes UNROLL=4 steps of 128 a trip; every GLM-5 K is), N a multiple of 8 (the output's TMA row stride is 16
    bytes aligned), a 16-byte aligned weight (a TMA descriptor's base; the activations and output are fresh allocations)."""
    if settings.triton_interpret() or not (x.is_cuda and weight.is_cuda) or capability(x.device) != (9, 0):
        return False
    n, k = weight.shape
    m = x.numel() // max(k, 1)
    return (act_quant and x.dtype in (torch.bfloat16, torch.float16) and m > MIN_M
            and k % (4 * BLOCK_K) == 0 and n % 8 == 0 and weight.data_ptr() % 16 == 0)


@gluon.jit
def _tile_coords(tile, num_m, num_n, GROUP_M: gl.constexpr):
    """(pid_m, pid_n) of a tile index in grouped order: GROUP_M consecutive tiles share one weight column tile
    while it is in L2."""
    width = GROUP_M * num_n
    first_m = (tile // width) * GROUP_M
    gsize = gl.minimum(num_m - first_m, GROUP_M)
    return first_m + (tile % width) % gsize, (tile % width) // gsize


@gluon.jit
def _issue_load(g, total, pid, nprog, KG, num_m, num_n, a_desc, b_desc, a_s, b_s, ready,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    """Start the TMA copies of this program's flattened step ``g`` (tile ``g // KG`` of its tiles, K step
    ``g % KG``) into stage ``g % STAGES``; nothing past the last step."""
    if g < total:
        pid_m, pid_n = _tile_coords(pid + (g // KG) * nprog, num_m, num_n, GROUP_M)
        k = (g % KG) * 128
        s = g % STAGES
        bar = ready.index(s)
        mbarrier.expect(bar, (BLOCK_M + BLOCK_N) * 128)
        tma.async_copy_global_to_shared(a_desc, [pid_m * BLOCK_M, k], bar, a_s.index(s))
        tma.async_copy_global_to_shared(b_desc, [pid_n * BLOCK_N, k], bar, b_s.index(s))


@gluon.jit
def _issue_mma(c, a_s, b_s, ready, acc_l: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               STAGES: gl.constexpr):
    """Wait for step ``c``'s tiles, issue its asynchronous [BLOCK_M, BLOCK_N] x K=128 MMA into a fresh fp32
    temporary."""
    s = c % STAGES
    mbarrier.wait(ready.index(s), (c // STAGES) & 1)
    return warpgroup_mma(a_s.index(s), b_s.index(s).permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_l),
                         use_acc=False, is_async=True)


@gluon.jit
def _retire(acc, tmp, c, kg, total, pid, nprog, KG, num_m, num_n, a_desc, b_desc, a_s, b_s, ready, as_ptr,
            stride_asm, rows, row_mask, sb_row, PENDING: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
            STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    """Retire step ``c`` (K step ``kg`` of its tile) while ``PENDING`` later MMAs keep running: load its
    factor s_a[row, kg] * s_b[kg] (rows past M: 0) before the wait, wait for its MMA, refill its stage with
    step ``c + STAGES`` once both warpgroups are past the wait, and promote ``acc += tmp * factor``."""
    f = gl.load(as_ptr + rows * stride_asm + kg, mask=row_mask, other=0.0) * gl.load(sb_row + kg)
    tmp = warpgroup_mma_wait(num_outstanding=PENDING, deps=(tmp,))
    gl.thread_barrier()
    _issue_load(c + STAGES, total, pid, nprog, KG, num_m, num_n, a_desc, b_desc, a_s, b_s, ready, BLOCK_M, BLOCK_N,
                STAGES, GROUP_M)
    return acc + tmp * f[:, None]


@gluon.jit
def _fp8_gemm_hopper_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, c_ptr,
    M, N, K, stride_am, stride_asm, stride_bn, stride_bsn, stride_cm,
    HAS_BIAS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    GROUP_M: gl.constexpr, UNROLL: gl.constexpr,
):
    NW: gl.constexpr = BLOCK_M // 16  # one warpgroup per 64 rows
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                    instr_shape=[16, BLOCK_N, 32])
    row_l: gl.constexpr = gl.SliceLayout(1, acc_l)
    col_l: gl.constexpr = gl.SliceLayout(0, acc_l)
    a_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, 128], gl.float8e4nv)
    b_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 128], gl.float8e4nv)
    c_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], c_ptr.dtype.element_ty)

    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    num_m = gl.cdiv(M, BLOCK_M)
    num_n = gl.cdiv(N, BLOCK_N)
    KG = K // 128
    my_tiles = gl.cdiv(num_m * num_n - pid, nprog)
    total = my_tiles * KG

    a_desc = tma.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_am, 1], block_shape=[BLOCK_M, 128],
                                        layout=a_l)
    b_desc = tma.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[stride_bn, 1], block_shape=[BLOCK_N, 128],
                                        layout=b_l)
    c_desc = tma.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[stride_cm, 1], block_shape=[BLOCK_M, BLOCK_N],
                                        layout=c_l)
    a_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_M, 128], a_l)
    b_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, 128], b_l)
    c_s = gl.allocate_shared_memory(c_ptr.dtype.element_ty, [BLOCK_M, BLOCK_N], c_l)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    fence_async_shared()

    for i in gl.static_range(STAGES):
        _issue_load(i, total, pid, nprog, KG, num_m, num_n, a_desc, b_desc, a_s, b_s, ready, BLOCK_M, BLOCK_N,
                    STAGES, GROUP_M)

    for t in range(my_tiles):
        pid_m, pid_n = _tile_coords(pid + t * nprog, num_m, num_n, GROUP_M)
        rows = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_l)
        row_mask = rows < M
        sb_row = bs_ptr + ((pid_n * BLOCK_N) // 128) * stride_bsn
        c0 = t * KG
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_l)
        # UNROLL steps a trip: step c + 2u runs in tmp0, c + 2u + 1 in tmp1, each issued before the other is
        # retired, so the tensor cores have the next step while the warps promote. No MMA is in flight across
        # the loop's back edge: ptxas serializes every MMA of a loop whose in-flight accumulator crosses it.
        for j in range(KG // UNROLL):
            c = c0 + j * UNROLL
            kg = j * UNROLL
            tmp0 = _issue_mma(c, a_s, b_s, ready, acc_l, BLOCK_M, BLOCK_N, STAGES)
            for u in gl.static_range(UNROLL // 2):
                tmp1 = _issue_mma(c + 2 * u + 1, a_s, b_s, ready, acc_l, BLOCK_M, BLOCK_N, STAGES)
                acc = _retire(acc, tmp0, c + 2 * u, kg + 2 * u, total, pid, nprog, KG, num_m, num_n, a_desc, b_desc,
                              a_s, b_s, ready, as_ptr, stride_asm, rows, row_mask, sb_row, 1, BLOCK_M, BLOCK_N,
                              STAGES, GROUP_M)
                if 2 * u + 2 < UNROLL:
                    tmp0 = _issue_mma(c + 2 * u + 2, a_s, b_s, ready, acc_l, BLOCK_M, BLOCK_N, STAGES)
                acc = _retire(acc, tmp1, c + 2 * u + 1, kg + 2 * u + 1, total, pid, nprog, KG, num_m, num_n, a_desc,
                              b_desc, a_s, b_s, ready, as_ptr, stride_asm, rows, row_mask, sb_row,
                              1 if 2 * u + 2 < UNROLL else 0, BLOCK_M, BLOCK_N, STAGES, GROUP_M)
        if HAS_BIAS:
            cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_l)
            acc += gl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(gl.float32)[None, :]
        tma.store_wait(0)  # the previous tile's output has left c_s (the issuing thread waits, then everyone)
        gl.thread_barrier()
        c_s.store(acc.to(c_ptr.dtype.element_ty))
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(c_desc, [pid_m * BLOCK_M, pid_n * BLOCK_N], c_s)
    tma.store_wait(0)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))


@gluon.jit
def _ws_producer(a_desc, b_desc, a_s, b_s, ready, empty, M, N, K, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 STAGES: gl.constexpr, GROUP_M: gl.constexpr):
    """The WS kernel's load warp: walks the program's flattened (tile, K step) sequence, waits until both
    consumer warpgroups have released a stage (``empty``, whose first wait per stage passes: a fresh mbarrier
    counts as having completed the phase before its first), and issues that step's A and W copies, which
    complete on the stage's ``ready`` barrier."""
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    num_m = gl.cdiv(M, BLOCK_M)
    num_n = gl.cdiv(N, BLOCK_N)
    KG = K // 128
    for t in range(gl.cdiv(num_m * num_n - pid, nprog)):
        pid_m, pid_n = _tile_coords(pid + t * nprog, num_m, num_n, GROUP_M)
        for kk in range(KG):
            g = t * KG + kk
            s = g % STAGES
            mbarrier.wait(empty.index(s), ((g // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, (BLOCK_M + BLOCK_N) * 128)
            tma.async_copy_global_to_shared(a_desc, [pid_m * BLOCK_M, kk * 128], bar, a_s.index(s))
            tma.async_copy_global_to_shared(b_desc, [pid_n * BLOCK_N, kk * 128], bar, b_s.index(s))


@gluon.jit
def _ws_mma(c, a_s, b_s, ready, HALF: gl.constexpr, acc_l: gl.constexpr, BLOCK_N: gl.constexpr,
            STAGES: gl.constexpr):
    """Wait for step ``c``'s tiles and issue this warpgroup's asynchronous [64, BLOCK_N] x K=128 MMA (its 64
    rows of the stage's A tile) into a fresh fp32 temporary."""
    s = c % STAGES
    mbarrier.wait(ready.index(s), (c // STAGES) & 1)
    return warpgroup_mma(a_s.index(s).slice(HALF * 64, 64), b_s.index(s).permute((1, 0)),
                         gl.zeros([64, BLOCK_N], gl.float32, acc_l), use_acc=False, is_async=True)


@gluon.jit
def _ws_retire(acc, tmp, c, kg, empty, as_ptr, stride_asm, rows, row_mask, sb_row, PENDING: gl.constexpr,
               STAGES: gl.constexpr):
    """Retire step ``c`` (K step ``kg`` of its tile) while ``PENDING`` later MMAs keep running: load its
    factor s_a[row, kg] * s_b[kg] before the wait, wait for its MMA, release its stage to the producer (one
    arrival of this warpgroup; the stage's barrier completes when both have arrived) and promote.

    The promoted accumulator goes through a second, already satisfied wait (``wgmma.wait_group`` takes its
    registers as operands, a no-op here): without it LLVM sinks every promotion of a loop trip to the trip's end,
    all four temporaries stay live (320 registers) and ptxas spills and serializes the MMAs (C7512). The non-WS
    kernel gets the same ordering from the branch around its refill."""
    f = gl.load(as_ptr + rows * stride_asm + kg, mask=row_mask, other=0.0) * gl.load(sb_row + kg)
    tmp = warpgroup_mma_wait(num_outstanding=PENDING, deps=(tmp,))
    mbarrier.arrive(empty.index(c % STAGES), count=1)
    return warpgroup_mma_wait(num_outstanding=PENDING, deps=(acc + tmp * f[:, None],))


@gluon.jit
def _ws_consumer(a_s, b_s, c_s, ready, empty, c_desc, as_ptr, bs_ptr, bias_ptr, M, N, K, stride_asm, stride_bsn,
                 HALF: gl.constexpr, HAS_BIAS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                 GROUP_M: gl.constexpr, UNROLL: gl.constexpr):
    """One MMA warpgroup of the WS kernel: rows ``HALF * 64 ..`` of every 128-row tile, the two-temporary
    schedule of the non-WS kernel (step c + 1 in flight while step c is promoted, no MMA across the loop's
    back edge), then its own 64-row epilogue through its half of ``c_s`` and a TMA store. It synchronizes with
    nothing but the stage barriers: the other warpgroup may run a step ahead or behind."""
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, BLOCK_N, 32])
    row_l: gl.constexpr = gl.SliceLayout(1, acc_l)
    col_l: gl.constexpr = gl.SliceLayout(0, acc_l)
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    num_m = gl.cdiv(M, 128)
    num_n = gl.cdiv(N, BLOCK_N)
    KG = K // 128
    out_s = c_s.index(HALF)
    for t in range(gl.cdiv(num_m * num_n - pid, nprog)):
        pid_m, pid_n = _tile_coords(pid + t * nprog, num_m, num_n, GROUP_M)
        rows = pid_m * 128 + HALF * 64 + gl.arange(0, 64, layout=row_l)
        row_mask = rows < M
        sb_row = bs_ptr + ((pid_n * BLOCK_N) // 128) * stride_bsn
        c0 = t * KG
        acc = gl.zeros([64, BLOCK_N], gl.float32, acc_l)
        for j in range(KG // UNROLL):
            c = c0 + j * UNROLL
            kg = j * UNROLL
            tmp0 = _ws_mma(c, a_s, b_s, ready, HALF, acc_l, BLOCK_N, STAGES)
            for u in gl.static_range(UNROLL // 2):
                tmp1 = _ws_mma(c + 2 * u + 1, a_s, b_s, ready, HALF, acc_l, BLOCK_N, STAGES)
                acc = _ws_retire(acc, tmp0, c + 2 * u, kg + 2 * u, empty, as_ptr, stride_asm, rows, row_mask, sb_row,
                                 1, STAGES)
                if 2 * u + 2 < UNROLL:
                    tmp0 = _ws_mma(c + 2 * u + 2, a_s, b_s, ready, HALF, acc_l, BLOCK_N, STAGES)
                acc = _ws_retire(acc, tmp1, c + 2 * u + 1, kg + 2 * u + 1, empty, as_ptr, stride_asm, rows, row_mask,
                                 sb_row, 1 if 2 * u + 2 < UNROLL else 0, STAGES)
        if HAS_BIAS:
            cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_l)
            acc += gl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(gl.float32)[None, :]
        tma.store_wait(0)  # this warpgroup's previous tile has left its half of c_s
        gl.thread_barrier()
        out_s.store(acc.to(out_s.dtype))
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(c_desc, [pid_m * 128 + HALF * 64, pid_n * BLOCK_N], out_s)
    tma.store_wait(0)


@gluon.jit
def _fp8_gemm_hopper_ws_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, c_ptr,
    M, N, K, stride_am, stride_asm, stride_bn, stride_bsn, stride_cm,
    HAS_BIAS: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
    UNROLL: gl.constexpr, MMA_REGS: gl.constexpr, LOAD_REGS: gl.constexpr,
):
    """Warp-specialized variant (config ``WS=True``, 128-row tiles): the default partition (4 warps) and one
    4-warp worker are the two MMA warpgroups, a 1-warp worker issues every TMA load; per-stage ``ready``
    (TMA bytes landed) and ``empty`` (both warpgroups retired the MMAs that read it) mbarriers replace the
    non-WS kernel's CTA barrier before each refill."""
    a_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([128, 128], gl.float8e4nv)
    b_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 128], gl.float8e4nv)
    c_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, BLOCK_N], c_ptr.dtype.element_ty)
    a_desc = tma.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_am, 1], block_shape=[128, 128],
                                        layout=a_l)
    b_desc = tma.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[stride_bn, 1], block_shape=[BLOCK_N, 128],
                                        layout=b_l)
    c_desc = tma.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[stride_cm, 1], block_shape=[64, BLOCK_N],
                                        layout=c_l)
    a_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, 128, 128], a_l)
    b_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, 128], b_l)
    c_s = gl.allocate_shared_memory(c_ptr.dtype.element_ty, [2, 64, BLOCK_N], c_l)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # one arrival per MMA warpgroup
    fence_async_shared()
    gl.warp_specialize([
        (_ws_consumer, (a_s, b_s, c_s, ready, empty, c_desc, as_ptr, bs_ptr, bias_ptr, M, N, K, stride_asm,
                        stride_bsn, 0, HAS_BIAS, BLOCK_N, STAGES, GROUP_M, UNROLL)),
        (_ws_consumer, (a_s, b_s, c_s, ready, empty, c_desc, as_ptr, bs_ptr, bias_ptr, M, N, K, stride_asm,
                        stride_bsn, 1, HAS_BIAS, BLOCK_N, STAGES, GROUP_M, UNROLL)),
        (_ws_producer, (a_desc, b_desc, a_s, b_s, ready, empty, M, N, K, 128, BLOCK_N, STAGES, GROUP_M)),
    ], [4, 1], [MMA_REGS, LOAD_REGS])


def launch(a: torch.Tensor, a_s: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
           bias: Optional[torch.Tensor], out: torch.Tensor, config: Optional[dict] = None) -> torch.Tensor:
    """``out [M, N] = (a * a_s) @ (weight * weight_scale_inv).T (+ bias)`` for inputs :func:`supported` accepts:
    ``a, a_s`` from ``quantize_act_1x128``, ``weight`` and ``weight_scale_inv`` contiguous, ``out`` contiguous
    bf16/fp16. One persistent program per SM (fewer if there are fewer tiles); ``config["WS"]`` picks the
    warp-specialized kernel."""
    m, k = a.shape
    n = weight.shape[0]
    cfg = pick_config(m, n, config)
    if k % (BLOCK_K * cfg["UNROLL"]):
        raise ValueError(f"fp8_gemm_hopper: K={k} is not a multiple of {BLOCK_K * cfg['UNROLL']} "
                         f"(UNROLL={cfg['UNROLL']})")
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    tiles = -(-m // bm) * -(-n // bn)
    ensure_tma_allocator()
    args = (a, a_s, weight, weight_scale_inv, bias if bias is not None else out, out,
            m, n, k, a.stride(0), a_s.stride(0), weight.stride(0), weight_scale_inv.stride(0), out.stride(0))
    grid = (min(tiles, num_sms(a.device)),)
    if cfg["WS"]:
        _fp8_gemm_hopper_ws_kernel[grid](*args, HAS_BIAS=bias is not None, BLOCK_N=bn, STAGES=cfg["STAGES"],
                                         GROUP_M=cfg["GROUP_M"], UNROLL=cfg["UNROLL"], MMA_REGS=MMA_REGS,
                                         LOAD_REGS=LOAD_REGS, num_warps=4)
    else:
        _fp8_gemm_hopper_kernel[grid](*args, HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, STAGES=cfg["STAGES"],
                                      GROUP_M=cfg["GROUP_M"], UNROLL=cfg["UNROLL"], num_warps=bm // 16)
    return out
