"""Paged attention building blocks on CPU: torch references vs an independent float64 oracle, Triton kernels
(TRITON_INTERPRET=1) vs the references, byte layouts of the 576 / 656 /
block-major indexer caches, and input validation."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fxglm5.errors import InputError  # noqa: E402
from fxglm5.lowering.reference import paged as ref  # noqa: E402
from tests.helpers import latent_values  # noqa: E402

triton = pytest.importorskip("triton")

from fxglm5.lowering.triton import indexer as tindexer  # noqa: E402
from fxglm5.lowering.triton import mla as tmla  # noqa: E402
from fxglm5.lowering.triton import paged_cache as tpc  # noqa: E402
from fxglm5.lowering.triton import sparse_mla as tsparse  # noqa: E402

R, DR, D = 512, 64, 576
SCALE = 1.0 / 16


# --------------------------------------------------------------------------------------------------------------
# independent helpers (no code shared with the reference)
# --------------------------------------------------------------------------------------------------------------
def _hand_scale(amax: float) -> float:
    """2 ** ceil(log2(max(amax, 1e-10) / 448)) in float64 (the documented rule, computed independently)."""
    s = max(amax, 1e-10) / 448.0
    e = math.ceil(math.log2(s))
    if 2.0 ** (e - 1) >= s:  # guard log2 rounding
        e -= 1
    return 2.0**e


def _hand_decode_latent(cache, slot):
    """Decode one latent row by hand -> float64 [576]."""
    row = cache.view(-1, cache.shape[-1])[slot]
    if cache.dtype != torch.uint8:
        return row.double()
    c = row[:512].clone().view(torch.float8_e4m3fn).double()
    sc = row[512:528].clone().view(torch.float32).double()
    pe = row[528:656].clone().view(torch.bfloat16).double()
    return torch.cat([c * sc.repeat_interleave(128), pe])


def _hand_index_bytes(cache, slot):
    """Byte offsets of one indexer key and its scale, by hand: a block of bs tokens is bs * 132 bytes, its bs
    128-byte keys first, then their bs float32 scales (the block-major layout RTP-LLM's writer uses)."""
    bs = cache.shape[1]
    base = (slot // bs) * bs * 132
    key = base + (slot % bs) * 128
    scale = base + bs * 128 + (slot % bs) * 4
    return torch.arange(key, key + 128), torch.arange(scale, scale + 4)


def _hand_decode_index(cache, slot):
    key, scale = _hand_index_bytes(cache, slot)
    flat = cache.view(-1)
    return flat[key].view(torch.float8_e4m3fn).double() * flat[scale].view(torch.float32).double()


def _hand_slot(bt, b, p, bs):
    return int(bt[b, p // bs]) * bs + p % bs


@st.composite
def paged_setup(draw, max_len=70, block_sizes=(4, 8, 16)):
    B = draw(st.integers(1, 3))
    bs = draw(st.sampled_from(block_sizes))
    lens = [draw(st.integers(1, max_len)) for _ in range(B)]
    need = [-(-n // bs) for n in lens]
    extra = draw(st.integers(0, 2))  # padded (0) entries at the end of the block table
    nb = sum(need) + 1 + draw(st.integers(0, 3))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    perm = (torch.randperm(nb - 1, generator=g) + 1).tolist()
    bt = torch.zeros(B, max(need) + extra, dtype=torch.int32)
    i = 0
    for b, n in enumerate(need):
        bt[b, :n] = torch.tensor(perm[i:i + n], dtype=torch.int32)
        i += n
    return dict(B=B, bs=bs, lens=lens, bt=bt, nb=nb, seed=seed)


def _filled_latent(s, cdtype):
    torch.manual_seed(s["seed"])
    cache = torch.zeros(s["nb"], s["bs"], 656 if cdtype == torch.uint8 else 576, dtype=cdtype)
    for b, n in enumerate(s["lens"]):
        pos = torch.arange(n)
        sl = ref.slots_from_positions(s["bt"], torch.full_like(pos, b), pos, s["bs"])
        ref.write_latent_cache(cache, latent_values(n), torch.randn(n, DR), sl)  # four distinct group scales
    return cache


def _filled_index(s, fill=0):
    torch.manual_seed(s["seed"] + 1)
    cache = torch.full((s["nb"], s["bs"], 132), fill, dtype=torch.uint8)
    for b, n in enumerate(s["lens"]):
        pos = torch.arange(n)
        sl = ref.slots_from_positions(s["bt"], torch.full_like(pos, b), pos, s["bs"])
        ref.write_indexer_cache(cache, torch.randn(n, 128), sl)
    return cache


def _queries(s, draw_tokens):
    """Tokens as (req, pos) pairs: for each request, a few positions incl. the last (decode) or a run (prefill)."""
    req, pos = [], []
    for b, n in enumerate(s["lens"]):
        k = draw_tokens(b, n)
        for p in k:
            req.append(b)
            pos.append(p)
    return torch.tensor(req, dtype=torch.int32), torch.tensor(pos, dtype=torch.int32)


def _naive_attention(q, cache, bt, req, rows_pos, bs, scale):
    """float64: gather rows by (request, positions list) and run plain softmax attention."""
    T, H, _ = q.shape
    out = torch.zeros(T, H, R, dtype=torch.float64)
    for t in range(T):
        ps = [p for p in rows_pos[t] if p >= 0]
        if not ps:
            continue
        rows = torch.stack([_hand_decode_latent(cache, _hand_slot(bt, int(req[t]), p, bs)) for p in ps])
        s = (q[t].double() @ rows.T) * scale
        out[t] = torch.softmax(s, dim=-1) @ rows[:, :R]
    return out


def _close(a, b, atol, rtol=0.0):
    a, b = a.double(), b.double()
    assert torch.allclose(a, b, atol=atol, rtol=rtol), (a - b).abs().max().item()


# --------------------------------------------------------------------------------------------------------------
# layouts
# --------------------------------------------------------------------------------------------------------------
def _layout_tokens(bs):
    bt = torch.tensor([[3, 1, 0], [2, 0, 0]], dtype=torch.int32)
    req = torch.tensor([0, 0, 0, 1, 1], dtype=torch.int32)
    pos = torch.tensor([0, bs - 1, bs + 1, 0, 2], dtype=torch.int32)
    return bt, req, pos


@pytest.mark.parametrize("impl", ["ref", "triton"])
@pytest.mark.parametrize("bs", [4, 16])
def test_latent_layout_compute_dtype(impl, bs):
    bt, req, pos = _layout_tokens(bs)
    sl = ref.slots_from_positions(bt, req, pos, bs)
    assert sl.tolist() == [3 * bs, 3 * bs + bs - 1, 1 * bs + 1, 2 * bs, 2 * bs + 2]
    cache = torch.zeros(5, bs, 576, dtype=torch.bfloat16)
    kv = torch.randn(5, R)
    pe = torch.randn(5, DR)
    slm = torch.cat([sl, torch.tensor([-1])])
    w = ref.write_latent_cache if impl == "ref" else tpc.write_latent_cache
    w(cache, torch.cat([kv, torch.randn(1, R)]), torch.cat([pe, torch.randn(1, DR)]), slm)
    flat = cache.view(-1, 576)
    for i, s in enumerate(sl.tolist()):
        assert s == int(bt[req[i], pos[i] // bs]) * bs + int(pos[i]) % bs
        assert torch.equal(flat[s, :R], kv[i].bfloat16())
        assert torch.equal(flat[s, R:], pe[i].bfloat16())
    written = torch.zeros(flat.shape[0], dtype=torch.bool)
    written[sl] = True
    assert (flat[~written] == 0).all()  # nothing else written: block 0 and the padding slot untouched
    assert (cache[0] == 0).all()


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_latent_layout_fp8_ds_mla(impl):
    bs = 8
    bt, req, pos = _layout_tokens(bs)
    sl = ref.slots_from_positions(bt, req, pos, bs)
    cache = torch.zeros(5, bs, 656, dtype=torch.uint8)
    kv = torch.randn(5, R) * torch.tensor([0.01, 1.0, 30.0, 1e-12]).repeat_interleave(128)
    kv[4, 128:256] = 0.0  # an all-zero group: amax floored at 1e-10
    pe = torch.randn(5, DR)
    w = ref.write_latent_cache if impl == "ref" else tpc.write_latent_cache
    w(cache, kv, pe, sl)
    flat = cache.view(-1, 656)
    for i, s in enumerate(sl.tolist()):
        row = flat[s]
        scales = row[512:528].clone().view(torch.float32)
        for gi in range(4):
            grp = kv[i, 128 * gi:128 * gi + 128]
            sc = float(scales[gi])
            assert sc == _hand_scale(float(grp.abs().max())), (gi, sc)
            e4 = row[128 * gi:128 * gi + 128].clone().view(torch.float8_e4m3fn)
            assert torch.equal(e4.view(torch.uint8), (grp / sc).to(torch.float8_e4m3fn).view(torch.uint8))
            deq = e4.double() * sc
            assert (deq - grp.double()).abs().max() <= grp.abs().max() * 2**-3 + 1e-30
        assert torch.equal(row[528:].clone().view(torch.bfloat16), pe[i].bfloat16())
    mask = torch.ones(flat.shape[0], dtype=torch.bool)
    mask[sl] = False
    assert (flat[mask] == 0).all() and (cache[0] == 0).all()
    # dequantizing reader agrees with the hand decoder
    rows = ref.read_latent_rows(cache, sl)
    for i, s in enumerate(sl.tolist()):
        assert torch.equal(rows[i].double(), _hand_decode_latent(cache, s))


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_indexer_layout(impl):
    bs = 4
    bt, req, pos = _layout_tokens(bs)
    sl = ref.slots_from_positions(bt, req, pos, bs)
    cache = torch.zeros(5, bs, 132, dtype=torch.uint8)
    k = torch.randn(5, 128) * torch.tensor([1.0, 100.0, 1e-3, 7.0, 0.0]).unsqueeze(1)
    w = ref.write_indexer_cache if impl == "ref" else tpc.write_indexer_cache
    w(cache, torch.cat([k, torch.randn(1, 128)]), torch.cat([sl, torch.tensor([-1])]))
    flat = cache.view(-1)
    mask = torch.ones(flat.shape[0], dtype=torch.bool)
    for i, s in enumerate(sl.tolist()):
        key, scale = _hand_index_bytes(cache, s)
        sc = float(flat[scale].view(torch.float32))
        assert sc == _hand_scale(float(k[i].abs().max()))
        assert torch.equal(flat[key], (k[i] / sc).to(torch.float8_e4m3fn).view(torch.uint8))
        assert torch.equal(ref.read_indexer_rows(cache, torch.tensor([s]))[0].double(), _hand_decode_index(cache, s))
        mask[key] = False
        mask[scale] = False
    assert (flat[mask] == 0).all() and (cache[0] == 0).all()


@given(paged_setup(), st.sampled_from([torch.float32, torch.bfloat16, torch.uint8]))
def test_cache_writes_triton_vs_reference(s, cdtype):
    torch.manual_seed(s["seed"])
    n = sum(s["lens"])
    req = torch.cat([torch.full((m,), b) for b, m in enumerate(s["lens"])])
    pos = torch.cat([torch.arange(m) for m in s["lens"]])
    sl = ref.slots_from_positions(s["bt"], req, pos, s["bs"])
    sl[torch.rand(n) < 0.2] = -1
    width = 656 if cdtype == torch.uint8 else 576
    c1 = torch.zeros(s["nb"], s["bs"], width, dtype=cdtype)
    c2 = c1.clone()
    kv, pe = latent_values(n), torch.randn(n, DR)
    ref.write_latent_cache(c1, kv, pe, sl)
    tpc.write_latent_cache(c2, kv, pe, sl)
    assert torch.equal(c1.view(torch.uint8), c2.view(torch.uint8))
    assert (c1[0] == 0).all()
    k1 = torch.zeros(s["nb"], s["bs"], 132, dtype=torch.uint8)
    k2 = k1.clone()
    k = torch.randn(n, 128).bfloat16()
    ref.write_indexer_cache(k1, k, sl)
    tpc.write_indexer_cache(k2, k, sl)
    assert torch.equal(k1, k2)


@given(paged_setup())
def test_slots_from_positions(s):
    req = torch.cat([torch.full((m,), b, dtype=torch.int32) for b, m in enumerate(s["lens"])])
    pos = torch.cat([torch.arange(m, dtype=torch.int32) for m in s["lens"]])
    sl = ref.slots_from_positions(s["bt"], req, pos, s["bs"])
    assert sl.dtype == torch.int64
    assert sl.tolist() == [_hand_slot(s["bt"], int(b), int(p), s["bs"]) for b, p in zip(req, pos)]
    assert len(set(sl.tolist())) == len(sl) and int(sl.min()) >= s["bs"]  # distinct, never block 0


# --------------------------------------------------------------------------------------------------------------
# MLA
# --------------------------------------------------------------------------------------------------------------
@given(paged_setup(), st.sampled_from([1, 2, 4]), st.sampled_from([torch.float32, torch.bfloat16, torch.uint8]),
       st.sampled_from([torch.float32, torch.bfloat16]), st.booleans(), st.data())
def test_mla_paged(s, H, cdtype, qdtype, prefill, data):
    cache = _filled_latent(s, cdtype)

    def toks(b, n):
        if prefill:  # a run of consecutive new tokens after a cached prefix
            start = data.draw(st.integers(0, n - 1))
            return list(range(start, min(n, start + 5)))
        return [n - 1]

    req, pos = _queries(s, toks)
    torch.manual_seed(s["seed"] + 2)
    q = torch.randn(len(req), H, D).to(qdtype)
    r = ref.mla_paged(q, cache, s["bt"], req, pos, SCALE)
    assert r.dtype == qdtype and r.shape == (len(req), H, R)
    naive = _naive_attention(q, cache, s["bt"], req, [list(range(int(p) + 1)) for p in pos], s["bs"], SCALE)
    _close(r, naive, atol=1e-4 if qdtype == torch.float32 else 2e-2, rtol=1e-2 if qdtype != torch.float32 else 0)
    tol = dict(atol=1e-4) if qdtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)  # bf16 output rounding
    _close(tmla.mla_paged(q, cache, s["bt"], req, pos, SCALE), r, **tol)
    _close(tmla.mla_decode_paged(q, cache, s["bt"], req, pos, SCALE, num_splits=3), r, **tol)
    # TMA full tiles + a zero-filled tail whenever the cache block is a whole number of 16-row tiles (bs 16)
    _close(tmla.mla_decode_paged(q, cache, s["bt"], req, pos, SCALE, num_splits=2, cfg=dict(BLOCK_N=16, USE_TMA=True)),
           r, **tol)
    _close(tmla.mla_prefill_paged(q, cache, s["bt"], req, pos, SCALE), r, **tol)


@given(paged_setup(), st.sampled_from([1, 2, 4]), st.sampled_from([torch.float32, torch.bfloat16, torch.uint8]),
       st.integers(1, 16), st.data())
def test_sparse_mla_paged(s, H, cdtype, K, data):
    cache = _filled_latent(s, cdtype)
    req, pos = _queries(s, lambda b, n: sorted({n - 1, data.draw(st.integers(0, n - 1))}))
    T = len(req)
    g = torch.Generator().manual_seed(s["seed"] + 3)
    lim = torch.tensor(s["lens"])[req.long()]
    topk = (torch.rand(T, K, generator=g) * lim.unsqueeze(1)).long().int()
    topk[torch.rand(T, K, generator=g) < 0.25] = -1
    if data.draw(st.booleans()):
        topk[0] = -1  # a row with no valid entry -> zeros
    q = torch.randn(T, H, D, generator=g)
    r = ref.sparse_mla_paged(q, cache, s["bt"], req, topk, SCALE)
    naive = _naive_attention(q, cache, s["bt"], req, topk.tolist(), s["bs"], SCALE)
    _close(r, naive, atol=1e-4)
    empty = (topk < 0).all(dim=1)
    assert (r[empty] == 0).all()
    _close(tsparse.sparse_mla_paged(q, cache, s["bt"], req, topk, SCALE), r, atol=1e-4)
    _close(tsparse.sparse_mla_decode_paged(q, cache, s["bt"], req, topk, SCALE, num_splits=2), r, atol=1e-4)
    _close(tsparse.sparse_mla_prefill_paged(q, cache, s["bt"], req, topk, SCALE), r, atol=1e-4)
    _close(tsparse.sparse_mla_prefill_paged(q, cache, s["bt"], req, topk, SCALE, cfg=dict(BLOCK_N=32)), r,
           atol=1e-4)
    qb = q.bfloat16()
    _close(tsparse.sparse_mla_paged(qb, cache, s["bt"], req, topk, SCALE),
           ref.sparse_mla_paged(qb, cache, s["bt"], req, topk, SCALE), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("sparse", [False, True], ids=["mla", "sparse_mla"])
def test_fp8_rows_dequantize_each_group_with_its_scale(sparse):
    """656-byte rows whose four 128-wide groups have different scales (tests.helpers.latent_values): every
    reference and Triton MLA path matches the hand-decoded float64 attention (hypothesis may draw no FP8 case)."""
    s = dict(B=2, bs=8, lens=[13, 6], bt=torch.tensor([[3, 1], [2, 0]], dtype=torch.int32), nb=4, seed=11)
    cache = _filled_latent(s, torch.uint8)
    written = ref.slots_from_positions(s["bt"], torch.tensor([0] * 13 + [1] * 6), torch.cat([torch.arange(13),
                                                                                          torch.arange(6)]), 8)
    scales = cache.view(-1, 656)[written, 512:528].clone().view(torch.float32)
    assert (scales != scales[:, :1]).any(dim=1).all()  # no row with one scale for all four groups
    req, pos = torch.tensor([0, 0, 0, 1], dtype=torch.int32), torch.tensor([10, 11, 12, 5], dtype=torch.int32)
    g = torch.Generator().manual_seed(12)
    q = torch.randn(4, 2, D, generator=g)
    if sparse:
        topk = torch.stack([torch.randperm(int(p) + 1, generator=g)[:5] for p in pos]).int()
        naive = _naive_attention(q, cache, s["bt"], req, topk.tolist(), s["bs"], SCALE)
        paths = [ref.sparse_mla_paged, tsparse.sparse_mla_paged, tsparse.sparse_mla_prefill_paged,
                 lambda *a: tsparse.sparse_mla_decode_paged(*a, num_splits=2)]
        args = (q, cache, s["bt"], req, topk, SCALE)
    else:
        naive = _naive_attention(q, cache, s["bt"], req, [list(range(int(p) + 1)) for p in pos], s["bs"], SCALE)
        paths = [ref.mla_paged, tmla.mla_paged, tmla.mla_prefill_paged,
                 lambda *a: tmla.mla_decode_paged(*a, num_splits=2)]
        args = (q, cache, s["bt"], req, pos, SCALE)
    for path in paths:
        _close(path(*args), naive, atol=1e-4)


def test_mla_decode_combines_many_splits():
    """130 and 65 splits (the combine's 256- and 128-wide split axis, 16 / 32 columns a program), with empty splits
    for the shorter request, match the reference. 64-row key tiles: one tile per 64-row split (what is tested is
    the combine; the interpreter's default 16-row tiles took four times the launches' work)."""
    bs, n = 64, 130 * 64
    perm = torch.randperm(141, generator=torch.Generator().manual_seed(7)).int() + 1
    bt = torch.zeros(2, 130, dtype=torch.int32)
    bt[0], bt[1, :11] = perm[:130], perm[130:]
    s = dict(B=2, bs=bs, lens=[n, 700], bt=bt, nb=142, seed=7)
    cache = _filled_latent(s, torch.float32)
    req = torch.tensor([0, 1], dtype=torch.int32)
    pos = torch.tensor([n - 1, 699], dtype=torch.int32)
    q = torch.randn(2, 2, D, generator=torch.Generator().manual_seed(8))
    r = ref.mla_paged(q, cache, bt, req, pos, SCALE)
    for ns in (130, 100):  # split lengths 64 and 128 rows: 130 and 65 splits
        out = tmla.mla_decode_paged(q, cache, bt, req, pos, SCALE, num_splits=ns,
                                    cfg=dict(BLOCK_N=64, num_warps=4, num_stages=1))
        _close(out, r, atol=1e-4)


def _w_uv_setup(T, qdtype, seed):
    """Two requests' fp32 latent rows (150 and 40 positions, 16-row blocks), T decode-like tokens spread over their
    positions, top-k lists of 12 (a quarter unused, and token 1's all unused), W_UV [2 heads, 24 outputs, 48 of the
    512 latent columns]: the widths are no powers of two, so every mask of the projecting combine is exercised."""
    s = dict(B=2, bs=16, lens=[150, 40], bt=torch.tensor([[3, 1, 4, 6, 9, 2, 5, 8, 7, 10], [11, 13, 12, 0, 0, 0, 0,
                                                                                            0, 0, 0]]).int(),
             nb=14, seed=seed)
    cache = _filled_latent(s, torch.float32)
    g = torch.Generator().manual_seed(seed)
    req = (torch.arange(T) % 2).int()
    pos = (torch.rand(T, generator=g) * torch.tensor(s["lens"])[req.long()]).int()
    topk = (torch.rand(T, 12, generator=g) * (pos.unsqueeze(1) + 1)).int()
    topk[torch.rand(T, 12, generator=g) < 0.25] = -1
    topk[min(1, T - 1)] = -1
    q = torch.randn(T, 2, D, generator=g).to(qdtype)
    w_uv = (torch.randn(2, 24, 48, generator=g) * 48**-0.5).to(qdtype)
    return cache, s["bt"], req, pos, topk, q, w_uv


@pytest.mark.parametrize("T, num_splits", [(2, 3), (3, 1), (5, 40), (20, 4), (70, 2)],
                         ids=["gemv", "one_split", "gemv_many_splits", "mma16", "mma64"])
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sparse", [False, True], ids=["mla", "sparse_mla"])
def test_combine_applies_w_uv(T, num_splits, qdtype, sparse):
    """The combine with W_UV (one token a program: a GEMV; 16- and 64-token tiles: MMAs; one split: the partials
    still written, then projected) against the same attention's latent output times W_UV by the reference's einsum:
    only the product's summation order differs, so float32 agrees to rtol 1e-5 and bf16 within a rounding (not bit
    for bit here: the plain kernels' bf16 stores truncate under the interpreter, where the projecting combine rounds
    to nearest as the GPU does; tests/gpu checks the bits); and against the reference op (W_UV applied by it); a
    token with no listed position gives zeros."""
    cache, bt, req, pos, topk, q, w_uv = _w_uv_setup(T, qdtype, seed=T)
    keys = topk if sparse else pos
    out = tmla.launch_mla(q, cache, bt, req, keys, SCALE, sparse=sparse, num_splits=num_splits, w_uv=w_uv)
    lat = tmla.launch_mla(q, cache, bt, req, keys, SCALE, sparse=sparse, num_splits=num_splits)
    same = ref.project_out(lat, w_uv)
    assert out.shape == (T, 2, 24) and out.dtype == qdtype
    tol = 1e-5 if qdtype == torch.float32 else 2.0**-7
    torch.testing.assert_close(out, same, rtol=tol, atol=tol * same.abs().max().item())
    attend = ref.sparse_mla_paged if sparse else ref.mla_paged
    want = attend(q, cache, bt, req, keys, SCALE, w_uv=w_uv)
    _close(out, want, atol=1e-4 if qdtype == torch.float32 else 2e-2, rtol=0 if qdtype == torch.float32 else 2e-2)
    if sparse:
        assert (out[min(1, T - 1)] == 0).all()


def _latent_step(T, sparse):
    """A step of the cached op's body over a tiny model's shapes (2 requests, 4 heads, q_nope 16 -> 32 latent
    columns, V 24, rope 16, FP8 cache of 16-row blocks): T tokens at the end of the requests' contexts
    (the positions 30.. of request 0 and 10.. of request 1, cached before), as the paged program's decode or
    prefill steps run it. Returns ``run(kern)``: the step over a kernel set (on its own copy of the cache)."""
    from fxglm5.lowering.reference import paged_steps

    g = torch.Generator().manual_seed(T)
    H, dn, ra, dv, dr, bs = 4, 16, 32, 24, 16, 16
    bt = torch.tensor([[2, 5, 1, 7], [3, 6, 4, 0]], dtype=torch.int32)
    cache = torch.zeros(8, bs, 656, dtype=torch.uint8)
    for b, n in enumerate((30, 10)):
        p = torch.arange(n)
        ref.write_latent_cache(cache, torch.randn(n, ra, generator=g), torch.randn(n, dr, generator=g),
                               ref.slots_from_positions(bt, torch.full_like(p, b), p, bs))
    req = (torch.arange(T) % 2).int()
    positions = (torch.tensor([30, 10])[req.long()] + torch.arange(T) // 2).int()
    slots = ref.slots_from_positions(bt, req, positions, bs)
    topk = (torch.rand(T, 8, generator=g) * (positions.unsqueeze(1) + 1)).int()

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    args = dict(q_nope=rand(T, 1, H, dn), q_pe=rand(T, 1, H, dr), kv_c=rand(T, 1, ra), k_pe=rand(T, 1, dr),
                w_uk=rand(H, dn, ra, scale=dn**-0.5), w_uv=rand(H, dv, ra, scale=ra**-0.5), scale=SCALE,
                slot_mapping=slots, block_table=bt, req_idx=req, positions=positions, max_positions=64)

    def run(kern):
        kv_cache = cache.clone()
        if sparse:
            return paged_steps.sparse_mla_step(kern, topk_pos=topk.view(T, 1, 8), kv_cache=kv_cache, **args)
        return paged_steps.mla_step(kern, kv_cache=kv_cache, **args)

    return run


@pytest.mark.parametrize("sparse", [False, True], ids=["mla", "sparse_mla"])
@pytest.mark.parametrize("T, launches", [
    (2, ["_latent_query_kernel", "_write_latent_fp8_kernel", "_mla_project_kernel"]),
    (8, ["_latent_query_kernel", "_write_latent_fp8_kernel", "_mla_fwd_kernel", "einsum"]),
], ids=["decode", "prefill"])
@pytest.mark.usefixtures("all_decode_joins")  # the MLA's W_UV combine in its launch: an opt-in join
def test_latent_attention_step_launches(sparse, T, launches, monkeypatch):
    """The attention of a decode step over the Triton kernel set is three Triton launches and no torch GEMM: W_UK is
    applied in the latent query kernel and W_UV in the combine, which runs in the MLA's launch (``_mla_project_kernel``;
    before: an einsum, the query kernel, the cache write, the MLA, the combine at several splits, an einsum; then
    the MLA and its combine as two launches). A prefill-shaped step (2 x SMs tokens, 8 on CPU) keeps
    cuBLAS's GEMM for W_UV after the MLA's one pass. Both give the reference kernel set's output (float32: to rtol
    1e-5, the GEMMs' summation order aside)."""
    from triton.runtime.interpreter import InterpretedFunction

    from fxglm5.lowering.triton import paged_ops

    run = _latent_step(T, sparse)
    want = run(ref)
    seen, launch, einsum = [], InterpretedFunction.run, torch.einsum
    monkeypatch.setattr(InterpretedFunction, "run", lambda self, *a, **k: seen.append(self.__name__) or
                        launch(self, *a, **k))
    monkeypatch.setattr(torch, "einsum", lambda *a: seen.append("einsum") or einsum(*a))
    out = run(paged_ops)
    assert seen == launches
    assert out.shape == want.shape == (T, 1, 4, 24)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_split_picker_fills_the_gpu_at_batch_one():
    assert tmla.pick_num_splits(1, 32768, 132) == 128  # one long row: every SM busy, 4 tiles a split
    assert tmla.pick_num_splits(64, 32768, 132) == 2  # a full batch: one wave of 128 programs
    for units, length in [(1, 100), (1, 8192), (1, 131072), (3, 131072), (200, 4096)]:
        assert 1 <= tmla.pick_num_splits(units, length, 132) <= min(256, -(-length // 64))


def test_sparse_equals_dense_when_topk_lists_the_whole_window():
    s = dict(B=1, bs=4, lens=[9], bt=torch.tensor([[2, 3, 1]], dtype=torch.int32), nb=4, seed=0)
    cache = _filled_latent(s, torch.float32)
    req = torch.zeros(3, dtype=torch.int32)
    pos = torch.tensor([2, 5, 8], dtype=torch.int32)
    topk = torch.full((3, 12), -1, dtype=torch.int32)
    for t, p in enumerate(pos.tolist()):
        topk[t, : p + 1] = torch.randperm(p + 1)
    q = torch.randn(3, 2, D)
    _close(ref.sparse_mla_paged(q, cache, s["bt"], req, topk, SCALE), ref.mla_paged(q, cache, s["bt"], req, pos, SCALE),
           atol=1e-5)


# --------------------------------------------------------------------------------------------------------------
# indexer
# --------------------------------------------------------------------------------------------------------------
def _naive_indexer_scores(q, w, kc, bt, req, pos, bs):
    T, HI, _ = q.shape
    out = []
    for t in range(T):
        qd = torch.zeros(HI, 128, dtype=torch.float64)
        for h in range(HI):
            sc = _hand_scale(float(q[t, h].float().abs().max()))
            qd[h] = (q[t, h].float() / sc).to(torch.float8_e4m3fn).double() * sc
        n = int(pos[t]) + 1
        k = torch.stack([_hand_decode_index(kc, _hand_slot(bt, int(req[t]), p, bs)) for p in range(n)])
        out.append((w[t].double().unsqueeze(1) * torch.relu(qd @ k.T)).sum(0))
    return out


@given(paged_setup(), st.sampled_from([1, 2, 4]), st.integers(1, 16), st.data())
def test_indexer_topk_paged(s, HI, K, data):
    kc = _filled_index(s)
    req, pos = _queries(s, lambda b, n: sorted({n - 1, data.draw(st.integers(0, n - 1))}))
    T = len(req)
    g = torch.Generator().manual_seed(s["seed"] + 4)
    q = torch.randn(T, HI, 128, generator=g).bfloat16()
    w = torch.randn(T, HI, generator=g)
    naive = _naive_indexer_scores(q, w, kc, s["bt"], req, pos, s["bs"])
    L = s["bt"].shape[1] * s["bs"]
    lr = ref.indexer_logits_paged(q, w, kc, s["bt"], req, pos, max_len=L)
    lt = tindexer.indexer_logits_paged(q, w, kc, s["bt"], req, pos)
    assert lt.shape == (T, L)
    for t in range(T):
        n = int(pos[t]) + 1
        _close(lr[t, :n], naive[t], atol=1e-4, rtol=1e-5)
        _close(lt[t, :n], lr[t, :n], atol=1e-4, rtol=1e-5)
        assert torch.isinf(lt[t, n:]).all() and torch.isinf(lr[t, n:]).all()
    for name, sel in [("ref", ref.indexer_topk_paged(q, w, kc, s["bt"], req, pos, K)),
                      ("triton", tindexer.indexer_topk_paged(q, w, kc, s["bt"], req, pos, K))]:
        assert sel.dtype == torch.int32 and sel.shape == (T, K), name
        scores = lr if name == "ref" else lt
        for t in range(T):
            n = int(pos[t]) + 1
            k = min(K, n)
            got = sel[t, :k].long()
            assert (sel[t, k:] == -1).all(), name
            assert got.unique().numel() == k and int(got.min()) >= 0 and int(got.max()) < n, name
            # the selection is exactly a top-k of the implementation's own scores...
            assert torch.equal(scores[t, got].sort().values, scores[t, :n].topk(k).values.sort().values), name
            # ...and a near-top-k of the independent float64 scores
            best = naive[t].topk(k).values.sort().values
            _close(naive[t][got].sort().values, best, atol=1e-3)


@settings(max_examples=4)
@given(paged_setup(max_len=48), st.integers(1, 16))
def test_indexer_logits_skip_rows_whose_window_fits(s, skip):
    """``skip_window``: a row whose causal window holds at most that many keys is not computed (``out`` keeps what
    it held: NaN here), every other row is the full call's; the top-k passes its k, so a decode step over contexts
    that fit in index_topk computes no scores."""
    kc = _filled_index(s)
    req, pos = _queries(s, lambda b, n: sorted({0, n // 2, n - 1}))
    g = torch.Generator().manual_seed(s["seed"] + 8)
    q = torch.randn(len(req), 2, 128, generator=g).bfloat16()
    w = torch.randn(len(req), 2, generator=g)
    full = tindexer.indexer_logits_paged(q, w, kc, s["bt"], req, pos)
    out = torch.full_like(full, float("nan"))
    tindexer.indexer_logits_paged(q, w, kc, s["bt"], req, pos, out=out, skip_window=skip)
    skipped = pos + 1 <= skip
    assert torch.isnan(out[skipped]).all()
    assert torch.equal(out[~skipped], full[~skipped])


@settings(max_examples=2)
@given(paged_setup(max_len=48), st.integers(1, 16))
def test_indexer_topk_paged_row_chunks_select_as_one_call(s, K):
    """A step whose [tokens, context] float32 logits would pass 2^31 bytes (monkeypatched down to one row's
    worth) runs as row chunks (here one row each): the selection of each row is the unchunked call's, bit for bit (a 262144-token
    prefill at 32k context faulted on the H200 before: int32 row offsets)."""
    from fxglm5.lowering.triton import fp8_gemm

    kc = _filled_index(s)
    req, pos = _queries(s, lambda b, n: sorted({0, n // 2, n - 1}))
    g = torch.Generator().manual_seed(s["seed"] + 6)
    q = torch.randn(len(req), 2, 128, generator=g).bfloat16()
    w = torch.randn(len(req), 2, generator=g)
    whole = tindexer.indexer_topk_paged(q, w, kc, s["bt"], req, pos, K)
    row_bytes = s["bt"].shape[1] * s["bs"] * tindexer.LOGITS_BYTES_PER_ELEMENT
    calls = []
    real = tindexer._launch  # the logits launch, or the decode step's one launch of logits and top-k
    limit = row_bytes + 1
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fp8_gemm, "INT32_ELEMENTS", limit)
        mp.setattr(tindexer, "_launch", lambda q, *a, **k: calls.append(q.shape[0]) or real(q, *a, **k))
        chunked = tindexer.indexer_topk_paged(q, w, kc, s["bt"], req, pos, K)
    assert calls == [1] * len(req)
    assert torch.equal(chunked, whole)


@given(paged_setup(max_len=100, block_sizes=(32, 64)), st.sampled_from([1, 4]), st.sampled_from([(16, 2), (32, 3)]))
def test_indexer_logits_tma(s, HI, tiles):
    """The TMA path (whole-tile boxes of the block-major keys): same logits as the reference, with every byte
    the step does not own set to 0x7F (an e4m3 NaN, and a NaN scale) so that stale rows inside a loaded box
    must be masked, not trusted."""
    kc = _filled_index(s, fill=0x7F)
    req, pos = _queries(s, lambda b, n: [n - 1])
    g = torch.Generator().manual_seed(s["seed"] + 5)
    q = torch.randn(len(req), HI, 128, generator=g).bfloat16()
    w = torch.randn(len(req), HI, generator=g)
    L = s["bt"].shape[1] * s["bs"]
    lr = ref.indexer_logits_paged(q, w, kc, s["bt"], req, pos, max_len=L)
    block_n, n_tiles = tiles
    lt = tindexer.indexer_logits_paged(q, w, kc, s["bt"], req, pos,
                                       cfg=dict(BLOCK_N=block_n, TILES=n_tiles, USE_TMA=True))
    assert torch.equal(torch.isinf(lt), torch.isinf(lr)) and not torch.isnan(lt).any()
    fin = ~torch.isinf(lr)
    _close(lt[fin], lr[fin], atol=1e-4, rtol=1e-5)


def test_indexer_logits_tma_needs_fitting_blocks():
    kc = torch.zeros(3, 16, 132, dtype=torch.uint8)
    one = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(InputError, match="USE_TMA needs the FP8 cache and a block size"):
        tindexer.indexer_logits_paged(torch.zeros(1, 1, 128), torch.ones(1, 1), kc, torch.ones(1, 2, dtype=torch.int32),
                                      one, one, cfg=dict(BLOCK_N=16, TILES=1, USE_TMA=True))
    exact = torch.zeros(3, 64, 128)  # a compute-dtype (exact mode) cache has no 128-byte FP8 rows to box
    with pytest.raises(InputError, match="cache torch.float32, block size 64"):
        tindexer.indexer_logits_paged(torch.zeros(1, 1, 128), torch.ones(1, 1), exact, torch.ones(1, 2, dtype=torch.int32),
                                      one, one, validate=False, cfg=dict(BLOCK_N=64, TILES=1, USE_TMA=True))


@pytest.mark.parametrize("bs, tma_kept", [(64, 4), (32, 0), (16, 0), (128, 4)])
def test_indexer_autotune_offers_tma_only_where_blocks_fit(bs, tma_kept):
    """The autotuner never launches a TMA candidate whose box would straddle cache blocks, and tunes per token-count
    bucket (a program length tuned at 64 tokens would leave the GPU idle at one)."""
    assert tindexer._indexer_logits_tuned.keys == ["HI", "max_len", "BS", "T_BUCKET"]
    kept = tindexer._fitting_configs(tindexer._LOGITS_CONFIGS, {}, BS=bs)
    assert sum(bool(c.kwargs.get("USE_TMA")) for c in kept) == tma_kept
    assert all(tindexer.tma_tiles_fit(bs, c.kwargs["BLOCK_N"]) for c in kept if c.kwargs.get("USE_TMA"))
    assert sum(not c.kwargs.get("USE_TMA") for c in kept) == sum(not c.kwargs.get("USE_TMA")
                                                                 for c in tindexer._LOGITS_CONFIGS)
    exact = tindexer._fitting_configs(tindexer._LOGITS_CONFIGS, {}, BS=bs, EXACT=True)
    assert exact and not any(c.kwargs.get("USE_TMA") for c in exact)  # the exact mode's cache: gathers only
    # the untuned launch (FXGLM5_NO_AUTOTUNE=1) follows the same rule; an explicit config gets TMA only if it
    # asks for it
    assert bool(tindexer._launch_config(bs, None, interp=False).get("USE_TMA")) == tindexer.tma_tiles_fit(bs, 64)
    explicit = tindexer._launch_config(bs, dict(BLOCK_N=128, TILES=4, PROMOTE=32), interp=False)
    assert not explicit.get("USE_TMA") and explicit["BLOCK_N"] == 128 and explicit["PROMOTE"] == 32
    assert tindexer._launch_config(bs, dict(BLOCK_N=32, USE_TMA=True), interp=False)["USE_TMA"]


def test_topk_from_logits_bad_inputs():
    x, pos = torch.randn(2, 40), torch.tensor([39, 10], dtype=torch.int32)
    with pytest.raises(InputError, match="method 'row'"):
        tindexer.topk_from_logits(x, pos, 8, method="row")
    with pytest.raises(InputError, match="SEGMENT_MAX"):
        tindexer.topk_from_logits(x, pos, tindexer.SEGMENT_MAX // 2 + 1)
    with pytest.raises(InputError, match="logits: dtype torch.bfloat16"):
        tindexer.topk_from_logits(x.bfloat16(), pos, 8)
    with pytest.raises(InputError, match="logits: columns must be contiguous"):
        tindexer.topk_from_logits(torch.randn(40, 2).t(), pos, 8)
    with pytest.raises(InputError, match="positions: expected 2 entries"):
        tindexer.topk_from_logits(x, pos[:1], 8)
    with pytest.raises(InputError, match="positions: dtype torch.float32"):
        tindexer.topk_from_logits(x, pos.float(), 8)
    with pytest.raises(InputError, match="topk: must be a positive int"):
        tindexer.topk_from_logits(x, pos, 0)
    with pytest.raises(InputError, match=r"out: expected a contiguous-row int32 \[2, 8\]"):
        tindexer.topk_from_logits(x, pos, 8, out=torch.empty(2, 7, dtype=torch.int32))
    with pytest.raises(InputError, match="out: dtype torch.int64"):
        tindexer.topk_from_logits(x, pos, 8, out=torch.empty(2, 8, dtype=torch.int64))


@given(st.integers(1, 3), st.integers(1, 300), st.integers(1, 80), st.sampled_from([64, 128]), st.integers(0, 2**16),
       st.sampled_from(["multi", "segments"]))
def test_radix_topk_from_logits(T, L, K, chunk, seed, method):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, L, generator=g)
    x[:, ::3] = torch.randint(-2, 3, (T, len(range(0, L, 3))), generator=g).float()  # many ties
    x[0, : L // 2] = -x[0, : L // 2].abs()  # negatives
    pos = torch.randint(0, L, (T,), generator=g).int()
    out = tindexer.topk_from_logits(x, pos, K, chunk=chunk, method=method)
    for t in range(T):
        n = int(pos[t]) + 1
        k = min(K, n)
        got = out[t, :k].long()
        assert (out[t, k:] == -1).all()
        assert got.unique().numel() == k and int(got.max()) < n
        assert torch.equal(x[t, got].sort().values, x[t, :n].topk(k).values.sort().values)


def test_multi_segment_length_fills_the_sms():
    from fxglm5.lowering.triton.topk import multi_segment_length

    assert multi_segment_length(16, 65536, 132) == 4096  # 256 CTAs already
    assert multi_segment_length(8, 65536, 132) == 2048  # 128 CTAs -> 256
    assert multi_segment_length(4, 65536, 132) == 1024  # 64 -> 256
    assert multi_segment_length(1, 131072, 132) == 512  # the floor: 256 CTAs
    assert multi_segment_length(1, 1000, 132) == 512
    assert multi_segment_length(64, 131072, 132) == 4096


@given(st.integers(1, 3), st.integers(1, 400), st.integers(1, 80), st.sampled_from([64, 128]), st.integers(0, 2**16),
       st.sampled_from(["multi", "segments"]))
def test_topk_ties_take_the_lowest_indices(T, L, K, chunk, seed, method):
    """Exact indices, not just values: among equal scores at the threshold the lowest indices win, through every
    tournament round (a segment keeps its first ties, and equal keys stay in index order in candidate lists)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 4, (T, L), generator=g).float()  # seven distinct values: ties everywhere
    pos = torch.randint(0, L, (T,), generator=g).int()
    out = tindexer.topk_from_logits(x, pos, K, chunk=chunk, method=method)
    for t in range(T):
        n = int(pos[t]) + 1
        k = min(K, n)
        want = sorted(range(n), key=lambda i: (-float(x[t, i]), i))[:k]
        got = out[t, :k].tolist()
        assert sorted(got) == sorted(want)
        if method == "segments":  # two increasing runs: the keys above the last bin, then the bin's selection
            p = next((i for i in range(1, k) if got[i] < got[i - 1]), k)
            assert got[p:] == sorted(got[p:])
            if 0 < p < k:
                assert float(x[t, got[:p]].min()) > float(x[t, got[p:]].max())


@pytest.mark.parametrize("method", ["segments", "multi"])
def test_topk_all_tied_rows_take_the_first_indices(method):
    """Rows of one value (no bin ever gets small: every bit gets fixed) with top-k above the bin capacity, and a
    row whose top values tie across segment boundaries: the lowest indices, exactly."""
    x = torch.zeros(3, 300)
    x[1, 150:] = 1.0
    x[2, ::2] = 2.0
    pos = torch.tensor([299, 299, 250], dtype=torch.int32)
    out = tindexer.topk_from_logits(x, pos, 80, method=method)
    want = [list(range(80)), list(range(150, 230)), list(range(0, 160, 2))]
    for t in range(3):
        assert sorted(out[t].tolist()) == want[t]


def test_topk_bin_decided_before_it_is_small():
    """Exactly k scores at or above a coarse bin boundary (here the k scores >= 2.0, which fix the key's top bits
    in the first step): the search stops there with more keys in the bin than its scratch holds (k = 48 > 32 in
    the interpreter's launch), and the whole bin is written straight to the output, in both the single round and
    a round that keeps candidates for the next. The scratch beyond this row's is never written."""
    g = torch.Generator().manual_seed(3)
    for L in (128, 1000):
        x = -torch.rand(2, L, generator=g) - 0.5  # every score below 0
        hot = torch.randperm(L, generator=g)[:48]
        x[0, hot] = 2.0 + torch.rand(48, generator=g)  # 48 distinct scores in [2, 3)
        x[1] = torch.linspace(-1.0, 1.0, L)  # the other row: a bin that gets small, then fine steps
        pos = torch.full((2,), L - 1, dtype=torch.int32)
        out = tindexer.topk_from_logits(x, pos, 48)
        assert sorted(out[0].tolist()) == sorted(hot.tolist()), L
        assert sorted(out[1].tolist()) == list(range(L - 48, L)), L


# --------------------------------------------------------------------------------------------------------------
# bad inputs
# --------------------------------------------------------------------------------------------------------------
def _small():
    bt = torch.tensor([[1, 2], [3, 0]], dtype=torch.int32)
    cache = torch.zeros(4, 4, 576)
    return bt, cache


@pytest.mark.parametrize("mla_fn", [ref.mla_paged, tmla.mla_paged])
def test_mla_bad_inputs(mla_fn):
    bt, cache = _small()
    q = torch.randn(2, 2, D)
    req = torch.tensor([0, 1], dtype=torch.int32)
    pos = torch.tensor([7, 3], dtype=torch.int32)
    mla_fn(q, cache, bt, req, pos, SCALE)
    cases = {
        "q": lambda: mla_fn(q.int(), cache, bt, req, pos, SCALE),
        "q ": lambda: mla_fn(torch.randn(2, 2, 512), cache, bt, req, pos, SCALE),
        "cache": lambda: mla_fn(q, torch.zeros(4, 4, 600), bt, req, pos, SCALE),
        "cache ": lambda: mla_fn(q, torch.zeros(4, 4, 576, dtype=torch.uint8), bt, req, pos, SCALE),
        "block_table": lambda: mla_fn(q, cache, torch.tensor([[1, 9], [3, 0]], dtype=torch.int32), req, pos, SCALE),
        "block_table ": lambda: mla_fn(q, cache, bt, req, torch.tensor([7, 4], dtype=torch.int32), SCALE),
        "req_idx": lambda: mla_fn(q, cache, bt, torch.tensor([0, 2], dtype=torch.int32), pos, SCALE),
        "positions": lambda: mla_fn(q, cache, bt, req, torch.tensor([8, 0], dtype=torch.int32), SCALE),
        "positions ": lambda: mla_fn(q, cache, bt, req, torch.tensor([-1, 0], dtype=torch.int32), SCALE),
        "positions  ": lambda: mla_fn(q, cache, bt, req, pos.float(), SCALE),
        "scale": lambda: mla_fn(q, cache, bt, req, pos, -1.0),
    }
    for name, fn in cases.items():
        with pytest.raises(InputError, match=name.strip()):
            fn()


@pytest.mark.parametrize("fn", [ref.sparse_mla_paged, tsparse.sparse_mla_paged])
def test_sparse_mla_bad_inputs(fn):
    bt, cache = _small()
    q = torch.randn(2, 2, D)
    req = torch.tensor([0, 1], dtype=torch.int32)
    top = torch.tensor([[0, 7, -1], [1, 2, 3]], dtype=torch.int32)
    fn(q, cache, bt, req, top, SCALE)
    for name, bad in {"topk_pos": torch.tensor([[0, 8, -1], [1, 2, 3]], dtype=torch.int32),  # beyond the table
                      "topk_pos ": torch.tensor([[0, 1, -2], [1, 2, 3]], dtype=torch.int32),
                      "topk_pos  ": torch.tensor([[0, 1], [4, 0]], dtype=torch.int32),  # block 0 (padding)
                      "topk_pos   ": torch.tensor([[0, 1]], dtype=torch.int32)}.items():
        with pytest.raises(InputError, match=name.strip()):
            fn(q, cache, bt, req, bad, SCALE)


@pytest.mark.parametrize("fn", [ref.indexer_topk_paged, tindexer.indexer_topk_paged])
def test_indexer_bad_inputs(fn):
    bt = torch.tensor([[1, 2]], dtype=torch.int32)
    kc = torch.zeros(3, 4, 132, dtype=torch.uint8)
    q = torch.randn(1, 2, 128)
    w = torch.randn(1, 2)
    req = torch.tensor([0], dtype=torch.int32)
    pos = torch.tensor([5], dtype=torch.int32)
    fn(q, w, kc, bt, req, pos, 4)
    cases = {
        "q": lambda: fn(torch.randn(1, 2, 64), w, kc, bt, req, pos, 4),
        "weights": lambda: fn(q, torch.randn(1, 3), kc, bt, req, pos, 4),
        "weights ": lambda: fn(q, w.double(), kc, bt, req, pos, 4),
        "k_cache": lambda: fn(q, w, torch.zeros(3, 4, 128, dtype=torch.uint8), bt, req, pos, 4),
        "k_cache ": lambda: fn(q, w, kc.float(), bt, req, pos, 4),
        "topk": lambda: fn(q, w, kc, bt, req, pos, 0),
        "positions": lambda: fn(q, w, kc, bt, req, torch.tensor([8], dtype=torch.int32), 4),
    }
    for name, f in cases.items():
        with pytest.raises(InputError, match=name.strip()):
            f()


@pytest.mark.parametrize("mod", [ref, tpc])
def test_write_bad_inputs(mod):
    cache = torch.zeros(3, 4, 576, dtype=torch.bfloat16)
    kv, pe = torch.randn(2, R), torch.randn(2, DR)
    sl = torch.tensor([4, -1])
    mod.write_latent_cache(cache, kv, pe, sl)
    with pytest.raises(InputError, match="slot_mapping"):
        mod.write_latent_cache(cache, kv, pe, torch.tensor([4, 12]))
    with pytest.raises(InputError, match="slot_mapping"):
        mod.write_latent_cache(cache, kv, pe, torch.tensor([4.0, 5.0]))
    with pytest.raises(InputError, match="slot_mapping"):
        mod.write_latent_cache(cache, kv, pe, torch.tensor([4]))
    with pytest.raises(InputError, match="kv_c"):
        mod.write_latent_cache(cache, torch.randn(2, 520), pe, sl)
    with pytest.raises(InputError, match="k_pe"):
        mod.write_latent_cache(cache, kv, torch.randn(3, DR), sl)
    with pytest.raises(InputError, match="cache"):
        mod.write_latent_cache(torch.zeros(3, 4, 656, dtype=torch.int8), kv, pe, sl)
    with pytest.raises(InputError, match="cache"):
        mod.write_latent_cache(torch.zeros(3, 4, 600, dtype=torch.uint8), kv, pe, sl)
    kc = torch.zeros(3, 4, 132, dtype=torch.uint8)
    mod.write_indexer_cache(kc, torch.randn(2, 128), sl)
    with pytest.raises(InputError, match="k"):
        mod.write_indexer_cache(kc, torch.randn(2, 130), sl)
    with pytest.raises(InputError, match="cache"):
        mod.write_indexer_cache(torch.zeros(3, 4, 128, dtype=torch.uint8), torch.randn(2, 128), sl)
    with pytest.raises(InputError, match="slot_mapping"):
        mod.write_indexer_cache(kc, torch.randn(2, 128), torch.tensor([0, 99]))
    with pytest.raises(InputError, match="slots"):
        ref.read_latent_rows(cache, torch.tensor([-1]))
    with pytest.raises(InputError, match="req_idx"):
        ref.slots_from_positions(torch.tensor([[1]], dtype=torch.int32), torch.tensor([1]), torch.tensor([0]), 4)


@pytest.mark.parametrize("cdtype", [torch.float32, torch.bfloat16, torch.uint8])
@pytest.mark.parametrize("cfg", [None, dict(BLOCK_N=16, USE_TMA=True, num_warps=4, num_stages=1),
                                 dict(BLOCK_N=32, num_warps=4, num_stages=2)])
def test_mla_launch_variants_ignore_garbage_rows(cdtype, cfg):
    """Unwritten cache rows hold NaN bytes (as a real cache may): no launch variant (pointer gathers, TMA tiles
    with a gathered tail) may let them leak into the output."""
    bs = 16
    cache = torch.zeros(12, bs, 656 if cdtype == torch.uint8 else 576, dtype=cdtype)
    if cdtype == torch.uint8:
        cache.fill_(0x7F)  # e4m3 NaN, and NaN float32 scales / bf16 k_pe
    else:
        cache.fill_(float("nan"))
    bt = torch.tensor([[3, 7, 1, 0], [2, 4, 5, 6]], dtype=torch.int32)
    s = dict(B=2, bs=bs, lens=[40, 57], bt=bt, nb=12, seed=5)
    torch.manual_seed(5)
    for b, n in enumerate(s["lens"]):
        pos = torch.arange(n)
        ref.write_latent_cache(cache, torch.randn(n, R), torch.randn(n, DR),
                               ref.slots_from_positions(bt, torch.full_like(pos, b), pos, bs))
    req = torch.tensor([0, 1, 1, 1], dtype=torch.int32)
    pos = torch.tensor([39, 0, 20, 56], dtype=torch.int32)
    q = torch.randn(4, 2, D)
    r = ref.mla_paged(q, cache, bt, req, pos, SCALE)
    assert torch.isfinite(r).all()
    for ns in (1, 3):
        o = tmla.mla_decode_paged(q, cache, bt, req, pos, SCALE, num_splits=ns, cfg=cfg)
        _close(o, r, atol=1e-4)
