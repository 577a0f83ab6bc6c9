"""The byte contracts every layer shares: FP8 blocks, the paged-cache row layouts, the slot formula, the tie rule.

A leaf module (it imports only torch), so the model, the kernels, the runtime and the RTP plugin all read these
numbers from one place instead of keeping copies that could drift apart.

- FP8 (GLM-5-FP8 / DeepSeek-V3): weights are e4m3 with one float32 ``weight_scale_inv`` per
  ``FP8_BLOCK`` x ``FP8_BLOCK`` block (:func:`scale_shape`); activations and cache rows are quantized in
  groups of ``FP8_BLOCK`` values; ``FP8_MAX`` is e4m3's largest finite value.
- Latent cache rows (absorbed MLA): ``[c_kv KV_LORA_RANK | k_pe ROPE_DIM]``, ``LATENT_DIM`` (576) values in the
  compute dtype, or the FP8 "ds_mla" row of ``FP8_ROW_BYTES`` (656) bytes: 512 e4m3 c_kv at 0, four float32
  scales at ``FP8_SCALE_OFFSET`` (512), 64 bf16 k_pe at ``FP8_ROPE_OFFSET`` (528).
- Indexer cache: ``INDEX_ROW_BYTES`` (132) bytes per token, ``INDEX_DIM`` (128) e4m3 key bytes + one float32
  scale, block-major inside a block (see ``fxglm5.lowering.reference.paged``).
- ``COMPUTE_DTYPES``: the dtypes a model computes in, and so the dtypes of the caches that are not FP8.
- Paging: :func:`slots` (position ``p`` of request ``r`` lives at ``block_table[r, p // bs] * bs + p % bs``).
- Top-k: :func:`topk_lowest_index_ties` (among equal scores the lower index wins), for every indexer path.
"""

from __future__ import annotations

import torch

FP8_BLOCK = 128
FP8_MAX = 448.0
KV_LORA_RANK = 512
ROPE_DIM = 64
LATENT_DIM = KV_LORA_RANK + ROPE_DIM  # 576
FP8_SCALE_OFFSET = KV_LORA_RANK  # 512: four float32 scales, one per FP8_BLOCK values of c_kv
FP8_ROPE_OFFSET = FP8_SCALE_OFFSET + 4 * (KV_LORA_RANK // FP8_BLOCK)  # 528: 64 bf16 k_pe
FP8_ROW_BYTES = FP8_ROPE_OFFSET + 2 * ROPE_DIM  # 656
INDEX_DIM = 128
INDEX_ROW_BYTES = INDEX_DIM + 4  # 132: e4m3 key + float32 scale
COMPUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what a model computes in (and plain caches hold)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def scale_shape(shape: tuple[int, ...], halves: bool = False) -> tuple[int, ...]:
    """float32 weight_scale_inv shape of an FP8 weight [.., N, K]: one entry per 128x128 block, the last
    block of each dim short when N or K is not a multiple of 128: [.., ceil(N/128), ceil(K/128)].

    ``halves``: a stacked gate|up weight [.., 2I, K] whose two halves are blocked on their own (the
    per-expert gate_proj / up_proj scales one after the other): [.., 2 * ceil(I/128), ceil(K/128)]. The
    same as the plain shape when I is a multiple of 128.
    """
    *lead, n, k = shape
    rows = 2 * _cdiv(n // 2, FP8_BLOCK) if halves else _cdiv(n, FP8_BLOCK)
    return (*lead, rows, _cdiv(k, FP8_BLOCK))


def slots(block_table: torch.Tensor, req_idx: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """int64 flat cache slots: ``block_table[req, p // bs] * bs + p % bs`` (no checks: callers validate)."""
    p = positions.long()
    return block_table.long()[req_idx.long(), p // block_size] * block_size + p % block_size


def topk_lowest_index_ties(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The DSA top-k rule: the ``k`` largest ``scores`` along the last dim -> (values, indices), by descending
    score, and among equal scores (``-0.0 == 0.0``) the lower index first.

    Every path of the indexer (the eager model, the reference ops, the kernels) selects this set: the score is a
    weighted sum of ReLUs, so many keys tie at exactly 0.0 whenever few indexer heads fire, and torch.topk's choice
    among ties is unspecified (it changes with the row length and the device). A stable descending sort is the
    rule itself, deterministic on every device, one captured op (``aten.sort.stable``, which match_sparse_mla
    recognises); ``k`` must not exceed the last dim."""
    values, indices = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]
