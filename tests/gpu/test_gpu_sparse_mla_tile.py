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


def _gluon_or_skip(q, cache):
    from fxglm5.lowering.triton import sparse_mla_tile

    if not sparse_mla_tile.uses_gluon(q, cache):
        pytest.skip("the Gluon tile targets Hopper (sm_90)")


def _poison_unlisted(cache, bt, req, top, lens) -> int:
    """Stale bytes (0xFF: NaN as bf16, e4m3, and in the FP8 row's scales and rope) in every cached row of a
    request's prefix that none of its tokens lists: rows inside walked key blocks the Gluon tile must zero-fill.
    Returns how many rows."""
    from bench.sparse_mla_prefill import BS

    rows = cache.view(-1, cache.shape[-1])
    n = 0
    for b, length in enumerate(lens):
        listed = torch.zeros(length, dtype=torch.bool, device="cuda")
        t = top[req == b]
        listed[t[t >= 0].long()] = True
        pos = (~listed).nonzero().view(-1)
        slots = ref.slots_from_positions(bt, torch.full_like(pos, b), pos, BS)
        rows[slots] = 0xFF if cache.dtype == torch.uint8 else float("nan")
        n += len(pos)
    return n


@pytest.mark.parametrize("cdtype", [torch.bfloat16, torch.uint8], ids=["bf16", "fp8"])
def test_gluon_tile_8k_prompt(cdtype, monkeypatch):
    """GLM-5's TP8 rank (8 heads, top-k 2048) over an 8k prompt: the Gluon tile against the reference and the
    Triton tile; rows no token lists (positions 4000 and 4001 taken out of every list) hold NaN bytes; a token
    lists nothing, another lists a position twice. The paged program's dispatch takes the Gluon tile (the same
    bits), and FXGLM5_SPARSE_MLA_TILE_GLUON=0 the Triton tile (the same bits as it)."""
    monkeypatch.delenv("FXGLM5_SPARSE_MLA_TILE_GLUON", raising=False)  # the default: the Gluon tile
    from fxglm5.lowering.triton import sparse_mla, sparse_mla_tile

    q, cache, bt, req, _, top = prefill_case([8192], [(0, 8192)], HEADS, cdtype)
    _gluon_or_skip(q, cache)
    top[(top == 4000) | (top == 4001)] = -1
    top[5000] = -1
    top[6000, 1] = top[6000, 0]
    assert _poison_unlisted(cache, bt, req, top, [8192]) >= 2
    expect = _reference(q, cache, bt, req, top)
    assert expect[5000].abs().max() == 0
    gluon = sparse_mla_tile.sparse_mla_tile_paged(q, cache, bt, req, top, SCALE, cfg={"kernel": "gluon"})
    _close(gluon, expect)
    assert gluon[5000].abs().max() == 0
    triton_tile = sparse_mla_tile.sparse_mla_tile_paged(q, cache, bt, req, top, SCALE, cfg={"kernel": "triton"})
    _close(gluon, triton_tile)
    assert torch.equal(sparse_mla.sparse_mla_paged(q, cache, bt, req, top, SCALE), gluon)
    monkeypatch.setenv("FXGLM5_SPARSE_MLA_TILE_GLUON", "0")
    assert torch.equal(sparse_mla.sparse_mla_paged(q, cache, bt, req, top, SCALE), triton_tile)


@pytest.mark.parametrize("cdtype", [torch.bfloat16, torch.uint8], ids=["bf16", "fp8"])
def test_gluon_tile_flat_batch_of_prefills(cdtype, monkeypatch):
    """Three requests' prefills in one flat batch (two after a cached prefix, tiles straddling two requests, the
    last cache block of each request part-written: NaN bytes past its end), every unlisted row of each prefix
    poisoned, a token with nothing listed, a position listed twice; at once and 600 tokens at a time (several
    launches); the Gluon tile against the reference and the Triton tile."""
    monkeypatch.delenv("FXGLM5_SPARSE_MLA_TILE_GLUON", raising=False)  # the default: the Gluon tile
    from fxglm5.lowering.triton import sparse_mla_tile

    lens = [3000, 1501, 700]
    q, cache, bt, req, _, top = prefill_case(lens, [(2000, 3000), (0, 1501), (333, 700)], HEADS, cdtype, seed=1)
    _gluon_or_skip(q, cache)
    top[7] = -1
    top[1200, 1] = top[1200, 0]
    top[(req == 0)[:, None] & (top == 1234)] = -1  # one position of request 0's cached prefix listed by nobody
    assert _poison_unlisted(cache, bt, req, top, lens) >= 1
    expect = _reference(q, cache, bt, req, top)
    gluon = sparse_mla_tile.sparse_mla_tile_paged(q, cache, bt, req, top, SCALE, cfg={"kernel": "gluon"})
    _close(gluon, expect)
    assert gluon[7].abs().max() == 0
    _close(gluon, sparse_mla_tile.sparse_mla_tile_paged(q, cache, bt, req, top, SCALE, cfg={"kernel": "triton"}))
    monkeypatch.setattr(sparse_mla_tile, "COUNT_BUDGET", 4 * (bt.shape[1] * 64 // 2) * 600)  # 600 tokens at a time
    assert torch.equal(sparse_mla_tile.sparse_mla_tile_paged(q, cache, bt, req, top, SCALE, cfg={"kernel": "gluon"}),
                       gluon)
