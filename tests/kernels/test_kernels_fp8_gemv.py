"""The block-FP8 GEMV for decode (fxglm5/lowering/triton/fp8_gemv.py), interpreted on the CPU: the reference's
numbers for 1 to 16 rows on both product paths (float32 FMAs up to 4 rows, the 16-row MMA above), W8A8 and W8A16,
bias, a gated input, N and K tails, split-K reduced in the kernel (ragged last split included) with its counters left
at zero, and the dispatch from fp8_linear."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fxglm5.lowering.reference import fp8 as ref  # noqa: E402

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("interpreted CPU tests; tests/gpu/test_gpu_fp8.py runs the GEMV at GLM-5's shapes",
                allow_module_level=True)

from fxglm5.lowering.triton import fp8_gemm, fp8_gemv, fp8_parts  # noqa: E402

FP8 = torch.float8_e4m3fn


def _weight(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(n, k, generator=g) * 0.5).to(FP8),
            torch.rand(-(-n // 128), -(-k // 128), generator=g) * 0.02 + 0.005)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _tol(dtype):
    return 1e-5 if dtype == torch.float32 else 2e-2  # fp32: summation order; bf16: the output's rounding


def _counters_are_zero():
    counters = fp8_parts._COUNTERS.get(("cpu", None))
    return counters is None or int(counters.abs().sum()) == 0


@settings(deadline=None)
@given(m=st.integers(1, 16), nk=st.sampled_from([(192, 320), (64, 128), (576, 256), (130, 200), (40, 384)]),
       act_quant=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]), bias=st.booleans(),
       ctas=st.sampled_from([1, 4, 16]), prefetch=st.booleans(), seed=st.integers(0, 2**16))
def test_gemv_matches_the_reference(m, nk, act_quant, dtype, bias, ctas, prefetch, seed):
    n, k = nk
    w, s = _weight(n, k, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    out = fp8_gemm.fp8_linear(x, w, s, b, act_quant, config=dict(kernel="gemv", CTAS_PER_SM=ctas, PREFETCH=prefetch))
    assert out.shape == (m, n) and out.dtype == dtype
    assert _rel(out, ref.fp8_linear(x, w, s, b, act_quant)) < _tol(dtype)
    assert _counters_are_zero()


@pytest.mark.parametrize("m", [1, 3, 9])
def test_split_k_really_splits_with_a_ragged_last_split(m):
    """K = 640 is 5 steps; 4 CTAs per SM (4 SMs on the CPU) over 3 column tiles gives 5 splits of one step at
    BLOCK_N 64, and 3 steps per split (a ragged last split of 2) when asked for 2 splits' worth. With PREFETCH (the
    next step's tile requested before this step's math) the bits are the same: a prefetch past a split's steps is
    never used, and past K it loads zeros."""
    w, s = _weight(192, 640, 7)
    x = torch.randn(m, 640)
    want = ref.fp8_linear(x, w, s, None, True)
    for ctas, splits in ((4, 5), (1.5, 2)):
        plan = fp8_gemv.plan(m, 192, 640, 4, dict(CTAS_PER_SM=ctas, BLOCK_N=64))
        assert plan["SPLIT_K"] == splits
        out, prefetched = (fp8_gemm.fp8_linear(x, w, s, None, True, config=dict(
            kernel="gemv", CTAS_PER_SM=ctas, BLOCK_N=64, PREFETCH=prefetch)) for prefetch in (False, True))
        assert _rel(out, want) < 1e-5
        assert torch.equal(prefetched, out)
    assert _counters_are_zero()


@pytest.mark.parametrize("m", [1, 4, 12])
def test_a_gated_input_is_silu_of_the_gate_times_up(m):
    w, s = _weight(128, 256, 5)
    g = torch.Generator().manual_seed(6)
    gate, up = torch.randn(m, 256, generator=g).bfloat16(), torch.randn(m, 256, generator=g).bfloat16()
    out = fp8_gemm.fp8_linear(gate, w, s, None, True, config=dict(kernel="gemv"), up=up)
    hidden = (torch.nn.functional.silu(gate.float()).bfloat16().float() * up.float()).bfloat16()
    assert _rel(out, ref.fp8_linear(hidden, w, s, None, True)) < 2e-2


def test_rows_pick_the_product_path_and_fp8_linear_dispatches_where_enabled(monkeypatch):
    assert [fp8_gemv.rows_padded(m) for m in (1, 2, 3, 4, 5, 16)] == [1, 2, 4, 4, 16, 16]
    launched = []
    real = fp8_gemv.launch
    monkeypatch.setattr(fp8_gemv, "launch", lambda x2, *a, **kw: launched.append(x2.shape[0]) or real(x2, *a, **kw))
    w, s = _weight(64, 128, 2)
    for m in (1, 16, 17):
        fp8_gemm.fp8_linear(torch.randn(m, 128), w, s)
    assert launched == []  # off by default until the decode step measures it
    monkeypatch.setitem(fp8_gemv.GEMV, "enabled", True)
    for m in (1, 16, 17):
        fp8_gemm.fp8_linear(torch.randn(m, 128), w, s)
    assert launched == [1, 16]  # 17 rows take the tiled kernel
    with pytest.raises(ValueError, match="up to 16 rows"):
        fp8_gemm.fp8_linear(torch.randn(17, 128), w, s, config=dict(kernel="gemv"))
    with pytest.raises(ValueError, match="BLOCK_N must divide 128"):
        fp8_gemm.fp8_linear(torch.randn(2, 128), w, s, config=dict(kernel="gemv", BLOCK_N=48))


@pytest.mark.parametrize("m", [1, 3])
def test_a_row_tile_may_be_forced_to_the_mma_path_and_a_bad_one_is_refused(m):
    """``M_PAD`` 16 (a sweep's choice) runs few rows through the 16-row MMA with the reference's numbers; a row tile
    smaller than the rows, or of no path, is refused before launching."""
    w, s = _weight(192, 256, 11)
    x = torch.randn(m, 256)
    assert fp8_gemv.plan(m, 192, 256, 4, dict(M_PAD=16))["M_PAD"] == 16
    out = fp8_gemm.fp8_linear(x, w, s, None, True, config=dict(kernel="gemv", M_PAD=16))
    assert _rel(out, ref.fp8_linear(x, w, s, None, True)) < 1e-5
    for bad in (8, 2 if m == 3 else 3):
        with pytest.raises(ValueError, match="M_PAD"):
            fp8_gemm.fp8_linear(x, w, s, None, True, config=dict(kernel="gemv", M_PAD=bad))
