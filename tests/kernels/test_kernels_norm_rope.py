"""RMSNorm, RoPE and their fusion into the cache writes: the torch references against independent float64 /
complex-number oracles, and the Triton kernels (TRITON_INTERPRET=1 on CPU) against the references, standalone
and fused (norm + RoPE + FP8 quantization in one cache-write kernel vs the unfused chain)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import fxglm5.ops  # noqa: E402,F401  (registers the canonical ops)
import fxglm5.ops.cached  # noqa: E402,F401  (registers the cached ops)
from fxglm5.errors import InputError  # noqa: E402
from fxglm5.lowering.reference import norm_rope as ref  # noqa: E402
from fxglm5.lowering.reference import paged  # noqa: E402
from tests.helpers import latent_values  # noqa: E402

pytest.importorskip("triton")

from fxglm5.lowering.triton import norm_rope as tnr  # noqa: E402
from fxglm5.lowering.triton import paged_cache as tpc  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


def _ulps(dtype) -> float:
    """Relative size of a couple of roundings in ``dtype`` (the reduction order of the mean may differ)."""
    return 1e-5 if dtype == torch.float32 else 2 * 2.0**-8


def _close(out, expected, dtype):
    """Within a couple of roundings everywhere, and bit-equal almost everywhere: the kernels round where the
    reference rounds, so only a differently ordered sum may move a value by one ulp."""
    tol = _ulps(dtype)
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol * expected.float().abs().max().item())
    assert (out.float() == expected.float()).float().mean() > 0.97


# GLM-5's eps; the norm tests' rows span 1e-4..4 in magnitude, so that in the small ones mean(x^2) is below eps
# and eps*2 or eps/10 moves the output by tens of percent (in unit rows it moves it by ~5e-6 only).
EPS = 1e-5
# per-row max |error| / max |row|, measured (float32: <= 2.6e-7 vs the float64 oracle and kernel vs reference;
# bf16: 0, the roundings agree), bounded a few roundings above: float32 ~8 ulps, bf16 one rounding
NORM_TOL = {torch.float32: 1e-6, torch.bfloat16: 2.0**-8}


def _norm_rows(T, D, gen, dtype):
    """x [T, D] with rows from 1e-4 (the first) to 4 in magnitude, weights around 1."""
    scale = torch.logspace(-4, 0.6, T, dtype=torch.float64)[:, None]
    x = torch.randn(T, D, generator=gen, dtype=torch.float64) * scale
    w = 1 + 0.1 * torch.randn(D, generator=gen, dtype=torch.float64)
    return x.to(dtype), w.to(dtype)


def _rows_close(out, expected, dtype):
    """Every row within NORM_TOL[dtype] of the expected one, relative to that row's largest value."""
    err = (out.double() - expected.double()).abs().amax(-1) / expected.double().abs().amax(-1)
    assert err.max() <= NORM_TOL[dtype], f"per-row relative error {err.max():.2e} > {NORM_TOL[dtype]:.1e}"


def _tables(T, half, gen):
    angles = torch.rand(T, 1, generator=gen) * 300 * torch.logspace(0, -3, half)[None]
    return angles.cos(), angles.sin()


# ---- the references against independent oracles -----------------------------------------------------------
@given(st.integers(1, 9), st.sampled_from([7, 64, 512]), st.sampled_from(["reference", "op"]), st.integers(0, 99))
def test_rms_norm_reference_is_rmsnorm(T, D, impl, seed):
    norm = ref.rms_norm if impl == "reference" else torch.ops.fxglm5.rms_norm
    x, w = _norm_rows(T, D, torch.Generator().manual_seed(seed), torch.float64)
    oracle = w * x / (x.pow(2).sum(-1, keepdim=True) / D + EPS).sqrt()
    _rows_close(norm(x.float(), w.float(), EPS), oracle, torch.float32)


@given(st.integers(1, 6), st.sampled_from([1, 3]), st.sampled_from([(8, 8), (16, 8), (64, 64), (128, 64)]),
       st.integers(0, 99))
def test_rope_reference_is_a_complex_rotation(T, H, dims, seed):
    D, rot = dims
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, D, generator=gen)
    cos, sin = _tables(T, rot // 2, gen)
    pairs = torch.view_as_complex(x[..., :rot].double().reshape(T, H, rot // 2, 2).contiguous())
    turned = torch.view_as_real(pairs * torch.polar(torch.ones_like(cos.double()), torch.atan2(sin, cos).double())[:, None])
    out = ref.rope_interleaved(x, cos, sin)
    torch.testing.assert_close(out[..., :rot].double(), turned.reshape(T, H, rot), rtol=1e-5, atol=1e-5)
    assert torch.equal(out[..., rot:], x[..., rot:])


# ---- standalone kernels ----------------------------------------------------------------------------------
@given(st.integers(1, 7), st.sampled_from([64, 100, 512, 1536]), st.sampled_from(DTYPES), st.booleans(),
       st.integers(0, 99))
def test_rms_norm_kernel_matches_reference(T, D, dtype, strided, seed):
    base, w = _norm_rows(T, D + 32 * strided, torch.Generator().manual_seed(seed), dtype)
    x, w = base[:, :D], w[:D]  # strided rows: a split of a wider projection, as in the graph
    expected = ref.rms_norm(x, w, EPS)
    out = tnr.rms_norm(x, w, EPS)
    _rows_close(out, expected, dtype)
    if dtype == torch.bfloat16:  # the float32 values differ by an ulp at most: the bf16 roundings agree
        assert (out == expected).float().mean() > 0.97


@given(st.integers(1, 5), st.sampled_from([1, 4, 19]), st.sampled_from([(64, 64), (128, 64), (32, 32), (64, 32)]),
       st.sampled_from(DTYPES), st.integers(0, 99))
def test_rope_kernel_matches_reference(T, H, dims, dtype, seed):
    D, rot = dims
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, D + 16, generator=gen).to(dtype)[..., 16:]  # not 16-aligned, strided
    cos, sin = _tables(T, rot // 2, gen)
    _close(tnr.rope_interleaved(x, cos, sin), ref.rope_interleaved(x, cos, sin), dtype)


# ---- fused into the cache writes / the query assembly -------------------------------------------------------
def _slots(T, nb, bs, gen):
    slots = torch.randperm(nb * bs - bs, generator=gen)[:T] + bs  # block 0 reserved
    slots[torch.rand(T, generator=gen) < 0.2] = -1
    return slots


def _decode_latent(cache):
    if cache.dtype != torch.uint8:
        return cache.float().view(-1, 576)
    rows = cache.view(-1, 656)
    c = rows[:, :512].clone().view(torch.float8_e4m3fn).float()
    sc = rows[:, 512:528].clone().view(torch.float32)
    return torch.cat([c * sc.repeat_interleave(128, dim=1), rows[:, 528:].clone().view(torch.bfloat16).float()], 1)


@given(st.integers(1, 9), st.sampled_from([(512, 64), (128, 32)]), st.sampled_from(DTYPES),
       st.sampled_from([torch.float32, torch.bfloat16, torch.uint8]), st.booleans(), st.booleans(), st.integers(0, 99))
def test_fused_latent_write_matches_the_unfused_chain(T, widths, dtype, cdtype, norm, rope, seed):
    rk, rp = widths
    gen = torch.Generator().manual_seed(seed)
    # one projection, split: strided rows; in FP8 rows of rank 512 the four group scales differ
    c = latent_values(T, rk, gen) if cdtype == torch.uint8 else torch.randn(T, rk, generator=gen)
    kv = (torch.cat([c, torch.randn(T, rp, generator=gen)], 1) * 3).to(dtype)
    kv_c, k_pe = kv[:, :rk], kv[:, rk:]
    norm_args = ((1 + 0.1 * torch.randn(rk, generator=gen)).to(dtype), 1e-6) if norm else None
    rope_args = _tables(T, rp // 2, gen) if rope else None
    slots = _slots(T, 4, 4, gen)
    width = 656 if cdtype == torch.uint8 else 576
    fused, unfused = torch.zeros(4, 4, width, dtype=cdtype), torch.zeros(4, 4, width, dtype=cdtype)
    tpc.write_latent_cache(fused, kv_c, k_pe, slots, norm=norm_args, rope=rope_args)
    rows = paged.prepare_latent_rows(kv_c, k_pe, norm_args, rope_args)  # the reference chain, then a plain write
    paged.write_latent_cache(unfused, *rows, slots)
    a, b = _decode_latent(fused), _decode_latent(unfused)
    if cdtype == torch.uint8:  # one e4m3 step where a 1-ulp input difference crosses a rounding boundary
        torch.testing.assert_close(a, b, rtol=2.0**-3, atol=1e-3 * b.abs().max().item())
        assert (fused == unfused).float().mean() > 0.98
    else:
        _close(a, b, torch.bfloat16 if torch.bfloat16 in (dtype, cdtype) else dtype)
    assert (fused[0] == 0).all()  # the reserved block stays untouched


@given(st.integers(1, 9), st.sampled_from([(128, 64), (64, 32)]), st.sampled_from(DTYPES), st.booleans(),
       st.booleans(), st.integers(0, 99))
def test_fused_index_write_matches_the_unfused_chain(T, dims, dtype, norm, rope, seed):
    kd, rot = dims
    gen = torch.Generator().manual_seed(seed)
    k = (torch.randn(T, kd, generator=gen) * 2 + 0.5).to(dtype)
    norm_args = ((1 + 0.1 * torch.randn(kd, generator=gen)).to(dtype), (0.1 * torch.randn(kd, generator=gen)).to(dtype),
                 1e-6) if norm else None
    rope_args = _tables(T, rot // 2, gen) if rope else None
    slots = _slots(T, 4, 8, gen)
    fused, unfused = torch.zeros(4, 8, 132, dtype=torch.uint8), torch.zeros(4, 8, 132, dtype=torch.uint8)
    tpc.write_indexer_cache(fused, k, slots, norm=norm_args, rope=rope_args)
    paged.write_indexer_cache(unfused, paged.prepare_index_keys(k, norm_args, rope_args), slots)
    keys_a, sc_a = paged.indexer_cache_parts(fused)
    keys_b, sc_b = paged.indexer_cache_parts(unfused)
    deq_a = keys_a.view(torch.float8_e4m3fn).float() * sc_a[..., None]
    deq_b = keys_b.view(torch.float8_e4m3fn).float() * sc_b[..., None]
    torch.testing.assert_close(deq_a, deq_b, rtol=2.0**-3, atol=1e-3 * deq_b.abs().max().item())
    assert (fused == unfused).float().mean() > 0.98


@pytest.mark.parametrize("T, H, dims", [(1, 8, (32, 512, 64)), (5, 3, (24, 64, 32)), (20, 2, (16, 128, 64))])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope", [False, True])
def test_latent_query_matches_reference(T, H, dims, dtype, rope):
    """``[q_nope . W_UK | rope(q_pe)]`` in one kernel against the reference's einsum and concat: decode tiles (16
    tokens x 32 columns, 8 heads at T = 1) and prefill tiles (64 x 64), a q_nope width that is no power of two,
    products narrower than the 512 columns, strided views of q_b's output. The product's sums run in another order
    than the einsum's: within a rounding, exactly for float32 (rtol 1e-5); the rope part bit for bit almost
    everywhere."""
    d, ra, rp = dims
    gen = torch.Generator().manual_seed(T)
    q_b = torch.randn(T, H, d + rp, generator=gen).to(dtype)  # q_b_proj's heads, [nope | pe]
    w_uk = (torch.randn(H, d, ra, generator=gen) * d**-0.5).to(dtype)
    rope_args = _tables(T, rp // 2, gen) if rope else None
    out = tpc.latent_query(q_b[..., :d], w_uk, q_b[..., d:], rope_args)
    expected = paged.latent_query(q_b[..., :d], w_uk, q_b[..., d:], rope_args)
    assert out.shape == (T, H, 576) and out.dtype == dtype
    tol = _ulps(dtype)
    torch.testing.assert_close(out[..., :ra].float(), expected[..., :ra].float(), rtol=tol,
                               atol=tol * expected[..., :ra].float().abs().max().item())
    _close(out[..., 512:], expected[..., 512:], dtype)
    assert (out[..., ra:512] == 0).all() and (out[..., 512 + rp:] == 0).all()


@given(st.integers(1, 5), st.sampled_from([1, 3, 16]), st.sampled_from([64, 32]), st.sampled_from(DTYPES),
       st.sampled_from(["fp8", "exact"]), st.integers(0, 99))
def test_indexer_logits_rotating_the_query_equal_the_unfused_chain(T, HI, rot, dtype, cache_kind, seed):
    """The indexer's logits kernel rotating the query as it loads it (``rope``) gives the bits of the unfused chain:
    the standalone RoPE kernel, then the logits of the rotated query, over the FP8 cache and the exact one; and the
    reference kernel set's chain (torch RoPE, then its logits) to the rounding the two RoPEs may differ by. Strided
    query rows (a slice of q_b|wq_b's output), 1 to 16 heads, the first 64 or 32 of 128 features rotated."""
    from fxglm5.lowering.triton import indexer as tindexer

    gen = torch.Generator().manual_seed(seed)
    bs, length = 4, 11
    bt = torch.tensor([[3, 1, 2]], dtype=torch.int32)
    fp8 = cache_kind == "fp8"
    cache = torch.zeros(4, bs, 132, dtype=torch.uint8) if fp8 else torch.zeros(4, bs, 128, dtype=dtype)
    keys = torch.randn(length, 128, generator=gen).to(dtype)
    slots = paged.slots_from_positions(bt, torch.zeros(length, dtype=torch.int32), torch.arange(length), bs)
    (paged.write_indexer_cache if fp8 else paged.write_exact_index_keys)(cache, keys, slots)
    q = (torch.randn(T, HI, 160, generator=gen) * 2).to(dtype)[..., 32:]
    w = torch.rand(T, HI, generator=gen)
    req, pos = torch.zeros(T, dtype=torch.int32), torch.randint(0, length, (T,), generator=gen, dtype=torch.int32)
    tables = _tables(T, rot // 2, gen)
    ctx = (cache, bt, req, pos)
    fused = tindexer.indexer_logits_paged(q, w, *ctx, rope=tables, validate=fp8)  # (the exact cache: unvalidated)
    unfused = tindexer.indexer_logits_paged(tnr.rope_interleaved(q, *tables), w, *ctx, validate=fp8)
    assert torch.equal(fused, unfused)
    rotated = paged.rotated_queries(q, tables)
    if fp8:
        want = paged.indexer_logits_paged(rotated, w, cache, bt, req, pos, max_len=fused.shape[1])
    else:  # the exact scores: float64 sums of the float32 products
        want = (torch.relu(rotated.double() @ cache.view(-1, 128)[slots].double().T) * w.double()[..., None]).sum(1)
    for t in range(T):
        n = int(pos[t]) + 1
        torch.testing.assert_close(fused[t, :n].double(), want[t, :n].double(), rtol=2e-2,
                                   atol=2e-2 * want[t, :n].abs().max().item())
    top = tindexer.indexer_topk_paged(q, w, *ctx, 4, rope=tables, validate=False)
    unfused_top = tindexer.indexer_topk_paged(tnr.rope_interleaved(q, *tables), w, *ctx, 4, validate=False)
    assert torch.equal(top.sort(-1).values, unfused_top.sort(-1).values)


@pytest.mark.parametrize("mod", [paged, tpc])
def test_fused_write_bad_inputs(mod):
    cache = torch.zeros(3, 4, 576, dtype=torch.bfloat16)
    kv, pe, sl = torch.randn(2, 512), torch.randn(2, 64), torch.tensor([4, -1])
    cos, sin = torch.ones(2, 32), torch.zeros(2, 32)
    with pytest.raises(InputError, match="kv_c rms_norm weight"):
        mod.write_latent_cache(cache, kv, pe, sl, norm=(torch.ones(500), 1e-6))
    with pytest.raises(InputError, match="rms_norm eps"):
        mod.write_latent_cache(cache, kv, pe, sl, norm=(torch.ones(512), 0.0))
    with pytest.raises(InputError, match="rope cos"):
        mod.write_latent_cache(cache, kv, pe, sl, rope=(torch.ones(2, 40), torch.zeros(2, 40)))
    with pytest.raises(InputError, match="rope cos"):
        mod.write_latent_cache(cache, kv, pe, sl, rope=(cos.double(), sin))
    with pytest.raises(InputError, match="rope cos"):
        mod.write_latent_cache(cache, kv, pe, sl, rope=(cos[:1], sin[:1]))
    with pytest.raises(InputError, match="rope sin"):
        mod.write_latent_cache(cache, kv, pe, sl, rope=(cos, sin[:, :16]))
    kc = torch.zeros(3, 4, 132, dtype=torch.uint8)
    with pytest.raises(InputError, match="k layer_norm bias"):
        mod.write_indexer_cache(kc, torch.randn(2, 128), sl, norm=(torch.ones(128), torch.ones(64), 1e-6))
    with pytest.raises(InputError, match="k layer_norm bias"):
        mod.write_indexer_cache(kc, torch.randn(2, 128), sl, norm=(torch.ones(128), None, 1e-6))
    assert (cache == 0).all() and (kc == 0).all()  # nothing written by a refused call


@pytest.mark.parametrize("index_dtype", [torch.uint8, torch.float32], ids=["fp8", "exact"])
def test_indexer_op_refuses_bad_folded_norm_before_writing(index_dtype):
    """Both index-cache kinds (FP8 rows, and exact compute-dtype keys) validate the folded LayerNorm / RoPE."""
    T, width = 3, 132 if index_dtype == torch.uint8 else 128
    cache = torch.zeros(4, 4, width, dtype=index_dtype)
    context = (torch.tensor([4, 5, 6]), torch.tensor([[1, 2]]), torch.zeros(T, dtype=torch.long), torch.arange(T), 64)
    q, k, w = torch.randn(1, T, 2, 128), torch.randn(1, T, 128), torch.rand(1, T, 2)
    cos, sin = torch.ones(1, T, 32), torch.zeros(1, T, 32)
    op = torch.ops.fxglm5.rtp_indexer
    with pytest.raises(InputError, match="k layer_norm weight"):
        op(q, k, w, 2, cache, *context, cos, sin, torch.ones(64), torch.zeros(64), 1e-6)
    with pytest.raises(InputError, match="rope cos"):
        op(q, k, w, 2, cache, *context, cos[:, :2], sin[:, :2], torch.ones(128), torch.zeros(128), 1e-6)
    assert (cache == 0).all()
    op(q, k, w, 2, cache, *context, cos, sin, torch.ones(128), torch.zeros(128), 1e-6)  # the valid call writes
    assert (cache != 0).any()


def test_standalone_bad_inputs():
    with pytest.raises(InputError, match="rms_norm weight"):
        tnr.rms_norm(torch.randn(2, 64), torch.ones(32), 1e-6)
    with pytest.raises(InputError, match="rope cos"):
        tnr.rope_interleaved(torch.randn(2, 1, 64), torch.ones(3, 32), torch.zeros(3, 32))
    with pytest.raises(InputError, match="rope_interleaved"):
        torch.ops.fxglm5.rope_interleaved(torch.randn(2, 64), torch.ones(2, 32), torch.zeros(2, 32))


# ---- the query latent's norm and both cache writes in one launch (fxglm5::rms_norm_write_caches) ------------------
def _layer_rows(T, q_rank, dtype, gen):
    """The slices of one layer's first-GEMM output (kv_c | k_pe | the indexer's k, strided as the stacked GEMM's
    slices are) and a query latent of another row stride (each role reads its own), the folded norms' weights and
    the RoPE tables."""
    out = (torch.randn(T, 512 + 64 + 128, generator=gen) * 2).to(dtype)
    kv_c, k_pe, k = out.split([512, 64, 128], dim=1)
    x = (torch.randn(T, q_rank + 32, generator=gen) * 2).to(dtype)[:, 16:-16]
    weights = [(1 + 0.1 * torch.randn(n, generator=gen)).to(dtype) for n in (q_rank, 512, 128)]
    return x, kv_c, k_pe, k, weights, (0.1 * torch.randn(128, generator=gen)).to(dtype), _tables(T, 32, gen)


@pytest.mark.parametrize("kv_dtype, index_dtype", [(torch.uint8, torch.uint8), (torch.bfloat16, torch.bfloat16),
                                                   (torch.uint8, None), (torch.float32, torch.float32)],
                         ids=["fp8", "bf16", "fp8-no-indexer", "f32"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("folded", [True, False], ids=["folded", "raw"])
@pytest.mark.parametrize("T", [1, 7])
def test_norm_and_cache_writes_in_one_launch_equal_the_three_kernels(kv_dtype, index_dtype, dtype, folded, T,
                                                                     monkeypatch):
    """``rms_norm_write_caches``' one kernel (programs in three roles) gives bit for bit what the standalone RMSNorm,
    latent-write and index-write kernels give: the normed query latent and both caches, byte for byte (FP8 rows,
    compute-dtype rows, exact keys), padding slots (-1) written nowhere, decode (1 token) and prefill (7), with the
    folded norms and RoPE and without; and it is one launch (two roles without an index cache)."""
    from triton.runtime.interpreter import InterpretedFunction

    gen = torch.Generator().manual_seed(T)
    x, kv_c, k_pe, k, (wq, wkv, wk), bk, tables = _layer_rows(T, 96, dtype, gen)
    kv_norm, k_norm, rope = ((wkv, 1e-6), (wk, bk, 1e-6), tables) if folded else (None, None, None)
    slots = _slots(T, 4, 4, gen)
    slots[0] = -1 if T > 1 else 5  # a prefill with a padding token, a decode token that is written
    results, launched, launch = {}, [], InterpretedFunction.run
    for how in ("fused", "separate"):
        kv_cache = torch.zeros(4, 4, 656 if kv_dtype == torch.uint8 else 576, dtype=kv_dtype)
        index_cache = None if index_dtype is None else \
            torch.zeros(4, 4, 132 if index_dtype == torch.uint8 else 128, dtype=index_dtype)
        if how == "fused":
            monkeypatch.setattr(InterpretedFunction, "run", lambda self, *a, **kw: launched.append(self.fn.__name__)
                                or launch(self, *a, **kw))
            normed = tpc.rms_norm_write_caches(x, wq, 1e-6, kv_cache, kv_c, k_pe, slots, index_cache,
                                               None if index_cache is None else k, kv_norm=kv_norm, index_norm=k_norm,
                                               rope=rope)
            monkeypatch.undo()
        else:
            normed = tnr.rms_norm(x, wq, 1e-6)
            tpc.write_latent_cache(kv_cache, kv_c, k_pe, slots, norm=kv_norm, rope=rope)
            if index_cache is not None:
                tpc.write_index_keys(index_cache, k, slots, norm=k_norm, rope=rope)
        results[how] = [t if t is None else t.view(torch.uint8) for t in (normed, kv_cache, index_cache)]
    assert launched == ["_norm_write_caches_kernel"]
    for fused, separate in zip(results["fused"], results["separate"]):
        assert (fused is None and separate is None) or torch.equal(fused, separate)
    normed, kv_cache, index_cache = results["fused"]
    assert normed.shape == (T, 96 * dtype.itemsize)  # x's shape, contiguous, in x's dtype
    written = (kv_cache.view(16, -1) != 0).any(1)
    assert written.sum() == (slots >= 0).sum() and written[slots[slots >= 0]].all()  # padding wrote nothing
    assert index_cache is None or (index_cache != 0).any()


# ---- ... and the indexer's head weights in the same launch at decode (fuse_index_weights_into_q_norm) -------------
SCALES = [0.5, 0.125]  # the head weights' folded scalars (GLM-5: heads ** -0.5 and the softmax scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 7, 16, 17])
def test_head_weights_join_the_launch_at_decode(T, dtype, monkeypatch):
    """Given the head weights' GEMV operands, ``rms_norm_write_caches``' one launch also gives the weights bit for
    bit as ``_f32_gemv_kernel`` gives them over the same rows (its K split over CTAs, each tile's last split summing
    the partials and applying the scales: 20 heads, rows past them masked; 300 features, a K tail), the counters
    reset after it; the normed latent and both caches are byte for byte what the launch without the weights gives.
    Past MAX_GEMV_ROWS (17 tokens) the weights are f32_linear's GEMM, launched before the kernel."""
    from triton.runtime.interpreter import InterpretedFunction

    from fxglm5.lowering.triton import f32_linear
    from fxglm5.lowering.triton.fp8_parts import tile_counters

    gen = torch.Generator().manual_seed(T)
    x, kv_c, k_pe, k, (wq, wkv, wk), bk, tables = _layer_rows(T, 96, dtype, gen)
    h = (torch.randn(T, 300, generator=gen) * 2).to(dtype)
    weight = torch.randn(20, 300, generator=gen)
    slots = _slots(T, 8, 4, gen)
    grid, cfg = f32_linear.gemv_launch(20, 300, min(T, f32_linear.MAX_GEMV_ROWS), 4)  # the interpreter's 4 "SMs"
    assert cfg["SPLIT"] > 1 and grid[0] == 2  # the split-K fix-up of two column tiles runs
    results, launched, launch = {}, {}, InterpretedFunction.run
    for how in ("fused", "separate"):
        kv_cache, index_cache = torch.zeros(8, 4, 656, dtype=torch.uint8), torch.zeros(8, 4, 132, dtype=torch.uint8)
        calls = launched.setdefault(how, [])
        monkeypatch.setattr(InterpretedFunction, "run", lambda self, *a, **kw: calls.append(self.fn.__name__)
                            or launch(self, *a, **kw))
        writes = dict(kv_norm=(wkv, 1e-6), index_norm=(wk, bk, 1e-6), rope=tables)
        if how == "fused":
            normed, weights = tpc.rms_norm_write_caches(x, wq, 1e-6, kv_cache, kv_c, k_pe, slots, index_cache, k,
                                                        head_weights=(h, weight, SCALES), **writes)
        else:
            weights = f32_linear.f32_linear(h, weight, SCALES)
            normed = tpc.rms_norm_write_caches(x, wq, 1e-6, kv_cache, kv_c, k_pe, slots, index_cache, k, **writes)
        monkeypatch.undo()
        results[how] = [normed.view(torch.uint8), weights, kv_cache, index_cache]
    gemm = [] if f32_linear.is_gemv(T) else ["_f32_gemm_kernel"]
    assert launched["fused"] == gemm + ["_norm_write_caches_kernel"]
    assert launched["separate"] == (gemm or ["_f32_gemv_kernel"]) + ["_norm_write_caches_kernel"]
    for fused, separate in zip(results["fused"], results["separate"]):
        assert torch.equal(fused, separate)
    assert results["fused"][1].shape == (T, 20) and (tile_counters(h.device, grid[0])[:grid[0]] == 0).all()


def test_the_gemv_runs_with_the_cache_writes_warps():
    """The launch runs every role with WRITE_WARPS (the cache writes' bits need it) and the GEMV's sums reduce over
    f32_linear's thread layout: the two are the same at every decode row count, at GLM-5's head weights."""
    from fxglm5.lowering.triton import f32_linear

    for rows in range(1, f32_linear.MAX_GEMV_ROWS + 1):
        assert f32_linear.gemv_launch(32, 6144, rows, 132)[1]["num_warps"] == tpc.WRITE_WARPS
