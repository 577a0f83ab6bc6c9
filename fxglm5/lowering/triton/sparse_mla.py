"""Triton sparse MLA (DSA): attention over the listed top-k positions of the paged latent cache.

Same signature and semantics as :func:`fxglm5.lowering.reference.paged.sparse_mla_paged` (-1 = unused entry;
a row with no valid entry gives zeros). Shares the kernel body of :mod:`fxglm5.lowering.triton.mla`
(``SPARSE=True``): each program gathers ``BLOCK_N`` listed rows of its request (block table lookup per row),
dequantizes FP8 ds_mla rows in-kernel, and runs the online softmax for a block of up to 64 heads.
Decode with a small batch splits the top-k list over grid axis 1 (partial softmax + combine); prefill (many
tokens) runs one pass per token. The split count depends on shapes only (CUDA-graph safe).
:func:`sparse_mla_paged` (the paged program's entry) sends prefill-shaped steps to the query-tile kernel
(:mod:`fxglm5.lowering.triton.sparse_mla_tile`) where :func:`~fxglm5.lowering.triton.sparse_mla_tile.tile_applies`.
"""

from __future__ import annotations

from fxglm5.lowering.reference import paged as ref
from fxglm5.lowering.triton.mla import into, launch_dispatched, launch_mla
from fxglm5.lowering.triton.sparse_mla_tile import sparse_mla_tile_paged, tile_applies

__all__ = ["sparse_mla_paged", "sparse_mla_decode_paged", "sparse_mla_prefill_paged"]


def sparse_mla_decode_paged(q, cache, block_table, req_idx, topk_pos, scale: float, *,
                            num_splits: int | None = None, validate: bool = True, out=None, cfg=None):
    """Split over the top-k list (flash-decoding style) + combine."""
    if validate:
        ref.validate_sparse_mla_paged(q, cache, block_table, req_idx, topk_pos, scale)
    return launch_mla(q, cache, block_table, req_idx, topk_pos, scale, sparse=True, num_splits=num_splits,
                      out=out, cfg=cfg)


def sparse_mla_prefill_paged(q, cache, block_table, req_idx, topk_pos, scale: float, *, validate: bool = True,
                             out=None, cfg=None):
    """One pass per (token, head block) over its top-k rows."""
    if validate:
        ref.validate_sparse_mla_paged(q, cache, block_table, req_idx, topk_pos, scale)
    return launch_mla(q, cache, block_table, req_idx, topk_pos, scale, sparse=True, num_splits=1, out=out, cfg=cfg)


def sparse_mla_paged(q, cache, block_table, req_idx, topk_pos, scale: float, *, validate: bool = True, out=None,
                     w_uv=None):
    """Dispatch on the shapes: a prefill's tokens in tiles (:func:`tile_applies`; W_UV, if given, by cuBLAS's GEMM
    after it), else one pass per token, the top-k list split when the tokens alone do not fill the GPU
    (:func:`~fxglm5.lowering.triton.mla.launch_dispatched`); with ``w_uv`` the value heads [T, H, V]."""
    if validate:
        ref.validate_sparse_mla_paged(q, cache, block_table, req_idx, topk_pos, scale)
        if w_uv is not None:
            ref.validate_project_out(q, w_uv)
    if tile_applies(q, cache, block_table, topk_pos):
        if w_uv is None:
            return sparse_mla_tile_paged(q, cache, block_table, req_idx, topk_pos, scale, validate=False, out=out)
        o_lat = sparse_mla_tile_paged(q, cache, block_table, req_idx, topk_pos, scale, validate=False)
        return into(ref.project_out(o_lat, w_uv), out)
    return launch_dispatched(q, cache, block_table, req_idx, topk_pos, scale, sparse=True, out=out, w_uv=w_uv)
