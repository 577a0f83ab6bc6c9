"""The fuse_kernels stage's ops (fxglm5.ops.fused) in Triton, interpreted on the CPU, against their references (the
chains they replace): add_rms_norm, alone and in the A loads of the decode GEMM that reads it
(add_rms_norm_fp8_linear: both decode kernels, against the two launches), f32_linear (the GEMV and the 3xTF32 GEMM,
split-K fix-up, scales in turn), moe_route_local, moe_router (the GEMV and the routing in one launch), the gated down
GEMM silu_mul_fp8_linear on the decode path (the gate applied as A tiles load) and past it (one elementwise kernel
first), the MoE with its shared expert (moe_fp8_shared: the shared GEMMs in the routed launches, the combine in the
down launch) and with its router too (moe_router_fp8_shared: the router in the gate|up launch) and the residual add
and norm before it (add_rms_norm_moe_router_fp8_shared: the norm's rows as the first tasks of that launch, add_rms_norm's
row function and its fixed order of sums), the q_b GEMM with the
latent query of its heads (fp8_linear_latent_query: the query's programs as the last tasks of the GEMM's launch);
bad inputs name the argument. Small shapes: CI runs it on 2 cores."""

import inspect
import os
from unittest import mock

import torch

if not torch.cuda.is_available():  # CPU CI: interpret; set before triton is imported in this process
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import fxglm5.ops  # noqa: E402,F401  (registers the ops)
from fxglm5.errors import InputError  # noqa: E402
from fxglm5.lowering.reference import fused as ref  # noqa: E402
from tests.helpers import tf32_rounded  # noqa: E402

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("CPU-tensor kernel tests run interpreted (TRITON_INTERPRET=1); on a GPU host "
                "tests/gpu/test_gpu_fused.py covers the kernels", allow_module_level=True)

from fxglm5.lowering.triton import f32_linear, fp8_gemm, moe, norm_rope  # noqa: E402

DTYPES = st.sampled_from([torch.float32, torch.bfloat16])


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


@given(rows=st.integers(1, 9), d=st.sampled_from([64, 200, 256]), dtype=DTYPES, seed=st.integers(0, 2**16))
def test_add_rms_norm_is_the_add_then_the_norm(rows, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x, r = (torch.randn(rows, 3, d, generator=g).to(dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype)
    normed, total = norm_rope.add_rms_norm(x, r, w, 1e-6)
    want_normed, want_total = ref.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(total, want_total)  # the sum is rounded once, as the add rounds it
    assert _rel(normed, want_normed) < (1e-6 if dtype == torch.float32 else 1e-2)


def test_add_rms_norm_reads_strided_rows():
    base = torch.randn(4, 2 * 64)
    x, r = base[:, :64], base[:, 64:]
    w = torch.rand(64)
    (normed, total), (want_normed, want_total) = norm_rope.add_rms_norm(x, r, w, 1e-5), ref.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(total, want_total) and _rel(normed, want_normed) < 1e-6


@given(m=st.integers(1, 70), n=st.sampled_from([16, 64, 72, 256]), k=st.sampled_from([64, 300, 1024]), dtype=DTYPES,
       scales=st.lists(st.sampled_from([0.5, 0.125, 0.0883883476, 3.0]), max_size=4), seed=st.integers(0, 2**16))
def test_f32_linear_matches_reference(m, n, k, dtype, scales, seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g)
    out = f32_linear.f32_linear(x, w, scales)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    assert _rel(out, ref.f32_linear(x, w, scales)) < 1e-6  # GEMV: exact products; GEMM (m > 16): 3xTF32


SCALES = [0.5, 0.125, 3.0, 0.0883883476]  # distinct, so a scale applied twice, skipped or swapped shows


@pytest.mark.parametrize("num_scales", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_f32_linear_reference_is_the_chain_it_replaces(num_scales, dtype):
    """The reference is the graph's chain exactly: the cast, the float32 GEMM, then one multiply per scale in the
    graph's order (the indexer's head weights take two: n_heads ** -0.5 and the softmax scale), each rounded."""
    g = torch.Generator().manual_seed(num_scales)
    x, w = torch.randn(5, 3, 200, generator=g).to(dtype), torch.randn(24, 200, generator=g)
    chain = torch.nn.functional.linear(x.float(), w)
    for scale in SCALES[:num_scales]:
        chain = chain * scale
    assert torch.equal(ref.f32_linear(x, w, SCALES[:num_scales]), chain)


@pytest.mark.parametrize("sms, num_scales, rows", [(132, 0, 1), (132, 1, 1), (132, 2, 1), (132, 3, 1), (132, 4, 1),
                                                     (1, 4, 1), (132, 2, 3), (132, 1, 8), (1, 2, 8), (132, 4, 16)],
                         ids=["split-0scales", "split-1scale", "split-2scales", "split-3scales", "split-4scales",
                              "one_split-4scales", "split-3rows", "split-8rows", "one_split-8rows", "split-16rows"])
def test_f32_linear_gemv_splits_k_and_applies_every_scale(monkeypatch, sms, num_scales, rows):
    """The GEMV (1 to MAX_GEMV_ROWS rows, every row served by one load of a weight tile) as it runs on a GPU: with
    an H200's 132 SMs (the SM count the launch sizes its split from) K really is split over CTAs and the last CTA of
    each column tile sums the partials, then applies the scales in turn; one SM gives one split (the CPU's count).
    Either way the router's shape [256, 6144] and a column count that is no multiple of the tile (72) give the
    reference row for row, and every tile's counter is left at zero."""
    monkeypatch.setattr(f32_linear, "num_sms", lambda device: sms)
    launched = []
    config = f32_linear.gemv_config
    monkeypatch.setattr(f32_linear, "gemv_config", lambda *a: launched.append(config(*a)) or launched[-1])
    scales = SCALES[:num_scales]
    g = torch.Generator().manual_seed(num_scales + rows)
    for n, k in ((256, 6144), (72, 1000)):
        x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
        got = f32_linear.f32_linear(x, w, scales)
        assert got.shape == (rows, n) and got.dtype == torch.float32
        want = ref.f32_linear(x, w, scales)
        assert max(_rel(got[r], want[r]) for r in range(rows)) < 1e-6
        assert not fp8_gemm.tile_counters(x.device, -(-n // f32_linear.BLOCK_N)).any()
    assert len(launched) == 2 and all((c["SPLIT"] > 1) == (sms > 1) for c in launched), launched


@pytest.mark.parametrize("m, n, k, split", [(100, 48, 256, True), (130, 24, 300, False)],
                         ids=["split_k-masked", "three_row_tiles-k_tail"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_f32_linear_gemm_is_float32_class(monkeypatch, m, n, k, split, dtype):
    """Past MAX_GEMV_ROWS the 3xTF32 GEMM runs (no GEMV launch): rows and columns no multiple of its tiles, K no
    multiple of its step, K split over CTAs with the fix-up (the CPU's 4 SMs against two row tiles) or not (three
    row tiles). Within 1e-6 of float64, as float32 is (the float32 reference is about 3e-7 from it here), where the same
    kernel on TF32-rounded weights, what one TF32 MMA computes of a bf16 x, is about 2e-4 off: the bound fails a
    GEMM that drops the low parts (the interpreter's dots are float32, so the split's bits are what it checks)."""
    monkeypatch.setattr(f32_linear, "gemv_config", lambda *a: pytest.fail("the GEMV launched past its rows"))
    launched = []
    config = f32_linear.gemm_config
    monkeypatch.setattr(f32_linear, "gemm_config", lambda *a: launched.append(config(*a)) or launched[-1])
    g = torch.Generator().manual_seed(m + k)
    x, w = torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g)
    exact = (x.double() @ w.double().T) * SCALES[0] * SCALES[1]
    got = f32_linear.f32_linear(x, w, SCALES[:2])
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert _rel(got.double(), exact) < 1e-6 and _rel(got, ref.f32_linear(x, w, SCALES[:2])) < 1e-6
    assert _rel(f32_linear.f32_linear(x, tf32_rounded(w), SCALES[:2]).double(), exact) > 1e-5
    assert (launched[0]["SPLIT"] > 1) == split and not fp8_gemm.tile_counters(x.device, 3).any()


@pytest.mark.parametrize("dtype, split", [(torch.float32, True), (torch.float64, True), (torch.bfloat16, False),
                                          (torch.float16, False), (torch.float8_e4m3fn, False)])
def test_f32_linear_gemm_splits_x_past_tf32(dtype, split):
    """x is split into TF32 parts (three MMAs a K step) only where its dtype has more than TF32's 10 mantissa bits;
    bf16, fp16 and fp8 are exact in TF32 (two). The interpreter's float32 dots cannot show a float32 x left
    unsplit (a GPU's TF32 MMA would cut it to 10 bits): tests/gpu/test_gpu_fused.py holds a float32 x to float64."""
    assert f32_linear.splits_x(dtype) == split


@pytest.mark.parametrize("cap, gemm", [((9, 0), True), ((8, 0), True), ((7, 5), False), (None, False)],
                         ids=["sm90", "sm80", "sm75", "rocm"])
def test_f32_linear_gemm_needs_tf32_mmas(monkeypatch, cap, gemm):
    """TF32 MMAs from sm_80 on NVIDIA; a ROCm build (capability None) and older GPUs keep the BLAS float32 GEMM,
    which gives the reference exactly (the scales applied in place after it); the interpreter runs the GEMM."""
    monkeypatch.setattr(f32_linear, "capability", lambda device: cap)
    assert f32_linear.tensor_core_gemm(torch.device("cuda", 0)) == gemm
    assert f32_linear.tensor_core_gemm(torch.device("cpu"))
    monkeypatch.setattr(f32_linear, "tensor_core_gemm", lambda device: False)
    x, w = torch.randn(f32_linear.MAX_GEMV_ROWS + 1, 300), torch.randn(24, 300)
    assert torch.equal(f32_linear.f32_linear(x, w, [0.5, 3.0]), ref.f32_linear(x, w, [0.5, 3.0]))


@pytest.mark.parametrize("m, n, want", [
    (64, 256, (64, 128, 4, 64, 3)), (2048, 256, (64, 128, 4, 2, 96)), (8192, 256, (64, 128, 4, 1, 192)),
    (32768, 256, (128, 128, 8, 1, 192)), (2048, 32, (64, 32, 4, 4, 48)), (8192, 32, (64, 32, 4, 1, 192)),
    (32768, 32, (128, 32, 4, 1, 192))])
def test_f32_linear_gemm_config_at_glm5_shapes(m, n, want):
    """The router's (256) and the indexer head weights' (32) columns at K = 6144 (192 K steps) on an H100's 132
    SMs: 128-row tiles where they fill the SMs, else 64; K split where the tiles alone leave SMs idle; 8 warps for
    128 x 128 tiles."""
    cfg = f32_linear.gemm_config(m, n, 6144, 132)
    assert (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"], cfg["SPLIT"], cfg["STEPS"]) == want


@pytest.mark.parametrize("offset, count", [(0, 4), (4, 4), (12, 4), (0, 16)])
def test_moe_route_local_matches_reference(offset, count):
    g = torch.Generator().manual_seed(offset)
    logits, bias = torch.randn(7, 16, generator=g), 0.1 * torch.randn(16, generator=g)
    off = torch.tensor(offset, dtype=torch.int32)
    weights, ids = moe.moe_route(logits, bias, 4, 1, 1, True, 2.5, off, count)
    want_weights, want_ids = ref.moe_route_local(logits, bias, 4, 1, 1, True, 2.5, off, count)
    assert torch.equal(ids, want_ids) and torch.allclose(weights, want_weights)
    assert ((ids == -1) | ((ids >= 0) & (ids < count))).all()


def _router_inputs(rows, experts, k, seed, ties):
    """bf16 tokens, a float32 router weight and a correction bias. ``ties``: experts 3 and 9 (and 20 and 21) share
    their weight rows, the bias is zero, so their scores tie exactly in every row (the lower id is picked first),
    and a third of the rows are zero, whose scores all tie at 0.5 (the lowest ids win)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = torch.randn(experts, k, generator=g) / k ** 0.5
    bias = 0.05 * torch.randn(experts, generator=g)
    if ties:
        w[9], w[21] = w[3], w[20]
        bias.zero_()
        x[::3] = 0
    return x, w, bias


@pytest.mark.parametrize("sms, rows", [(132, 1), (132, 3), (132, 8), (132, 16), (1, 5)],
                         ids=["splits-1row", "splits-3rows", "splits-8rows", "splits-16rows", "one_split-5rows"])
@pytest.mark.parametrize("renorm, ties", [(True, False), (False, True)], ids=["renorm", "ties-no_renorm"])
@pytest.mark.parametrize("offset", [None, 24], ids=["global", "local"])
def test_moe_router_is_the_gemv_then_the_route(monkeypatch, sms, rows, renorm, ties, offset):
    """The router in one launch (up to MAX_GEMV_ROWS tokens) gives the two launches' ids and weights bit for bit
    (f32_linear's GEMV, then the route kernel): with an H100's 132 SMs K is split over CTAs and 40 experts make
    three expert tiles, the last one partial, so every tile's last split reduces and the last tile routes every row
    (16 rows: two passes of ROUTE_ROWS); one SM gives one split (each tile's CTA stores its logits at once). Scores
    tie (the lower id first), renormalized or not, ids global or local to a rank's experts [24, 40) (-1
    elsewhere), and every arrival counter back at 0. Against the float32 reference chain (no ties: torch's top-k
    orders them its own way): the same ids and the weights within float32 rounding (the logits' sums run in
    another order)."""
    for module in (f32_linear, moe):  # the SM count each launch sizes its K split from
        monkeypatch.setattr(module, "num_sms", lambda device: sms)
    launched = []
    kernel = moe._router_kernel
    monkeypatch.setattr(moe, "_router_kernel", type("Launch", (), {
        "__getitem__": lambda self, grid: lambda *a, **k: launched.append(k["SPLIT"]) or kernel[grid](*a, **k)})())
    x, w, bias = _router_inputs(rows, 40, 700, rows + 7 * ties, ties)
    off = None if offset is None else torch.tensor(offset, dtype=torch.int32)
    args = (bias, 6, 1, 1, renorm, 2.5, off, 16)
    weights, ids = moe.moe_router(x, w, *args)
    assert len(launched) == 1 and (launched[0] > 1) == (sms > 1)
    want_weights, want_ids = moe.moe_route(f32_linear.f32_linear(x, w, []), *args)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)
    assert not fp8_gemm.tile_counters(x.device, 4).any()
    picked = moe.moe_router(x, w, bias, 6, 1, 1, renorm, 2.5)[1]  # the global ids
    if offset is not None:
        assert torch.equal(ids, ref.local_expert_ids(picked, off, 16))
    if ties:  # the kernels' rule (torch.topk, the reference's, orders ties as it likes)
        assert (picked[0] == torch.arange(6)).all()  # a zero row: every score ties, the lowest ids win
        both = [row.tolist() for row in picked[1:] if 3 in row and 9 in row]
        assert all(row.index(3) == row.index(9) - 1 for row in both)
    else:
        ref_weights, ref_ids = ref.moe_router(x, w, *args)
        assert torch.equal(ids, ref_ids) and torch.allclose(weights, ref_weights, rtol=1e-6, atol=1e-7)


def test_moe_router_past_the_gemv_rows_runs_two_launches(monkeypatch):
    """Past MAX_GEMV_ROWS (a prefill's tokens) the logits are the tensor-core GEMM's and the route kernel's program
    per token routes them: no router kernel, the two-launch chain's values."""
    monkeypatch.setattr(moe, "_router_kernel", None)  # launching it would fail
    x, w, bias = _router_inputs(f32_linear.MAX_GEMV_ROWS + 1, 40, 300, 0, False)
    weights, ids = moe.moe_router(x, w, bias, 6, 1, 1, True, 2.5)
    want_weights, want_ids = moe.moe_route(f32_linear.f32_linear(x, w, []), bias, 6, 1, 1, True, 2.5)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)
    assert not moe.router_fuses(f32_linear.MAX_GEMV_ROWS + 1, 1) and moe.router_fuses(f32_linear.MAX_GEMV_ROWS, 1)
    assert not moe.router_fuses(1, 4)  # group-limited routing: the reference's


@pytest.mark.parametrize("offset", [None, 4])
def test_moe_router_reference_is_the_chain_it_replaces(offset):
    """The op's reference is f32_linear's then moe_route's (moe_route_local's with an offset), bit for bit."""
    x, w, bias = _router_inputs(5, 16, 64, 1, False)
    off = None if offset is None else torch.tensor(offset, dtype=torch.int32)
    got = ref.moe_router(x, w, bias, 4, 1, 1, True, 2.5, off, 4)
    logits = torch.ops.fxglm5.f32_linear(x, w, [])
    if offset is None:
        chain = torch.ops.fxglm5.moe_route(logits, bias, 4, 1, 1, True, 2.5)
    else:
        chain = torch.ops.fxglm5.moe_route_local(logits, bias, 4, 1, 1, True, 2.5, off, 4)
    assert all(torch.equal(a, b) for a, b in zip(got, chain))
    assert all(torch.equal(a, b) for a, b in zip(torch.ops.fxglm5.moe_router(x, w, bias, 4, 1, 1, True, 2.5, off, 4),
                                                 chain))


def _fp8_weight(n, k, g):
    w = (torch.randn(n, k, generator=g) * 0.5).to(torch.float8_e4m3fn)
    return w, torch.rand(-(-n // 128), -(-k // 128), generator=g) * 0.02 + 0.005


@given(m=st.sampled_from([1, 5, 64, 65, 130]), inter=st.sampled_from([128, 200, 256]), act_quant=st.booleans(),
       dtype=DTYPES, seed=st.integers(0, 2**16))
def test_silu_mul_fp8_linear_is_the_unfused_chain(m, inter, act_quant, dtype, seed):
    """Gate and up are the halves of one [m, 2I] tensor (a stacked gate|up GEMM's output): decode rows (<= 64) fold
    the gate into the GEMM's A loads, more rows run the elementwise kernel first; both give what silu, multiply and
    fp8_linear give on the same kernel (bitwise in bf16, where silu rounds to the dtype)."""
    g = torch.Generator().manual_seed(seed)
    both = torch.randn(m, 2 * inter, generator=g).to(dtype)
    gate, up = both[:, :inter], both[:, inter:]
    w, s = _fp8_weight(192, inter, g)
    fused = fp8_gemm.fp8_linear(gate, w, s, None, act_quant, up=up)
    unfused = fp8_gemm.fp8_linear(ref.silu_mul(gate, up), w, s, None, act_quant)
    if dtype == torch.bfloat16:
        assert torch.equal(fused, unfused)
    else:
        assert _rel(fused, unfused) < 1e-5
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert _rel(fused, ref.silu_mul_fp8_linear(gate, up, w, s, None, act_quant)) < tol


def _moe_with_shared(tokens, dtype, g, experts=8, hidden=256, inter=128, shared_inter=200):
    """A MoE layer's routed FP8 experts and tokens (ids with -1 entries: experts another rank holds) and its shared
    expert at its own width (200: a K tail in its down GEMM), gate|up stacked with the gate padded to 256 rows."""
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) * 0.5).to(torch.float8_e4m3fn)
    s13 = torch.rand(experts, 2 * inter // 128, hidden // 128, generator=g) * 0.02 + 0.005
    w2 = (torch.randn(experts, hidden, inter, generator=g) * 0.5).to(torch.float8_e4m3fn)
    s2 = torch.rand(experts, hidden // 128, inter // 128, generator=g) * 0.02 + 0.005
    (gw, gs), (uw, us), (dw, ds) = (_fp8_weight(shared_inter, hidden, g), _fp8_weight(shared_inter, hidden, g),
                                    _fp8_weight(hidden, shared_inter, g))
    pad = -(-shared_inter // 128) * 128
    gate_up = torch.cat([gw, torch.zeros(pad - shared_inter, hidden, dtype=gw.dtype), uw])
    shared = (gate_up, torch.cat([gs, us]), dw, ds, pad)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    ids = (torch.rand(tokens, experts + 1, generator=g).topk(2).indices - 1).to(torch.int32)  # -1: remote
    weights = torch.rand(tokens, 2, generator=g)
    return (x, ids, weights, w13, s13, w2, s2), shared


@pytest.mark.parametrize("tokens", [1, 5, 16])
@pytest.mark.parametrize("act_quant", [False, True])
@pytest.mark.parametrize("split_k", [False, True])
def test_moe_fp8_shared_runs_the_shared_gemms_in_the_moe_launches(monkeypatch, tokens, act_quant, split_k):
    """Up to BLOCK_M tokens (the routed GEMMs' scan) the shared expert's gate|up and down GEMMs run as extra CTAs of
    the routed gate|up and down launches, and the down launch combines: those two launches, no _gemm_kernel, no
    _combine_kernel, and the bits of the shared expert's own two launches followed by moe_fp8_add's (and of the
    combine kernel's, after the align kernel's layout); with split_k both shared GEMMs (and the routed
    ones) are split over K, reduced by their last CTAs, whose counters are back at 0; without, none is. Close to
    the float32 reference chain."""
    from triton.runtime.interpreter import InterpretedFunction

    from fxglm5.lowering.triton import fp8_parts

    if not split_k:
        monkeypatch.setitem(fp8_gemm.DECODE, "SPLIT_K", 1)
        monkeypatch.setitem(moe.MOE_DECODE, "SPLIT1", 1)
        monkeypatch.setitem(moe.MOE_DECODE, "SPLIT2", 1)
    routed, (w13, s13, w2, s2, up_start) = _moe_with_shared(tokens, torch.bfloat16, torch.Generator().manual_seed(tokens))
    shared = moe.SharedExpert(w13, s13, w2, s2, act_quant, up_start)
    x = routed[0]
    launches = [fp8_gemm.lone_launch(x, None, w13, s13, act_quant, torch.empty(tokens, w13.shape[0]))[0],
                fp8_gemm.lone_launch(*shared.halves(torch.empty(tokens, w13.shape[0])), w2, s2, act_quant,
                                     torch.empty_like(x))[0]]
    assert [launch.meta["SPLIT_K"] > 1 for launch in launches] == [split_k, split_k]
    launched, arguments, run = [], [], InterpretedFunction.run

    def record(self, *a, **k):
        launched.append(self.fn.__name__)
        arguments.append(dict(zip(inspect.signature(self.fn).parameters, a)) | k)
        return run(self, *a, **k)

    monkeypatch.setattr(InterpretedFunction, "run", record)
    fused = moe.moe_fp8(*routed, act_quant, shared=shared)
    assert launched == ["_moe_gemm_kernel", "_moe_gemm_kernel"]
    assert not fp8_parts.tile_counters(x.device, 1).any()
    gate_up = arguments[0]  # its routed tiles' counters (blocks x column tiles, where split) below the shared ones'
    if split_k:
        routed_counters = gate_up["num_blocks"] * -(-gate_up["N"] // gate_up["BLOCK_N"])
        assert gate_up["s_cnt_ptr"].data_ptr() - gate_up["cnt_ptr"].data_ptr() >= 4 * routed_counters
    launched.clear()
    separate = moe.moe_fp8(*routed, act_quant, addend=moe.shared_expert(x, shared))
    assert launched == ["_gemm_kernel", "_gemm_kernel", "_moe_gemm_kernel", "_moe_gemm_kernel"]
    assert torch.equal(fused, separate)
    launched.clear()  # and today's combine launch after the align kernel's layout: the same bits
    aligned = moe.moe_fp8(*routed, act_quant, addend=moe.shared_expert(x, shared), config=dict(scan=False))
    assert launched[-4:] == ["_align_kernel", "_moe_gemm_kernel", "_moe_gemm_kernel", "_combine_kernel"]
    assert torch.equal(fused, aligned)
    assert not fp8_parts.tile_counters(x.device, 1).any()
    tol = 3e-2 if act_quant else 2e-2  # W8A8: the kernels quantize bf16 rows, the reference float32 ones
    assert _rel(fused, ref.moe_fp8_shared(*routed, act_quant, w13, s13, w2, s2, up_start)) < tol


@pytest.mark.parametrize("tokens", [1, 6])
@pytest.mark.parametrize("extra", ["none", "addend", "shared"])
@pytest.mark.parametrize("split2", [1, 3])
def test_the_down_launch_combines_what_the_combine_kernel_did(monkeypatch, tokens, extra, split2):
    """Up to BLOCK_M tokens the down launch combines: each (block, column tile)'s last K split and each finished
    shared tile take a ticket per token, the ticket that completes a token's count (its local slots, + the shared
    tile) combines its tile; tokens with no local expert are written too (zeros, the addend, the shared row:
    token 0 here). No combine launch, the bits of the combine kernel after the align kernel's layout (the same
    per-element sums), and every counter back at zero for the next call."""
    from triton.runtime.interpreter import InterpretedFunction

    from fxglm5.lowering.triton import fp8_parts

    monkeypatch.setitem(moe.MOE_DECODE, "SPLIT2", split2)
    routed, (w13, s13, w2, s2, up_start) = _moe_with_shared(tokens, torch.bfloat16, torch.Generator().manual_seed(9))
    x, ids = routed[0], routed[1].clone()
    ids[0] = -1  # a token none of whose experts this rank holds
    if tokens > 1:
        ids[1] = torch.tensor([3, 5], dtype=torch.int32)  # a token with two local experts
    routed = (x, ids, *routed[2:])
    shared = moe.SharedExpert(w13, s13, w2, s2, False, up_start)
    addend = torch.randn(x.shape, generator=torch.Generator().manual_seed(10)).to(x.dtype)
    kwargs = {"none": {}, "addend": {"addend": addend}, "shared": {"shared": shared}}[extra]
    launched, run = [], InterpretedFunction.run
    monkeypatch.setattr(InterpretedFunction, "run", lambda self, *a, **k: launched.append(self.fn.__name__)
                        or run(self, *a, **k))
    fused = moe.moe_fp8(*routed, False, **kwargs)
    assert launched == ["_moe_gemm_kernel", "_moe_gemm_kernel"]
    assert not fp8_parts.tile_counters(x.device, 1).any()
    if extra == "shared":
        kwargs = {"addend": moe.shared_expert(x, shared)}
    launched.clear()
    aligned = moe.moe_fp8(*routed, False, config=dict(scan=False), **kwargs)
    assert launched[-4:] == ["_align_kernel", "_moe_gemm_kernel", "_moe_gemm_kernel", "_combine_kernel"]
    assert torch.equal(fused, aligned)
    assert torch.equal(fused[0], kwargs["addend"][0] if kwargs else torch.zeros_like(fused[0]))


@pytest.mark.parametrize("tokens, dtype", [(5, torch.float32), (20, torch.bfloat16)], ids=["float32", "prefill"])
def test_moe_fp8_shared_float32_and_past_the_scan(monkeypatch, tokens, dtype):
    """float32 tokens (IEEE dots, no rounding to a narrower dtype) fuse the same way, bit for bit; past BLOCK_M
    tokens (the align kernel's sizes) the shared expert keeps its own two launches before the MoE's."""
    from triton.runtime.interpreter import InterpretedFunction

    routed, (w13, s13, w2, s2, up_start) = _moe_with_shared(tokens, dtype, torch.Generator().manual_seed(7))
    shared = moe.SharedExpert(w13, s13, w2, s2, True, up_start)
    launched, run = [], InterpretedFunction.run
    monkeypatch.setattr(InterpretedFunction, "run", lambda self, *a, **k: launched.append(self.fn.__name__)
                        or run(self, *a, **k))
    fused = moe.moe_fp8(*routed, True, shared=shared)
    assert launched.count("_gemm_kernel") == (2 if tokens > 16 else 0)
    assert torch.equal(fused, moe.moe_fp8(*routed, True, addend=moe.shared_expert(routed[0], shared)))
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert _rel(fused, ref.moe_fp8_shared(*routed, True, w13, s13, w2, s2, up_start)) < tol


def _router_of(x, experts, seed, offset):
    """A router over 3 * ``experts`` experts (float32 weight, small bias), top-2, ids local to ``experts`` of them
    from ``offset`` (None: global ids, ``experts`` then all of them)."""
    g = torch.Generator().manual_seed(seed)
    total = experts if offset is None else 3 * experts
    return moe.Router(torch.randn(total, x.shape[1], generator=g) / 16, 0.01 * torch.randn(total, generator=g), 2, 1,
                      1, True, 2.5, None if offset is None else torch.tensor(offset, dtype=torch.int32), experts)


@pytest.mark.parametrize("tokens", [1, 5, 16])
@pytest.mark.parametrize("act_quant", [False, True])
@pytest.mark.parametrize("offset", [None, 8], ids=["global", "local"])
@pytest.mark.parametrize("split_k", [False, True])
def test_moe_router_fp8_routes_in_the_gate_up_launch(monkeypatch, tokens, act_quant, offset, split_k):
    """Up to BLOCK_M (and MAX_GEMV_ROWS) tokens the router's tiles, the shared expert's gate|up and the routed
    gate|up are tasks of one launch, then the down launch combines: two launches, the bits of the router's own launch
    followed by moe_fp8's (the routed tiles read the ids the routing CTA wrote in the same launch); the router's, the
    GEMMs' and the tasks' counters are back at 0; with split_k the router, both gate|up GEMMs and the down are split
    over K. Close to the reference op."""
    from triton.runtime.interpreter import InterpretedFunction

    from fxglm5.lowering.triton import fp8_parts, tasks

    if not split_k:
        monkeypatch.setitem(fp8_gemm.DECODE, "SPLIT_K", 1)
        monkeypatch.setitem(moe.MOE_DECODE, "SPLIT1", 1)
        monkeypatch.setitem(moe.MOE_DECODE, "SPLIT2", 1)
    routed, (w13, s13, w2, s2, up_start) = _moe_with_shared(tokens, torch.bfloat16, torch.Generator().manual_seed(3))
    x, experts = routed[0], routed[3:]
    router = _router_of(x, experts[0].shape[0], tokens, offset)
    shared = moe.SharedExpert(w13, s13, w2, s2, act_quant, up_start)
    launched, run = [], InterpretedFunction.run
    monkeypatch.setattr(InterpretedFunction, "run", lambda self, *a, **k: launched.append(self.fn.__name__)
                        or run(self, *a, **k))
    fused = moe.moe_router_fp8(x, router, *experts, act_quant, shared=shared)
    assert launched == ["_router_gate_up_kernel", "_moe_gemm_kernel"]
    assert not fp8_parts.tile_counters(x.device, 1).any() and not tasks.counters(x.device, 1).any()
    launched.clear()
    weights, ids = moe.moe_router(x, *router)
    assert (ids >= 0).any()
    assert torch.equal(fused, moe.moe_fp8(x, ids, weights, *experts, act_quant, shared=shared))
    assert launched == ["_router_kernel", "_moe_gemm_kernel", "_moe_gemm_kernel"]
    reference = ref.moe_router_fp8_shared(x, *router, *experts, act_quant, w13, s13, w2, s2, up_start)
    assert _rel(fused, reference) < (3e-2 if act_quant else 2e-2)


@pytest.mark.parametrize("tokens", [1, 5, 20])
def test_blocks_last_reverses_the_grid_and_keeps_the_bits(monkeypatch, tokens):
    """BLOCKS_LAST: up to BLOCK_M tokens (the scan) the grouped GEMM launches run over the reversed grid (splits,
    column tiles, blocks), each program reading its coordinates back in that order: the same bits, the shared expert's
    CTAs and the down launch's combine included; past it (the align kernel's blocks) the grid stays as it was."""
    from triton.runtime.interpreter import InterpretedFunction

    routed, (w13, s13, w2, s2, up_start) = _moe_with_shared(tokens, torch.bfloat16, torch.Generator().manual_seed(4))
    shared = moe.SharedExpert(w13, s13, w2, s2, False, up_start)
    grids, run = [], InterpretedFunction.run

    def recorded(self, *a, **k):
        if self.fn.__name__ == "_moe_gemm_kernel":
            grids.append(tuple(k["grid"]))
        return run(self, *a, **k)

    monkeypatch.setattr(InterpretedFunction, "run", recorded)
    want = moe.moe_fp8(*routed, False, shared=shared)
    plain = list(grids)
    grids.clear()
    got = moe.moe_fp8(*routed, False, shared=shared, config={"BLOCKS_LAST": True})
    assert torch.equal(got, want)
    assert len(plain) == 2 and grids == ([g[::-1] for g in plain] if tokens <= 16 else plain), (plain, grids)


@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("act_quant", [False, True])
def test_the_expert_walk_gives_the_bits_of_the_split_it_picks(monkeypatch, tokens, act_quant):
    """WALK_CTAS_PER_SM: the routed part of the router / gate|up launch is that many CTAs an SM (at least a block
    and column tile each) walking the picked experts' tiles, the K split sized at run time from the picked count P:
    the most splits of the two K groups with P x column tiles x splits at most the walkers. With P x column tiles x 2
    walkers and with one asked for: the bits of that fixed split (SPLIT1), the walkers' partials packed (block b's
    split s in slot b x splits + s); with no local expert (ids steered to -1) no tile runs and the shared expert
    alone is the output. Two launches each time, and every counter back at 0."""
    from triton.runtime.interpreter import InterpretedFunction

    from fxglm5.lowering.triton import fp8_parts, tasks

    monkeypatch.setattr(moe, "num_sms", lambda device: 1)  # walkers = WALK_CTAS_PER_SM
    routed, (w13, s13, w2, s2, up_start) = _moe_with_shared(tokens, torch.bfloat16, torch.Generator().manual_seed(9))
    x, experts = routed[0], routed[3:]
    router = _router_of(x, experts[0].shape[0], tokens, None)  # every expert local: at least two picked
    shared = moe.SharedExpert(w13, s13, w2, s2, act_quant, up_start)
    picked = len(set(moe.moe_router(x, *router)[1].flatten().tolist()) - {-1})
    columns = -(-experts[0].shape[1] // 2 // moe.MOE_DECODE["BLOCK_N1"])
    assert picked > 0 and experts[0].shape[2] // 128 == 2  # two K groups: splits of 1 and 2
    launched, run = [], InterpretedFunction.run
    monkeypatch.setattr(InterpretedFunction, "run", lambda self, *a, **k: launched.append(self.fn.__name__)
                        or run(self, *a, **k))
    partials, grouped = [], moe._grouped

    def zeroed(a, a_s, mode, w, w_s, blocks, c, *args, walkers=0, **kwargs):
        if walkers:  # the walk's packed partials, zeroed first, to see which slots it writes
            partials.append(c.zero_())
        return grouped(a, a_s, mode, w, w_s, blocks, c, *args, walkers=walkers, **kwargs)

    monkeypatch.setattr(moe, "_grouped", zeroed)
    blocks = min(experts[0].shape[0], tokens * 2)  # the scan's blocks: min(E, T x k)

    def split_of(asked):  # the kernel's pick: walkers >= blocks x columns; the most splits that fit, of 2 K groups
        walkers = max(asked, blocks * columns)
        return 2 if walkers // (picked * columns) >= 2 else 1

    for walkers, steered in ((picked * columns * 2, None), (1, None), (3, torch.full_like(routed[1], -1))):
        split = split_of(walkers)
        want = moe.moe_router_fp8(x, router, *experts, act_quant, shared=shared, config={"SPLIT1": split},
                                  steered_ids=steered)
        launched.clear()
        got = moe.moe_router_fp8(x, router, *experts, act_quant, shared=shared,
                                 config={"SPLIT1": split, "WALK_CTAS_PER_SM": walkers}, steered_ids=steered)
        assert launched == ["_router_gate_up_kernel", "_moe_gemm_kernel"]
        assert torch.equal(got, want), (walkers, split)
        assert not fp8_parts.tile_counters(x.device, 1).any() and not tasks.counters(x.device, 1).any()
        # block b's split s in slot b * splits + s (first row: the block's first entry, always a real one)
        slots = partials[-1].view(-1, moe.MOE_DECODE["BLOCK_M"], partials[-1].shape[1])[:, 0]
        written = {i for i, row in enumerate(slots) if row.any()}
        assert written == set(range(0 if steered is not None else picked * split)), (walkers, written)
    assert split_of(picked * columns * 2) == 2 and (tokens > 1 or split_of(1) == 1)  # one token: both splits
    reference = ref.moe_router_fp8_shared(x, *router, *experts, act_quant, w13, s13, w2, s2, up_start)
    walked = moe.moe_router_fp8(x, router, *experts, act_quant, shared=shared, config={"WALK_CTAS_PER_SM": 2})
    assert _rel(walked, reference) < (3e-2 if act_quant else 2e-2)


@pytest.mark.parametrize("tokens", [3, 17])
def test_moe_router_fp8_steered_ids_replace_the_routers(monkeypatch, tokens):
    """bench/routing_load.py's steered load: the experts take the given ids, the router still runs in its launch
    (two launches at decode) and its weights are used: moe_fp8 of those ids and the router's weights, bit for bit."""
    from triton.runtime.interpreter import InterpretedFunction

    routed, (w13, s13, w2, s2, up_start) = _moe_with_shared(tokens, torch.bfloat16, torch.Generator().manual_seed(6))
    x, experts = routed[0], routed[3:]
    router = _router_of(x, experts[0].shape[0], tokens, 8)
    shared = moe.SharedExpert(w13, s13, w2, s2, False, up_start)
    steered = routed[1]  # ids of the test's own
    launched, run = [], InterpretedFunction.run
    monkeypatch.setattr(InterpretedFunction, "run", lambda self, *a, **k: launched.append(self.fn.__name__)
                        or run(self, *a, **k))
    out = moe.moe_router_fp8(x, router, *experts, False, shared=shared, steered_ids=steered)
    assert ("_router_gate_up_kernel" in launched) == (tokens <= 16)
    weights, ids = moe.moe_router(x, *router)
    assert not torch.equal(ids, steered)
    assert torch.equal(out, moe.moe_fp8(x, steered, weights, *experts, False, shared=shared))


@pytest.mark.parametrize("tokens", [1, 5, 16])
@pytest.mark.parametrize("act_quant", [False, True])
@pytest.mark.parametrize("split_k", [False, True])
def test_add_rms_norm_moe_router_fp8_norms_in_the_gate_up_launch(monkeypatch, tokens, act_quant, split_k):
    """Up to 16 tokens (BLOCK_M, MAX_GEMV_ROWS) the residual add and RMSNorm before the MoE are the first tasks of the
    router / gate|up launch of tasks, a token row each, and the MoE layer is two launches: the bits of add_rms_norm's
    kernel followed by moe_router_fp8's launches, both outputs (the MoE's, the sum); the router's, the GEMMs' and the
    tasks' counters back at 0. x and the residual are row-strided views ([1, 5, H] at 5 tokens: the op flattens the
    rows). Close to the reference op, whose sum is the same."""
    from triton.runtime.interpreter import InterpretedFunction

    from fxglm5.lowering.triton import fp8_parts, tasks

    if not split_k:
        monkeypatch.setitem(fp8_gemm.DECODE, "SPLIT_K", 1)
        monkeypatch.setitem(moe.MOE_DECODE, "SPLIT1", 1)
        monkeypatch.setitem(moe.MOE_DECODE, "SPLIT2", 1)
    routed, (w13, s13, w2, s2, up_start) = _moe_with_shared(tokens, torch.bfloat16, torch.Generator().manual_seed(3))
    experts, h = routed[3:], routed[0].shape[1]
    x, r, nw = _add_norm_inputs(tokens, h, torch.bfloat16, torch.Generator().manual_seed(tokens),
                                lead=(1,) if tokens == 5 else ())
    router = _router_of(routed[0], experts[0].shape[0], tokens, 8)
    shared = moe.SharedExpert(w13, s13, w2, s2, act_quant, up_start)
    launched, run = [], InterpretedFunction.run
    monkeypatch.setattr(InterpretedFunction, "run", lambda self, *a, **k: launched.append(self.fn.__name__)
                        or run(self, *a, **k))
    out, total = moe.add_rms_norm_moe_router_fp8(x, r, nw, 1e-5, router, *experts, act_quant, shared=shared)
    assert launched == ["_router_gate_up_kernel", "_moe_gemm_kernel"]
    assert not fp8_parts.tile_counters(x.device, 1).any() and not tasks.counters(x.device, 2).any()
    launched.clear()
    normed, want_total = norm_rope.add_rms_norm(x, r, nw, 1e-5)
    want = moe.moe_router_fp8(normed.reshape(-1, h), router, *experts, act_quant, shared=shared)
    assert launched == ["_add_rms_norm_kernel", "_router_gate_up_kernel", "_moe_gemm_kernel"]
    assert torch.equal(out, want) and torch.equal(total, want_total) and total.shape == x.shape
    reference = ref.add_rms_norm_moe_router_fp8_shared(x, r, nw, 1e-5, *router, *experts, act_quant, w13, s13, w2,
                                                       s2, up_start)
    assert torch.equal(total, reference[1]) and _rel(out, reference[0]) < (3e-2 if act_quant else 2e-2)


@pytest.mark.parametrize("tokens, n_group, config", [(17, 1, None), (4, 2, None), (4, 1, {"fused_quant": False})],
                         ids=["prefill", "group_limited", "quant_kernel"])
def test_add_rms_norm_moe_router_fp8_keeps_the_norm_launch_where_it_does_not_join(monkeypatch, tokens, n_group,
                                                                                   config):
    """Where the router keeps its own launches (past 16 tokens, group-limited routing) and where the tokens are
    quantized by a kernel of their own before the gate|up launch (W8A8 with the in-register quantization off), the
    norm's own kernel runs first, once, then moe_router_fp8's launches over its rows: that chain's bits."""
    from triton.runtime.interpreter import InterpretedFunction

    routed, (w13, s13, w2, s2, up_start) = _moe_with_shared(tokens, torch.bfloat16, torch.Generator().manual_seed(4))
    experts, h = routed[3:], routed[0].shape[1]
    x, r, nw = _add_norm_inputs(tokens, h, torch.bfloat16, torch.Generator().manual_seed(1))
    router = _router_of(routed[0], experts[0].shape[0], tokens, 8)._replace(n_group=n_group)
    shared = moe.SharedExpert(w13, s13, w2, s2, True, up_start)
    launched, run = [], InterpretedFunction.run
    monkeypatch.setattr(InterpretedFunction, "run", lambda self, *a, **k: launched.append(self.fn.__name__)
                        or run(self, *a, **k))
    out, total = moe.add_rms_norm_moe_router_fp8(x, r, nw, 1e-5, router, *experts, True, shared=shared, config=config)
    assert launched[0] == "_add_rms_norm_kernel" and "_add_rms_norm_kernel" not in launched[1:]
    assert ("_router_gate_up_kernel" in launched) == (config is not None)  # the router joins, the norm does not
    normed, want_total = norm_rope.add_rms_norm(x, r, nw, 1e-5)
    want = moe.moe_router_fp8(normed, router, *experts, True, shared=shared, config=config)
    assert torch.equal(out, want) and torch.equal(total, want_total)


def test_add_rms_norm_moe_router_fp8_steered_ids_replace_the_routers(monkeypatch):
    """bench/routing_load.py's steered load with the norm in the launch: the experts take the given ids, the router
    still runs (on the normed rows) and its weights are used: moe_fp8 of the normed rows, those ids and the router's
    weights, bit for bit, in two launches."""
    from triton.runtime.interpreter import InterpretedFunction

    routed, (w13, s13, w2, s2, up_start) = _moe_with_shared(3, torch.bfloat16, torch.Generator().manual_seed(6))
    experts, h, steered = routed[3:], routed[0].shape[1], routed[1]
    x, r, nw = _add_norm_inputs(3, h, torch.bfloat16, torch.Generator().manual_seed(2))
    router = _router_of(routed[0], experts[0].shape[0], 3, 8)
    shared = moe.SharedExpert(w13, s13, w2, s2, False, up_start)
    launched, run = [], InterpretedFunction.run
    monkeypatch.setattr(InterpretedFunction, "run", lambda self, *a, **k: launched.append(self.fn.__name__)
                        or run(self, *a, **k))
    out, total = moe.add_rms_norm_moe_router_fp8(x, r, nw, 1e-5, router, *experts, False, shared=shared,
                                                 steered_ids=steered)
    assert launched == ["_router_gate_up_kernel", "_moe_gemm_kernel"]
    normed, want_total = norm_rope.add_rms_norm(x, r, nw, 1e-5)
    weights, ids = moe.moe_router(normed, *router)
    assert not torch.equal(ids, steered)
    assert torch.equal(out, moe.moe_fp8(normed, steered, weights, *experts, False, shared=shared))
    assert torch.equal(total, want_total)


@pytest.mark.parametrize("tokens, n_group, joins", [(17, 1, None), (4, 2, None), (4, 1, "none")],
                         ids=["prefill", "group_limited", "join_off"])
def test_moe_router_fp8_keeps_the_router_launches_where_it_does_not_join(monkeypatch, tokens, n_group, joins):
    """Past BLOCK_M tokens (the router's float32 GEMM and route kernel, the align kernel), with group-limited
    routing (the reference's router) and where FXGLM5_DECODE_JOINS leaves out ``moe_router``, the router keeps its
    own launches before moe_fp8's: no router-and-gate|up launch, the chain's bits."""
    from triton.runtime.interpreter import InterpretedFunction

    if joins is not None:
        monkeypatch.setenv("FXGLM5_DECODE_JOINS", joins)

    routed, (w13, s13, w2, s2, up_start) = _moe_with_shared(tokens, torch.bfloat16, torch.Generator().manual_seed(4))
    x, experts = routed[0], routed[3:]
    router = _router_of(x, experts[0].shape[0], tokens, 8)._replace(n_group=n_group)
    shared = moe.SharedExpert(w13, s13, w2, s2, True, up_start)
    assert not moe.router_joins(x, router, experts[0].shape[0])
    launched, run = [], InterpretedFunction.run
    monkeypatch.setattr(InterpretedFunction, "run", lambda self, *a, **k: launched.append(self.fn.__name__)
                        or run(self, *a, **k))
    fused = moe.moe_router_fp8(x, router, *experts, True, shared=shared)
    assert "_router_gate_up_kernel" not in launched
    if joins is None:
        assert "_router_kernel" not in launched
    else:  # the one-launch router (its GEMV and routing) on its own, then the two expert launches
        assert launched == ["_router_kernel", "_moe_gemm_kernel", "_moe_gemm_kernel"]
    weights, ids = moe.moe_router(x, *router)
    assert torch.equal(fused, moe.moe_fp8(x, ids, weights, *experts, True, shared=shared))


def _add_rms_norm_in_order(x, r, w, eps):
    """add_rms_norm's normed rows recomputed with torch in the order ``norm_rope.add_rms_norm_row`` sums in: the squares
    of the sum (rounded to the dtype) added elementwise chunk by chunk (1024 columns, zero past D), then the chunk's
    values in pairs level by level; every float32 operation rounded as the kernel rounds it."""
    t = (x + r).float()
    d = t.shape[-1]
    chunk = min(1024, 1 << (d - 1).bit_length())
    sq = torch.nn.functional.pad(t * t, (0, -d % chunk))
    acc = torch.zeros(*t.shape[:-1], chunk)
    for i in range(sq.shape[-1] // chunk):
        acc = acc + sq[..., i * chunk:(i + 1) * chunk]
    while acc.shape[-1] > 1:
        acc = acc[..., 0::2] + acc[..., 1::2]
    rstd = 1.0 / torch.sqrt(acc / d + eps)
    return (w.float() * (t * rstd).to(x.dtype).float()).to(x.dtype)


@pytest.mark.parametrize("d, dtype", [(2560, torch.bfloat16), (6144, torch.bfloat16), (200, torch.float32)])
def test_add_rms_norm_sums_the_squares_in_a_fixed_order(d, dtype):
    """The kernel's sum of squares has one order whatever its warp count (elementwise over chunks, then pairwise), the
    one the MoE's norm tasks share (another warp count): its normed rows are that order's, recomputed with torch,
    bit for bit (a last chunk of 512 at 2560; a float32 row of 200 in one chunk of 256)."""
    g = torch.Generator().manual_seed(d)
    x, r = (torch.randn(5, d, generator=g).to(dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype)
    normed, total = norm_rope.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(total, x + r)
    assert torch.equal(normed, _add_rms_norm_in_order(x, r, w, 1e-5))


def _add_norm_inputs(m, k, dtype, g, lead=()):
    """x and the residual as row-strided views (the halves of one [..., m, 2k] tensor: the kernel reads rows at their
    stride) and the norm's weight."""
    both = (torch.randn(*lead, m, 2 * k, generator=g) * 2).to(dtype)
    return both[..., :k], both[..., k:], (1 + 0.1 * torch.randn(k, generator=g)).to(dtype)


def _assert_normed_close(normed, want, dtype):
    """The fused kernel's normed rows against add_rms_norm's kernel's. Its sums of squares run in another order, so a
    row's factor may be an ulp apart: in float32 every value of such a row differs (rel 1e-6), in bf16 only a value
    that close to a rounding boundary, by one unit (test_add_rms_norm_in_the_gemm_at_glm5_width measures how often):
    at most 1 in 1000 values, each one unit of bf16 off."""
    if dtype == torch.float32:
        assert _rel(normed, want) < 1e-6
        return
    off = normed != want
    assert off.float().mean().item() <= 1e-3
    assert ((normed.float() - want.float()).abs() <= want.float().abs() * 2 ** -7)[off].all()


class _Launches(list):
    """The interpreted kernels launched inside the ``with`` block, by name (hypothesis' tests take no monkeypatch)."""

    def __enter__(self):
        from triton.runtime.interpreter import InterpretedFunction

        self._run = run = InterpretedFunction.run
        InterpretedFunction.run = lambda fn, *a, **k: self.append(fn.fn.__name__) or run(fn, *a, **k)
        return self

    def __exit__(self, *exc):
        from triton.runtime.interpreter import InterpretedFunction

        InterpretedFunction.run = self._run


def _norm_gemm_chain(x, r, nw, w, s, bias, act_quant, config=None):
    """add_rms_norm's kernel, then fp8_linear on its normed rows: the two launches the fused op replaces."""
    normed, total = norm_rope.add_rms_norm(x, r, nw, 1e-6)
    return fp8_gemm.fp8_linear(normed, w, s, bias, act_quant, config=config), total, normed


@given(m=st.integers(1, 16), nk=st.sampled_from([(192, 384), (130, 300), (576, 256), (64, 640)]),
       act_quant=st.booleans(), dtype=DTYPES, kernel=st.sampled_from(["triton", "gemv"]), seed=st.integers(0, 2**16))
def test_add_rms_norm_fp8_linear_is_one_launch_of_the_chain_at_decode(m, nk, act_quant, dtype, kernel, seed):
    """Up to 16 rows one launch of either decode GEMM (the tiled kernel split over K with its in-kernel fix-up, or the
    GEMV) computes add_rms_norm -> fp8_linear: the sum bitwise (each value written by column tile 0's CTAs; N and K
    tails), the normed rows as add_rms_norm's up to the order of the sum of squares, and the output bitwise what the
    same GEMM gives on those normed rows (its A operand is what it writes); without keep_normed the same output and
    sum, the normed output empty."""
    n, k = nk
    g = torch.Generator().manual_seed(seed)
    x, r, nw = _add_norm_inputs(m, k, dtype, g)
    w, s = _fp8_weight(n, k, g)
    config = dict(kernel=kernel)
    with _Launches() as chain:  # the default: the join is opt-in (settings.DECODE_JOINS), the chain's launches
        fp8_gemm.add_rms_norm_fp8_linear(x, r, nw, 1e-6, w, s, None, act_quant, True, config=config)
    assert chain[0] == "_add_rms_norm_kernel" and len(chain) >= 2
    with mock.patch.dict(os.environ, {"FXGLM5_DECODE_JOINS": "norm_gemm"}), _Launches() as launched:
        out, total, normed = fp8_gemm.add_rms_norm_fp8_linear(x, r, nw, 1e-6, w, s, None, act_quant, True,
                                                              config=config)
    assert launched == ["_gemm_kernel" if kernel == "triton" else "_gemv_kernel"]
    assert (out.shape, total.shape, normed.shape) == ((m, n), (m, k), (m, k))
    _, want_total, want_normed = _norm_gemm_chain(x, r, nw, w, s, None, act_quant)
    assert torch.equal(total, want_total)
    _assert_normed_close(normed, want_normed, dtype)
    assert torch.equal(out, fp8_gemm.fp8_linear(normed, w, s, None, act_quant, config=config))
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert _rel(out, ref.add_rms_norm_fp8_linear(x, r, nw, 1e-6, w, s, None, act_quant, False)[0]) < tol
    with mock.patch.dict(os.environ, {"FXGLM5_DECODE_JOINS": "norm_gemm"}):
        alone = fp8_gemm.add_rms_norm_fp8_linear(x, r, nw, 1e-6, w, s, None, act_quant, False, config=config)
    assert torch.equal(alone[0], out) and torch.equal(alone[1], total) and alone[2].shape == (m, 0)


@pytest.mark.parametrize("config", [dict(kernel="triton", SPLIT_K=2), dict(kernel="triton", SPLIT_K=2, FIXUP=False),
                                    dict(kernel="gemv", CTAS_PER_SM=1.5, BLOCK_N=64)],
                         ids=["fixup", "reduce_kernel", "gemv"])
@pytest.mark.parametrize("m", [1, 7, 16])
def test_add_rms_norm_fp8_linear_over_ragged_splits_with_bias(config, m):
    """K = 640 is 5 K steps, split 3 + 2 (a ragged last split, whose steps past K load nothing and write nothing):
    every value of the sum is written once, the output is the same GEMM's on the normed rows, bias included, and the
    split-K counters are left at zero."""
    from fxglm5.lowering.triton import fp8_gemv, fp8_parts

    g = torch.Generator().manual_seed(m)
    x, r, nw = _add_norm_inputs(m, 640, torch.bfloat16, g)
    w, s = _fp8_weight(192, 640, g)
    bias = torch.randn(192, generator=g).to(torch.bfloat16)
    if config["kernel"] == "gemv":
        plan = fp8_gemv.plan(m, 192, 640, 4, config)
        assert (plan["SPLIT_K"], plan["KG_PER_SPLIT"]) == (2, 3)
    out, total, normed = fp8_gemm.add_rms_norm_fp8_linear(x, r, nw, 1e-6, w, s, bias, True, True, config=config)
    _, want_total, want_normed = _norm_gemm_chain(x, r, nw, w, s, bias, True)
    assert torch.equal(total, want_total)
    _assert_normed_close(normed, want_normed, torch.bfloat16)
    assert torch.equal(out, fp8_gemm.fp8_linear(normed, w, s, bias, True, config=config))
    counters = fp8_parts._COUNTERS.get(("cpu", None))
    assert counters is None or int(counters.abs().sum()) == 0


@pytest.mark.parametrize("m, x_dtype, r_dtype", [
    (17, torch.bfloat16, torch.bfloat16), (40, torch.float32, torch.float32), (3, torch.bfloat16, torch.float32),
], ids=["past_decode", "prefill_float32", "mixed_dtypes"])
def test_add_rms_norm_fp8_linear_past_the_decode_path_is_the_two_kernels(m, x_dtype, r_dtype):
    """More than 16 rows, or a sum whose dtype is not x's (x bf16 + a float32 residual: the sum and the GEMM's input
    are float32), launches add_rms_norm's kernel and then fp8_linear's: the chain's bits, sum and normed rows
    included."""
    g = torch.Generator().manual_seed(m)
    x, _, nw = _add_norm_inputs(m, 256, x_dtype, g)
    r = torch.randn(m, 256, generator=g).to(r_dtype)
    w, s = _fp8_weight(192, 256, g)
    with _Launches() as launched:
        got = fp8_gemm.add_rms_norm_fp8_linear(x, r, nw, 1e-6, w, s, None, True, True)
    assert launched[0] == "_add_rms_norm_kernel" and "_add_rms_norm_kernel" not in launched[1:]
    for a, b in zip(got, _norm_gemm_chain(x, r, nw, w, s, None, True)):
        assert torch.equal(a, b)


def test_add_rms_norm_fp8_linear_keeps_leading_dims():
    """[2, 3, K] rows (6: the decode path) give [2, 3, N], [2, 3, K] and [2, 3, 0] without keep_normed."""
    g = torch.Generator().manual_seed(5)
    x, r, nw = _add_norm_inputs(3, 256, torch.bfloat16, g, lead=(2,))
    w, s = _fp8_weight(130, 256, g)
    out, total, normed = fp8_gemm.add_rms_norm_fp8_linear(x, r, nw, 1e-6, w, s, None, False, False)
    assert (out.shape, total.shape, normed.shape) == ((2, 3, 130), (2, 3, 256), (2, 3, 0))
    assert torch.equal(total, x + r)
    want = _norm_gemm_chain(x.reshape(6, 256), r.reshape(6, 256), nw, w, s, None, False)[0]
    assert _rel(out.reshape(6, 130), want) < 1e-2


@pytest.mark.parametrize("kernel", ["triton", "gemv"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_add_rms_norm_in_the_gemm_at_glm5_width(kernel, dtype):
    """At GLM-5's hidden size (6144 values a row: 48 K steps, the sums of squares in 6 chunks of 1024 at 1 row, 96
    chunks of 64 at 16) on random rows, how often the fused normed rows differ from add_rms_norm's kernel's, the
    interpreter's sums against numpy's. Measured when written (6 draws of 1, 8 and 16 rows each, both kernels): none of
    the 1843200 bf16 values; 28 and 23 of 150 float32 rows (tiled, GEMV) a factor's ulp off, so most values of them;
    bounded as :func:`_assert_normed_close` says.
    The GPU's own orders are tests/gpu/test_gpu_fused.py's to measure. Two K splits (CTAs) keep it quick."""
    g = torch.Generator().manual_seed(11)
    w, s = _fp8_weight(64, 6144, g)
    config = dict(kernel=kernel, **(dict(SPLIT_K=2) if kernel == "triton" else dict(CTAS_PER_SM=0.5)))
    for m in (1, 16):
        x, r, nw = _add_norm_inputs(m, 6144, dtype, g)
        out, total, normed = fp8_gemm.add_rms_norm_fp8_linear(x, r, nw, 1e-6, w, s, None, True, True, config=config)
        _, want_total, want_normed = _norm_gemm_chain(x, r, nw, w, s, None, True)
        assert torch.equal(total, want_total)
        _assert_normed_close(normed, want_normed, dtype)
        assert torch.equal(out, fp8_gemm.fp8_linear(normed, w, s, None, True, config=config))


@pytest.mark.parametrize("call, message", [
    (lambda: norm_rope.add_rms_norm(torch.ones(2, 8), torch.ones(2, 4), torch.ones(8), 1e-6), "add_rms_norm residual"),
    (lambda: f32_linear.f32_linear(torch.ones(2, 8), torch.ones(4, 8, dtype=torch.bfloat16), []), "f32_linear weight"),
    (lambda: f32_linear.f32_linear(torch.ones(2, 8), torch.ones(4, 8), [1.0] * 5), "f32_linear scales"),
    (lambda: moe.moe_router(torch.ones(2, 8), torch.ones(4, 8, dtype=torch.bfloat16), torch.zeros(4), 2, 1, 1, True,
                            1.0), "f32_linear weight"),
    (lambda: moe.moe_router(torch.ones(2, 8), torch.ones(4, 8), torch.zeros(5), 2, 1, 1, True, 1.0),
     "correction_bias"),
    (lambda: fp8_gemm.fp8_linear(torch.ones(2, 128), *_fp8_weight(128, 128, torch.Generator()), None, False,
                                 up=torch.ones(2, 64)), "up:"),
    (lambda: fp8_gemm.add_rms_norm_fp8_linear(torch.ones(2, 128), torch.ones(2, 64), torch.ones(128), 1e-6,
                                              *_fp8_weight(128, 128, torch.Generator())), "add_rms_norm residual"),
    (lambda: fp8_gemm.add_rms_norm_fp8_linear(torch.ones(2, 128), torch.ones(2, 128), torch.ones(64), 1e-6,
                                              *_fp8_weight(128, 128, torch.Generator())), "add_rms_norm weight"),
    (lambda: fp8_gemm.add_rms_norm_fp8_linear(torch.ones(2, 128), torch.ones(2, 128), torch.ones(128), 1e-6,
                                              *_fp8_weight(128, 256, torch.Generator())), "x: last dim"),
])
def test_bad_inputs_name_the_argument(call, message):
    with pytest.raises(InputError, match=message):
        call()


# the q_b | wq_b GEMM with the latent query of its heads (fp8_linear_latent_query): 3 heads of 40 + 32 columns from
# column 100 (head 0 on column tiles 0 and 1, head 1 on tile 1, head 2 on tiles 1 and 2 of 128), 60 more columns
# after them (the indexer's query), K = 256 (two K steps: split in two on the interpreter's 4 SMs), W_UK [3, 40, 96]
LQ_HEADS, LQ_NOPE, LQ_ROPE, LQ_START, LQ_N, LQ_K = 3, 40, 32, 100, 376, 256


def _latent_query_inputs(tokens, dtype, seed, rope=True, bias=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, LQ_K, generator=g).to(dtype)
    w, s = _fp8_weight(LQ_N, LQ_K, g)
    w_uk = (torch.randn(LQ_HEADS, LQ_NOPE, 96, generator=g) / 6).to(dtype)
    angles = torch.rand(tokens, LQ_ROPE // 2, generator=g) * 10
    b = torch.randn(LQ_N, generator=g).to(dtype) if bias else None
    return x, w, s, b, w_uk, ((angles.cos(), angles.sin()) if rope else None)


def _separate_launches(x, w, s, bias, act_quant, w_uk, rope):
    """fp8_linear, then the latent query of its heads (the attention op's body: its own launch over views)."""
    from fxglm5.lowering.triton import paged_cache

    out = fp8_gemm.fp8_linear(x, w, s, bias, act_quant)
    q_nope, q_pe = ref.query_heads(out, LQ_START, LQ_HEADS, LQ_NOPE, LQ_ROPE)
    return out, paged_cache.latent_query(q_nope, w_uk, q_pe, rope)


@pytest.mark.parametrize("tokens", [1, 5, 16])
@pytest.mark.parametrize("act_quant", [False, True])
@pytest.mark.parametrize("split_k", [False, True])
@pytest.mark.parametrize("dtype, rope, bias", [(torch.bfloat16, True, False), (torch.float32, False, True)],
                         ids=["bf16_rope", "float32_bias"])
@pytest.mark.usefixtures("all_decode_joins")  # an opt-in join (settings.DECODE_JOINS)
def test_fp8_linear_latent_query_runs_the_latent_query_in_the_gemm_launch(monkeypatch, tokens, act_quant, split_k,
                                                                          dtype, rope, bias):
    """Up to 16 tokens the GEMM's tiles and the latent query's programs are tasks of one launch: the bits of
    fp8_linear's launch followed by the latent query's, the GEMM's output and the query both. Each head's programs wait
    for exactly the signals of the tiles its columns lie on (heads across tile boundaries, 1 or 2 tiles a head: every
    wait finds its count reached, never exceeded, in the interpreter's order), one signal per finished tile per head
    (with split_k only the CTA that completes a tile signals); the tasks' and the split-K counters are back at 0.
    Close to the reference op."""
    from triton.runtime.interpreter import InterpretedFunction

    from fxglm5.lowering.triton import fp8_parts, paged_cache, tasks

    if not split_k:
        monkeypatch.setitem(fp8_gemm.DECODE, "SPLIT_K", 1)
    x, w, s, b, w_uk, rope_args = _latent_query_inputs(tokens, dtype, tokens, rope, bias)
    counters = tasks.counters(x.device, LQ_HEADS)
    waits, signals, call = [], [], InterpretedFunction.__call__

    def value(v):
        return int(v.handle.data.reshape(-1)[0]) if hasattr(v, "handle") else int(v)

    def record(self, *a, **k):
        if self.fn is tasks.wait.fn:  # (head, signals awaited, signals there)
            waits.append((value(a[1]), value(a[2]), int(counters[tasks.DEPS.value + value(a[1])])))
            assert waits[-1][2] >= waits[-1][1], waits[-1]  # else the interpreted spin never ends
        if self.fn is tasks.signal.fn:
            signals.append(value(a[1]))
        return call(self, *a, **k)

    launched, run = [], InterpretedFunction.run
    monkeypatch.setattr(InterpretedFunction, "run", lambda self, *a, **k: launched.append(self.fn.__name__)
                        or run(self, *a, **k))
    monkeypatch.setattr(InterpretedFunction, "__call__", record)
    out, q = paged_cache.fp8_linear_latent_query(x, w, s, b, act_quant, w_uk, LQ_START, LQ_ROPE, rope_args)
    assert launched == ["_gemm_latent_query_kernel"]
    assert len(waits) == LQ_HEADS * 16 and {(h, n) for h, n, _ in waits} == {(0, 2), (1, 1), (2, 2)}
    assert all(there == awaited for _, awaited, there in waits)
    assert sorted(signals) == [0, 0, 1, 2, 2]
    assert not fp8_parts.tile_counters(x.device, 1).any() and not counters.any()
    launched.clear()
    want_out, want_q = _separate_launches(x, w, s, b, act_quant, w_uk, rope_args)
    assert launched[-2:] == ["_gemm_kernel", "_latent_query_kernel"]
    assert torch.equal(out, want_out) and torch.equal(q, want_q)
    tables = (None, None) if rope_args is None else rope_args
    ref_out, ref_q = ref.fp8_linear_latent_query(x, w, s, b, act_quant, w_uk, LQ_START, LQ_ROPE, *tables)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert _rel(out, ref_out) < tol and _rel(q, ref_q) < tol


@pytest.mark.parametrize("case", ["prefill", "gemv", "lead_dims"])
@pytest.mark.usefixtures("all_decode_joins")  # elsewhere than decode even with the join on
def test_fp8_linear_latent_query_elsewhere_is_the_two_launches(monkeypatch, case):
    """Past 16 tokens (the latent query's prefill tiles) and where the GEMM is the GEMV, the op is fp8_linear's
    launches and then the latent query's, with their bits; [2, 3, K] tokens (the decode path) come back as [2, 3, N] and
    [2, 3, H, 576], the flattened call's values."""
    from fxglm5.lowering.triton import fp8_gemv, paged_cache

    tokens = 17 if case == "prefill" else 6
    if case == "gemv":
        monkeypatch.setitem(fp8_gemv.GEMV, "enabled", True)
    x, w, s, b, w_uk, rope_args = _latent_query_inputs(tokens, torch.bfloat16, 9)
    with _Launches() as launched:
        if case == "lead_dims":
            out, q = paged_cache.fp8_linear_latent_query(x.view(2, 3, LQ_K), w, s, b, True, w_uk, LQ_START, LQ_ROPE,
                                                         rope_args)
        else:
            out, q = paged_cache.fp8_linear_latent_query(x, w, s, b, True, w_uk, LQ_START, LQ_ROPE, rope_args)
    if case == "lead_dims":
        assert launched == ["_gemm_latent_query_kernel"]
    else:  # fp8_linear's launches (at 17 rows the split-K reduce kernel after the GEMM's), then the latent query's
        assert launched[0] == ("_gemm_kernel" if case == "prefill" else "_gemv_kernel")
        assert launched[-1] == "_latent_query_kernel" and "_gemm_latent_query_kernel" not in launched
    want_out, want_q = _separate_launches(x, w, s, b, True, w_uk, rope_args)
    if case == "lead_dims":
        assert out.shape == (2, 3, LQ_N) and q.shape == (2, 3, LQ_HEADS, 576)
        out, q = out.view(tokens, LQ_N), q.view(tokens, LQ_HEADS, 576)
    assert torch.equal(out, want_out) and torch.equal(q, want_q)
