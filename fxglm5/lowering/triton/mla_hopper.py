"""MLA on Hopper in Gluon: dense and sparse, bf16 and FP8 (ds_mla) caches, the QK^T split across warpgroups.

Same semantics as :mod:`fxglm5.lowering.triton.mla` (the reference is
:func:`fxglm5.lowering.reference.paged.mla_paged` / ``sparse_mla_paged``) for up to 64 heads (GLM-5's 64, or a
tensor-parallel shard of them); :func:`supported` says when it applies and ``launch_mla`` picks it then. Above
16 heads the heads are the 64 MMA rows (padded) as below; up to 16 (a TP4 / TP8 rank) the keys of a tile are the
MMA rows and the heads, padded to 8 or 16, the MMAs' N (:func:`rows_for`): S^T = K Q^T, O^T = V^T P^T on one
warpgroup, the same loop, so 8 heads do not pay for the 64-head MMA work. It exists because of one layout decision Triton 3.6 makes for
the generic kernel (docs/perf/attention_notes.md, "Duplicated QK^T"): a QK^T whose result feeds
P @ V in the same loop gets all 8 warps along its 64 rows, so both warpgroups issue the same QK^T MMAs. Gluon
states the layouts:

- S = Q K^T [64 heads x 64 keys] is laid out ``warps_per_cta=[4, 2]``: each warpgroup computes 32 of the 64
  key columns (once), and the row max / sum cross the warpgroups through shared memory;
- P goes to shared memory once and both warpgroups read it as the A operand of P @ V, each for its own half of
  every 256-column latent half (``[4, 2]`` over [64 x 256], two accumulators);
- the queries (64 x 576) stay in shared memory for the whole program; cache tiles arrive in a ring of two
  stages: TMA boxes for dense attention (a tile is 64 rows of one cache block), cp.async gathers through the
  block table for sparse attention (invalid rows zero-filled);
- FP8 rows (512 e4m3 values, four power-of-two scales, 64 bf16 rope values) arrive as they are stored; the
  warps dequantize a tile into one bf16 buffer that both MMAs read, which frees the stage early, so FP8 keeps
  two tiles in flight (bf16 one);
- the MMAs are asynchronous, and the loop order is the one measured fastest (see the kernel).

Up to 16 tokens with W_UV (decode), ``_mla_hopper_project_kernel`` runs this kernel's programs as the split tasks of
a launch of tasks (:mod:`fxglm5.lowering.triton.tasks`, whose @triton.jit helpers Gluon compiles as they are) and
the combine with W_UV as its last tasks, in Gluon (:func:`_project_tile`: Triton's combine tile cannot be called
from Gluon, whose ``arange`` and ``zeros`` need layouts): one launch where there were two.

Gluon kernels do not run under ``TRITON_INTERPRET=1``, so this path is checked on the GPU only
(tests/gpu/test_gpu_attention.py, against the reference op and the Triton kernel); the Triton kernel stays the
CPU-tested path and the fallback for every other shape, dtype and device.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from fxglm5.lowering.triton import tasks
from fxglm5.lowering.triton.device import capability, gluon_pdl_prologue, pdl

__all__ = ["supported", "launch", "project_supported", "launch_project"]

MAX_HEADS = 64  # the MMA rows of one program
SMALL_HEADS = 16  # up to this many heads, the keys are the MMA rows (:func:`rows_for`)
BLOCK_N = 64
STAGES = 2


def rows_for(H: int, keys_as_rows: bool | None = None) -> tuple[int, bool]:
    """(padded head count, keys as MMA rows) of a launch for H heads. With the heads as the 64 MMA rows, a
    tensor-parallel shard of 8 heads would do the 64-head MMA work for an eighth of the output; up to
    ``SMALL_HEADS`` heads the kernel makes the 64 keys of a tile the MMA rows and the heads, padded to 8 or 16,
    the N of the MMAs (one warpgroup). ``keys_as_rows`` forces either form (up to 16 heads for the keys)."""
    if keys_as_rows is None:
        keys_as_rows = H <= SMALL_HEADS
    if keys_as_rows and H > SMALL_HEADS:
        raise ValueError(f"mla_hopper: keys as MMA rows serve up to {SMALL_HEADS} heads, not {H}")
    return (8 if H <= 8 else 16, True) if keys_as_rows else (MAX_HEADS, False)


def supported(q, cache, *, sparse: bool) -> bool:
    """Shapes, dtypes and devices the Hopper kernel serves (everything else takes the Triton kernel)."""
    return (q.is_cuda and capability(q.device) == (9, 0)
            and q.dtype == torch.bfloat16 and cache.dtype in (torch.bfloat16, torch.uint8) and q.shape[1] <= MAX_HEADS
            and q.shape[2] == 576 and q.stride(2) == 1 and (sparse or cache.shape[1] % BLOCK_N == 0)
            and cache.is_contiguous() and cache.data_ptr() % 16 == 0)


@gluon.constexpr_function
def _query_layout(NW):
    """Register layout of the queries on their way to shared memory: 16-byte loads along a row's columns."""
    return gl.BlockedLayout([1, 8], [4, 8], [NW, 1], [1, 0])


@gluon.jit
def _stage_query_rows(row_ptr, keep, qa_s, qb_s, qpe_s, NW: gl.constexpr):
    """Each MMA row's 576 queries (from ``row_ptr``, a row-indexed vector of ``_query_layout``) -> three
    shared-memory operands [rows, 256 / 64] (latent halves and rope); rows not kept are zeros, computed and never
    stored. Also the operand staging of the sparse prefill tile (:mod:`fxglm5.lowering.triton.sparse_mla_tile_hopper`),
    whose rows are tokens x heads."""
    ld: gl.constexpr = _query_layout(NW)
    c = gl.arange(0, 256, layout=gl.SliceLayout(0, ld))
    cp = gl.arange(0, 64, layout=gl.SliceLayout(0, ld))
    base = row_ptr[:, None]
    hm = keep[:, None]
    qa_s.store(gl.load(base + c[None, :], mask=hm, other=0.0))
    qb_s.store(gl.load(base + 256 + c[None, :], mask=hm, other=0.0))
    qpe_s.store(gl.load(base + 512 + cp[None, :], mask=hm, other=0.0))


@gluon.jit
def _stage_queries(q_ptr, q_row, stride_qh, H, qa_s, qb_s, qpe_s, ROWS: gl.constexpr, NW: gl.constexpr):
    """The H x 576 queries of one token -> three shared-memory operands [ROWS, 256 / 64] (latent halves and
    rope); rows past H (fewer heads, e.g. a tensor-parallel shard) are zeros, computed and never stored."""
    h = gl.arange(0, ROWS, layout=gl.SliceLayout(1, _query_layout(NW)))
    _stage_query_rows(q_ptr + q_row + h * stride_qh, h < H, qa_s, qb_s, qpe_s, NW)


@gluon.constexpr_function
def _rows_layout(VEC, NW):
    """Register layout of a [64, n] tile of cache rows over NW warps: VEC contiguous elements (16 bytes) per
    thread, 4 x NW rows a pass. Every row-indexed vector of the kernel's copies lives in its row slice, which is
    the same for any VEC."""
    return gl.BlockedLayout([1, VEC], [4, 8], [NW, 1], [1, 0])


@gluon.constexpr_function
def _key_axis(keys_as_rows):
    """The axis of the scores S (and the one reduced in the softmax) that runs over keys: 1 when the MMA rows
    are the heads (S = Q K^T, [heads, keys]), 0 when they are the keys (S^T = K Q^T, [keys, heads])."""
    return 0 if keys_as_rows else 1


@gluon.constexpr_function
def _score_layout(keys_as_rows, rows):
    """S's register layout. Heads as rows: two warpgroups, 32 key columns each. Keys as rows: one warpgroup,
    N = the padded head count."""
    if keys_as_rows:
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, rows, 16])
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16])


@gluon.constexpr_function
def _out_layout(keys_as_rows, rows):
    """The output accumulators' layout: [heads, 256] at 128 columns a warpgroup, or O^T [256, heads] on one
    warpgroup (4 MMA row blocks)."""
    if keys_as_rows:
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, rows, 16])
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 128, 16])


@gluon.jit
def _tile_rows(j, start, end, t64, req, bt_ptr, stride_bt, pos_ptr, stride_pt, BS: gl.constexpr,
               BLOCK: gl.constexpr, SPARSE: gl.constexpr, NW: gl.constexpr):
    """Where tile ``j``'s rows are in the cache. Dense: the first row (a tile lies inside one cache block);
    sparse: the slot of every listed position and whether it is valid. These are dependent global loads (list,
    then block table), so the kernel issues them for a later tile while this tile's QK^T runs."""
    if SPARSE:
        offs = start + j * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, _rows_layout(8, NW)))
        inside = offs < end
        p = gl.load(pos_ptr + t64 * stride_pt + offs, mask=inside, other=-1)
        valid = inside & (p >= 0)
        p = gl.maximum(p, 0)
        slot = gl.load(bt_ptr + req * stride_bt + p // BS, mask=valid, other=0).to(gl.int64) * BS + (p % BS)
        return slot, valid
    else:
        n0 = start + j * BLOCK  # past the split for the tiles after the last: not read (the table may end)
        return gl.load(bt_ptr + req * stride_bt + n0 // BS, mask=n0 < end, other=0).to(gl.int64) * BS + (n0 % BS), n0


@gluon.jit
def _copy_boxes(d_lat, d_pe, d_sc, r, bar, la, lb, pe, sc, FP8: gl.constexpr, PE_COL: gl.constexpr):
    """The TMA boxes of one tile at descriptor row ``r``: two latent halves, the rope columns, FP8 scales."""
    tma.async_copy_global_to_shared(d_lat, [r, 0], bar, la)
    tma.async_copy_global_to_shared(d_lat, [r, 256], bar, lb)
    tma.async_copy_global_to_shared(d_pe, [r, PE_COL], bar, pe)
    if FP8:
        tma.async_copy_global_to_shared(d_sc, [r, 128], bar, sc)


@gluon.jit
def _row_descs(lat_ptr, pe_ptr, sc_ptr, row0, n_rows, lat_l: gl.constexpr, pe_l: gl.constexpr,
               sc_l: gl.constexpr, BLOCK: gl.constexpr, FP8: gl.constexpr):
    """TMA descriptors over cache rows row0 .. row0 + n_rows - 1 (rows past them read as zeros): the latent
    (576 bf16 / 656 bytes a row), the rope (bf16 view) and the FP8 scales (fp32 view)."""
    LAT_W: gl.constexpr = 656 if FP8 else 576
    PE_W: gl.constexpr = 328 if FP8 else 576
    d_lat = tma.make_tensor_descriptor(lat_ptr + row0 * LAT_W, shape=[n_rows, LAT_W], strides=[LAT_W, 1],
                                       block_shape=[BLOCK, 256], layout=lat_l)
    d_pe = tma.make_tensor_descriptor(pe_ptr + row0 * PE_W, shape=[n_rows, PE_W], strides=[PE_W, 1],
                                      block_shape=[BLOCK, 64], layout=pe_l)
    if FP8:
        d_sc = tma.make_tensor_descriptor(sc_ptr + row0 * 164, shape=[n_rows, 164], strides=[164, 1],
                                          block_shape=[BLOCK, 4], layout=sc_l)
    else:
        d_sc = d_pe  # no scales
    return d_lat, d_pe, d_sc


@gluon.jit
def _gather_part(dst, ptr, W: gl.constexpr, slot, valid, col0, NCOL: gl.constexpr, VEC: gl.constexpr,
                 NW: gl.constexpr):
    """Asynchronous 16-byte copies of columns col0 .. col0+NCOL-1 of the listed rows (row stride W elements)
    into ``dst``; invalid rows are zero-filled (cp.async with a zero source size), so they add nothing."""
    lay: gl.constexpr = _rows_layout(VEC, NW)
    slot = gl.convert_layout(slot, gl.SliceLayout(1, lay))
    valid = gl.convert_layout(valid, gl.SliceLayout(1, lay))
    c = gl.arange(0, NCOL, layout=gl.SliceLayout(0, lay))
    async_copy.async_copy_global_to_shared(dst, ptr + slot[:, None] * W + col0 + c[None, :], mask=valid[:, None])


@gluon.jit
def _issue_tile(rows, j, n_full, end, lat_ptr, pe_ptr, sc_ptr, descs, la_s, lb_s, pe_s, sc_s, ready,
                lat_l: gl.constexpr, pe_l: gl.constexpr, sc_l: gl.constexpr, BLOCK: gl.constexpr,
                STAGES_: gl.constexpr, SPARSE: gl.constexpr, FP8: gl.constexpr, NW: gl.constexpr):
    """Start copying tile ``j`` (located by :func:`_tile_rows`) into its stage. Sparse: cp.async gathers, one
    commit group per tile. Dense: TMA boxes; a full tile through the cache-wide descriptors, the ragged last
    tile through descriptors that end at the last valid row, so TMA zero-fills the rest (rows past the
    sequence may hold stale bytes, NaN included, that P @ V would otherwise multiply by 0)."""
    s = j % STAGES_
    PE_COL: gl.constexpr = 264 if FP8 else 512
    if SPARSE:
        slot, valid = rows
        LAT_W: gl.constexpr = 656 if FP8 else 576
        LAT_VEC: gl.constexpr = 16 if FP8 else 8
        _gather_part(la_s.index(s), lat_ptr, LAT_W, slot, valid, 0, 256, LAT_VEC, NW)
        _gather_part(lb_s.index(s), lat_ptr, LAT_W, slot, valid, 256, 256, LAT_VEC, NW)
        _gather_part(pe_s.index(s), pe_ptr, 328 if FP8 else 576, slot, valid, PE_COL, 64, 8, NW)
        if FP8:
            _gather_part(sc_s.index(s), sc_ptr, 164, slot, valid, 128, 4, 4, NW)
        async_copy.commit_group()
    else:
        row, n0 = rows
        bar = ready.index(s)
        mbarrier.expect(bar, BLOCK * (656 if FP8 else 1152))
        d_lat, d_pe, d_sc = descs
        if j < n_full:
            _copy_boxes(d_lat, d_pe, d_sc, row.to(gl.int32), bar, la_s.index(s), lb_s.index(s), pe_s.index(s),
                        sc_s.index(s), FP8, PE_COL)
        else:
            t_lat, t_pe, t_sc = _row_descs(lat_ptr, pe_ptr, sc_ptr, row, end - n0, lat_l, pe_l, sc_l, BLOCK, FP8)
            _copy_boxes(t_lat, t_pe, t_sc, 0, bar, la_s.index(s), lb_s.index(s), pe_s.index(s), sc_s.index(s), FP8,
                        PE_COL)


@gluon.jit
def _wait_tile(j, ready, STAGES_: gl.constexpr, SPARSE: gl.constexpr, AHEAD: gl.constexpr):
    """Tile ``j`` is in shared memory and visible to the MMAs. TMA: its barrier. cp.async: every thread's
    copies of it (the AHEAD-1 later tiles' commit groups may stay in flight; past the last tile they are
    empty), a fence to the async proxy, a CTA barrier."""
    if SPARSE:
        async_copy.wait_group(AHEAD - 1)
        fence_async_shared()
        gl.thread_barrier()
    else:
        mbarrier.wait(ready.index(j % STAGES_), (j // STAGES_) & 1)


@gluon.jit
def _tile_mask(j, start, end, t64, pos_ptr, stride_pt, layout: gl.constexpr, BLOCK: gl.constexpr,
               SPARSE: gl.constexpr):
    """Key columns of tile ``j`` that take part: inside the split, and (sparse) listed (>= 0)."""
    offs = start + j * BLOCK + gl.arange(0, BLOCK, layout=layout)
    valid = offs < end
    if SPARSE:
        valid = valid & (gl.load(pos_ptr + t64 * stride_pt + offs, mask=valid, other=-1) >= 0)
    return valid


@gluon.jit
def _dequant(src, sc, G0: gl.constexpr, NW: gl.constexpr):
    """[BLOCK, 256] e4m3 (columns of scale groups G0, G0+1) x their per-row power-of-two scales -> bf16
    registers (exact: the cache writer's scales are powers of two)."""
    lay: gl.constexpr = _rows_layout(16, NW)
    scl: gl.constexpr = _rows_layout(4, NW)
    x = src.load(lay)
    scales = sc.load(scl)
    g = gl.arange(0, 4, layout=gl.SliceLayout(0, scl))
    sa = gl.convert_layout(gl.sum(gl.where(g[None, :] == G0, scales, 0.0), 1), gl.SliceLayout(1, lay))
    sb = gl.convert_layout(gl.sum(gl.where(g[None, :] == G0 + 1, scales, 0.0), 1), gl.SliceLayout(1, lay))
    cols = gl.arange(0, 256, layout=gl.SliceLayout(0, lay))
    s2 = gl.where(cols[None, :] < 128, sa[:, None], sb[:, None])
    # e4m3 -> fp32 -> bf16, both exact: a direct e4m3 -> bf16 cast goes through f16 and F2F.BF16.F16, a
    # quarter-rate conversion that bound the FP8 loop (256 of them a thread per tile); this is full-rate
    # (F2FP.F16.E4M3 unpack, HADD2.F32, F2FP.BF16.F32 pack; tests/kernels/test_mla_hopper_compile.py checks)
    return x.to(gl.float32).to(gl.bfloat16) * s2.to(gl.bfloat16)


@gluon.jit
def _issue_qk(qa_s, qb_s, qpe_s, ka, kb, kpe, s_l: gl.constexpr, BLOCK: gl.constexpr, ROWS: gl.constexpr,
              KEYS_AS_ROWS: gl.constexpr):
    """Issue the scores of one tile over its 576 columns (three asynchronous MMA groups): S = Q K^T
    [ROWS heads, BLOCK keys], or with the keys as MMA rows S^T = K Q^T [BLOCK, ROWS] (the queries as B)."""
    if KEYS_AS_ROWS:
        qk = warpgroup_mma(ka, qa_s.permute((1, 0)), gl.zeros([BLOCK, ROWS], gl.float32, s_l), use_acc=False,
                           is_async=True)
        qk = warpgroup_mma(kb, qb_s.permute((1, 0)), qk, is_async=True)
        qk = warpgroup_mma(kpe, qpe_s.permute((1, 0)), qk, is_async=True)
    else:
        qk = warpgroup_mma(qa_s, ka.permute((1, 0)), gl.zeros([ROWS, BLOCK], gl.float32, s_l), use_acc=False,
                           is_async=True)
        qk = warpgroup_mma(qb_s, kb.permute((1, 0)), qk, is_async=True)
        qk = warpgroup_mma(qpe_s, kpe.permute((1, 0)), qk, is_async=True)
    return qk


@gluon.jit
def _issue_pv(p_s, ka, kb, acc_a, acc_b, KEYS_AS_ROWS: gl.constexpr):
    """Issue the two latent halves' P @ V (two asynchronous MMA groups); with the keys as rows O^T = V^T P^T, the
    latent tile as a transposed (M-major) A operand and P [heads, keys] as B."""
    if KEYS_AS_ROWS:
        acc_a = warpgroup_mma(ka.permute((1, 0)), p_s.permute((1, 0)), acc_a, is_async=True)
        acc_b = warpgroup_mma(kb.permute((1, 0)), p_s.permute((1, 0)), acc_b, is_async=True)
    else:
        acc_a = warpgroup_mma(p_s, ka, acc_a, is_async=True)
        acc_b = warpgroup_mma(p_s, kb, acc_b, is_async=True)
    return acc_a, acc_b


@gluon.jit
def _online_softmax(qk, valid, m_i, l_i, sm_scale_log2, SPARSE: gl.constexpr, KA: gl.constexpr):
    """Masked online-softmax step in the exp2 domain over the key axis KA of the scores -> (P, rescale of the
    running output, new max, new sum)."""
    qk = gl.where(gl.expand_dims(valid, 1 - KA), qk * sm_scale_log2, float("-inf"))
    return _softmax_update(qk, m_i, l_i, SPARSE, KA)


@gluon.jit
def _softmax_update(qk, m_i, l_i, SPARSE: gl.constexpr, KA: gl.constexpr):
    """The online-softmax step over scores already scaled to the exp2 domain and masked (-inf) -> (P, rescale of
    the running output, new max, new sum). SPARSE: a row may have seen no key yet (its max -inf), whose weights
    and rescale are then 0, not NaN. Also the sparse prefill tile's step (its scores carry log2 of each count)."""
    m_new = gl.maximum(m_i, gl.max(qk, KA))
    if SPARSE:  # a sparse tile may list no valid key
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_safe = m_new
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(qk - gl.expand_dims(m_safe, KA))
    return p, alpha, m_new, l_i * alpha + gl.sum(p, KA)


@gluon.jit
def _store_rows(ptr, rows, hmask, acc, col0, layout: gl.constexpr, KA: gl.constexpr):
    """Store the heads ``hmask`` of an output half at ``ptr + rows[h] + col0 + c`` (int64 rows); the half is
    [heads, 256] (KA = 1) or O^T [256, heads] (KA = 0): its columns run along axis KA."""
    c = gl.arange(0, 256, layout=gl.SliceLayout(1 - KA, layout))
    gl.store(ptr + gl.expand_dims(rows, KA) + col0 + gl.expand_dims(c, 1 - KA), acc.to(ptr.dtype.element_ty),
             mask=gl.expand_dims(hmask, KA))


@gluon.jit
def _allocate_buffers(ROWS: gl.constexpr, BLOCK: gl.constexpr, STAGES_: gl.constexpr, FP8: gl.constexpr):
    """The shared memory of a program over ROWS query rows (:func:`_mla_split`, the sparse prefill tile): the queries'
    latent halves and rope, the ring of STAGES_ cache tiles (latent halves, rope; FP8: their scales and the one
    dequantized bf16 tile both MMAs read, else the ring's own tiles) and P."""
    lat_dt: gl.constexpr = gl.float8e4nv if FP8 else gl.bfloat16
    lat_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, 256], lat_dt)
    kv_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, 256], gl.bfloat16)
    pe_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, 64], gl.bfloat16)
    sc_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    qlat_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, 256], gl.bfloat16)
    qpe_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, 64], gl.bfloat16)
    p_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK], gl.bfloat16)
    qa_s = gl.allocate_shared_memory(gl.bfloat16, [ROWS, 256], qlat_l)
    qb_s = gl.allocate_shared_memory(gl.bfloat16, [ROWS, 256], qlat_l)
    qpe_s = gl.allocate_shared_memory(gl.bfloat16, [ROWS, 64], qpe_l)
    la_s = gl.allocate_shared_memory(lat_dt, [STAGES_, BLOCK, 256], lat_l)
    lb_s = gl.allocate_shared_memory(lat_dt, [STAGES_, BLOCK, 256], lat_l)
    pe_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES_, BLOCK, 64], pe_l)
    if FP8:  # the scales' ring, and the one dequantized bf16 tile both MMAs read
        sc_s = gl.allocate_shared_memory(gl.float32, [STAGES_, BLOCK, 4], sc_l)
        ka_s = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK, 256], kv_l)
        kb_s = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK, 256], kv_l)
    else:
        sc_s = pe_s  # unused
        ka_s = la_s
        kb_s = lb_s
    p_s = gl.allocate_shared_memory(gl.bfloat16, [ROWS, BLOCK], p_l)
    return qa_s, qb_s, qpe_s, la_s, lb_s, pe_s, sc_s, ka_s, kb_s, p_s


@gluon.jit
def _mla_split(
    t, sp, q_ptr, stride_qt, stride_qh, H,
    lat_ptr, pe_ptr, sc_ptr, bt_ptr, stride_bt, req_ptr, pos_ptr, stride_pt, K,
    o_ptr, stride_ot, stride_oh, po_ptr, plse_ptr,
    sm_scale_log2, split_len, num_splits, n_rows,
    BS: gl.constexpr, DIRECT: gl.constexpr, SPARSE: gl.constexpr, FP8: gl.constexpr, BLOCK: gl.constexpr,
    STAGES_: gl.constexpr, ROWS: gl.constexpr, KEYS_AS_ROWS: gl.constexpr,
):
    """Token ``t`` over split ``sp`` of its keys, every head: the output (DIRECT) or the split's normalized partial
    and log-sum-exp. The body of :func:`_mla_hopper_kernel` and of :func:`_mla_hopper_project_kernel`'s split
    tasks."""
    # heads as MMA rows (ROWS = 64, two warpgroups) or, for a few heads, keys as MMA rows (one warpgroup, the
    # ROWS padded heads as N): the same loop either way, the scores and outputs transposed
    NW: gl.constexpr = 4 if KEYS_AS_ROWS else 8
    KA: gl.constexpr = _key_axis(KEYS_AS_ROWS)
    s_l: gl.constexpr = _score_layout(KEYS_AS_ROWS, ROWS)
    o_l: gl.constexpr = _out_layout(KEYS_AS_ROWS, ROWS)
    lat_dt: gl.constexpr = gl.float8e4nv if FP8 else gl.bfloat16
    lat_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, 256], lat_dt)
    pe_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, 64], gl.bfloat16)
    sc_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    # tiles copied ahead: a bf16 stage is read by P @ V until the next tile's MMAs; an FP8 stage only until its
    # dequantization and QK^T, so FP8 issues the tile after next at that point
    AHEAD: gl.constexpr = 2 if FP8 else 1

    t64 = t.to(gl.int64)
    req = gl.load(req_ptr + t).to(gl.int64)
    if SPARSE:
        n_total = K
    else:
        n_total = gl.load(pos_ptr + t).to(gl.int32) + 1
    start = sp * split_len
    end = gl.minimum(start + split_len, n_total)
    n_keys = gl.maximum(end - start, 0)
    n_full = n_keys // BLOCK
    n_tiles = (n_keys + BLOCK - 1) // BLOCK

    qa_s, qb_s, qpe_s, la_s, lb_s, pe_s, sc_s, ka_s, kb_s, p_s = _allocate_buffers(ROWS, BLOCK, STAGES_, FP8)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES_, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES_):
        mbarrier.init(ready.index(i), count=1)

    descs = _row_descs(lat_ptr, pe_ptr, sc_ptr, 0, n_rows, lat_l, pe_l, sc_l, BLOCK, FP8)
    for i in gl.static_range(AHEAD):
        if i < n_tiles:
            _issue_tile(_tile_rows(i, start, end, t64, req, bt_ptr, stride_bt, pos_ptr, stride_pt, BS, BLOCK, SPARSE,
                                   NW),
                        i, n_full, end, lat_ptr, pe_ptr, sc_ptr, descs, la_s, lb_s, pe_s, sc_s, ready, lat_l, pe_l,
                        sc_l, BLOCK, STAGES_, SPARSE, FP8, NW)
        elif SPARSE:
            async_copy.commit_group()  # an empty group keeps one group per tile for _wait_tile
    _stage_queries(q_ptr, t64 * stride_qt, stride_qh, H, qa_s, qb_s, qpe_s, ROWS, NW)
    fence_async_shared()
    gl.thread_barrier()

    m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(KA, s_l))
    l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(KA, s_l))
    if KEYS_AS_ROWS:
        acc_a = gl.zeros([256, ROWS], gl.float32, o_l)
        acc_b = gl.zeros([256, ROWS], gl.float32, o_l)
    else:
        acc_a = gl.zeros([ROWS, 256], gl.float32, o_l)
        acc_b = gl.zeros([ROWS, 256], gl.float32, o_l)
    # Per tile j: P @ V of tile j-1 is issued first, so it runs while tile j may still be arriving (decode is
    # bound by the cache read); FP8 then dequantizes tile j into the bf16 tile; then QK^T of tile j; while
    # it runs, the mask of tile j and the location of tile j+AHEAD are loaded, and as soon as the stage that
    # tile reuses is free (bf16: after P @ V of tile j-1, while QK^T still runs) its copy is issued. (Issuing
    # P @ V behind QK^T instead, under the softmax, measured 920 vs 732 us at B=64 / 32k:
    # bench/results/mla_loop_ordering_9b92938/loop_ordering.json.) Tile 0 has no P @ V before it, the last one's follows the
    # loop, so no MMA is in flight across the loop's back edge (ptxas would serialize the MMAs otherwise).
    for j in range(n_tiles):
        s = j % STAGES_
        kv = 0 if FP8 else s
        if j > 0:
            prev = 0 if FP8 else (j - 1) % STAGES_
            acc_a, acc_b = _issue_pv(p_s, ka_s.index(prev), kb_s.index(prev), acc_a, acc_b, KEYS_AS_ROWS)
            # FP8 waits at once: the dequantization overwrites the bf16 tile this P @ V reads (dequantizing into
            # registers meanwhile took 255 registers, and ptxas serialized the MMAs)
            acc_a, acc_b = warpgroup_mma_wait(num_outstanding=0 if FP8 else 2, deps=(acc_a, acc_b))
        _wait_tile(j, ready, STAGES_, SPARSE, AHEAD)
        if FP8:
            gl.thread_barrier()  # both warpgroups are done with the bf16 tile (P @ V of tile j-1)
            ka_s.index(0).store(_dequant(la_s.index(s), sc_s.index(s), 0, NW))
            kb_s.index(0).store(_dequant(lb_s.index(s), sc_s.index(s), 2, NW))
            fence_async_shared()
            gl.thread_barrier()
        qk = _issue_qk(qa_s, qb_s, qpe_s, ka_s.index(kv), kb_s.index(kv), pe_s.index(s), s_l, BLOCK, ROWS,
                       KEYS_AS_ROWS)
        valid = _tile_mask(j, start, end, t64, pos_ptr, stride_pt, gl.SliceLayout(1 - KA, s_l), BLOCK, SPARSE)
        nxt = _tile_rows(j + AHEAD, start, end, t64, req, bt_ptr, stride_bt, pos_ptr, stride_pt, BS, BLOCK, SPARSE,
                         NW)
        if FP8:  # the next copy reuses this tile's stage, whose rope columns QK^T reads
            qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))
        else:  # the next copy reuses tile j-1's stage: free once P @ V of tile j-1 is done, QK^T may still run
            acc_a, acc_b = warpgroup_mma_wait(num_outstanding=3, deps=(acc_a, acc_b))
        gl.thread_barrier()  # both warpgroups are done with the stage the next copy goes to, and with P
        if j + AHEAD < n_tiles:
            _issue_tile(nxt, j + AHEAD, n_full, end, lat_ptr, pe_ptr, sc_ptr, descs, la_s, lb_s, pe_s, sc_s, ready,
                        lat_l, pe_l, sc_l, BLOCK, STAGES_, SPARSE, FP8, NW)
        elif SPARSE:
            async_copy.commit_group()
        qk, acc_a, acc_b = warpgroup_mma_wait(num_outstanding=0, deps=(qk, acc_a, acc_b))
        p, alpha, m_i, l_i = _online_softmax(qk, valid, m_i, l_i, sm_scale_log2, SPARSE, KA)
        alpha_o = gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(KA, o_l)), KA)
        acc_a = acc_a * alpha_o
        acc_b = acc_b * alpha_o
        if KEYS_AS_ROWS:  # P^T [keys, heads] -> P [heads, keys], the B operand's K-major tile
            p_s.store(gl.permute(p.to(gl.bfloat16), (1, 0)))
        else:
            p_s.store(p.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
    if n_tiles > 0:
        last = 0 if FP8 else (n_tiles - 1) % STAGES_
        acc_a, acc_b = _issue_pv(p_s, ka_s.index(last), kb_s.index(last), acc_a, acc_b, KEYS_AS_ROWS)
        acc_a, acc_b = warpgroup_mma_wait(num_outstanding=0, deps=(acc_a, acc_b))
    for i in gl.static_range(STAGES_):
        mbarrier.invalidate(ready.index(i))

    l_safe = gl.where(l_i > 0.0, l_i, 1.0)
    inv = gl.expand_dims(gl.convert_layout(1.0 / l_safe, gl.SliceLayout(KA, o_l)), KA)
    heads = gl.arange(0, ROWS, layout=gl.SliceLayout(KA, o_l)).to(gl.int64)
    hmask = heads < H
    if DIRECT:
        rows = t64 * stride_ot + heads * stride_oh
        _store_rows(o_ptr, rows, hmask, acc_a * inv, 0, o_l, KA)
        _store_rows(o_ptr, rows, hmask, acc_b * inv, 256, o_l, KA)
    else:  # the combine kernel's partial layout: [T, num_splits, H, 512] and [T, num_splits, H]
        base = (t64 * num_splits + sp) * H + heads
        _store_rows(po_ptr, base * 512, hmask, acc_a * inv, 0, o_l, KA)
        _store_rows(po_ptr, base * 512, hmask, acc_b * inv, 256, o_l, KA)
        lse = gl.where(l_i > 0.0, m_i + gl.log2(l_safe), float("-inf"))
        lse_heads = gl.arange(0, ROWS, layout=gl.SliceLayout(KA, s_l)).to(gl.int64)
        gl.store(plse_ptr + (t64 * num_splits + sp) * H + lse_heads, lse, mask=lse_heads < H)


@gluon.jit
def _mla_hopper_kernel(
    q_ptr, stride_qt, stride_qh, H,
    lat_ptr, pe_ptr, sc_ptr, bt_ptr, stride_bt, req_ptr, pos_ptr, stride_pt, K,
    o_ptr, stride_ot, stride_oh, po_ptr, plse_ptr,
    sm_scale_log2, split_len, num_splits, n_rows,
    BS: gl.constexpr, DIRECT: gl.constexpr, SPARSE: gl.constexpr, FP8: gl.constexpr, BLOCK: gl.constexpr,
    STAGES_: gl.constexpr, ROWS: gl.constexpr, KEYS_AS_ROWS: gl.constexpr, PDL: gl.constexpr,
):
    gluon_pdl_prologue(PDL)
    _mla_split(gl.program_id(0), gl.program_id(1), q_ptr, stride_qt, stride_qh, H, lat_ptr, pe_ptr, sc_ptr, bt_ptr,
               stride_bt, req_ptr, pos_ptr, stride_pt, K, o_ptr, stride_ot, stride_oh, po_ptr, plse_ptr, sm_scale_log2,
               split_len, num_splits, n_rows, BS, DIRECT, SPARSE, FP8, BLOCK, STAGES_, ROWS, KEYS_AS_ROWS)


MMA_ROWS = gl.constexpr(16)  # the tokens of a combine tile, padded to mma_v2's M


@gluon.constexpr_function
def _merge_layout(TB, SC, BKM, NW):
    """[TB tokens, SC splits, BKM latent columns] partial tiles: 16-byte loads along the columns, the lanes and then
    the warps over the columns, the splits, then the tokens, as far as each extent goes (no thread holds a copy of
    another's values, which at 16 columns took every register)."""
    tk = min(8, BKM // 4)
    ts = min(32 // tk, SC)
    wk = min(NW, BKM // (4 * tk))
    wt = min(NW // wk, max(1, TB // (32 // (tk * ts))))
    return gl.BlockedLayout([1, 1, 4], [32 // (tk * ts), ts, tk], [wt, NW // (wk * wt), wk], [2, 1, 0])


@gluon.constexpr_function
def _chunk_layout(BKM, NW):
    """[rows, BKM] bf16 chunks of W_UV and of the merged rows: 16-byte vectors along the columns."""
    tpc = min(32, BKM // 8)
    return gl.BlockedLayout([1, 8], [32 // tpc, tpc], [NW, 1], [1, 0])


@gluon.constexpr_function
def _project_layout(NW):
    """The projection's accumulator [16 tokens, BV outputs]: mma_v2 (m16n8k16), one n8 column block a warp."""
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, NW], instr_shape=[16, 8])


@gluon.jit
def _project_tile(c, task_ptr, T, H, V, num_splits, po_ptr, plse_ptr, w_ptr, o_ptr, s_w_h, s_w_v, RA: gl.constexpr,
                  RA_PAD: gl.constexpr, TB: gl.constexpr, S_PAD: gl.constexpr, BKM: gl.constexpr, SC: gl.constexpr,
                  BV: gl.constexpr, NW: gl.constexpr):
    """Combine task ``c`` of :func:`_mla_hopper_project_kernel`: head ``c // n_v``, outputs ``BV * (c % n_v) ..`` of
    every token (at most 16). The Gluon form of ``mla._combine_project_tile`` (Gluon cannot call it: Triton's
    ``tl.arange`` and ``tl.zeros`` need a layout here), the same math in another summation order: W_UV[h]'s BV x RA
    slice is copied to shared memory (cp.async, rows past V zero-filled, issued before the task waits for the split
    tasks' signals: ``tasks.wait`` of dependency 0 for all T x num_splits) while the tokens' split partials merge by
    their log-sum-exps (SC splits x BKM latent columns a tile, read from L2: :func:`project_tiles`), each merged row
    rounded to bf16 (where the two launches store it) into a 16-row shared tile (rows past the tokens zero), then
    out[t, h, v] = sum_k o[t, k] W_UV[h, v, k] on the tensor cores (mma_v2, float32 accumulation, one rounding)."""
    n_v = gl.cdiv(V, BV)
    h = c // n_v
    v0 = (c % n_v) * BV
    # W_UV[h, v0 .. v0 + BV, :RA] -> w_s, BKM columns a chunk (rows past V, columns past RA: zeros)
    NCH: gl.constexpr = RA_PAD // BKM
    w_l: gl.constexpr = _chunk_layout(BKM, NW)
    w_s = gl.allocate_shared_memory(gl.bfloat16, [NCH, BV, BKM], gl.SwizzledSharedLayout(8, 1, min(8, BKM // 8),
                                                                                         [1, 0]))
    # the merged rows, the same chunks; unswizzled: the merge stores the tokens' rows alone (no slice may cut a
    # swizzle pattern's rows)
    o_s = gl.allocate_shared_memory(gl.bfloat16, [NCH, MMA_ROWS, BKM], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    wv = v0 + gl.arange(0, BV, layout=gl.SliceLayout(1, w_l))
    wk = gl.arange(0, BKM, layout=gl.SliceLayout(0, w_l))
    w_rows = w_ptr + h.to(gl.int64) * s_w_h + wv.to(gl.int64)[:, None] * s_w_v
    for i in gl.static_range(NCH):
        async_copy.async_copy_global_to_shared(w_s.index(i), w_rows + (i * BKM + wk)[None, :],
                                               mask=(wv < V)[:, None] & ((i * BKM + wk) < RA)[None, :])
    async_copy.commit_group()
    if TB < MMA_ROWS:  # the MMA's rows past the tokens
        for i in gl.static_range(NCH):
            o_s.index(i).store(gl.zeros([MMA_ROWS, BKM], gl.bfloat16, w_l))
    tasks.wait(task_ptr, 0, T * num_splits)  # every split's partial, W_UV's copy in flight meanwhile (and a barrier)

    # the merge weights of each token's splits (mla._split_weights): their max and sum over every split first
    m3: gl.constexpr = _merge_layout(TB, SC, BKM, NW)
    m2: gl.constexpr = gl.SliceLayout(2, m3)
    t = gl.arange(0, TB, layout=gl.SliceLayout(1, m2))
    rows = t.to(gl.int64)[:, None] * num_splits
    tm = (t < T)[:, None]
    sp = gl.arange(0, S_PAD, layout=gl.SliceLayout(0, m2))
    lse = gl.load(plse_ptr + (rows + sp[None, :]) * H + h, mask=tm & (sp < num_splits)[None, :],
                  other=float("-inf"), cache_modifier=".cg")
    m = gl.max(lse, 1)
    m = gl.where(m == float("-inf"), 0.0, m)[:, None]
    wsum = gl.sum(gl.exp2(lse - m), 1)
    den = gl.convert_layout(gl.where(wsum > 0.0, wsum, 1.0), gl.SliceLayout(1, gl.SliceLayout(1, m3)))
    # then, BKM latent columns at a time, the partials of SC splits at a time (at most 32 values a thread)
    sc = gl.arange(0, SC, layout=gl.SliceLayout(0, m2))
    k = gl.arange(0, BKM, layout=gl.SliceLayout(0, gl.SliceLayout(1, m3)))
    for i in range(RA_PAD // BKM):  # loops, not unrolled: one tile of partials in registers at a time
        kk = i * BKM + k
        o = gl.zeros([TB, BKM], gl.float32, gl.SliceLayout(1, m3))
        for s0 in range(0, num_splits, SC):
            base = (rows + (s0 + sc)[None, :]) * H + h  # [TB, SC]
            lse_c = gl.load(plse_ptr + base, mask=tm & ((s0 + sc) < num_splits)[None, :], other=float("-inf"),
                            cache_modifier=".cg")
            w = gl.exp2(lse_c - m)
            po = gl.load(po_ptr + base[:, :, None] * 512 + kk[None, None, :],
                         mask=(w > 0.0)[:, :, None] & (kk < RA)[None, None, :], other=0.0, cache_modifier=".cg")
            o += gl.sum(po * w[:, :, None], 1)
        o_s.index(i).slice(0, TB, 0).store((o / den[:, None]).to(gl.bfloat16))
    async_copy.wait_group(0)
    gl.thread_barrier()  # the merged rows and W_UV's slice in shared memory, for every warp

    acc_l: gl.constexpr = _project_layout(NW)
    acc = gl.zeros([MMA_ROWS, BV], gl.float32, acc_l)
    KC: gl.constexpr = min(64, BKM)
    for i in range(NCH):  # a loop, not unrolled: at most 64 columns of operands in registers at a time
        for j in gl.static_range(BKM // KC):
            a = o_s.index(i).slice(j * KC, KC, 1).load(gl.DotOperandLayout(0, acc_l, 2))
            b = w_s.index(i).slice(j * KC, KC, 1).permute((1, 0)).load(gl.DotOperandLayout(1, acc_l, 2))
            acc = mma_v2(a, b, acc)
    ot = gl.arange(0, MMA_ROWS, layout=gl.SliceLayout(1, acc_l)).to(gl.int64)
    ov = v0 + gl.arange(0, BV, layout=gl.SliceLayout(0, acc_l))
    gl.store(o_ptr + (ot[:, None] * H + h) * V + ov[None, :], acc.to(o_ptr.dtype.element_ty),
             mask=(ot < T)[:, None] & (ov < V)[None, :])


@gluon.jit
def _mla_hopper_project_kernel(
    q_ptr, stride_qt, stride_qh, H,
    lat_ptr, pe_ptr, sc_ptr, bt_ptr, stride_bt, req_ptr, pos_ptr, stride_pt, K,
    po_ptr, plse_ptr, sm_scale_log2, split_len, num_splits, n_rows,
    w_ptr, o_ptr, s_w_h, s_w_v, T, V, task_ptr,
    BS: gl.constexpr, SPARSE: gl.constexpr, FP8: gl.constexpr, BLOCK: gl.constexpr, STAGES_: gl.constexpr,
    ROWS: gl.constexpr, KEYS_AS_ROWS: gl.constexpr, RA: gl.constexpr, RA_PAD: gl.constexpr, TB: gl.constexpr,
    S_PAD: gl.constexpr, BKM: gl.constexpr, SC: gl.constexpr, BV: gl.constexpr, PDL: gl.constexpr,
):
    """The split-KV MLA and its combine with W_UV in one launch of tasks (:mod:`fxglm5.lowering.triton.tasks`; up
    to 16 tokens, ``mla.project_fuses``): tasks [0, T x num_splits) are :func:`_mla_hopper_kernel`'s (token, split)
    programs (:func:`_mla_split`, token by token), each storing its partial and log-sum-exp and then signalling
    dependency 0 (``tasks.signal``, a @triton.jit helper: scalar atomics and a barrier, which Gluon compiles as
    they are); the rest are the (head, V tile) combine tasks (:func:`_project_tile`), each waiting until all
    T x num_splits partials are signalled (its W_UV slice already on its way). A task waits only on tasks before it,
    so the launch cannot deadlock."""
    gluon_pdl_prologue(PDL)
    NW: gl.constexpr = 4 if KEYS_AS_ROWS else 8
    task = tasks.take(task_ptr)
    splits = T * num_splits
    if task < splits:
        _mla_split(task // num_splits, task % num_splits, q_ptr, stride_qt, stride_qh, H, lat_ptr, pe_ptr, sc_ptr,
                   bt_ptr, stride_bt, req_ptr, pos_ptr, stride_pt, K, o_ptr, 0, 0, po_ptr, plse_ptr, sm_scale_log2,
                   split_len, num_splits, n_rows, BS, False, SPARSE, FP8, BLOCK, STAGES_, ROWS, KEYS_AS_ROWS)
        tasks.signal(task_ptr, 0)
    else:
        _project_tile(task - splits, task_ptr, T, H, V, num_splits, po_ptr, plse_ptr, w_ptr, o_ptr, s_w_h, s_w_v, RA,
                      RA_PAD, TB, S_PAD, BKM, SC, BV, NW)
    tasks.finish(task_ptr, 1)


def project_supported(w_uv) -> bool:
    """W_UV [H, V, RA] the Hopper combine tile serves (besides :func:`supported`): bf16, contiguous, RA a multiple
    of 16 (GLM-5: 512), so its rows are whole 16-byte copies."""
    return (w_uv.dtype == torch.bfloat16 and w_uv.is_contiguous() and w_uv.shape[2] % 16 == 0
            and w_uv.data_ptr() % 16 == 0)


def project_tiles(T: int, num_splits: int, RA: int, keys_as_rows: bool) -> dict:
    """The combine tile's constants: every token (at most 16) in one tile, BV outputs a task (32: 8 heads x 8 tiles
    of GLM-5's 256 give 64 tasks, each reading 32 KB of W_UV; 64 at 8 warps: a column block a warp), partial tiles
    [TB tokens, SC splits, BKM latent columns] of at most 32 values a thread (every split at once where they fit,
    with at least 16 columns)."""
    nw = 4 if keys_as_rows else 8
    tb = triton.next_power_of_2(T)
    s_pad = max(2, triton.next_power_of_2(num_splits))
    ra_pad = max(64, triton.next_power_of_2(RA))
    values = 32 * 32 * nw  # 32 a thread
    bkm = max(16, min(ra_pad, values // (tb * s_pad)))
    return dict(RA=RA, RA_PAD=ra_pad, TB=tb, S_PAD=s_pad, BKM=bkm, SC=min(s_pad, values // (tb * bkm)), BV=8 * nw)


def _cache_args(cache, pos_or_topk, sparse: bool):
    """(block size, FP8, the cache's latent / rope / scale views, the top-k lists' row stride and width) of a launch."""
    fp8 = cache.dtype == torch.uint8
    views = ((cache.view(torch.float8_e4m3fn), cache.view(torch.bfloat16), cache.view(torch.float32)) if fp8
             else (cache, cache, cache))
    return cache.shape[1], fp8, views, (pos_or_topk.stride(0), pos_or_topk.shape[1]) if sparse else (0, 0)


def launch_project(q, cache, block_table, req_idx, pos_or_topk, scale_log2: float, split_len: int, num_splits: int,
                   po, plse, w_uv, out, counters, *, sparse: bool, keys_as_rows: bool | None = None):
    """Launch :func:`_mla_hopper_project_kernel`: the (token, split) tasks, then H x ceil(V / BV) combine tasks
    writing the value heads ``out`` [T, H, V]; ``counters``: ``tasks.counters`` (zeros, left zeros)."""
    rows, keys_as_rows = rows_for(q.shape[1], keys_as_rows)
    T, H = q.shape[0], q.shape[1]
    V = w_uv.shape[1]
    bs, fp8, (lat, pe, sc), (stride_pt, K) = _cache_args(cache, pos_or_topk, sparse)
    tiles = project_tiles(T, num_splits, w_uv.shape[2], keys_as_rows)
    grid = (T * num_splits + H * triton.cdiv(V, tiles["BV"]),)
    _mla_hopper_project_kernel[grid](
        q, q.stride(0), q.stride(1), H, lat, pe, sc, block_table, block_table.stride(0), req_idx, pos_or_topk,
        stride_pt, K, po, plse, scale_log2, split_len, num_splits, cache.shape[0] * bs,
        w_uv, out, w_uv.stride(0), w_uv.stride(1), T, V, counters,
        BS=bs, SPARSE=sparse, FP8=fp8, BLOCK=BLOCK_N, STAGES_=STAGES, ROWS=rows, KEYS_AS_ROWS=keys_as_rows, **tiles,
        num_warps=4 if keys_as_rows else 8, **pdl(q.device))


def launch(q, cache, block_table, req_idx, pos_or_topk, scale_log2: float, split_len: int, num_splits: int,
           out, po, plse, *, sparse: bool, direct: bool, keys_as_rows: bool | None = None):
    """One program per (token, split); writes ``out`` directly (``direct``: one split, no W_UV to apply after
    it), else the partials for a combine kernel of :mod:`fxglm5.lowering.triton.mla`. Dense: ``pos_or_topk`` are the query positions;
    sparse: the [T, K] listed positions (-1 = unused). ``keys_as_rows``: see :func:`rows_for`."""
    rows, keys_as_rows = rows_for(q.shape[1], keys_as_rows)
    T = q.shape[0]
    bs, fp8, (lat, pe, sc), (stride_pt, K) = _cache_args(cache, pos_or_topk, sparse)
    _mla_hopper_kernel[(T, num_splits)](
        q, q.stride(0), q.stride(1), q.shape[1], lat, pe, sc, block_table, block_table.stride(0), req_idx, pos_or_topk,
        stride_pt, K, out, out.stride(0), out.stride(1), po, plse,
        scale_log2, split_len, num_splits, cache.shape[0] * bs,
        BS=bs, DIRECT=direct, SPARSE=sparse, FP8=fp8, BLOCK=BLOCK_N, STAGES_=STAGES, ROWS=rows,
        KEYS_AS_ROWS=keys_as_rows, num_warps=4 if keys_as_rows else 8, **pdl(q.device))
