"""The query-tile sparse MLA prefill kernel (TRITON_INTERPRET=1) against the torch reference
``paged.sparse_mla_paged``: several prefills in one flat batch (tiles that straddle two requests), top-k lists
shorter than the context, blocks no token of a tile lists, -1 padding, rows with nothing listed, a position listed
twice, stale NaN rows beside listed ones, both latent cache layouts; and the shape rule that sends the paged
program's prefill there."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from fxglm5 import settings  # noqa: E402
from fxglm5.lowering.reference import paged as ref  # noqa: E402
from fxglm5.lowering.reference import paged_steps  # noqa: E402
from tests.helpers import latent_values  # noqa: E402

triton = pytest.importorskip("triton")

from fxglm5.lowering.triton import paged_ops  # noqa: E402
from fxglm5.lowering.triton import sparse_mla as tsparse  # noqa: E402
from fxglm5.lowering.triton import sparse_mla_tile as ttile  # noqa: E402

D, DR = 576, 64
SCALE = 1.0 / 16
BS = 8
LENS = (37, 9, 22)  # cached tokens of each request
PREFILL = ((21, 37), (0, 9), (10, 22))  # the prefill positions [start, end) of each request, flat in this order


def _setup(cdtype, seed=0):
    """Caches of three requests (blocks permuted, table padded with 0); unwritten rows hold NaN bytes."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // BS) for n in LENS]
    nb = sum(need) + 3
    perm = (torch.randperm(nb - 1, generator=g) + 1).tolist()
    bt = torch.zeros(len(LENS), max(need) + 1, dtype=torch.int32)
    i = 0
    for b, n in enumerate(need):
        bt[b, :n] = torch.tensor(perm[i:i + n], dtype=torch.int32)
        i += n
    if cdtype == torch.uint8:
        cache = torch.full((nb, BS, 656), 0xFF, dtype=torch.uint8)  # e4m3 NaN, NaN scales and k_pe
    else:
        cache = torch.full((nb, BS, D), float("nan"), dtype=cdtype)
    for b, n in enumerate(LENS):
        pos = torch.arange(n)
        slots = ref.slots_from_positions(bt, torch.full_like(pos, b), pos, BS)
        ref.write_latent_cache(cache, latent_values(n, generator=g), torch.randn(n, DR, generator=g), slots)
    req = torch.cat([torch.full((e - s,), b, dtype=torch.int32) for b, (s, e) in enumerate(PREFILL)])
    pos = torch.cat([torch.arange(s, e, dtype=torch.int32) for s, e in PREFILL])
    return cache, bt, req, pos, g


def _lists(pos, K, g):
    """Each token lists K distinct positions of its causal prefix (all of it when shorter, -1 padded), in a random
    order; a quarter of the entries dropped to -1."""
    top = torch.full((len(pos), K), -1, dtype=torch.int32)
    for t, p in enumerate(pos.tolist()):
        pick = torch.randperm(p + 1, generator=g)[:K]
        top[t, :len(pick)] = pick.int()
    top[torch.rand(top.shape, generator=g) < 0.25] = -1
    return top


def _close(a, b, atol, rtol=0.0):
    assert torch.isfinite(a.float()).all()
    assert torch.allclose(a.double(), b.double(), atol=atol, rtol=rtol), (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("cdtype", [torch.float32, torch.bfloat16, torch.uint8], ids=["f32", "bf16", "fp8"])
@pytest.mark.parametrize("block_q", [2, 4, 32])  # 32 (the default at 2 heads): a tile holding all three requests
def test_tile_kernel_matches_reference(cdtype, block_q):
    cache, bt, req, pos, g = _setup(cdtype)
    H = 2
    top = _lists(pos, 6, g)
    top[3] = -1  # nothing listed: zeros
    top[5, :3] = 0  # position 0 listed three times weighs three times
    q = torch.randn(len(pos), H, D, generator=g)
    expect = ref.sparse_mla_paged(q, cache, bt, req, top, SCALE)
    assert not torch.allclose(expect[5], ref.sparse_mla_paged(q, cache, bt, req, top[:, 2:], SCALE)[5], atol=1e-3)
    cfg = dict(BLOCK_Q=block_q)
    _close(ttile.sparse_mla_tile_paged(q, cache, bt, req, top, SCALE, cfg=cfg), expect, atol=1e-4)
    qb = q.bfloat16()
    _close(ttile.sparse_mla_tile_paged(qb, cache, bt, req, top, SCALE, cfg=cfg),
           ref.sparse_mla_paged(qb, cache, bt, req, top, SCALE), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("cdtype", [torch.bfloat16, torch.uint8], ids=["bf16", "fp8"])
def test_disjoint_lists_skip_blocks_but_not_a_lone_one(cdtype):
    """The tokens of a tile list disjoint positions in different key blocks: one token alone lists the only
    position of a far block, another lists only its own position (the causal limit), the rest list the first
    block; every block between is skipped and the output is still the reference's."""
    cache, bt, req, pos, g = _setup(cdtype, seed=1)
    H, K = 4, 3
    top = torch.full((len(pos), K), -1, dtype=torch.int32)
    top[:, 0] = torch.arange(len(pos)) % 5  # first block (positions 0..4)
    top[1] = torch.tensor([-1, 33, -1])  # token 1 (position 22 of request 0): alone in block 32..47 (BLOCK_N 16)
    top[2] = torch.tensor([-1, -1, int(pos[2])])  # its own position only
    q = torch.randn(len(pos), H, D, generator=g)
    expect = ref.sparse_mla_paged(q, cache, bt, req, top, SCALE)
    for block_n in (8, 16):
        _close(ttile.sparse_mla_tile_paged(q, cache, bt, req, top, SCALE, cfg=dict(BLOCK_Q=4, BLOCK_N=block_n)),
               expect, atol=1e-4)


def test_tokens_counted_in_chunks(monkeypatch):
    """A counter budget smaller than the batch's counters: tokens are counted (and attended) a chunk at a time."""
    cache, bt, req, pos, g = _setup(torch.bfloat16, seed=2)
    top = _lists(pos, 5, g)
    q = torch.randn(len(pos), 2, D, generator=g)
    words = bt.shape[1] * BS // 2
    monkeypatch.setattr(ttile, "COUNT_BUDGET", 4 * words * 8)  # 8 tokens at a time
    _close(ttile.sparse_mla_tile_paged(q, cache, bt, req, top, SCALE, cfg=dict(BLOCK_Q=4)),
           ref.sparse_mla_paged(q, cache, bt, req, top, SCALE), atol=1e-4)


def test_prefill_dispatch_takes_the_tile_kernel(monkeypatch):
    """The paged program's sparse MLA (the Triton step body) runs the tile kernel for a prefill-shaped step, the
    per-token kernel for decode-shaped ones, long prefixes, or with FXGLM5_SPARSE_MLA_TILE=0."""
    cache, bt, req, pos, g = _setup(torch.bfloat16, seed=3)
    H, K = 8, 6  # 8 heads: 8 tokens a tile
    top = _lists(pos, K, g)
    q = torch.randn(len(pos), H, D, generator=g)
    calls = []
    tile_fn = ttile.sparse_mla_tile_paged
    monkeypatch.setattr(tsparse, "sparse_mla_tile_paged", lambda *a, **k: calls.append(1) or tile_fn(*a, **k))
    out = tsparse.sparse_mla_paged(q, cache, bt, req, top, SCALE)
    assert calls == [1]
    _close(out, ref.sparse_mla_paged(q, cache, bt, req, top, SCALE), atol=1e-4)

    assert ttile.tile_applies(q, cache, bt, top)
    assert not ttile.tile_applies(q[:3], cache, bt, top[:3])  # one token a request: decode
    assert not ttile.tile_applies(q, cache, bt, top[:, :2])  # prefix 48 > 8 tokens x top-k 2
    assert not ttile.tile_applies(torch.randn(len(pos), 64, D), cache, bt, top)  # 64 heads: one token a tile
    with monkeypatch.context() as compiled:  # float32 only interpreted: its compiled tile outgrows shared memory
        compiled.setattr(settings, "triton_interpret", lambda: False)
        assert not ttile.tile_applies(q, cache, bt, top)
        assert ttile.tile_applies(q.to(torch.bfloat16), cache, bt, top)
    monkeypatch.setenv("FXGLM5_SPARSE_MLA_TILE", "0")
    assert not ttile.tile_applies(q, cache, bt, top)
    tsparse.sparse_mla_paged(q, cache, bt, req, top, SCALE)
    assert calls == [1]


def test_cached_step_over_the_tile_kernel():
    """rtp_sparse_mla's body over the Triton kernel set writes the step's rows and attends through the tile kernel:
    the same output as over the torch references."""
    cache, bt, req, pos, g = _setup(torch.bfloat16, seed=4)
    T, H, dn, R = len(pos), 8, 16, 512
    top = _lists(pos, 6, g).view(1, T, 6)
    slots = ref.slots_from_positions(bt, req, pos, BS)
    args = [torch.randn(1, T, H, dn, generator=g), torch.randn(1, T, H, DR, generator=g),
            latent_values(T, generator=g)[None], torch.randn(1, T, DR, generator=g),
            torch.randn(H, dn, R, generator=g) / 4, torch.randn(H, dn, R, generator=g) / 4, top, SCALE]
    ctx = (slots, bt, req, pos, 4096)
    outs = [step(kern, *args, c, *ctx) for kern, c in ((paged_ops, cache.clone()), (ref, cache.clone()))
            for step in (paged_steps.sparse_mla_step,)]
    _close(outs[0], outs[1], atol=3e-2, rtol=3e-2)


def test_sharp_scores_take_each_tokens_own_maximum():
    """Scores hundreds apart: each token's softmax is shifted by the maximum over its own listed keys, not over the
    tile's (another token's key scoring far higher would underflow every weight of this one)."""
    cache, bt, req, pos, g = _setup(torch.float32, seed=5)
    top = _lists(pos, 4, g)
    q = torch.randn(len(pos), 2, D, generator=g) * 50
    _close(ttile.sparse_mla_tile_paged(q, cache, bt, req, top, SCALE, cfg=dict(BLOCK_Q=4)),
           ref.sparse_mla_paged(q, cache, bt, req, top, SCALE), atol=1e-3)


def test_tokens_of_requests_interleaved():
    """The flat batch's tokens shuffled: a tile holds tokens of up to three requests in any order, each request
    attended by its own program over its own block table row."""
    cache, bt, req, pos, g = _setup(torch.uint8, seed=6)
    perm = torch.randperm(len(pos), generator=g)
    req, pos = req[perm], pos[perm]
    top = _lists(pos, 6, g)
    q = torch.randn(len(pos), 2, D, generator=g)
    for block_q in (4, 8):
        _close(ttile.sparse_mla_tile_paged(q, cache, bt, req, top, SCALE, cfg=dict(BLOCK_Q=block_q)),
               ref.sparse_mla_paged(q, cache, bt, req, top, SCALE), atol=1e-4)


def test_bad_inputs_are_named():
    """Invalid inputs are the reference's InputError naming the argument; a top-k wider than the 16-bit counters
    hold is a ValueError saying so (the dispatch never sends one)."""
    from fxglm5.errors import InputError

    cache, bt, req, pos, g = _setup(torch.bfloat16, seed=7)
    q = torch.randn(len(pos), 2, D, generator=g)
    top = _lists(pos, 4, g)
    top[0, 0] = bt.shape[1] * BS  # beyond the block table
    with pytest.raises(InputError, match="topk_pos"):
        ttile.sparse_mla_tile_paged(q, cache, bt, req, top, SCALE)
    wide = torch.full((1, ttile.MAX_LISTED + 1), -1, dtype=torch.int32)
    with pytest.raises(ValueError, match="16-bit counters"):
        ttile.sparse_mla_tile_paged(q[:1], cache, bt, req[:1], wide, SCALE)
