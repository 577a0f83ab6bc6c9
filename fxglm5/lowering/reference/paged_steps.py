"""The bodies of the cached RTP attention ops (``fxglm5.ops.cached`` declares their schemas), over a kernel set.

Each ``*_step`` takes ``kern``: :mod:`fxglm5.lowering.reference.paged` (the torch reference, what the custom
ops run by default) or :mod:`fxglm5.lowering.triton.paged_ops` (the Triton twins, bound by the ``lower``
pass), so both backends share one validation and one argument handling.

Validation (shapes, dtypes, block ids, slots, positions < max_positions, causal top-k) runs before any
cache write and raises :class:`fxglm5.errors.InputError` naming the field, so a bad step loses nothing
stored. It syncs with the host, so it cannot run inside CUDA-graph capture, and it repeats what a runtime that
validated the step's forward context already checked: ``validate=False`` skips it. Whether it runs is decided
when the graph is lowered (``PagedProgram.inputs_validated``: the lower stage binds these bodies with
``validate=False`` for a caller that validates), never by a switch at run time.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from fxglm5.errors import InputError
from fxglm5.lowering.reference import norm_rope, paged
from fxglm5.lowering.reference.collectives import gather_split_rows
from fxglm5.lowering.reference.fused import (index_query, validate_f32_linear, validate_fp8_linear_latent_query,
                                             validate_index_query)

_INT_DTYPES = (torch.int32, torch.int64)


def _pad(x: Tensor, width: int, name: str) -> Tensor:
    """Zero-pad the last dim to ``width`` (the RTP row width); wider inputs do not fit the layout."""
    if x.shape[-1] > width:
        raise InputError(f"{name}: last dim {x.shape[-1]} exceeds the cache layout's {width}")
    if x.shape[-1] == width:
        return x
    return torch.nn.functional.pad(x, (0, width - x.shape[-1]))


def _flat(x: Tensor, name: str, ndim: int) -> Tensor:
    """[N, S, ...] -> [N*S, ...]."""
    if not isinstance(x, Tensor) or x.dim() != ndim:
        raise InputError(f"{name}: expected {ndim} dims [N, S, ...], got {tuple(getattr(x, 'shape', ()))}")
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def check_context(cache: Tensor, slot_mapping, block_table, req_idx, positions, max_positions: int) -> None:
    """The forward-context checks every op shares (cache = the op's paged cache, kernel granularity)."""
    if not isinstance(cache, Tensor) or cache.dim() != 3:
        raise InputError(f"cache: expected a 3-D paged cache [blocks, bs, row], got {tuple(getattr(cache, 'shape', ()))}")
    for name, t, nd in (("slot_mapping", slot_mapping, 1), ("block_table", block_table, 2),
                        ("req_idx", req_idx, 1), ("positions", positions, 1)):
        if not isinstance(t, Tensor) or t.dim() != nd or t.dtype not in _INT_DTYPES:
            raise InputError(f"{name}: expected a {nd}-D int32/int64 tensor, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
        if t.device != cache.device:
            raise InputError(f"{name}: on {t.device}, but the cache is on {cache.device}")
    T = positions.shape[0]
    if slot_mapping.shape[0] != T or req_idx.shape[0] != T:
        raise InputError(f"slot_mapping/req_idx: expected {T} entries (one per token), got "
                         f"{slot_mapping.shape[0]} / {req_idx.shape[0]}")
    nb, bs = cache.shape[0], cache.shape[1]
    if block_table.numel() and (int(block_table.min()) < 0 or int(block_table.max()) >= nb):
        bad = int(block_table.min()) if int(block_table.min()) < 0 else int(block_table.max())
        raise InputError(f"block_table: block id {bad} out of range [0, {nb})")
    if T == 0:
        return
    if int(positions.min()) < 0 or int(positions.max()) >= max_positions:
        bad = int(positions.min()) if int(positions.min()) < 0 else int(positions.max())
        raise InputError(f"positions: position {bad} out of range [0, {max_positions}) (max_position_embeddings)")
    paged.validate_slots_from_positions(block_table, req_idx, positions, bs)
    need = torch.arange(block_table.shape[1], device=cache.device)[None] <= (positions.long() // bs)[:, None]
    if bool(((block_table.long()[req_idx.long()] == 0) & need).any()):
        raise InputError("block_table: a token's position maps to block 0 (reserved / padding)")
    expected = paged.slots_from_positions(block_table, req_idx, positions, bs, validate=False)
    if bool(((slot_mapping.long() != expected) & (slot_mapping >= 0)).any()):
        raise InputError("slot_mapping: a slot disagrees with block_table / positions")


# ---------------------------------------------------------------------------------------------------------
# indexer
# ---------------------------------------------------------------------------------------------------------
def _check_index_cache(cache: Tensor) -> None:
    if cache.dtype == torch.uint8:
        return  # paged.validate_write_indexer_cache checks the FP8 layout's shape
    if cache.dim() != 3 or cache.dtype not in paged.COMPUTE_DTYPES or cache.shape[2] != paged.INDEX_DIM:
        raise InputError(f"index_cache: expected uint8 [blocks, bs, {paged.INDEX_ROW_BYTES}] or a compute-dtype "
                         f"[blocks, bs, {paged.INDEX_DIM}] tensor, got {cache.dtype} {tuple(cache.shape)}")
    if not cache.is_contiguous():
        raise InputError("index_cache: must be contiguous")


def _rope(cos, sin) -> tuple[Tensor, Tensor] | None:
    if cos is None and sin is None:
        return None
    if cos is None or sin is None:
        raise InputError("rope_cos / rope_sin: give both or neither")
    return _flat(cos, "rope_cos", 3), _flat(sin, "rope_sin", 3)


def _validate_index_write(index_cache, kf, slot_mapping, norm, rope) -> None:
    """This step's keys fit the index cache (of either kind; check_context checked the context)."""
    if index_cache.dtype == torch.uint8:
        paged.validate_write_indexer_cache(index_cache, kf, slot_mapping, norm, rope)
        return
    paged.validate_index_keys(kf, norm, rope)
    if kf.shape[0] != slot_mapping.shape[0]:
        raise InputError(f"k: {kf.shape[0]} tokens, slot_mapping has {slot_mapping.shape[0]}")


def indexer_step(kern, q, k, weights, topk, index_cache, slot_mapping, block_table, req_idx, positions, max_positions,
                 rope_cos=None, rope_sin=None, k_norm_weight=None, k_norm_bias=None, k_norm_eps=0.0, group=None,
                 world=1, rope_q=False, written=False, *, validate=True):
    """rtp_indexer's body over a kernel set ``kern`` (``paged`` = torch reference, or the Triton twins). Every rank
    writes every key (its later queries read them all); with a ``group`` of ``world`` ranks a step large enough
    selects on each rank its share of the tokens only (:func:`_selection`). ``rope_q``: the selection rotates the
    query by the key's tables (the kernel set's ``rope`` argument), so no RoPE of its own runs before it.
    ``written``: an earlier op (``fxglm5::rms_norm_write_caches``) wrote and validated this step's keys (then ``k``
    may be None: nothing reads it)."""
    qf, kf, wf, rope, norm = _indexer_inputs(q, k, weights, rope_cos, rope_sin, k_norm_weight, k_norm_bias,
                                             k_norm_eps, rope_q, written)
    if validate:
        _check_indexer(q, qf, kf, wf, weights, topk, index_cache, slot_mapping, block_table, req_idx, positions,
                       max_positions, rope, norm, rope_q, written)
    if not written:
        kern.write_index_keys(index_cache, kf, slot_mapping, norm=norm, rope=rope)
    fp8 = index_cache.dtype == torch.uint8
    select = functools.partial(kern.indexer_topk_paged, validate=False) if fp8 else kern.exact_indexer_topk_paged
    out = _selection(select, qf, wf, index_cache, block_table, req_idx, positions, topk, group, world,
                     rope if rope_q else None)
    return out.view(*q.shape[:2], topk)


def _indexer_inputs(q, k, weights, rope_cos, rope_sin, k_norm_weight, k_norm_bias, k_norm_eps, rope_q, written):
    """rtp_indexer's inputs as its kernels take them: (q [T, HI, 128] zero-padded, k [T, D] (None where ``written``
    and not given), weights [T, HI], the RoPE tables [T, R/2] or None, the key's LayerNorm or None)."""
    qf = _pad(_flat(q, "q", 4), paged.INDEX_DIM, "q")
    kf = None if written and k is None else _flat(k, "k", 3)
    wf = _flat(weights, "weights", 3)
    rope = _rope(rope_cos, rope_sin)
    if rope_q and rope is None:
        raise InputError("rope_q: the query's RoPE needs rope_cos / rope_sin")
    norm = None if k_norm_weight is None else (k_norm_weight, k_norm_bias, k_norm_eps)
    return qf, kf, wf, rope, norm


def _check_indexer(q, qf, kf, wf, weights, topk, index_cache, slot_mapping, block_table, req_idx, positions,
                   max_positions, rope, norm, rope_q, written) -> None:
    """rtp_indexer's validation (it syncs with the host), before any write."""
    _check_index_cache(index_cache)
    check_context(index_cache, slot_mapping, block_table, req_idx, positions, max_positions)
    if not written:
        _validate_index_write(index_cache, kf, slot_mapping, norm, rope)
    if index_cache.dtype == torch.uint8:
        paged.validate_indexer_topk_paged(qf, wf, index_cache, block_table, req_idx, positions, topk)
    if tuple(wf.shape) != tuple(qf.shape[:2]):
        raise InputError(f"weights: shape {tuple(weights.shape)} does not fit q {tuple(q.shape)}")
    if rope_q:
        norm_rope.validate_rope(qf, *rope)


def latent_query_indexer_step(kern, x, weight, weight_scale_inv, bias, act_quant, w_uk, q_start, rope_dim, rope_cos,
                              rope_sin, index_start, index_heads, index_dim, weights, topk, index_cache, slot_mapping,
                              block_table, req_idx, positions, max_positions, rope_q=False, group=None, world=1, *,
                              validate=True):
    """``fxglm5::fp8_linear_latent_query_indexer``'s body over a kernel set ``kern``: the chain it replaces,
    ``fp8_linear_latent_query`` (the kernel set's), then rtp_indexer's body (:func:`indexer_step`, its keys
    ``written``) over the indexer's query heads in the GEMM's output (``fused.index_query``); where the kernel set
    runs all three in one launch (the Triton set's ``fp8_linear_latent_query_indexer``, a decode step), that one.
    Everything is validated first, the indexer's query by a stand-in of its shape (the GEMM has not run yet);
    ``validate=False`` skips the indexer's host-syncing checks (the GEMM's and the query layout's check shapes only
    and always run)."""
    validate_fp8_linear_latent_query(x, weight, weight_scale_inv, bias, w_uk, q_start, rope_dim, rope_cos, rope_sin)
    validate_index_query(x, weight, index_start, index_heads, index_dim)
    index = (weights, topk, index_cache, slot_mapping, block_table, req_idx, positions, max_positions, rope_cos,
             rope_sin, None, None, 0.0, group, world, rope_q, True)
    if validate:
        stand_in = x.new_empty(*x.shape[:-1], index_heads, index_dim)
        qf, kf, wf, rope, norm = _indexer_inputs(stand_in, None, weights, rope_cos, rope_sin, None, None, 0.0, rope_q,
                                                 True)
        _check_indexer(stand_in, qf, kf, wf, weights, topk, index_cache, slot_mapping, block_table, req_idx,
                       positions, max_positions, rope, norm, rope_q, True)
    joined = getattr(kern, "fp8_linear_latent_query_indexer", None)
    if joined is not None:
        result = joined(x, weight, weight_scale_inv, bias, act_quant, w_uk, q_start, rope_dim, rope_cos, rope_sin,
                        index_start, index_heads, index_dim, weights, topk, index_cache, block_table, req_idx,
                        positions, rope_q, world)
        if result is not None:
            return result
    out, q = kern.fp8_linear_latent_query(x, weight, weight_scale_inv, bias, act_quant, w_uk, q_start, rope_dim,
                                          rope_cos, rope_sin)
    top = indexer_step(kern, index_query(out, index_start, index_heads, index_dim), None, *index, validate=False)
    return out, q, top


def _selection(select, qf, wf, cache, block_table, req_idx, positions, topk, group, world, rope) -> Tensor:
    """Every token's top-k by ``select`` (the kernel set's selection; ``rope``: the per-token (cos, sin) that rotate
    the queries in it): all of them here, or, where the step splits over the ``world`` ranks of ``group``
    (``collectives.gather_split_rows``: a prefill-sized step), this rank's share of the tokens, gathered, each row's
    tables taken with its query. A padding row of the split reads as token 0's request at position 0: a window of
    one key, which that request's first block holds, so the kernels skip its scores."""
    tokens = positions.shape[0]

    def rows(index: Tensor) -> Tensor:
        real = index < tokens
        take = torch.where(real, index, 0)
        return select(qf[take], wf[take], cache, block_table, req_idx[take], torch.where(real, positions[take], 0),
                      topk, rope=None if rope is None else (rope[0][take], rope[1][take]))

    out = gather_split_rows(rows, tokens, group, world, qf.device)
    return select(qf, wf, cache, block_table, req_idx, positions, topk, rope=rope) if out is None else out


# ---------------------------------------------------------------------------------------------------------
# latent attention
# ---------------------------------------------------------------------------------------------------------
def _check_latent_cache(kv_cache, slot_mapping, block_table, req_idx, positions, max_positions) -> None:
    paged._validate_latent_cache(kv_cache, "kv_cache")
    check_context(kv_cache, slot_mapping, block_table, req_idx, positions, max_positions)


def _prepare_latent(kern, q_nope, q_pe, kv_c, k_pe, w_uk, w_uv, kv_cache, slot_mapping, block_table, req_idx,
                    positions, max_positions, rope_cos, rope_sin, kv_norm_weight, kv_norm_eps, written, validate,
                    q_latent=None):
    """Validate everything (unless ``validate`` is False), then return the [T, H, 576] queries and ``write()``,
    which stores this step's rows (nothing where they are ``written`` already: ``fxglm5::rms_norm_write_caches``
    wrote and validated them). The queries are the kernel set's latent query of q_nope, W_UK and q_pe, or, given
    ``q_latent`` [N, S, H, 576], that one (``fxglm5::fp8_linear_latent_query`` made it with their GEMM).

    The write is deferred so that the caller validates its attention arguments (which need the queries)
    before anything already cached is touched."""
    rope = _rope(rope_cos, rope_sin)
    norm = None if kv_norm_weight is None else (kv_norm_weight, kv_norm_eps)
    kv, pe = _flat(kv_c, "kv_c", 3), _flat(k_pe, "k_pe", 3)
    if validate:
        for name, t, nd in (("q_nope", q_nope, 4), ("q_pe", q_pe, 4), ("w_uk", w_uk, 3), ("w_uv", w_uv, 3)):
            if not isinstance(t, Tensor) or t.dim() != nd:
                raise InputError(f"{name}: expected {nd} dims, got {tuple(getattr(t, 'shape', ()))}")
        if w_uk.shape[0] != q_nope.shape[2] or w_uk.shape[1] != q_nope.shape[3] or w_uk.shape[2] != kv_c.shape[2]:
            raise InputError(f"w_uk: shape {tuple(w_uk.shape)} does not fit q_nope {tuple(q_nope.shape)} / "
                             f"kv_c {tuple(kv_c.shape)}")
        if w_uv.shape[0] != w_uk.shape[0] or w_uv.shape[2] != w_uk.shape[2]:
            raise InputError(f"w_uv: shape {tuple(w_uv.shape)} does not fit w_uk {tuple(w_uk.shape)}")
        if q_pe.shape[-1] != k_pe.shape[-1]:
            raise InputError(f"k_pe: rope dim {k_pe.shape[-1]} != q_pe's {q_pe.shape[-1]}")
        if q_pe.shape[-1] > paged.ROPE_DIM or w_uk.shape[2] > paged.KV_LORA_RANK:
            raise InputError(f"q_pe / w_uk: widths {q_pe.shape[-1]} / {w_uk.shape[2]} exceed the cache layout's "
                             f"{paged.ROPE_DIM} / {paged.KV_LORA_RANK}")
        if rope is not None and 2 * rope[0].shape[-1] != q_pe.shape[-1]:
            raise InputError(f"rope_cos: rotates {2 * rope[0].shape[-1]} features, q_pe / k_pe have {q_pe.shape[-1]}")
        _check_latent_cache(kv_cache, slot_mapping, block_table, req_idx, positions, max_positions)
        if not written:
            paged.validate_write_latent_cache(kv_cache, kv, pe, slot_mapping, norm, rope)
        if q_latent is not None and (not isinstance(q_latent, Tensor) or q_latent.dtype != q_nope.dtype
                                     or tuple(q_latent.shape) != (*q_nope.shape[:3], paged.LATENT_DIM)
                                     or q_latent.device != q_nope.device):
            raise InputError(f"q_latent: expected {q_nope.dtype} {(*q_nope.shape[:3], paged.LATENT_DIM)} on "
                             f"q_nope's device (the latent query of q_nope's heads), got "
                             f"{getattr(q_latent, 'dtype', type(q_latent))} {tuple(getattr(q_latent, 'shape', ()))}")
    if q_latent is None:
        q = kern.latent_query(_flat(q_nope, "q_nope", 4), w_uk, _flat(q_pe, "q_pe", 4), rope)
    else:
        q = _flat(q_latent, "q_latent", 4)

    def write():
        if not written:
            kern.write_latent_cache(kv_cache, kv, pe, slot_mapping, validate=False, norm=norm, rope=rope)

    return q, write


def _value_heads(o: Tensor, w_uv: Tensor, like: Tensor) -> Tensor:
    """The kernel set's [T, H, V] attention output (W_UV applied) back to q_nope's [N, S, H, V]."""
    return o.view(*like.shape[:3], w_uv.shape[1])


def sparse_mla_step(kern, q_nope, q_pe, kv_c, k_pe, w_uk, w_uv, topk_pos, scale, kv_cache, slot_mapping, block_table,
                    req_idx, positions, max_positions, rope_cos=None, rope_sin=None, kv_norm_weight=None,
                    kv_norm_eps=0.0, written=False, q_latent=None, *, validate=True):
    """rtp_sparse_mla's body over a kernel set ``kern`` (``paged`` = torch reference, or the Triton twins)."""
    q, write = _prepare_latent(kern, q_nope, q_pe, kv_c, k_pe, w_uk, w_uv, kv_cache, slot_mapping, block_table,
                               req_idx, positions, max_positions, rope_cos, rope_sin, kv_norm_weight, kv_norm_eps,
                               written, validate, q_latent)
    top = _flat(topk_pos, "topk_pos", 3)
    if validate:
        paged.validate_sparse_mla_paged(q, kv_cache, block_table, req_idx, top, scale)
        if top.numel() and bool((top.long() > positions.long()[:, None]).any()):
            raise InputError("topk_pos: a selected position lies after its query's position (not causal)")
    write()
    o = kern.sparse_mla_paged(q, kv_cache, block_table, req_idx, top, scale, validate=False, w_uv=w_uv)
    return _value_heads(o, w_uv, q_nope)


def mla_step(kern, q_nope, q_pe, kv_c, k_pe, w_uk, w_uv, scale, kv_cache, slot_mapping, block_table, req_idx,
             positions, max_positions, rope_cos=None, rope_sin=None, kv_norm_weight=None, kv_norm_eps=0.0,
             written=False, q_latent=None, *, validate=True):
    """rtp_mla's body over a kernel set ``kern`` (``paged`` = torch reference, or the Triton twins)."""
    q, write = _prepare_latent(kern, q_nope, q_pe, kv_c, k_pe, w_uk, w_uv, kv_cache, slot_mapping, block_table,
                               req_idx, positions, max_positions, rope_cos, rope_sin, kv_norm_weight, kv_norm_eps,
                               written, validate, q_latent)
    if validate:
        paged.validate_mla_paged(q, kv_cache, block_table, req_idx, positions, scale)
    write()
    o = kern.mla_paged(q, kv_cache, block_table, req_idx, positions, scale, validate=False, w_uv=w_uv)
    return _value_heads(o, w_uv, q_nope)


# ---------------------------------------------------------------------------------------------------------
# the query latent's RMSNorm with this step's cache writes (fxglm5::rms_norm_write_caches)
# ---------------------------------------------------------------------------------------------------------
def norm_write_caches_step(kern, x, weight, eps, kv_c, k_pe, kv_cache, k, index_cache, slot_mapping, block_table,
                           req_idx, positions, max_positions, rope_cos=None, rope_sin=None, kv_norm_weight=None,
                           kv_norm_eps=0.0, k_norm_weight=None, k_norm_bias=None, k_norm_eps=0.0, weights_x=None,
                           weights_proj=None, weights_scales=None, *, validate=True):
    """rms_norm_write_caches' body over a kernel set ``kern``: RMSNorm of the query latent ``x`` [N, S, Q] and the
    writes the attention ops of its layer would make, the latent rows (as rtp_*mla) and, given ``index_cache``, the
    indexer keys (as rtp_indexer), with their folded norms and RoPE; given ``weights_proj``, the indexer's head
    weights ``f32_linear(weights_x, weights_proj, weights_scales)`` too. Returns (the normed latent, the head weights
    or [N, S, 0] without them). Everything the writes, the norm and the weights read is validated before any
    cache changes, as those ops do."""
    rope = _rope(rope_cos, rope_sin)
    kv, pe = _flat(kv_c, "kv_c", 3), _flat(k_pe, "k_pe", 3)
    kv_norm = None if kv_norm_weight is None else (kv_norm_weight, kv_norm_eps)
    kf = None if k is None else _flat(k, "k", 3)
    index_norm = None if k_norm_weight is None else (k_norm_weight, k_norm_bias, k_norm_eps)
    head_weights = None if weights_proj is None else (weights_x, weights_proj, list(weights_scales or ()))
    if validate:
        norm_rope.validate_norm(x, weight, eps, what="q rms_norm")
        _check_latent_cache(kv_cache, slot_mapping, block_table, req_idx, positions, max_positions)
        if x.dim() != 3 or x.shape[0] * x.shape[1] != slot_mapping.shape[0]:
            raise InputError(f"x: expected [N, S, Q] with N * S = {slot_mapping.shape[0]} tokens, got {tuple(x.shape)}")
        paged.validate_write_latent_cache(kv_cache, kv, pe, slot_mapping, kv_norm, rope)
        if (k is None) != (index_cache is None):
            raise InputError("k / index_cache: give both or neither")
        if index_cache is not None:
            _check_index_cache(index_cache)
            check_context(index_cache, slot_mapping, block_table, req_idx, positions, max_positions)
            _validate_index_write(index_cache, kf, slot_mapping, index_norm, rope)
        if (weights_x is None) != (weights_proj is None):
            raise InputError("weights_x / weights_proj: give both or neither")
        if head_weights is not None:
            validate_f32_linear(*head_weights)
            if tuple(weights_x.shape[:-1]) != tuple(x.shape[:-1]):
                raise InputError(f"weights_x: expected the step's tokens {tuple(x.shape[:-1])} in its leading dims, "
                                 f"got {tuple(weights_x.shape)}")
    out = kern.rms_norm_write_caches(x, weight, eps, kv_cache, kv, pe, slot_mapping, index_cache, kf, kv_norm=kv_norm,
                                     index_norm=index_norm, rope=rope, head_weights=head_weights)
    if head_weights is None:
        return out, x.new_empty(*x.shape[:-1], 0, dtype=torch.float32)
    return out
