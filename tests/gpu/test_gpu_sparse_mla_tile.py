"""The query-tile sparse MLA prefill kernel on the GPU at GLM-5's TP8 rank shapes (8 heads, 576 / 512, top-k 2048,
64-token blocks, an 8k prompt) against the torch reference ``paged.sparse_mla_paged``, bf16 and FP8 caches whose
unwritten rows hold NaN bytes; timing it against the per-token kernel: ``bench/sparse_mla_prefill.py``."""

import os

import pytest
import torch

pytestmark = pytest.mark.gpu

triton = pytest.importorskip("triton")

from bench.sparse_mla_prefill import SCALE, SWEEP, prefill_case  # noqa: E402
from fxglm5.lowering.reference import paged as ref  # noqa: E402

HEADS = 8
CFGS = [] if os.environ.get("FXGLM5_TEST_CFGS", "all") == "none" else SWEEP  # short device runs: default only


def _reference(q, cache, bt, req, top, rows=256):
    """The reference a few hundred tokens at a time (it gathers float32 [T, top-k, 576])."""
    return torch.cat([ref.sparse_mla_paged(q[s:s + rows], cache, bt, req[s:s + rows], top[s:s + rows], SCALE)
                      for s in range(0, len(q), rows)])


def _close(a, b, tol=3e-2):
    assert torch.isfinite(a.float()).all()
    err = (a.float() - b.float()).abs().max().item()
    assert err <= tol * max(1.0, b.float().abs().max().item()), err


@pytest.mark.parametrize("cdtype", [torch.bfloat16, torch.uint8], ids=["bf16", "fp8"])
def test_tile_kernel_8k_prompt(cdtype):
    """One 8k prompt at once: the paged program's dispatch takes the tile kernel, whose output is the reference's,
    with its default launch and every launch the bench sweeps (FXGLM5_TEST_CFGS=none: the default only)."""
    from fxglm5.lowering.triton import sparse_mla, sparse_mla_tile

    q, cache, bt, req, _, top = prefill_case([8192], [(0, 8192)], HEADS, cdtype)
    assert sparse_mla_tile.tile_applies(q, cache, bt, top)
    expect = _reference(q, cache, bt, req, top)
    _close(sparse_mla.sparse_mla_paged(q, cache, bt, req, top, SCALE), expect)
    for cfg in CFGS:
        _close(sparse_mla_tile.sparse_mla_tile_paged(q, cache, bt, req, top, SCALE, cfg=cfg), expect)


@pytest.mark.parametrize("cdtype", [torch.bfloat16, torch.uint8], ids=["bf16", "fp8"])
def test_tile_kernel_flat_batch_of_prefills(cdtype, monkeypatch):
    """Three requests' prefills in one flat batch, two after a cached prefix, tiles straddling two requests, a
    token with nothing listed, a position listed twice, token chunks smaller than the batch, fp16 queries."""
    from fxglm5.lowering.triton import sparse_mla_tile

    q, cache, bt, req, _, top = prefill_case([3000, 1501, 700], [(2000, 3000), (0, 1501), (333, 700)], HEADS, cdtype,
                                             seed=1)
    top[7] = -1
    top[1200, 1] = top[1200, 0]
    expect = _reference(q, cache, bt, req, top)
    _close(sparse_mla_tile.sparse_mla_tile_paged(q, cache, bt, req, top, SCALE), expect)
    monkeypatch.setattr(sparse_mla_tile, "COUNT_BUDGET", 4 * (bt.shape[1] * 64 // 2) * 600)  # 600 tokens at a time
    _close(sparse_mla_tile.sparse_mla_tile_paged(q, cache, bt, req, top, SCALE), expect)
    qh = q.half()  # fp16 queries: the bias MMA stays in bf16 (its unlisted bias overflows fp16)
    _close(sparse_mla_tile.sparse_mla_tile_paged(qh, cache, bt, req, top, SCALE), _reference(qh, cache, bt, req, top))
