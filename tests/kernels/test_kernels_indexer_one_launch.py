"""A decode step's indexer in one launch (``indexer._indexer_topk_kernel``, issue 45, item 5) on the CPU
(TRITON_INTERPRET=1): bit for bit the logits kernel followed by the top-k kernel under the same launch configuration
(the same indices in the same order), over the FP8 cache (gathers and TMA boxes) and the exact mode's keys, with and
without the query's RoPE, rows that fit in the top-k beside rows that select; with integer-valued queries, keys and
weights every score is exact, so the selection is also the reference's set, the tie rule deciding among the many
equal scores. The GPU runs it at GLM-5's shapes (tests/gpu/test_gpu_attention.py)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fxglm5.lowering.reference import paged as ref  # noqa: E402
from fxglm5.lowering.reference.attention import topk_lowest_index_ties  # noqa: E402

triton = pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from fxglm5.lowering.triton import fp8_parts  # noqa: E402
from fxglm5.lowering.triton import indexer as tindexer  # noqa: E402
from fxglm5.lowering.triton import topk as ttopk  # noqa: E402

pytestmark = pytest.mark.usefixtures("all_decode_joins")  # the joined kernels (an opt-in, settings.DECODE_JOINS)

MAX_LEN = 64  # logits rows the interpreter's top-k selects in one round (its segments: 128 entries, or 2 * topk)


@st.composite
def decode_steps(draw, block_sizes=(4, 8, 16)):
    """A paged step whose logits rows are at most MAX_LEN keys: 1-3 requests (blocks shuffled, block 0 never used,
    a few blocks to spare), each one's last position and one more of its positions as the step's tokens."""
    bs = draw(st.sampled_from(block_sizes))
    width = draw(st.integers(1, MAX_LEN // bs))
    lens = draw(st.lists(st.integers(1, width * bs), min_size=1, max_size=3))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // bs) for n in lens]
    perm = (torch.randperm(sum(need) + 2, generator=g) + 1).tolist()
    bt = torch.zeros(len(lens), width, dtype=torch.int32)
    for b, n in enumerate(need):
        bt[b, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    tokens = [(b, p) for b, n in enumerate(lens) for p in sorted({n - 1, draw(st.integers(0, n - 1))})]
    req = torch.tensor([b for b, _ in tokens], dtype=torch.int32)
    pos = torch.tensor([p for _, p in tokens], dtype=torch.int32)
    return dict(bs=bs, lens=lens, bt=bt, nb=sum(need) + 3, req=req, pos=pos, g=g)


def _values(kind, shape, g, dtype=torch.float32, limit=3):
    """``floats``: normal; ``ints``: integers in [-limit, limit] (FP8 codes and scales hold them exactly, so every
    score is an exact integer: ties everywhere); ``zeros``: all zero (every score +0.0 or -0.0, one tie)."""
    if kind == "floats":
        return torch.randn(*shape, generator=g).to(dtype)
    if kind == "ints":
        return torch.randint(-limit, limit + 1, shape, generator=g).to(dtype)
    return torch.zeros(*shape, dtype=dtype)


def _step(s, HI, kind, exact=False):
    """The step's index cache (FP8 rows, or ``exact`` bfloat16 keys), queries and head weights."""
    g = s["g"]
    bs = s["bs"]
    cache = torch.zeros(s["nb"], bs, 128, dtype=torch.bfloat16) if exact else \
        torch.zeros(s["nb"], bs, 132, dtype=torch.uint8)
    for b, n in enumerate(s["lens"]):
        p = torch.arange(n)
        slots = ref.slots_from_positions(s["bt"], torch.full_like(p, b), p, bs)
        keys = _values("floats" if kind == "zeros" else kind, (n, 128), g, limit=4)
        if exact:
            ref.write_exact_index_keys(cache, keys, slots)
        else:
            ref.write_indexer_cache(cache, keys, slots)
    T = s["pos"].numel()
    q = _values(kind, (T, HI, 128), g, torch.bfloat16)
    w = _values("ints" if kind == "zeros" else kind, (T, HI), g, limit=2)
    return cache, q, w


def _rope(T, g):
    angles = torch.rand(T, 32, generator=g) * 6.0
    return angles.cos(), angles.sin()


def _one_and_two_launches(s, q, w, cache, K, rope=None, cfg=None):
    """(the one launch's selection, the two launches' selection, the logits kernel's scores), each from buffers
    full of stale values (NaN scores, garbage indices)."""
    L = s["bt"].shape[1] * s["bs"]
    T = q.shape[0]
    assert tindexer.one_launch_round(T, L, K, interp=True) is not None
    args = (q, w, cache, s["bt"], s["req"], s["pos"])
    one = tindexer.indexer_topk_paged(*args, K, validate=False, rope=rope, cfg=cfg,
                                      logits_buf=torch.full((T, L), float("nan")),
                                      out=torch.full((T, K), 7, dtype=torch.int32))
    logits = tindexer.indexer_logits_paged(*args, validate=False, skip_window=K, rope=rope, cfg=cfg)
    two = ttopk.topk_from_logits(logits, s["pos"], K, validate=False)
    assert int(fp8_parts.tile_counters(q.device, T)[:T].abs().sum()) == 0  # every row's counter reset
    return one, two, logits


def _assert_tie_rule(sel, logits, pos, K):
    """Each row holds its window's top-min(K, n) by the tie rule (the lower position first among equal scores) of
    the kernels' own scores, then -1; a row that fits holds its window in order."""
    for t in range(sel.shape[0]):
        n = int(pos[t]) + 1
        k = min(K, n)
        assert (sel[t, k:] == -1).all(), t
        if n <= K:
            assert sel[t, :k].tolist() == list(range(n)), t
        else:
            want = topk_lowest_index_ties(logits[t:t + 1, :n], k)[1][0]
            assert sorted(sel[t, :k].tolist()) == sorted(want.tolist()), t


def _assert_reference_sets(sel, want):
    assert torch.equal(sel.long().sort(dim=1).values, want.long().sort(dim=1).values)


# the interpreter's logits launch (32 keys a program), and 16 keys a program: up to 4 programs a row take tickets
CONFIGS = [None, dict(BLOCK_N=16, TILES=1)]


@given(decode_steps(), st.sampled_from([1, 2, 4]), st.integers(1, 20), st.sampled_from(["floats", "ints", "zeros"]),
       st.booleans(), st.sampled_from(CONFIGS))
def test_one_launch_selects_as_the_two_launches_fp8(s, HI, K, kind, rotate, cfg):
    cache, q, w = _step(s, HI, kind)
    rope = _rope(q.shape[0], s["g"]) if rotate else None
    one, two, logits = _one_and_two_launches(s, q, w, cache, K, rope, cfg)
    assert torch.equal(one, two)
    _assert_tie_rule(one, logits, s["pos"], K)
    if kind != "floats" and not rotate:  # exact scores: the reference's logits are the kernels', bit for bit
        _assert_reference_sets(one, ref.indexer_topk_paged(q, w, cache, s["bt"], s["req"], s["pos"], K))


@given(decode_steps(), st.sampled_from([1, 4]), st.integers(1, 20), st.sampled_from(["floats", "ints", "zeros"]),
       st.booleans())
def test_one_launch_selects_as_the_two_launches_exact_mode(s, HI, K, kind, rotate):
    """The exact mode's bfloat16 keys (``exact_indexer_topk_paged``, what rtp_indexer runs over that cache)."""
    cache, q, w = _step(s, HI, kind, exact=True)
    rope = _rope(q.shape[0], s["g"]) if rotate else None
    one, two, logits = _one_and_two_launches(s, q, w, cache, K, rope)
    assert torch.equal(one, two)
    assert torch.equal(tindexer.exact_indexer_topk_paged(q, w, cache, s["bt"], s["req"], s["pos"], K, rope=rope), one)
    _assert_tie_rule(one, logits, s["pos"], K)
    if kind != "floats" and not rotate:
        _assert_reference_sets(one, ref.exact_indexer_topk_paged(q, w, cache, s["bt"], s["req"], s["pos"], K))


@given(decode_steps(block_sizes=(32, 64)), st.sampled_from([1, 4]), st.integers(1, 20),
       st.sampled_from([(16, 2, 2), (32, 1, 3)]), st.sampled_from(["floats", "ints"]))
def test_one_launch_selects_as_the_two_launches_tma(s, HI, K, tiles, kind):
    """The logits' TMA boxes (block sizes that are multiples of 32), the same explicit launch for both paths."""
    block_n, n_tiles, stages = tiles
    cache, q, w = _step(s, HI, kind)
    cfg = dict(BLOCK_N=block_n, TILES=n_tiles, USE_TMA=True, num_warps=4, num_stages=stages)
    one, two, logits = _one_and_two_launches(s, q, w, cache, K, cfg=cfg)
    assert torch.equal(one, two)
    _assert_tie_rule(one, logits, s["pos"], K)
    if kind == "ints":
        _assert_reference_sets(one, ref.indexer_topk_paged(q, w, cache, s["bt"], s["req"], s["pos"], K))


@pytest.mark.parametrize("cfg", CONFIGS)
def test_one_launch_keeps_the_two_launches_order(cfg):
    """At top-20 of 64 distinct scores every row comes out as two increasing runs (the keys above the round's last
    bin, then the bin's selected keys): the one launch lists the same indices in the same order, which the round's
    chunks and bins (topk.one_round) decide."""
    g = torch.Generator().manual_seed(0)
    bs, width, K = 8, 8, 20
    bt = (torch.randperm(width, generator=g) + 1).to(torch.int32)[None]
    cache = torch.zeros(width + 1, bs, 132, dtype=torch.uint8)
    p = torch.arange(width * bs)
    ref.write_indexer_cache(cache, torch.randn(width * bs, 128, generator=g),
                            ref.slots_from_positions(bt, torch.zeros_like(p), p, bs))
    s = dict(bs=bs, bt=bt, req=torch.zeros(4, dtype=torch.int32), pos=torch.tensor([63, 50, 40, 30], dtype=torch.int32))
    q = torch.randn(4, 2, 128, generator=g).bfloat16()
    w = torch.randn(4, 2, generator=g)
    one, two, logits = _one_and_two_launches(s, q, w, cache, K, cfg=cfg)
    assert torch.equal(one, two)
    assert [int((one[t, 1:] < one[t, :-1]).sum()) for t in range(4)] == [1, 1, 1, 1]  # two runs a row
    _assert_tie_rule(one, logits, s["pos"], K)


def _launched(monkeypatch, call) -> list[str]:
    names, launch = [], InterpretedFunction.run
    with monkeypatch.context() as m:
        m.setattr(InterpretedFunction, "run", lambda self, *a, **k: names.append(self.fn.__name__) or
                  launch(self, *a, **k))
        call()
    return names


@pytest.mark.parametrize("tokens, width, K, one", [
    (16, 8, 4, True),  # 16 tokens, rows of 64 keys: one launch
    (17, 8, 4, False),  # past ONE_LAUNCH_ROWS
    (3, 32, 4, False),  # rows of 256 keys: two rounds of the interpreter's 128-entry segments
    (3, 32, 128, True),  # top-128: 256-entry segments, one round
])
def test_the_step_takes_one_launch_only_where_it_applies(monkeypatch, tokens, width, K, one):
    """Decode steps of up to ONE_LAUNCH_ROWS tokens whose rows take one round of the top-k launch one kernel; other
    steps the logits kernel and the top-k's own launches, with the same selection."""
    g = torch.Generator().manual_seed(tokens + width)
    bs = 8
    bt = (torch.randperm(width, generator=g) + 1).to(torch.int32)[None]
    cache = torch.zeros(width + 1, bs, 132, dtype=torch.uint8)
    p = torch.arange(width * bs)
    slots = ref.slots_from_positions(bt, torch.zeros_like(p), p, bs)
    ref.write_indexer_cache(cache, torch.randn(width * bs, 128, generator=g), slots)
    req = torch.zeros(tokens, dtype=torch.int32)
    pos = torch.randint(0, width * bs, (tokens,), generator=g, dtype=torch.int32)
    q = torch.randn(tokens, 2, 128, generator=g).bfloat16()
    w = torch.randn(tokens, 2, generator=g)
    assert (tindexer.one_launch_round(tokens, width * bs, K, interp=True) is not None) == one
    out = {}
    names = _launched(monkeypatch, lambda: out.setdefault("sel", tindexer.indexer_topk_paged(q, w, cache, bt, req, pos,
                                                                                             K)))
    if one:
        assert names == ["_indexer_topk_kernel"]
    else:
        assert names[0] == "_indexer_logits_kernel" and set(names[1:]) == {"_segment_topk_kernel"}
    logits = tindexer.indexer_logits_paged(q, w, cache, bt, req, pos, skip_window=K)
    assert torch.equal(out["sel"], ttopk.topk_from_logits(logits, pos, K))


def test_one_launch_bounds_at_glm5_shapes():
    """On the GPU (16384-entry segments): up to 16 tokens and rows of 8192 keys at GLM-5's top-2048, where the
    4-warp logits programs hold the round's row in registers (tests/kernels/test_indexer_topk_compile.py)."""
    assert tindexer.one_launch_round(16, 8192, 2048, interp=False) == (2048, 256)
    assert tindexer.one_launch_round(1, 4096, 2048, interp=False) == (1024, 128)
    assert tindexer.one_launch_round(17, 4096, 2048, interp=False) is None
    assert tindexer.one_launch_round(1, 8256, 2048, interp=False) is None
    assert tindexer.one_launch_round(1, 16384, 2048, interp=False) is None
    # what topk_from_logits launches on those rows: one round, these chunks and bins
    assert ttopk.one_round(16384, 2048, False) == (4096, 512) and ttopk.one_round(16448, 2048, False) is None
