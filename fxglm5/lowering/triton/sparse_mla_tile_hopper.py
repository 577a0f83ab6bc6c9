"""Sparse MLA prefill on Hopper in Gluon: the query-tile kernel of :mod:`fxglm5.lowering.triton.sparse_mla_tile`
with the layouts of :mod:`fxglm5.lowering.triton.mla_hopper`'s sparse path.

Same inputs, grid and semantics as ``sparse_mla_tile._tile_kernel``: program (tile, i) takes the request whose first
token in the tile is ``leads[tile, i]``, walks the key blocks ``blocks[tile, :n_blocks[tile]]`` the tile's tokens
list (from the 16-bit listing counters ``_count_listed`` fills), and gives each (token, key) score log2 of its count
(a position listed twice weighs twice; a row with nothing listed: zeros). Why a second kernel: Triton 3.6 lays out
the tile kernel's QK^T with all 8 warps along its 64 rows, so both warpgroups issue the same MMAs
(docs/perf/attention_notes.md, "Duplicated QK^T"); Gluon states the layouts, and this kernel takes them, and the
loop order, from ``mla_hopper._mla_split`` (its helpers, imported):

- the 64 MMA rows are ``BLOCK_Q`` tokens x ``HEADS`` heads (row r: token r // HEADS, head r % HEADS); their
  queries stay in shared memory for the whole walk;
- S [64 rows x 64 keys] is laid out ``warps_per_cta=[4, 2]`` (each warpgroup computes 32 key columns once), P goes
  through shared memory to both warpgroups' P @ V, each for its 128 columns of the two [64, 256] accumulators;
- each walked block's 64 rows are gathered with cp.async through the request's block-table row into a ring of two
  stages, the next block's copies in flight while this one's MMAs run (FP8: dequantized into one bf16 tile, which
  frees the stage early, so two blocks in flight); rows no token of the request lists are zero-filled, so stale
  cache bytes (NaN included) never reach P @ V;
- the counts are loaded straight in the score layout while QK^T runs (no one-hot MMA, whose only purpose in
  Triton was to keep a layout conversion away from the MMAs): an unlisted (row, key) scores -inf, and a row
  that has seen nothing listed takes ``mla_hopper``'s all-masked-tile path (its max is treated as 0).

Gluon kernels do not run under ``TRITON_INTERPRET=1``: the Triton tile kernel stays the CPU path and the fallback;
this one is compiled for sm_90 in CI (tests/kernels/test_sparse_mla_tile_hopper_compile.py) and checked against the
reference and the Triton kernel on the GPU (tests/gpu/test_gpu_sparse_mla_tile.py).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma_wait

from fxglm5 import settings
from fxglm5.lowering.triton.device import capability
from fxglm5.lowering.triton.mla_hopper import (BLOCK_N, STAGES, _allocate_buffers, _cache_args, _dequant, _issue_pv,
                                               _issue_qk, _issue_tile, _out_layout, _query_layout, _rows_layout,
                                               _score_layout, _softmax_update, _stage_query_rows, _store_rows,
                                               _wait_tile)

__all__ = ["supported", "launch", "ROWS", "BLOCK_N"]

ROWS = 64  # MMA rows of a program: BLOCK_Q tokens x HEADS heads, two warpgroups
NUM_WARPS = 8


def supported(q, cache, block_q: int, heads: int) -> bool:
    """Inputs the Gluon tile serves (everything else takes the Triton tile kernel): bf16 queries of GLM-5's 576
    columns on an sm_90 GPU, ``block_q`` (at least 2) tokens x ``heads`` (padded) heads filling the 64 MMA rows
    (the compile test covers 8 x 8 and 4 x 16), a bf16 or FP8 (uint8 ds_mla) cache, contiguous and 16-byte aligned
    (whole 16-byte cp.async copies), and the Gluon tile not switched off (``FXGLM5_SPARSE_MLA_TILE_GLUON=0``)."""
    return (settings.sparse_mla_tile_gluon() and not settings.triton_interpret() and q.is_cuda
            and capability(q.device) == (9, 0) and q.dtype == torch.bfloat16 and q.dim() == 3 and q.shape[2] == 576
            and q.stride(2) == 1 and block_q >= 2 and block_q * heads == ROWS
            and cache.dtype in (torch.bfloat16, torch.uint8) and cache.is_contiguous() and cache.data_ptr() % 16 == 0)


@gluon.jit
def _of_request(tok, ok, req_ptr, req, has_req):
    """Which tokens ``tok`` (where ``ok``) belong to this program's request."""
    return ok & (gl.load(req_ptr + tok, mask=ok, other=-1) == req) & has_req


@gluon.jit
def _block_rows(j, n_walk, blocks, counts_ptr, count_row, tok_mine, n_pos, bt_ptr, bt_row, BS: gl.constexpr,
                BLOCK: gl.constexpr, NW: gl.constexpr):
    """Walked block ``j``'s cache slots and which of its rows some token of the request lists (the others, and
    every row past the walk, are zero-filled by the gather), as ``mla_hopper._tile_rows`` gives a sparse tile's.
    ``count_row`` / ``tok_mine``: the tile's tokens' counter rows and whether they are the request's, along the
    columns of the gather layout, whose row slice ``mla_hopper._gather_part`` takes as it is."""
    lay: gl.constexpr = _rows_layout(8, NW)
    walk = j < n_walk
    offs = gl.load(blocks + j, mask=walk, other=0) * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, lay))
    inside = (offs < n_pos) & walk
    cnt = gl.load(counts_ptr + count_row[None, :] + offs[:, None], mask=tok_mine[None, :] & inside[:, None],
                  other=0)
    listed = gl.max((cnt != 0).to(gl.int32), 1) > 0
    slot = gl.load(bt_ptr + bt_row + offs // BS, mask=listed, other=0).to(gl.int64) * BS + offs % BS
    return slot, listed


@gluon.jit
def _block_counts(j, blocks, counts_ptr, cnt_row, row_mine, n_pos, s_l: gl.constexpr, BLOCK: gl.constexpr):
    """How often each MMA row's token lists each key of walked block ``j`` (float32 in the score layout, 0:
    unlisted). The 16-bit counters are read unsigned (the Triton kernel's int16 view of them)."""
    offs = gl.load(blocks + j) * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(0, s_l))
    cnt = gl.load(counts_ptr + cnt_row[:, None] + offs[None, :], mask=row_mine[:, None] & (offs < n_pos)[None, :],
                  other=0)
    return (cnt.to(gl.int32) & 0xFFFF).to(gl.float32)


@gluon.jit
def _tile_hopper_kernel(
    q_ptr, stride_qt, stride_qh,
    lat_ptr, pe_ptr, sc_ptr, bt_ptr, stride_bt, req_ptr,
    counts_ptr, count_stride, n_pos, blocks_ptr, n_key_blocks, n_blocks_ptr, leads_ptr, n_slots,
    o_ptr, stride_ot, stride_oh, T, H, sm_scale_log2,
    BS: gl.constexpr, BLOCK_Q: gl.constexpr, HEADS: gl.constexpr, FP8: gl.constexpr, BLOCK: gl.constexpr,
    STAGES_: gl.constexpr,
):
    """Program (tile, i): the request whose first token in the tile is ``leads[tile, i]`` (T: none; it walks
    nothing and stores nothing), over the tile's listed key blocks in block order."""
    NW: gl.constexpr = 8
    M: gl.constexpr = BLOCK_Q * HEADS
    s_l: gl.constexpr = _score_layout(False, M)
    o_l: gl.constexpr = _out_layout(False, M)
    lat_dt: gl.constexpr = gl.float8e4nv if FP8 else gl.bfloat16
    lat_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, 256], lat_dt)
    pe_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, 64], gl.bfloat16)
    sc_l: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    AHEAD: gl.constexpr = 2 if FP8 else 1  # blocks in flight (mla_hopper._mla_split: an FP8 stage frees early)

    tile = gl.num_programs(0) - 1 - gl.program_id(0)  # the longest prefixes first: a shorter tail wave
    t0 = tile * BLOCK_Q
    lead = gl.load(leads_ptr + tile * n_slots + gl.program_id(1))
    has_req = lead < T
    req = gl.load(req_ptr + gl.minimum(lead, T - 1))
    bt_row = req.to(gl.int64) * stride_bt
    n_walk = gl.load(n_blocks_ptr + tile, mask=has_req, other=0)
    blocks = blocks_ptr + tile.to(gl.int64) * n_key_blocks
    # the tile's tokens along the gather layout's columns (which rows to copy), and each MMA row's token in the
    # score layout (its counts), in the query layout (its queries) and in the output layout (its store)
    toks = t0 + gl.arange(0, BLOCK_Q, layout=gl.SliceLayout(0, _rows_layout(8, NW)))
    tok_mine = _of_request(toks, toks < T, req_ptr, req, has_req)
    count_row = toks * count_stride  # int32: the launcher keeps a chunk's counters under 2**31 entries
    r_s = t0 + gl.arange(0, M, layout=gl.SliceLayout(1, s_l)) // HEADS
    row_mine = _of_request(r_s, r_s < T, req_ptr, req, has_req)
    cnt_row = r_s * count_stride

    qa_s, qb_s, qpe_s, la_s, lb_s, pe_s, sc_s, ka_s, kb_s, p_s = _allocate_buffers(M, BLOCK, STAGES_, FP8)

    # the first AHEAD blocks' gathers (one cp.async commit group per block, empty past the walk: _wait_tile counts
    # groups), then the queries; _issue_tile's TMA-only arguments (n_full, end, descs, ready) are unused (0)
    for i in gl.static_range(AHEAD):
        if i < n_walk:
            _issue_tile(_block_rows(i, n_walk, blocks, counts_ptr, count_row, tok_mine, n_pos, bt_ptr, bt_row, BS,
                                    BLOCK, NW),
                        i, 0, 0, lat_ptr, pe_ptr, sc_ptr, 0, la_s, lb_s, pe_s, sc_s, 0, lat_l, pe_l, sc_l, BLOCK,
                        STAGES_, True, FP8, NW)
        else:
            async_copy.commit_group()
    q_r = gl.arange(0, M, layout=gl.SliceLayout(1, _query_layout(NW)))
    q_t = t0 + q_r // HEADS
    q_h = q_r % HEADS
    _stage_query_rows(q_ptr + q_t.to(gl.int64) * stride_qt + q_h * stride_qh,
                      (q_h < H) & _of_request(q_t, q_t < T, req_ptr, req, has_req), qa_s, qb_s, qpe_s, NW)
    fence_async_shared()
    gl.thread_barrier()

    m_i = gl.full([M], float("-inf"), gl.float32, gl.SliceLayout(1, s_l))
    l_i = gl.zeros([M], gl.float32, gl.SliceLayout(1, s_l))
    acc_a = gl.zeros([M, 256], gl.float32, o_l)
    acc_b = gl.zeros([M, 256], gl.float32, o_l)
    # mla_hopper._mla_split's loop (heads-as-rows, sparse), block by block: P @ V of block j-1 first, FP8 then
    # dequantizes block j, QK^T of block j, and while it runs the counts of block j and the rows of block j+AHEAD
    # are loaded and that block's gathers issued once its stage is free; no MMA in flight across the back edge
    for j in range(n_walk):
        s = j % STAGES_
        kv = 0 if FP8 else s
        if j > 0:
            prev = 0 if FP8 else (j - 1) % STAGES_
            acc_a, acc_b = _issue_pv(p_s, ka_s.index(prev), kb_s.index(prev), acc_a, acc_b, False)
            acc_a, acc_b = warpgroup_mma_wait(num_outstanding=0 if FP8 else 2, deps=(acc_a, acc_b))
        _wait_tile(j, 0, STAGES_, True, AHEAD)
        if FP8:
            gl.thread_barrier()  # both warpgroups are done with the bf16 tile (P @ V of block j-1)
            ka_s.index(0).store(_dequant(la_s.index(s), sc_s.index(s), 0, NW))
            kb_s.index(0).store(_dequant(lb_s.index(s), sc_s.index(s), 2, NW))
            fence_async_shared()
            gl.thread_barrier()
        qk = _issue_qk(qa_s, qb_s, qpe_s, ka_s.index(kv), kb_s.index(kv), pe_s.index(s), s_l, BLOCK, M, False)
        cnt = _block_counts(j, blocks, counts_ptr, cnt_row, row_mine, n_pos, s_l, BLOCK)
        nxt = _block_rows(j + AHEAD, n_walk, blocks, counts_ptr, count_row, tok_mine, n_pos, bt_ptr, bt_row, BS,
                          BLOCK, NW)
        if FP8:  # the next gathers reuse this block's stage, whose rope columns QK^T reads
            qk = warpgroup_mma_wait(num_outstanding=0, deps=(qk,))
        else:  # the next gathers reuse block j-1's stage: free once its P @ V is done, QK^T may still run
            acc_a, acc_b = warpgroup_mma_wait(num_outstanding=3, deps=(acc_a, acc_b))
        gl.thread_barrier()  # both warpgroups are done with the stage the next gathers go to, and with P
        if j + AHEAD < n_walk:
            _issue_tile(nxt, j + AHEAD, 0, 0, lat_ptr, pe_ptr, sc_ptr, 0, la_s, lb_s, pe_s, sc_s, 0, lat_l, pe_l,
                        sc_l, BLOCK, STAGES_, True, FP8, NW)
        else:
            async_copy.commit_group()
        qk, acc_a, acc_b = warpgroup_mma_wait(num_outstanding=0, deps=(qk, acc_a, acc_b))
        # a listed score plus log2 of its count (exp2 domain); unlisted -inf, whatever QK^T gave
        scores = gl.where(cnt > 0.0, qk * sm_scale_log2 + gl.log2(cnt), float("-inf"))
        p, alpha, m_i, l_i = _softmax_update(scores, m_i, l_i, True, 1)
        alpha_o = gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_l)), 1)
        acc_a = acc_a * alpha_o
        acc_b = acc_b * alpha_o
        p_s.store(p.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
    if n_walk > 0:
        last = 0 if FP8 else (n_walk - 1) % STAGES_
        acc_a, acc_b = _issue_pv(p_s, ka_s.index(last), kb_s.index(last), acc_a, acc_b, False)
        acc_a, acc_b = warpgroup_mma_wait(num_outstanding=0, deps=(acc_a, acc_b))

    inv = gl.expand_dims(gl.convert_layout(1.0 / gl.where(l_i > 0.0, l_i, 1.0), gl.SliceLayout(1, o_l)), 1)
    o_r = gl.arange(0, M, layout=gl.SliceLayout(1, o_l))
    o_t = t0 + o_r // HEADS
    o_h = o_r % HEADS
    rows = o_t.to(gl.int64) * stride_ot + o_h * stride_oh
    keep = (o_h < H) & _of_request(o_t, o_t < T, req_ptr, req, has_req)
    _store_rows(o_ptr, rows, keep, acc_a * inv, 0, o_l, 1)
    _store_rows(o_ptr, rows, keep, acc_b * inv, 256, o_l, 1)


def launch(q, cache, block_table, req_idx, counts, count_stride: int, n_pos: int, blocks, n_key_blocks: int,
           n_blocks, leads, out, T: int, scale_log2: float, block_q: int, heads: int):
    """One chunk's launch, with the arguments ``sparse_mla_tile_paged`` gives ``_tile_kernel`` (``counts``: the
    int16 view of the counters; ``q``, ``req_idx``, ``out``: the chunk's tokens on)."""
    bs, fp8, (lat, pe, sc), _ = _cache_args(cache, None, False)
    tiles, slots = leads.shape
    _tile_hopper_kernel[(tiles, slots)](
        q, q.stride(0), q.stride(1), lat, pe, sc, block_table, block_table.stride(0), req_idx,
        counts, count_stride, n_pos, blocks, n_key_blocks, n_blocks, leads, slots, out, out.stride(0), out.stride(1),
        T, q.shape[1], scale_log2, BS=bs, BLOCK_Q=block_q, HEADS=heads, FP8=fp8, BLOCK=BLOCK_N, STAGES_=STAGES,
        num_warps=NUM_WARPS)
