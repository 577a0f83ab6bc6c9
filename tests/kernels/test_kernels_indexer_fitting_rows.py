"""Rows whose causal window fits in the top-k (n = positions[t] + 1 <= topk) select their whole window: both top-k
methods write 0..n-1 (then -1) without reading their scores, decided per row on the device. Mixed batches (n < topk, n == topk, n == topk + 1, long) against the reference, on CPU
(TRITON_INTERPRET=1)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from fxglm5.lowering.reference import paged as ref  # noqa: E402

pytest.importorskip("triton")

from fxglm5.lowering.triton import fp8_gemm  # noqa: E402
from fxglm5.lowering.triton import indexer as tindexer  # noqa: E402

K = 16
BS = 8
LENS = [5, K, K + 1, 60]  # per request: a window below, at and just above the top-k, and a long one
# (request, position) per token: each request's last token, and short / boundary / long prefixes of the long one
TOKENS = [(0, 4), (1, K - 1), (2, K), (3, 59), (3, 0), (3, K - 1), (3, K), (3, 40)]
# a float32 NaN whose order key is 0, the top-k's "no entry" key: a kernel that read it would write -1, not j
UNREADABLE = torch.tensor(-1, dtype=torch.int32).view(torch.float32).item()


def _window(n, topk):
    return list(range(n)) + [-1] * (topk - n)


def _paged_step(seed=0, bs=BS):
    """A block-major FP8 index cache holding LENS (blocks shuffled, block 0 reserved) and 2-head queries for TOKENS."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // bs) for n in LENS]
    perm = (torch.randperm(sum(need), generator=g) + 1).tolist()
    bt = torch.zeros(len(LENS), max(need) + 1, dtype=torch.int32)
    cache = torch.zeros(sum(need) + 1, bs, 132, dtype=torch.uint8)
    for b, n in enumerate(LENS):
        bt[b, :need[b]] = torch.tensor(perm[:need[b]], dtype=torch.int32)
        perm = perm[need[b]:]
        pos = torch.arange(n)
        slots = ref.slots_from_positions(bt, torch.full_like(pos, b), pos, bs)
        ref.write_indexer_cache(cache, torch.randn(n, 128, generator=g), slots)
    req = torch.tensor([r for r, _ in TOKENS], dtype=torch.int32)
    pos = torch.tensor([p for _, p in TOKENS], dtype=torch.int32)
    q = torch.randn(len(TOKENS), 2, 128, generator=g).bfloat16()
    w = torch.randn(len(TOKENS), 2, generator=g)
    return q, w, cache, bt, req, pos


def _assert_same_sets(got, want, pos, topk):
    for t in range(got.shape[0]):
        n = min(topk, int(pos[t]) + 1)
        assert sorted(got[t, :n].tolist()) == sorted(want[t, :n].tolist()), t
        assert (got[t, n:] == -1).all() and (want[t, n:] == -1).all(), t


@pytest.mark.parametrize("chunked", [False, True])
def test_indexer_topk_paged_mixed_rows_match_reference(chunked):
    """The selection equals the reference's as a set for every row, in one call and in one-row chunks (the path of
    steps whose logits would pass 2^31 bytes); rows that fit come out as their window in order."""
    q, w, kc, bt, req, pos = _paged_step()
    want = ref.indexer_topk_paged(q, w, kc, bt, req, pos, K)
    with pytest.MonkeyPatch.context() as mp:
        if chunked:  # one row's logits per chunk
            mp.setattr(fp8_gemm, "INT32_ELEMENTS", bt.shape[1] * BS * tindexer.LOGITS_BYTES_PER_ELEMENT + 1)
        got = tindexer.indexer_topk_paged(q, w, kc, bt, req, pos, K)
    assert got.shape == (len(TOKENS), K) and got.dtype == torch.int32
    _assert_same_sets(got, want, pos, K)
    for t in range(len(TOKENS)):
        n = int(pos[t]) + 1
        if n <= K:
            assert got[t].tolist() == _window(n, K), t


@pytest.mark.parametrize("method", ["segments", "multi"])
@pytest.mark.parametrize("chunk, L", [(64, 100), (64, 300), (128, 1000)])
def test_topk_rows_that_fit_read_no_scores(method, chunk, L):
    """Rows that fit hold UNREADABLE scores (and a NaN): they still get 0..n-1 in order, and the multi radix's
    histogram and counts never see them; the other rows are the exact top-k (lowest indices among ties). L = 300 /
    1000 with 64 / 128-entry segments runs the tournament's rounds that keep candidates."""
    topk = 40
    g = torch.Generator().manual_seed(L)
    x = torch.randint(-5, 6, (6, L), generator=g).float()  # ties at every threshold
    pos = torch.tensor([0, topk - 2, topk - 1, topk, L - 1, L // 2], dtype=torch.int32)
    fits = pos + 1 <= topk
    x[fits] = UNREADABLE
    x[1, 3] = float("nan")
    ws = dict(hist=torch.zeros(4, 6, 256, dtype=torch.int32))
    ws["cnt"] = torch.full((6, max(-(-L // chunk), -(-topk // chunk)), 2), -7, dtype=torch.int32)
    out = tindexer.topk_from_logits(x, pos, topk, chunk=chunk, method=method, workspace=ws)
    for t in range(6):
        n = int(pos[t]) + 1
        if fits[t]:
            assert out[t].tolist() == _window(n, topk), t
        else:
            want = torch.sort(-x[t, :n], stable=True).indices[:topk]
            assert sorted(out[t].tolist()) == sorted(want.tolist()), t
    if method == "multi":
        assert not ws["hist"][:, fits].any() and (ws["cnt"][fits] == -7).all()
        assert ws["hist"][:, ~fits].any() and (ws["cnt"][~fits] >= 0).all()
