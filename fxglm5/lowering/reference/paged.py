"""Torch references for the paged-cache attention building blocks (exact semantics, any device).

Conventions (GLM-5, absorbed MLA):
- R = 512 (kv_lora_rank), DR = 64 (rope dim): a latent row is 576 wide, ``[c_kv 512 | k_pe 64]``.
- Queries are absorbed, ``q = [q_nope . W_UK (512) | q_pe (64)]`` per head; score = (q . row) * scale over
  the 576 dims; the values are the first 512 entries of each row; the output is the latent ``o_lat [.., H, 512]``.
- Paging: slot of position ``p`` of request ``r`` = ``block_table[r, p // bs] * bs + p % bs`` with
  ``bs = cache.shape[1]``. Block 0 is reserved (never a real block); block tables are padded with 0.

Cache layouts:
- latent, compute dtype: ``[num_blocks, bs, 576]`` (bf16 / fp16 / fp32), one row per token.
- latent, FP8 "ds_mla": uint8 ``[num_blocks, bs, 656]``, one row per token: bytes 0..511 e4m3 c_kv, bytes
  512..527 four float32 scales (scale i covers c_kv[128i : 128i+128]), bytes 528..655 64 bf16 k_pe (not
  quantized).
- indexer keys: uint8 ``[num_blocks, bs, 132]``, 132 bytes per token but block-major inside a block: the block's
  ``bs`` e4m3 keys (128 bytes each, token order), then their ``bs`` float32 scales. This is the layout RTP-LLM's
  (and vLLM's) ``indexer_k_quant_and_cache`` writes and DeepGEMM's paged MQA logits reads; it also makes the
  keys of a block one contiguous, 16-byte aligned run (wide loads), which per-token 132-byte rows are not.
  :func:`indexer_cache_parts` gives the two parts as views.

FP8 scale rule (shared by every writer, the Triton kernels and the indexer's query quantization):
``scale = 2 ** ceil(log2(max(amax, 1e-10) / 448))``, i.e. ``amax / 448`` rounded UP to a power of two,
computed exactly on the float32 bits (exponent + 1 when the mantissa is non-zero). The stored value is
``e4m3(x / scale)`` (round to nearest even; |x / scale| <= 448 by construction), dequantized as ``e4m3 * scale``.

Validation lives in separate ``validate_*`` functions (raising :class:`fxglm5.errors.InputError` naming the
argument) so that CUDA-graph code paths can skip them; the public functions call them unless
``validate=False``.
"""

from __future__ import annotations

import torch

from fxglm5 import contracts
from fxglm5.contracts import (COMPUTE_DTYPES, FP8_BLOCK, FP8_MAX, FP8_ROPE_OFFSET, FP8_ROW_BYTES, FP8_SCALE_OFFSET,
                              INDEX_DIM, INDEX_ROW_BYTES, KV_LORA_RANK, LATENT_DIM, ROPE_DIM, topk_lowest_index_ties)
from fxglm5.errors import InputError
from fxglm5.lowering.reference import fused, norm_rope
# latent_query, fp8_linear_latent_query: a paged step's kernels, defined beside the fused ops whose references they are
# part of
from fxglm5.lowering.reference.fused import fp8_linear_latent_query, latent_query, pad_last

FP8_GROUP = FP8_BLOCK
AMAX_FLOOR = 1e-10
_INT_DTYPES = (torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)

__all__ = [
    "fp8_pow2_scale",
    "quantize_fp8_groups",
    "slots_from_positions",
    "validate_slots_from_positions",
    "write_latent_cache",
    "write_index_keys",
    "rms_norm_write_caches",
    "latent_query",
    "fp8_linear_latent_query",
    "project_out",
    "validate_project_out",
    "prepare_latent_rows",
    "prepare_index_keys",
    "validate_index_keys",
    "validate_write_latent_cache",
    "write_indexer_cache",
    "validate_write_indexer_cache",
    "write_exact_index_keys",
    "exact_indexer_topk_paged",
    "read_latent_rows",
    "read_indexer_rows",
    "indexer_cache_parts",
    "validate_read_rows",
    "mla_paged",
    "validate_mla_paged",
    "sparse_mla_paged",
    "validate_sparse_mla_paged",
    "indexer_logits_paged",
    "indexer_topk_paged",
    "rotated_queries",
    "validate_indexer_topk_paged",
    "is_fp8_latent_cache",
]


# ----------------------------------------------------------------------------------------------------------
# FP8 helpers
# ----------------------------------------------------------------------------------------------------------
def fp8_pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """``amax / 448`` (amax floored at 1e-10) rounded up to a power of two, exactly, in float32."""
    s = amax.float().clamp_min(AMAX_FLOOR) / FP8_MAX
    bits = s.view(torch.int32)
    exp = (bits >> 23) & 0xFF
    exp = exp + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exp << 23).view(torch.float32)


def quantize_fp8_groups(x: torch.Tensor, group: int = FP8_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the last dim of ``x`` in groups of ``group`` values -> (e4m3 [..., D], float32 scales [..., D/group])."""
    shp = x.shape
    xg = x.float().reshape(*shp[:-1], shp[-1] // group, group)
    scale = fp8_pow2_scale(xg.abs().amax(dim=-1))
    q = (xg / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(shp), scale


def is_fp8_latent_cache(cache: torch.Tensor) -> bool:
    return cache.dtype == torch.uint8


# ----------------------------------------------------------------------------------------------------------
# validation helpers
# ----------------------------------------------------------------------------------------------------------
def _check_tensor(name: str, t, ndim: int | None = None, dtypes=None):
    if not isinstance(t, torch.Tensor):
        raise InputError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise InputError(f"{name}: expected {ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise InputError(f"{name}: dtype {t.dtype} not supported (expected one of {list(dtypes)})")


def _check_topk(topk):
    if not isinstance(topk, int) or topk < 1:
        raise InputError(f"topk: must be a positive int, got {topk!r}")


def _check_device(ref_name: str, ref: torch.Tensor, **others):
    for n, t in others.items():
        if t.device != ref.device:
            raise InputError(f"{n}: on {t.device}, but {ref_name} is on {ref.device}")


def _validate_latent_cache(cache, name="cache"):
    _check_tensor(name, cache, 3)
    if cache.dtype == torch.uint8:
        if cache.shape[2] != FP8_ROW_BYTES:
            raise InputError(f"{name}: uint8 (FP8 ds_mla) latent cache rows must be {FP8_ROW_BYTES} bytes, "
                             f"got shape {tuple(cache.shape)}")
    elif cache.dtype in COMPUTE_DTYPES:
        if cache.shape[2] != LATENT_DIM:
            raise InputError(f"{name}: latent cache rows must be {LATENT_DIM} wide, got shape {tuple(cache.shape)}")
    else:
        raise InputError(f"{name}: dtype {cache.dtype} not supported (uint8 ds_mla or bf16/fp16/fp32)")
    if not cache.is_contiguous():
        raise InputError(f"{name}: must be contiguous")
    if cache.shape[0] < 1 or cache.shape[1] < 1:
        raise InputError(f"{name}: empty cache shape {tuple(cache.shape)}")


def _validate_indexer_cache(cache, name="cache"):
    _check_tensor(name, cache, 3, (torch.uint8,))
    if cache.shape[2] != INDEX_ROW_BYTES:
        raise InputError(f"{name}: indexer cache rows must be {INDEX_ROW_BYTES} bytes, got shape {tuple(cache.shape)}")
    if not cache.is_contiguous():
        raise InputError(f"{name}: must be contiguous")


def _validate_slots(slots, num_slots: int, name: str, allow_negative: bool):
    _check_tensor(name, slots, 1, _INT_DTYPES)
    if slots.numel() == 0:
        return
    mx = int(slots.max())
    mn = int(slots.min())
    if mx >= num_slots:
        raise InputError(f"{name}: slot {mx} out of range (cache has {num_slots} slots)")
    if allow_negative:
        valid = slots[slots >= 0]
        if valid.numel() and int(valid.min()) < 0:
            raise InputError(f"{name}: negative slot")
    elif mn < 0:
        raise InputError(f"{name}: slot {mn} out of range (must be >= 0)")


def _validate_block_table(block_table, num_blocks: int, name="block_table"):
    _check_tensor(name, block_table, 2, _INT_DTYPES)
    if block_table.numel():
        mx, mn = int(block_table.max()), int(block_table.min())
        if mx >= num_blocks or mn < 0:
            raise InputError(f"{name}: block id {mx if mx >= num_blocks else mn} out of range [0, {num_blocks})")


def _validate_req_pos(req_idx, positions, block_table, block_size, T, *, pos_name="positions"):
    _check_tensor("req_idx", req_idx, 1, _INT_DTYPES)
    if req_idx.shape[0] != T:
        raise InputError(f"req_idx: expected {T} entries, got {req_idx.shape[0]}")
    B, max_blocks = block_table.shape
    if T and (int(req_idx.min()) < 0 or int(req_idx.max()) >= B):
        raise InputError(f"req_idx: request index out of range [0, {B})")
    if positions is not None:
        _check_tensor(pos_name, positions, 1, _INT_DTYPES)
        if positions.shape[0] != T:
            raise InputError(f"{pos_name}: expected {T} entries, got {positions.shape[0]}")
        if T and int(positions.min()) < 0:
            raise InputError(f"{pos_name}: negative position {int(positions.min())}")
        if T and int(positions.max()) >= max_blocks * block_size:
            raise InputError(f"{pos_name}: position {int(positions.max())} beyond the block table "
                             f"({max_blocks} blocks of {block_size})")
        if T:
            # every block a query can see must be a real block (block 0 is reserved)
            last_blk = (positions.long() // block_size)
            bt = block_table.long()[req_idx.long()]
            ar = torch.arange(max_blocks, device=bt.device)
            used = ar.unsqueeze(0) <= last_blk.unsqueeze(1)
            if bool(((bt == 0) & used).any()):
                raise InputError(f"block_table: a position in {pos_name} maps to block 0 (reserved / padding)")


# ----------------------------------------------------------------------------------------------------------
# slots
# ----------------------------------------------------------------------------------------------------------
def validate_slots_from_positions(block_table, req_idx, positions, block_size: int):
    _check_tensor("block_table", block_table, 2, _INT_DTYPES)
    _check_tensor("req_idx", req_idx, 1, _INT_DTYPES)
    _check_tensor("positions", positions, 1, _INT_DTYPES)
    if req_idx.shape != positions.shape:
        raise InputError(f"positions: shape {tuple(positions.shape)} != req_idx shape {tuple(req_idx.shape)}")
    if not isinstance(block_size, int) or block_size < 1:
        raise InputError(f"block_size: must be a positive int, got {block_size!r}")
    B, mb = block_table.shape
    if req_idx.numel():
        if int(req_idx.min()) < 0 or int(req_idx.max()) >= B:
            raise InputError(f"req_idx: request index out of range [0, {B})")
        if int(positions.min()) < 0 or int(positions.max()) >= mb * block_size:
            raise InputError(f"positions: out of range [0, {mb * block_size})")


def slots_from_positions(block_table, req_idx, positions, block_size: int = 64, *, validate: bool = True):
    """int64 [T] physical slots: ``block_table[req, p // bs] * bs + p % bs``."""
    if validate:
        validate_slots_from_positions(block_table, req_idx, positions, block_size)
    return contracts.slots(block_table, req_idx, positions, block_size)


def _slots_2d(block_table, req_idx, pos2d, block_size):
    """Slots for a [T, K] position matrix (negatives -> slot -1)."""
    p = pos2d.long()
    valid = p >= 0
    pc = p.clamp_min(0)
    blk = block_table.long()[req_idx.long().unsqueeze(1), pc // block_size]
    s = blk * block_size + pc % block_size
    return torch.where(valid, s, torch.full_like(s, -1))


# ----------------------------------------------------------------------------------------------------------
# cache writes / reads
# ----------------------------------------------------------------------------------------------------------
def validate_write_latent_cache(cache, kv_c, k_pe, slot_mapping, norm=None, rope=None):
    """kv_c [T, <=512] and k_pe [T, <=64] (narrower rows are zero-padded); ``norm`` = (weight, eps) of the
    RMSNorm still to apply to kv_c, ``rope`` = (cos, sin) [T, DR/2] of the RoPE still to apply to k_pe."""
    _validate_latent_cache(cache)
    _check_tensor("kv_c", kv_c, 2, COMPUTE_DTYPES)
    _check_tensor("k_pe", k_pe, 2, COMPUTE_DTYPES)
    if kv_c.shape[1] > KV_LORA_RANK:
        raise InputError(f"kv_c: expected [T, <= {KV_LORA_RANK}], got {tuple(kv_c.shape)}")
    if k_pe.shape[1] > ROPE_DIM:
        raise InputError(f"k_pe: expected [T, <= {ROPE_DIM}], got {tuple(k_pe.shape)}")
    if k_pe.shape[0] != kv_c.shape[0]:
        raise InputError(f"k_pe: {k_pe.shape[0]} tokens but kv_c has {kv_c.shape[0]}")
    _check_tensor("slot_mapping", slot_mapping, 1, _INT_DTYPES)
    if slot_mapping.shape[0] != kv_c.shape[0]:
        raise InputError(f"slot_mapping: {slot_mapping.shape[0]} entries but kv_c has {kv_c.shape[0]} tokens")
    _check_device("cache", cache, kv_c=kv_c, k_pe=k_pe, slot_mapping=slot_mapping)
    if norm is not None:
        norm_rope.validate_norm(kv_c, *norm, what="kv_c rms_norm")
    if rope is not None:
        norm_rope.validate_rope(k_pe, *rope)
    _validate_slots(slot_mapping, cache.shape[0] * cache.shape[1], "slot_mapping", allow_negative=True)


def prepare_latent_rows(kv_c, k_pe, norm=None, rope=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The values a latent row stores: kv_c RMS-normed (``norm``), k_pe rotated (``rope``), zero-padded to 512 / 64."""
    if norm is not None:
        kv_c = norm_rope.rms_norm(kv_c, *norm)
    if rope is not None:
        k_pe = norm_rope.rope_interleaved(k_pe, *rope)
    return pad_last(kv_c, KV_LORA_RANK), pad_last(k_pe, ROPE_DIM)


def validate_project_out(q, w_uv):
    """W_UV [H, V, <=512] for the attention of the [T, H, 576] queries ``q``."""
    _check_tensor("w_uv", w_uv, 3, COMPUTE_DTYPES)
    if w_uv.shape[0] != q.shape[1] or w_uv.shape[2] > KV_LORA_RANK:
        raise InputError(f"w_uv: expected [{q.shape[1]}, V, <= {KV_LORA_RANK}] for q {tuple(q.shape)}, "
                         f"got {tuple(w_uv.shape)}")
    _check_device("q", q, w_uv=w_uv)


def project_out(o_lat, w_uv) -> torch.Tensor:
    """[T, H, 512] latent outputs x W_UV [H, V, R] (their first R columns) -> the value heads [T, H, V], in o_lat's
    dtype (the model's, as :func:`latent_query`'s product: float32 accumulation, one rounding)."""
    return torch.einsum("thr,hvr->thv", o_lat[..., : w_uv.shape[2]], w_uv.to(o_lat.dtype)).contiguous()


def write_latent_cache(cache, kv_c, k_pe, slot_mapping, *, validate: bool = True, norm=None, rope=None) -> None:
    """Write ``[kv_c | k_pe]`` rows at ``slot_mapping`` (slot < 0: padding, skipped), in place; ``norm`` / ``rope``
    as in :func:`prepare_latent_rows`."""
    if validate:
        validate_write_latent_cache(cache, kv_c, k_pe, slot_mapping, norm, rope)
    kv_c, k_pe = prepare_latent_rows(kv_c, k_pe, norm, rope)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    if slots.numel() == 0:
        return
    kv = kv_c[keep]
    pe = k_pe[keep]
    flat = cache.view(-1, cache.shape[-1])
    if cache.dtype == torch.uint8:
        q, sc = quantize_fp8_groups(kv)
        row = torch.empty(slots.numel(), FP8_ROW_BYTES, dtype=torch.uint8, device=cache.device)
        row[:, :FP8_SCALE_OFFSET] = q.view(torch.uint8)
        row[:, FP8_SCALE_OFFSET:FP8_ROPE_OFFSET] = sc.contiguous().view(torch.uint8)
        row[:, FP8_ROPE_OFFSET:] = pe.to(torch.bfloat16).contiguous().view(torch.uint8)
        flat[slots] = row
    else:
        flat[slots] = torch.cat([kv, pe], dim=1).to(cache.dtype)


def validate_write_indexer_cache(cache, k, slot_mapping, norm=None, rope=None):
    """k [T, <=128] (narrower keys are zero-padded); ``norm`` / ``rope`` as in :func:`validate_index_keys`."""
    _validate_indexer_cache(cache)
    validate_index_keys(k, norm, rope)
    _check_tensor("slot_mapping", slot_mapping, 1, _INT_DTYPES)
    if slot_mapping.shape[0] != k.shape[0]:
        raise InputError(f"slot_mapping: {slot_mapping.shape[0]} entries but k has {k.shape[0]} tokens")
    _check_device("cache", cache, k=k, slot_mapping=slot_mapping)
    _validate_slots(slot_mapping, cache.shape[0] * cache.shape[1], "slot_mapping", allow_negative=True)


def validate_index_keys(k, norm=None, rope=None):
    """k [T, <=128]; ``norm`` = (weight, bias, eps) of the LayerNorm still to apply, ``rope`` = (cos, sin) [T, R/2]
    of the RoPE still to apply to its first R features."""
    _check_tensor("k", k, 2, COMPUTE_DTYPES)
    if k.shape[1] > INDEX_DIM:
        raise InputError(f"k: expected [T, <= {INDEX_DIM}], got {tuple(k.shape)}")
    if norm is not None:
        weight, bias, eps = norm
        if bias is None:
            raise InputError("k layer_norm bias: required with its weight (the indexer's LayerNorm)")
        norm_rope.validate_norm(k, weight, eps, bias, what="k layer_norm")
    if rope is not None:
        norm_rope.validate_rope(k, *rope)


def prepare_index_keys(k, norm=None, rope=None) -> torch.Tensor:
    """The keys the indexer cache stores: LayerNorm (``norm``), RoPE on the first features (``rope``), padded to 128."""
    if norm is not None:
        k = norm_rope.layer_norm(k, *norm)
    if rope is not None:
        k = norm_rope.rope_interleaved(k, *rope)
    return pad_last(k, INDEX_DIM)


def indexer_cache_parts(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of an FP8 indexer cache ``[nb, bs, 132]``: the e4m3 keys as uint8 ``[nb, bs, 128]`` and their
    scales as float32 ``[nb, bs]`` (block-major: each block holds its keys, then its scales)."""
    nb, bs, _ = cache.shape
    per_block = cache.view(nb, bs * INDEX_ROW_BYTES)
    keys = per_block[:, : bs * INDEX_DIM].view(nb, bs, INDEX_DIM)
    scales = per_block[:, bs * INDEX_DIM:].view(torch.float32)
    return keys, scales


def write_indexer_cache(cache, k, slot_mapping, *, validate: bool = True, norm=None, rope=None) -> None:
    """Write FP8 indexer keys (one power-of-two scale per 128-vector) at ``slot_mapping``, in place; ``norm`` /
    ``rope`` as in :func:`prepare_index_keys`."""
    if validate:
        validate_write_indexer_cache(cache, k, slot_mapping, norm, rope)
    k = prepare_index_keys(k, norm, rope)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    if slots.numel() == 0:
        return
    q, sc = quantize_fp8_groups(k[keep])
    keys, scales = indexer_cache_parts(cache)
    blk, off = slots // cache.shape[1], slots % cache.shape[1]
    keys[blk, off] = q.view(torch.uint8)
    scales[blk, off] = sc[:, 0]


def write_exact_index_keys(cache, k, slot_mapping, *, norm=None, rope=None) -> None:
    """Write indexer keys unquantized into a compute-dtype cache ``[blocks, bs, 128]`` (the exact mode) at
    ``slot_mapping`` (negative slots write nothing), in place; ``norm`` / ``rope`` as in :func:`prepare_index_keys`.
    The caller validated the cache and the keys (``paged_steps.indexer_step``)."""
    k = prepare_index_keys(k, norm, rope)
    keep = slot_mapping >= 0
    cache.view(-1, INDEX_DIM)[slot_mapping[keep].long()] = k[keep].to(cache.dtype)


def write_index_keys(cache, k, slot_mapping, *, norm=None, rope=None) -> None:
    """Either index cache's write (the caller validated): FP8 rows into a uint8 cache (:func:`write_indexer_cache`),
    the exact keys into a compute-dtype one (:func:`write_exact_index_keys`)."""
    if cache.dtype == torch.uint8:
        write_indexer_cache(cache, k, slot_mapping, validate=False, norm=norm, rope=rope)
    else:
        write_exact_index_keys(cache, k, slot_mapping, norm=norm, rope=rope)


def rms_norm_write_caches(x, weight, eps, kv_cache, kv_c, k_pe, slot_mapping, index_cache=None, k=None, *,
                          kv_norm=None, index_norm=None, rope=None, head_weights=None):
    """The chain ``fxglm5::rms_norm_write_caches`` stands for (the caller validated): this step's latent rows written
    (:func:`write_latent_cache`), its indexer keys too given ``index_cache`` (:func:`write_index_keys`), and the
    query latent's RMSNorm ``norm_rope.rms_norm(x, weight, eps)`` returned; given ``head_weights`` = (h, W, scales),
    the indexer's head weights ``fused.f32_linear(h, W, scales)`` returned after it. Each reads only its own
    inputs."""
    write_latent_cache(kv_cache, kv_c, k_pe, slot_mapping, validate=False, norm=kv_norm, rope=rope)
    if index_cache is not None:
        write_index_keys(index_cache, k, slot_mapping, norm=index_norm, rope=rope)
    normed = norm_rope.rms_norm(x, weight, eps)
    return normed if head_weights is None else (normed, fused.f32_linear(*head_weights))


def exact_indexer_topk_paged(q, weights, cache, block_table, req_idx, positions, topk: int, *,
                             rope=None) -> torch.Tensor:
    """The exact (unquantized) indexer over a compute-dtype key cache ``[blocks, bs, 128]`` -> int32 [T, topk]:
    score[t, s] = sum_h weights[t, h] * relu(q[t, h] . k[s]) in float32 for s in 0..positions[t], the lower
    position first among equal scores (the rule of every indexer path), -1 padded. ``rope`` = (cos, sin) [T, R/2]:
    q's first R features are rotated first (:func:`rotated_queries`)."""
    q = rotated_queries(q, rope)
    T, bs = q.shape[0], cache.shape[1]
    out = torch.full((T, topk), -1, dtype=torch.int32, device=q.device)
    for t in range(T):
        n = int(positions[t]) + 1
        slots = slots_from_positions(block_table, req_idx[t].expand(n), torch.arange(n, device=q.device), bs,
                                     validate=False)
        keys = cache.view(-1, cache.shape[-1])[slots].float()
        score = (torch.relu(q[t].float() @ keys.t()) * weights[t].float()[:, None]).sum(0)
        k = min(topk, n)
        out[t, :k] = topk_lowest_index_ties(score, k)[1].to(torch.int32)
    return out


def validate_read_rows(cache, slots, kind: str = "latent"):
    if kind == "latent":
        _validate_latent_cache(cache)
    else:
        _validate_indexer_cache(cache)
    _validate_slots(slots, cache.shape[0] * cache.shape[1], "slots", allow_negative=False)


def read_latent_rows(cache, slots, *, validate: bool = True) -> torch.Tensor:
    """float32 [n, 576] dequantized latent rows at ``slots``."""
    if validate:
        validate_read_rows(cache, slots, "latent")
    flat = cache.view(-1, cache.shape[-1])
    rows = flat[slots.long()]
    if cache.dtype != torch.uint8:
        return rows.float()
    n = rows.shape[0]
    c = rows[:, :FP8_SCALE_OFFSET].contiguous().view(torch.float8_e4m3fn).float()
    sc = rows[:, FP8_SCALE_OFFSET:FP8_ROPE_OFFSET].contiguous().view(torch.float32)  # [n, 4]
    c = (c.view(n, 4, FP8_GROUP) * sc.unsqueeze(-1)).view(n, KV_LORA_RANK)
    pe = rows[:, FP8_ROPE_OFFSET:].contiguous().view(torch.bfloat16).float()
    return torch.cat([c, pe], dim=1)


def read_indexer_rows(cache, slots, *, validate: bool = True) -> torch.Tensor:
    """float32 [n, 128] dequantized indexer keys at ``slots``."""
    if validate:
        validate_read_rows(cache, slots, "indexer")
    keys, scales = indexer_cache_parts(cache)
    blk, off = slots.long() // cache.shape[1], slots.long() % cache.shape[1]
    return keys[blk, off].view(torch.float8_e4m3fn).float() * scales[blk, off][:, None]


# ----------------------------------------------------------------------------------------------------------
# attention
# ----------------------------------------------------------------------------------------------------------
def _validate_q(q, name="q", width=LATENT_DIM):
    _check_tensor(name, q, 3, COMPUTE_DTYPES)
    if q.shape[2] != width:
        raise InputError(f"{name}: expected [T, H, {width}], got {tuple(q.shape)}")


def validate_mla_paged(q, cache, block_table, req_idx, positions, scale):
    _validate_q(q)
    _validate_latent_cache(cache)
    _validate_block_table(block_table, cache.shape[0])
    _check_device("q", q, cache=cache, block_table=block_table, req_idx=req_idx, positions=positions)
    _validate_req_pos(req_idx, positions, block_table, cache.shape[1], q.shape[0])
    if not isinstance(scale, (int, float)) or not scale > 0:
        raise InputError(f"scale: must be a positive number, got {scale!r}")


def mla_paged(q, cache, block_table, req_idx, positions, scale: float, *, validate: bool = True, w_uv=None):
    """Causal, prefix-aware MLA over the paged latent cache -> [T, H, 512] in q.dtype; with ``w_uv`` the value
    heads :func:`project_out` makes of that, [T, H, V].

    Query t attends to positions 0..positions[t] (inclusive) of request req_idx[t].
    """
    if validate:
        validate_mla_paged(q, cache, block_table, req_idx, positions, scale)
        if w_uv is not None:
            validate_project_out(q, w_uv)
    T, H, _ = q.shape
    bs = cache.shape[1]
    out = torch.zeros(T, H, KV_LORA_RANK, dtype=torch.float32, device=q.device)
    for t in range(T):
        n = int(positions[t]) + 1
        pos = torch.arange(n, device=q.device)
        slots = slots_from_positions(block_table, req_idx[t].expand(n), pos, bs, validate=False)
        rows = read_latent_rows(cache, slots, validate=False)
        s = (q[t].float() @ rows.t()) * scale
        p = torch.softmax(s, dim=-1)
        out[t] = p @ rows[:, :KV_LORA_RANK]
    return _projected(out.to(q.dtype), w_uv)


def _projected(o_lat, w_uv):
    return o_lat if w_uv is None else project_out(o_lat, w_uv)


def validate_sparse_mla_paged(q, cache, block_table, req_idx, topk_pos, scale):
    _validate_q(q)
    _validate_latent_cache(cache)
    _validate_block_table(block_table, cache.shape[0])
    _check_tensor("topk_pos", topk_pos, 2, _INT_DTYPES)
    if topk_pos.shape[0] != q.shape[0]:
        raise InputError(f"topk_pos: {topk_pos.shape[0]} rows but q has {q.shape[0]} tokens")
    _check_device("q", q, cache=cache, block_table=block_table, req_idx=req_idx, topk_pos=topk_pos)
    _validate_req_pos(req_idx, None, block_table, cache.shape[1], q.shape[0])
    bs = cache.shape[1]
    if topk_pos.numel():
        if int(topk_pos.max()) >= block_table.shape[1] * bs:
            raise InputError(f"topk_pos: position {int(topk_pos.max())} beyond the block table "
                             f"({block_table.shape[1]} blocks of {bs})")
        if int(topk_pos.min()) < -1:
            raise InputError(f"topk_pos: {int(topk_pos.min())} is invalid (-1 marks unused entries)")
        blk = block_table.long()[req_idx.long().unsqueeze(1), topk_pos.long().clamp_min(0) // bs]
        if bool(((blk == 0) & (topk_pos >= 0)).any()):
            raise InputError("topk_pos: a listed position maps to block 0 (reserved / padding) in block_table")
    if not isinstance(scale, (int, float)) or not scale > 0:
        raise InputError(f"scale: must be a positive number, got {scale!r}")


def sparse_mla_paged(q, cache, block_table, req_idx, topk_pos, scale: float, *, validate: bool = True, w_uv=None):
    """MLA whose softmax runs only over the listed positions (-1 = unused) -> [T, H, 512] in q.dtype; with
    ``w_uv`` the value heads :func:`project_out` makes of that, [T, H, V].

    A row without any valid entry gives zeros.
    """
    if validate:
        validate_sparse_mla_paged(q, cache, block_table, req_idx, topk_pos, scale)
        if w_uv is not None:
            validate_project_out(q, w_uv)
    T, H, _ = q.shape
    bs = cache.shape[1]
    out = torch.zeros(T, H, KV_LORA_RANK, dtype=torch.float32, device=q.device)
    if T == 0 or topk_pos.shape[1] == 0:
        return _projected(out.to(q.dtype), w_uv)
    slots = _slots_2d(block_table, req_idx, topk_pos, bs)  # [T, K]
    valid = slots >= 0
    rows = read_latent_rows(cache, slots.clamp_min(0).reshape(-1), validate=False).view(T, -1, LATENT_DIM)
    rows = torch.where(valid.unsqueeze(-1), rows, 0.0)  # unused entries read slot 0, whose bytes may be stale (NaN)
    s = torch.einsum("thd,tkd->thk", q.float(), rows) * scale
    s = s.masked_fill(~valid.unsqueeze(1), float("-inf"))
    any_valid = valid.any(dim=1)
    p = torch.softmax(s, dim=-1)
    p = torch.where(any_valid.view(T, 1, 1), p, torch.zeros_like(p))
    out = torch.einsum("thk,tkd->thd", p, rows[:, :, :KV_LORA_RANK])
    return _projected(out.to(q.dtype), w_uv)


# ----------------------------------------------------------------------------------------------------------
# DSA lightning indexer
# ----------------------------------------------------------------------------------------------------------
def validate_indexer_topk_paged(q, weights, k_cache, block_table, req_idx, positions, topk):
    _check_tensor("q", q, 3, COMPUTE_DTYPES)
    if q.shape[2] != INDEX_DIM:
        raise InputError(f"q: expected [T, HI, {INDEX_DIM}], got {tuple(q.shape)}")
    _check_tensor("weights", weights, 2, (torch.float32,))
    if tuple(weights.shape) != tuple(q.shape[:2]):
        raise InputError(f"weights: expected shape {tuple(q.shape[:2])} ([T, HI]), got {tuple(weights.shape)}")
    _validate_indexer_cache(k_cache, "k_cache")
    _validate_block_table(block_table, k_cache.shape[0])
    _check_device("q", q, weights=weights, k_cache=k_cache, block_table=block_table, req_idx=req_idx,
                  positions=positions)
    _validate_req_pos(req_idx, positions, block_table, k_cache.shape[1], q.shape[0])
    _check_topk(topk)


def validate_topk_from_logits(logits, positions, topk, out=None):
    """The selection's own inputs: float32 [T, L] scores with unit column stride, [T] integer positions, a
    positive int top-k, and (if given) an int32 [T, topk] output, all on one device."""
    _check_tensor("logits", logits, 2, (torch.float32,))
    if logits.dim() == 2 and logits.shape[1] > 1 and logits.stride(1) != 1:
        raise InputError(f"logits: columns must be contiguous (stride(1) == 1), got strides {logits.stride()}")
    _check_tensor("positions", positions, 1, (torch.int32, torch.int64))
    if positions.shape[0] != logits.shape[0]:
        raise InputError(f"positions: expected {logits.shape[0]} entries (one per logits row), "
                         f"got {positions.shape[0]}")
    _check_topk(topk)
    _check_device("logits", logits, positions=positions)
    if out is not None:
        _check_tensor("out", out, 2, (torch.int32,))
        if tuple(out.shape) != (logits.shape[0], topk) or (topk > 1 and out.stride(1) != 1):
            raise InputError(f"out: expected a contiguous-row int32 [{logits.shape[0]}, {topk}], "
                             f"got shape {tuple(out.shape)} strides {out.stride()}")
        _check_device("logits", logits, out=out)


def rotated_queries(q, rope):
    """The indexer's queries [T, HI, 128] as the selection scores them: ``rope`` = (cos, sin) [T, R/2] rotates each
    head's first R features (``norm_rope.rope_interleaved``, rounded to q's dtype as the standalone RoPE rounds:
    the selection sees the values the unfused chain would have stored); None leaves q as it is."""
    return q if rope is None else norm_rope.rope_interleaved(q, *rope)


def indexer_logits_paged(q, weights, k_cache, block_table, req_idx, positions, max_len: int | None = None):
    """float32 [T, max_len] indexer scores; positions beyond the causal window are -inf."""
    T, HI, _ = q.shape
    bs = k_cache.shape[1]
    if max_len is None:
        max_len = int(positions.max()) + 1 if T else 0
    qq, qs = quantize_fp8_groups(q)  # [T, HI, 128], [T, HI, 1]
    q_deq = qq.float() * qs
    out = torch.full((T, max_len), float("-inf"), dtype=torch.float32, device=q.device)
    for t in range(T):
        n = min(int(positions[t]) + 1, max_len)
        pos = torch.arange(n, device=q.device)
        slots = slots_from_positions(block_table, req_idx[t].expand(n), pos, bs, validate=False)
        k = read_indexer_rows(k_cache, slots, validate=False)  # [n, 128]
        s = torch.relu(q_deq[t] @ k.t())  # [HI, n]
        out[t, :n] = (weights[t].float().unsqueeze(1) * s).sum(0)
    return out


def indexer_topk_paged(q, weights, k_cache, block_table, req_idx, positions, topk: int, *,
                       validate: bool = True, rope=None) -> torch.Tensor:
    """DSA lightning indexer -> int32 [T, topk] positions of the best scores, -1 padded. Among equal scores
    the lower position wins (:func:`~fxglm5.lowering.reference.attention.topk_lowest_index_ties`, which also
    fixes this reference's order: descending score, then position; kernels may list the set in any order).

    q [T, HI, 128] (rotated first where ``rope`` = (cos, sin) [T, R/2] is given: :func:`rotated_queries`) is
    quantized per (token, head) to e4m3 with a power-of-two scale (the cache rule);
    score[t, s] = sum_h weights[t, h] * relu(q_deq[t, h] . k_deq[s]) for s in 0..positions[t].
    """
    if validate:
        validate_indexer_topk_paged(q, weights, k_cache, block_table, req_idx, positions, topk)
        if rope is not None:
            norm_rope.validate_rope(q, *rope)
    q = rotated_queries(q, rope)
    T = q.shape[0]
    out = torch.full((T, topk), -1, dtype=torch.int32, device=q.device)
    if T == 0:
        return out
    logits = indexer_logits_paged(q, weights, k_cache, block_table, req_idx, positions)
    k = min(topk, logits.shape[1])
    idx = topk_lowest_index_ties(logits, k)[1].to(torch.int32)
    n_valid = (positions.long() + 1).unsqueeze(1)
    col = torch.arange(k, device=q.device).unsqueeze(0)
    out[:, :k] = torch.where(col < n_valid, idx, torch.full_like(idx, -1))
    return out
