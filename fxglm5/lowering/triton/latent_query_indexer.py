"""The q_b | wq_b GEMM, the latent query and the DSA indexer of a decode step in one launch of tasks
(``fxglm5::fp8_linear_latent_query_indexer``, issue 45, item 5: a decode attention layer in five launches).

The launch is ``paged_cache._gemm_latent_query_kernel``'s (the GEMM's tiles, then the latent query's programs, each
head's waiting for the tiles of its columns: :func:`paged_cache.gemm_latent_query_task`) with the indexer's programs
after them: the one-launch indexer's grid (``indexer._indexer_topk_kernel``: a program per (token, ``BLOCK_N * TILES``
key positions), token by token), each :func:`indexer.select_row` of its (token, program), so each row's last logits
program selects the row's top-k with ``topk.py``'s code. The indexer reads nothing else this launch writes but its
query, the wq_b columns of the GEMM's output: every tile holding some of them signals one more dependency (H, after
the H heads'), and a program whose row computes logits waits for all of them, then reads the query from L2 (.cg); the
head weights and the index keys come from the norm launch before (``rms_norm_write_caches``). A task waits only on
tasks before it (tasks.py's argument), and the row tickets never wait, so the launch cannot deadlock.

Counters: the tasks' (queue, done, the H + 1 dependencies) reset by the launch's last CTA (``tasks.finish``); each
row's ticket counter by its selecting program, the rows' counters placed in ``fp8_parts.tile_counters`` after the
GEMM's FIXUP counters (both are in use in the same launch). So the next call and every CUDA-graph replay start from
zero.

Where: a decode step, where both one-launch paths apply: :func:`paged_cache.latent_query_joins` (up to 16 tokens, the
GEMM one plain launch of 4 warps) and :func:`indexer.one_launch_round` (up to 16 tokens, rows of at most 8192 keys,
one top-k round), no tensor-parallel split of the top-k (``collectives.split_rows``); FP8 and exact index caches
alike. Elsewhere :func:`fp8_linear_latent_query_indexer` returns None and the op's body runs the separate launches.

The logits configuration is fixed (``indexer.gather_config``: gathers of 128 keys, 4 tiles a program on the GPU):
there is no autotuner inside a launch of tasks, TMA boxes would need the tensor-map allocator beside the GEMM's
pipeline, and its 4 warps are the GEMM's and the latent query's (a launch has one warp count). So the indices are
bit for bit those of the GEMM's launch, the latent query's and ``indexer_topk_paged`` under that configuration; the
standalone launch's autotuner may pick another, whose sums over the heads may round differently (near ties only).
"""

from __future__ import annotations

import triton
import triton.language as tl

from fxglm5.lowering.reference import paged as ref
from fxglm5.lowering.reference.collectives import split_rows
from fxglm5.lowering.reference.fused import index_query
from fxglm5.lowering.triton import tasks
from fxglm5.lowering.triton.device import interpreter_compat, pdl, pdl_prologue
from fxglm5.lowering.triton.fp8_parts import tile_counters
from fxglm5.lowering.triton.indexer import (gather_config, interpreted, logits_args, one_launch_round, select_row,
                                           selection_buffers)
from fxglm5.lowering.triton.paged_cache import gemm_latent_query_task, joined_launch, tiles_over

interpreter_compat()

__all__ = ["fp8_linear_latent_query_indexer"]


@triton.jit
def _gemm_latent_query_indexer_kernel(
        a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, c_ptr, out_ptr, cnt_ptr, up_ptr, M, N, K, KG,
        KG_PER_SPLIT: tl.constexpr, stride_am, stride_asm, stride_bn, stride_bsn, stride_cm, stride_cs, stride_um,
        qn_ptr, w_ptr, pe_ptr, cos_ptr, sin_ptr, q_ptr, s_qn_t, s_qn_h, s_w_h, s_w_d, s_pe_t, s_pe_h, stride_c, T,
        H: tl.constexpr, D, RA, RP, HALF, task_ptr, q_start, head_cols, i_start, i_cols,
        iq_ptr, i_stride_qt, i_stride_qh, hw_ptr, i_stride_wt, kc_ptr, ks_ptr, n_key_rows, bt_ptr, i_stride_bt,
        req_ptr, pos_ptr, i_cos_ptr, i_sin_ptr, i_stride_c, I_HALF, o_ptr, i_stride_ot, HI, max_len, sel_ptr,
        i_stride_st, bin_ptr, row_cnt_ptr, topk,
        A_MODE: tl.constexpr, GATED_A: tl.constexpr, DT: tl.constexpr, DOT_F32: tl.constexpr, INTERPRET: tl.constexpr,
        HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, FIXUP: tl.constexpr, NO_K_MASK: tl.constexpr,
        SCALAR_SB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
        R: tl.constexpr, DR: tl.constexpr, BT: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, ROPE: tl.constexpr,
        Q_DT: tl.constexpr, DT_PE: tl.constexpr, IEEE: tl.constexpr, SIGNALS: tl.constexpr,
        BS: tl.constexpr, BLOCK_HI: tl.constexpr, I_BLOCK_N: tl.constexpr, TILES: tl.constexpr, F32DOT: tl.constexpr,
        C: tl.constexpr, BIN_C: tl.constexpr, PROMOTE: tl.constexpr, EXACT: tl.constexpr, ROPE_Q: tl.constexpr,
        I_DT: tl.constexpr, QD: tl.constexpr, PDL: tl.constexpr):
    """fxglm5::fp8_linear_latent_query_indexer in one launch of tasks: tasks below the GEMM's tiles x splits plus the
    latent query's programs are :func:`paged_cache.gemm_latent_query_task` (each finished tile that holds some of
    the ``i_cols`` index-query columns from ``i_start`` signalling dependency H too), the rest the indexer's
    programs, token by token (``max_len / (I_BLOCK_N * TILES)`` a token): :func:`indexer.select_row` with the
    one-launch indexer's arguments (``i_*``, the head weights ``hw_ptr``, the rows' tickets ``row_cnt_ptr``), its
    query read from L2 after the wait for every tile of its columns. The PDL wait comes first: a task's role is
    known only once its id is taken."""
    pdl_prologue(PDL)
    task = tasks.take(task_ptr)
    first = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N) * SPLIT_K + tl.cdiv(T, BT) * H * (R // BR)
    if task < first:
        gemm_latent_query_task(
            task, a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, c_ptr, out_ptr, cnt_ptr, up_ptr, M, N, K, KG, KG_PER_SPLIT,
            stride_am, stride_asm, stride_bn, stride_bsn, stride_cm, stride_cs, stride_um, qn_ptr, w_ptr, pe_ptr,
            cos_ptr, sin_ptr, q_ptr, s_qn_t, s_qn_h, s_w_h, s_w_d, s_pe_t, s_pe_h, stride_c, T, H, D, RA, RP, HALF,
            task_ptr, q_start, head_cols, i_start, i_cols, A_MODE, GATED_A, DT, DOT_F32, INTERPRET, HAS_BIAS, SPLIT_K,
            FIXUP, NO_K_MASK, SCALAR_SB, BLOCK_M, BLOCK_N, GROUP_M, R, DR, BT, BR, BK, ROPE, Q_DT, DT_PE, IEEE,
            SIGNALS, True)
    else:
        programs = tl.cdiv(max_len, I_BLOCK_N * TILES)
        row = task - first
        select_row(row // programs, row % programs, programs, iq_ptr, i_stride_qt, i_stride_qh, hw_ptr, i_stride_wt,
                   kc_ptr, ks_ptr, n_key_rows, bt_ptr, i_stride_bt, req_ptr, pos_ptr, i_cos_ptr, i_sin_ptr, i_stride_c,
                   I_HALF, o_ptr, i_stride_ot, HI, max_len, sel_ptr, i_stride_st, bin_ptr, row_cnt_ptr, topk, task_ptr,
                   H, tiles_over(i_start, i_cols, BLOCK_N), BS, BLOCK_HI, I_BLOCK_N, TILES, F32DOT, C, BIN_C, PROMOTE,
                   False, EXACT, ROPE_Q, I_DT, QD, ".cg", True)
    tasks.finish(task_ptr, H + 1)


def fp8_linear_latent_query_indexer(x, weight, weight_scale_inv, bias, act_quant, w_uk, q_start, rope_dim, rope_cos,
                                    rope_sin, index_start, index_heads, index_dim, weights, topk, index_cache,
                                    block_table, req_idx, positions, rope_q, world):
    """``(out [N, S, n], the latent query [N, S, H, 576], the top-k [N, S, topk])`` of
    ``fxglm5::fp8_linear_latent_query_indexer`` in one launch (the caller validated; ``paged_steps
    .latent_query_indexer_step``), or None where that launch does not apply (the module doc): then the op runs
    ``fp8_linear_latent_query``'s launches and the indexer's."""
    k = weight.shape[1]
    tokens, max_len = x.numel() // k, block_table.shape[1] * index_cache.shape[1]
    interp = interpreted(x.device)
    select = one_launch_round(tokens, max_len, topk, interp)
    if select is None or not tokens or not max_len or split_rows(tokens, world):
        return None
    heads, lead = w_uk.shape[0], x.shape[:-1]
    rope = None if rope_cos is None else (rope_cos.reshape(tokens, -1), rope_sin.reshape(tokens, -1))
    joined = joined_launch(x, weight, weight_scale_inv, bias, act_quant, w_uk, q_start, rope_dim, rope, heads + 1)
    if joined is None:
        return None
    counters = tile_counters(x.device, joined.tiles + tokens)[joined.tiles:]  # after the GEMM's FIXUP counters
    logits, top, tail = selection_buffers(tokens, max_len, topk, select, x.device, counters=counters)
    query = index_query(joined.out, index_start, index_heads, index_dim)
    row, const, _ = logits_args(query, weights.reshape(tokens, -1), index_cache, block_table, req_idx, positions,
                                max_len, logits, rope if rope_q else None, interp)
    cfg = gather_config(index_cache.shape[1], interp, const["EXACT"])
    assert cfg["num_warps"] == joined.meta["num_warps"]  # a launch has one warp count
    programs = tokens * triton.cdiv(max_len, cfg["BLOCK_N"] * cfg["TILES"])
    _gemm_latent_query_indexer_kernel[(joined.tasks + programs,)](
        *joined.args, index_start, index_heads * index_dim, *row, *tail, **joined.meta, I_BLOCK_N=cfg["BLOCK_N"],
        TILES=cfg["TILES"], PROMOTE=cfg.get("PROMOTE", 128), C=select[0], BIN_C=select[1], QD=index_dim,
        I_DT=const.pop("DT"), **const, **pdl(x.device))
    return (joined.out.view(*lead, weight.shape[0]), joined.query.view(*lead, heads, ref.LATENT_DIM),
            top.view(*lead, topk))
