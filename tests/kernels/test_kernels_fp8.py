"""Block-FP8 GEMM and FP8 MoE: Triton kernels (interpreted on CPU) vs the torch reference, the reference vs
naive loops and transformers' router, and the InputError messages. Small shapes: CI runs it on 2 cores."""

import os

import torch

if not torch.cuda.is_available():  # CPU CI: interpret; set before triton is imported in this process
    os.environ.setdefault("TRITON_INTERPRET", "1")  # (not on GPU hosts: it would also hit the GPU suite)

import pytest  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fxglm5.errors import InputError  # noqa: E402
from fxglm5.lowering.reference import fp8 as ref  # noqa: E402
from tests.helpers import assert_saturates, loop_quantize_fp8, saturating_values  # noqa: E402

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("CPU-tensor kernel tests run interpreted (TRITON_INTERPRET=1); on a GPU host "
                "tests/gpu/test_gpu_fp8.py covers the kernels", allow_module_level=True)

from fxglm5.lowering.triton import fp8_gemm, fp8_parts, moe  # noqa: E402

FP8 = torch.float8_e4m3fn
# Padding rows of the MoE intermediate are never written (their results are never stored either); the
# interpreter's numpy matmul warns about the garbage they hold.
pytestmark = [
    pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered in matmul:RuntimeWarning"),
]


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _weight(n, k, seed, lead=()):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(*lead, n, k, generator=g) * 0.5).to(FP8)
    s = torch.rand(*lead, -(-n // 128), -(-k // 128), generator=g) * 0.02 + 0.005
    return w, s


def _tol(dtype, act_quant):
    if dtype == torch.float32:  # same math, fp32 accumulation order (+ rare e4m3 rounding ties in W8A8)
        return 1e-4 if act_quant else 1e-5
    return 2e-2  # bf16 output rounding (the interpreter truncates fp32 -> bf16) and bf16 intermediates


# ------------------------------------------------------------------------------------------ GEMM
@given(m=st.integers(1, 70), k=st.sampled_from([64, 128, 200, 320]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2**16))
def test_quantize_act_matches_reference(m, k, dtype, seed):
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)
    q, s = fp8_gemm.quantize_act_1x128(x)
    qr, sr = ref.quantize_act_1x128(x)
    assert q.dtype == FP8 and s.shape == (m, -(-k // 128))
    assert torch.equal(s, sr)
    assert (q.float() != qr.float()).float().mean().item() <= 1e-3  # rounding ties only


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_act_matches_an_independent_loop(impl, dtype):
    """Bit for bit the per-group Python-float quantizer (tests.helpers.loop_quantize_fp8) on 1x128 groups far
    above 448, of amax exactly 448, of multiples of 448, zero, unit and subnormal-producing, with a short last
    group; every non-zero group saturates at exactly +-448."""
    x = saturating_values(13, 260, 1, torch.Generator().manual_seed(2)).to(dtype)
    q, s = (ref if impl == "reference" else fp8_gemm).quantize_act_1x128(x)
    q_loop, s_loop = loop_quantize_fp8(x, 1, floor=1e-10)
    assert torch.equal(s, s_loop) and torch.equal(q.view(torch.uint8), q_loop.view(torch.uint8))
    assert_saturates(q, s, x, 1)


@given(m=st.integers(1, 70), nk=st.sampled_from([(192, 320), (64, 128), (130, 256), (256, 200)]),
       act_quant=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]), bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_fp8_linear_matches_reference(m, nk, act_quant, dtype, bias, seed):
    n, k = nk
    w, s = _weight(n, k, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    out = fp8_gemm.fp8_linear(x, w, s, b, act_quant)
    assert out.shape == (m, n) and out.dtype == dtype
    assert _rel(out, ref.fp8_linear(x, w, s, b, act_quant)) < _tol(dtype, act_quant)


PARTIAL = st.integers(1, 400).filter(lambda v: v % 128)  # widths with a short last 128-block


@given(m=st.integers(1, 70), n=PARTIAL, k=PARTIAL, act_quant=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       split=st.sampled_from([None, 1, 2, 3]), seed=st.integers(0, 2**16))
def test_fp8_linear_partial_blocks(m, n, k, act_quant, dtype, split, seed):
    """N and K tails (weight blocks and the activations' 1x128 groups cut short) in every regime: decode
    (activations quantized in registers), medium (quantized by their own kernel), split-K."""
    w, s = _weight(n, k, seed)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    out = fp8_gemm.fp8_linear(x, w, s, None, act_quant, config=None if split is None else dict(SPLIT_K=split))
    assert out.shape == (m, n)
    assert _rel(out, ref.fp8_linear(x, w, s, None, act_quant)) < _tol(dtype, act_quant)


@pytest.mark.parametrize("fixup", [False, True])
@pytest.mark.parametrize("split", [1, 2, 3])
def test_fp8_linear_split_k(split, fixup):
    """Split-K (ragged last split for K=320) with the reduce kernel or the in-kernel fixup."""
    w, s = _weight(192, 320, 3)
    x = torch.randn(5, 320)
    b = torch.randn(192)
    for act_quant in (False, True):
        out = fp8_gemm.fp8_linear(x, w, s, b, act_quant, config=dict(SPLIT_K=split, FIXUP=fixup, BLOCK_N=64))
        assert _rel(out, ref.fp8_linear(x, w, s, b, act_quant)) < 1e-4
    counters = fp8_parts._COUNTERS.get(("cpu", None))
    assert counters is None or int(counters.abs().sum()) == 0  # fixup leaves its counters at zero


def test_fp8_linear_prefill_path_and_leading_dims():
    """M > 64 quantizes activations in their own kernel (prefill path); [..., K] inputs keep their dims."""
    w, s = _weight(130, 256, 4)
    x = torch.randn(2, 40, 256)
    out = fp8_gemm.fp8_linear(x, w, s, None, True)
    assert out.shape == (2, 40, 130)
    assert _rel(out, ref.fp8_linear(x, w, s, None, True)) < 1e-4


def _spy_launches(monkeypatch, module, name, rows_of):
    """The row count of every call of ``module.name`` (the chunks call it again through the module global)."""
    calls, fn = [], getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(rows_of(*args))
        return fn(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


@pytest.mark.parametrize("act_quant", [False, True])
@pytest.mark.parametrize("n, k", [(256, 384), (384, 128)])  # the limit reached by M x K, then by M x N
def test_fp8_linear_past_the_int32_limit_runs_in_row_chunks(monkeypatch, n, k, act_quant):
    """A call whose M x max(N, K) reaches INT32_ELEMENTS (2^31, monkeypatched down to 150 rows' worth) runs as row
    chunks below it, each one GEMM on a contiguous row view of whole 128-row tiles: the result is the unchunked
    one, bit for bit. (The tile config is fixed: the default picks by M, and a chunk's M is smaller.)"""
    w, s = _weight(n, k, 5)
    x = torch.randn(3, 100, k)  # M = 300 rows
    b = torch.randn(n)
    config = dict(fp8_gemm.MEDIUM, SPLIT_K=1)
    whole = fp8_gemm.fp8_linear(x, w, s, b, act_quant, config=config)
    monkeypatch.setattr(fp8_gemm, "INT32_ELEMENTS", 150 * max(n, k))
    calls = _spy_launches(monkeypatch, fp8_gemm, "fp8_linear", lambda x, *_: x.reshape(-1, x.shape[-1]).shape[0])
    out = fp8_gemm.fp8_linear(x, w, s, b, act_quant, config=config)
    assert calls == [300, 128, 128, 44]  # halved to whole tiles below the limit
    assert out.shape == whole.shape and torch.equal(out, whole)


@pytest.mark.parametrize("act_quant", [False, True])
def test_moe_fp8_past_the_int32_limit_runs_in_token_chunks(monkeypatch, act_quant):
    """The fused MoE's largest tensor (the padded [rows, 2I] gate|up rows or the [SPLIT2, T*k, H] partials) at
    INT32_ELEMENTS (monkeypatched small) splits the tokens into independent MoE calls: the unchunked result, bit
    for bit. The routing gives every expert 16 entries (one BLOCK_M block) per 32 tokens, so that every entry sits
    at the same row of its block in both (the interpreter's numpy matmul rounds a row by its place in the tile)."""
    t, e, k, inter, h = 64, 4, 2, 128, 256
    _, _, w13, s13, w2, s2 = _moe_case(t, e, k, inter, h, 6)
    ids = torch.tensor([[j % 4, (j + 1 + j // 4 % 3) % 4] for j in range(t)], dtype=torch.int32)
    tw, x = torch.rand(t, k), torch.randn(t, h)
    whole = moe.moe_fp8(x, ids, tw, w13, s13, w2, s2, act_quant)
    limit = moe._moe_elements(40, k, e, h, inter, None)  # chunks of 64 -> 32 tokens
    monkeypatch.setattr(fp8_gemm, "INT32_ELEMENTS", limit)
    calls = _spy_launches(monkeypatch, moe, "moe_fp8", lambda x, *_: x.shape[0])
    out = moe.moe_fp8(x, ids, tw, w13, s13, w2, s2, act_quant)
    assert calls == [64, 32, 32]
    assert all(moe._moe_elements(c, k, e, h, inter, None) < limit for c in calls[1:])
    assert torch.equal(out, whole)


def test_reference_fp8_linear_vs_naive():
    """Reference dequant + GEMM against explicit per-block loops (N=192, K=320: short last blocks)."""
    w, s = _weight(192, 320, 5)
    x = torch.randn(3, 320)
    wf = torch.empty(192, 320)
    for i in range(2):
        for j in range(3):
            wf[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float() * s[i, j]
    assert torch.equal(ref.dequantize_block_fp8(w, s), wf)
    torch.testing.assert_close(ref.fp8_linear(x, w, s, None, False), x @ wf.T, rtol=1e-5, atol=1e-5)
    xq = torch.empty_like(x)
    for t in range(3):
        for j in range(3):
            blk = x[t, j * 128:(j + 1) * 128]
            sc = max(blk.abs().max().item(), 1e-10) / 448
            xq[t, j * 128:(j + 1) * 128] = (blk / sc).clamp(-448, 448).to(FP8).float() * sc
    torch.testing.assert_close(ref.fp8_linear(x, w, s, None, True), xq @ wf.T, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------- routing
@given(t=st.integers(1, 40), e=st.sampled_from([4, 8, 12, 16, 256]), top_k=st.integers(1, 4), renorm=st.booleans(),
       seed=st.integers(0, 2**16))
def test_moe_route_matches_reference(t, e, top_k, renorm, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, e, generator=g)
    bias = torch.randn(e, generator=g) * 0.1
    w, ids = moe.moe_route(logits, bias, top_k, 1, 1, renorm, 2.5)
    wr, idr = ref.moe_route(logits, bias, top_k, 1, 1, renorm, 2.5)
    assert ids.dtype == torch.int32 and torch.equal(ids, idr)
    torch.testing.assert_close(w, wr, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("e,top_k,n_group,topk_group", [(16, 4, 1, 1), (16, 4, 4, 2), (32, 8, 8, 4), (8, 2, 2, 1)])
def test_moe_route_reference_vs_transformers(e, top_k, n_group, topk_group):
    modeling = pytest.importorskip("transformers.models.glm_moe_dsa.modeling_glm_moe_dsa")
    from transformers.models.glm_moe_dsa.configuration_glm_moe_dsa import GlmMoeDsaConfig

    cfg = GlmMoeDsaConfig(hidden_size=32, n_routed_experts=e, num_experts_per_tok=top_k, n_group=n_group,
                          topk_group=topk_group, norm_topk_prob=True, routed_scaling_factor=2.5, num_hidden_layers=1)
    router = modeling.GlmMoeDsaTopkRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(e, 32))
        router.e_score_correction_bias.copy_(torch.randn(e) * 0.1)
    x = torch.randn(9, 32)
    logits, w_hf, ids_hf = router(x)
    for impl in (ref.moe_route, moe.moe_route):
        w, ids = impl(logits, router.e_score_correction_bias, top_k, n_group, topk_group, True, 2.5)
        o_hf, o = ids_hf.argsort(dim=1), ids.long().argsort(dim=1)
        assert torch.equal(ids_hf.gather(1, o_hf), ids.long().gather(1, o))
        torch.testing.assert_close(w_hf.gather(1, o_hf), w.gather(1, o), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------- MoE
def _moe_case(t, e, k, inter, h, seed, pad_ids=True):
    """Routed experts; w13's scales are the gate's ceil(I/128) block rows, then the up half's."""
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(e, 2 * inter, h, generator=g) * 0.5).to(FP8)
    s13 = torch.rand(e, 2 * -(-inter // 128), -(-h // 128), generator=g) * 0.02 + 0.005
    g = torch.Generator().manual_seed(seed)
    w2, s2 = _weight(h, inter, seed + 1, (e,))
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).int()
    if pad_ids:
        ids[0, -1] = -1  # expert-parallel padding is skipped
    tw = torch.rand(t, k, generator=g)
    return ids, tw, w13, s13, w2, s2


@given(t=st.integers(1, 24), e=st.integers(4, 16), k=st.integers(1, 4), inter=st.sampled_from([128, 256]),
       act_quant=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]), fused_quant=st.booleans(),
       split2=st.integers(1, 2), split1=st.integers(1, 2), seed=st.integers(0, 2**16))
def test_moe_fp8_matches_reference(t, e, k, inter, act_quant, dtype, fused_quant, split2, split1, seed):
    ids, tw, w13, s13, w2, s2 = _moe_case(t, e, k, inter, 256, seed)
    x = torch.randn(t, 256, generator=torch.Generator().manual_seed(seed + 2)).to(dtype)
    cfg = dict(fused_quant=fused_quant, SPLIT2=split2, SPLIT1=split1)
    out = moe.moe_fp8(x, ids, tw, w13, s13, w2, s2, act_quant, config=cfg)
    assert out.shape == (t, 256) and out.dtype == dtype
    assert _rel(out, ref.moe_fp8(x, ids, tw, w13, s13, w2, s2, act_quant)) < _tol(dtype, act_quant)


@given(t=st.integers(1, 24), e=st.integers(4, 16), k=st.integers(1, 4), inter=PARTIAL, h=PARTIAL,
       act_quant=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]), fused_quant=st.booleans(),
       split2=st.integers(1, 3), split1=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_moe_fp8_partial_blocks(t, e, k, inter, h, act_quant, dtype, fused_quant, split2, split1, seed):
    """I and H tails: gate and up halves with short blocks of their own, K tails of both GEMMs (the
    intermediate's last 1x128 group cut short), an N tail of the down projection."""
    ids, tw, w13, s13, w2, s2 = _moe_case(t, e, k, inter, h, seed)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(seed + 2)).to(dtype)
    cfg = dict(fused_quant=fused_quant, SPLIT2=split2, SPLIT1=split1)
    out = moe.moe_fp8(x, ids, tw, w13, s13, w2, s2, act_quant, config=cfg)
    assert out.shape == (t, h)
    assert _rel(out, ref.moe_fp8(x, ids, tw, w13, s13, w2, s2, act_quant)) < _tol(dtype, act_quant)


@pytest.mark.parametrize("inter,h", [(128, 256), (24, 200), (200, 136)])
def test_moe_reference_vs_naive_loop(inter, h):
    """Reference moe_fp8 against a plain per-token, per-slot loop over dequantized experts, the gate and
    the up half dequantized as the separate weights the checkpoint holds."""
    t, e, k = 6, 5, 3
    ib = -(-inter // 128)
    ids, tw, w13, s13, w2, s2 = _moe_case(t, e, k, inter, h, 7)
    x = torch.randn(t, h)
    for act_quant in (False, True):
        want = torch.zeros(t, h)
        for i in range(t):
            xi = ref.fake_quant_act_1x128(x[i:i + 1]) if act_quant else x[i:i + 1]
            for j in range(k):
                ex = int(ids[i, j])
                if ex < 0:
                    continue
                gate = xi @ ref.dequantize_block_fp8(w13[ex, :inter], s13[ex, :ib]).T
                up = xi @ ref.dequantize_block_fp8(w13[ex, inter:], s13[ex, ib:]).T
                hm = torch.nn.functional.silu(gate) * up
                hm = ref.fake_quant_act_1x128(hm) if act_quant else hm
                want[i] += tw[i, j] * (hm @ ref.dequantize_block_fp8(w2[ex], s2[ex]).T)[0]
        torch.testing.assert_close(ref.moe_fp8(x, ids, tw, w13, s13, w2, s2, act_quant), want, rtol=1e-5, atol=1e-5)


def _launched(monkeypatch):
    """The names of the Triton kernels launched (interpreted), in launch order."""
    from triton.runtime.interpreter import InterpretedFunction

    names, run = [], InterpretedFunction.run

    def spy(self, *args, **kwargs):
        names.append(self.fn.__name__)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", spy)
    return names


RAGGED_IDS = [[0, 1, 2], [0, 1, 3], [0, 5, 1], [0, 2, -1], [-1, -1, -1], [5, 0, 3], [1, 0, -1]]  # expert 4: none


GEMMS_AND_COMBINE = ["_moe_gemm_kernel", "_moe_gemm_kernel", "_combine_kernel"]
GEMMS = ["_moe_gemm_kernel", "_moe_gemm_kernel"]  # up to BLOCK_M tokens the down launch combines


@pytest.mark.parametrize("scan", [True, False])
@pytest.mark.parametrize("act_quant,dtype,split1", [(True, torch.bfloat16, 3), (False, torch.float32, 2)])
def test_moe_fp8_split_gate_up_reduced_by_its_last_split(monkeypatch, act_quant, dtype, split1, scan):
    """SPLIT1 > 1: the gate|up GEMM's last split CTA of each (block, column tile) sums the partials and applies the
    gate, so a call launches the two GEMMs only where they scan the ids (the down launch combines), else the align
    kernel, the two GEMMs and the combine. Ragged expert loads, an expert no token picks, slots and a whole token routed to no local expert (-1,
    expert parallelism); the counters end at zero."""
    t, e, k, inter, h = 7, 6, 3, 256, 384
    _, tw, w13, s13, w2, s2 = _moe_case(t, e, k, inter, h, 11)
    ids = torch.tensor(RAGGED_IDS, dtype=torch.int32)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(12)).to(dtype)
    splits, grouped = [], moe._grouped

    def spy(*args, **kwargs):  # (gated, the splits it ran) of each grouped GEMM
        splits.append((args[9], grouped(*args, **kwargs)))
        return splits[-1][1]

    monkeypatch.setattr(moe, "_grouped", spy)
    names = _launched(monkeypatch)
    out = moe.moe_fp8(x, ids, tw, w13, s13, w2, s2, act_quant, config=dict(SPLIT1=split1, scan=scan))
    assert names == (GEMMS if scan else ["_align_kernel"] + GEMMS_AND_COMBINE)
    assert splits[0] == (True, split1)  # the gated GEMM really was split
    want = ref.moe_fp8(x, ids, tw, w13, s13, w2, s2, act_quant)
    assert _rel(out, want) < _tol(dtype, act_quant)
    assert torch.equal(out[4], torch.zeros(h, dtype=dtype))  # no local expert: nothing routed
    assert int(fp8_parts._COUNTERS[("cpu", None)].abs().sum()) == 0


def _scan_case_ids(t, seed):
    """[t, 3] ids over 6 experts: every token picks expert 0 (a full 16-row block at t = 16), two of experts 1-4 in
    a ragged mix, never expert 5; token 0's last slot and, past t = 1, token 1's two last go to no local expert."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.cat([torch.zeros(1, dtype=torch.long), torch.randperm(4, generator=g)[:2] + 1])
                       for _ in range(t)]).int()
    ids[0, -1] = -1
    ids[1:2, 1:] = -1
    return ids


@pytest.mark.parametrize("t", [1, 5, 16, 17])  # BLOCK_M = 16: the scan up to it, the align kernel at 17
@pytest.mark.parametrize("act_quant,dtype,split1,fused_quant", [
    (True, torch.bfloat16, 2, True), (False, torch.float32, 1, True), (True, torch.float32, 3, False),
    (False, torch.bfloat16, 2, True), (True, torch.bfloat16, 1, True)])
def test_moe_fp8_scan_finds_the_align_layout(monkeypatch, t, act_quant, dtype, split1, fused_quant):
    """Up to BLOCK_M tokens the GEMMs find their blocks from the ids and no align kernel runs (gate|up and down, which
    combines, are the launches); each CTA finds the align kernel's layout (the b-th picked expert in id order, its
    entries in entry order), so the result is the align path's bit for bit, and the reference's value. Above
    BLOCK_M tokens the align kernel runs. Ragged loads, an expert no token picks, -1 slots, a full block at t = 16."""
    e, k, inter, h = 6, 3, 128, 256
    _, _, w13, s13, w2, s2 = _moe_case(1, e, k, inter, h, 21)
    ids = _scan_case_ids(t, t)
    tw = torch.rand(t, k, generator=torch.Generator().manual_seed(22))
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(23)).to(dtype)
    cfg = dict(SPLIT1=split1, fused_quant=fused_quant)
    assert moe.pick_moe_config(t, k, e, cfg)["BLOCK_M"] == 16
    gated, grouped = [], moe._grouped

    def spy(*args, **kwargs):  # the gated GEMM's output rows [blocks * BLOCK_M, I] (``h`` where split, else ``c``)
        if args[9]:
            gated.append(args[13] if len(args) > 13 else args[6])
        return grouped(*args, **kwargs)

    monkeypatch.setattr(moe, "_grouped", spy)
    launched = _launched(monkeypatch)
    quants = 2 if act_quant and not fused_quant else 0  # without fused_quant, each GEMM's A is quantized first

    def kernels(calls):  # the launches of the first ``calls`` MoE calls, less the quantizations (counted)
        names = [n for n in launched if n != "_quant_kernel"]
        assert len(launched) - len(names) == quants * calls
        return names

    out = moe.moe_fp8(x, ids, tw, w13, s13, w2, s2, act_quant, config=cfg)
    assert kernels(1) == (GEMMS if t <= 16 else ["_align_kernel"] + GEMMS_AND_COMBINE)
    assert _rel(out, ref.moe_fp8(x, ids, tw, w13, s13, w2, s2, act_quant)) < _tol(dtype, act_quant)
    if t <= 16:
        aligned = moe.moe_fp8(x, ids, tw, w13, s13, w2, s2, act_quant, config=dict(cfg, scan=False))
        assert kernels(2)[2:] == ["_align_kernel"] + GEMMS_AND_COMBINE
        assert torch.equal(out, aligned)
        rows = (moe.align_by_expert(ids, e, 16)[0] < t * k).nonzero().flatten()  # the align layout's real rows
        assert torch.equal(gated[0][rows], gated[1][rows])  # every entry's gate|up output at the same row


@pytest.mark.parametrize("block_m", [16, 64])
def test_align_by_expert(block_m):
    """Triton and torch alignment agree; every block holds one expert; every valid entry appears once."""
    e, t, k = 6, 11, 3
    ids = torch.randint(-1, e, (t, k), generator=torch.Generator().manual_seed(block_m)).int()
    s1, b1 = moe.align_by_expert(ids, e, block_m, use_triton=True)
    s2, b2 = moe.align_by_expert(ids, e, block_m, use_triton=False)
    assert torch.equal(s1, s2) and torch.equal(b1, b2)
    flat = ids.reshape(-1)
    real = s1[s1 < t * k].long()
    assert sorted(real.tolist()) == (flat >= 0).nonzero().flatten().tolist()
    for blk, ex in enumerate(b1.tolist()):
        rows = s1[blk * block_m:(blk + 1) * block_m]
        rows = rows[rows < t * k].long()
        if ex < 0:
            assert rows.numel() == 0
        else:
            assert (flat[rows] == ex).all()


# ------------------------------------------------------------------------------------ bad inputs
def _lin_args(**over):
    w, s = _weight(192, 320, 0)
    args = dict(x=torch.randn(2, 320), weight=w, weight_scale_inv=s, bias=None, act_quant=True)
    args.update(over)
    return args


def _moe_args(**over):
    ids, tw, w13, s13, w2, s2 = _moe_case(3, 4, 2, 128, 256, 0, pad_ids=False)
    args = dict(x=torch.randn(3, 256), topk_ids=ids, topk_weights=tw, w13=w13, w13_scale=s13, w2=w2, w2_scale=s2)
    args.update(over)
    return args


BAD_INPUTS = [
    ("quantize", lambda f: f(torch.ones(2, 128, dtype=torch.int32)), "x: dtype"),
    ("quantize", lambda f: f(torch.randn(2, 2, 128)), "x: expected 2 dims"),
    ("linear", lambda f: f(**_lin_args(weight=torch.randn(192, 320))), "weight: dtype"),
    ("linear", lambda f: f(**_lin_args(weight_scale_inv=torch.rand(2, 2))), "weight_scale: shape"),
    ("linear", lambda f: f(**_lin_args(x=torch.randn(2, 256))), "x: last dim 256"),
    ("linear", lambda f: f(**_lin_args(bias=torch.randn(7))), "bias: shape"),
    ("route", lambda f: f(torch.randn(3, 8).bfloat16(), torch.zeros(8), 2, 1, 1, True, 1.0), "router_logits: dtype"),
    ("route", lambda f: f(torch.randn(3, 8), torch.zeros(7), 2, 1, 1, True, 1.0), "correction_bias: shape"),
    ("route", lambda f: f(torch.randn(3, 8), torch.zeros(8), 9, 1, 1, True, 1.0), "top_k: 9"),
    ("route", lambda f: f(torch.randn(3, 8), torch.zeros(8), 2, 3, 1, True, 1.0), "n_group: 3"),
    ("moe", lambda f: f(**_moe_args(topk_ids=torch.full((3, 2), 4, dtype=torch.int32))), "topk_ids: values must be in [-1, 4)"),
    ("moe", lambda f: f(**_moe_args(topk_ids=torch.full((3, 2), -2, dtype=torch.int32))), "topk_ids: values must be in [-1, 4)"),
    ("moe", lambda f: f(**_moe_args(topk_ids=torch.zeros(3, 2))), "topk_ids: dtype"),
    ("moe", lambda f: f(**_moe_args(topk_weights=torch.rand(3, 3))), "topk_weights: shape"),
    ("moe", lambda f: f(**_moe_args(x=torch.randn(3, 128))), "w13: hidden dim"),
    ("moe", lambda f: f(**_moe_args(w2=torch.zeros(4, 256, 256, dtype=FP8))), "w2"),
    ("moe", lambda f: f(**_moe_args(w13_scale=torch.rand(4, 1, 2))), "w13_scale: shape"),
    ("moe", lambda f: f(**_moe_args(w13=torch.zeros(4, 256, 256))), "w13: dtype"),
]
IMPLS = {
    "quantize": (ref.quantize_act_1x128, fp8_gemm.quantize_act_1x128),
    "linear": (ref.fp8_linear, fp8_gemm.fp8_linear),
    "route": (ref.moe_route, moe.moe_route),
    "moe": (ref.moe_fp8, moe.moe_fp8),
}


@pytest.mark.parametrize("impl", [0, 1], ids=["reference", "triton"])
@pytest.mark.parametrize("kind,call,message", BAD_INPUTS, ids=[f"{b[0]}-{b[2][:24]}" for b in BAD_INPUTS])
def test_bad_inputs(kind, call, message, impl):
    with pytest.raises(InputError) as err:
        call(IMPLS[kind][impl])
    assert message in str(err.value)


def test_dequantize_bad_scale():
    w, s = _weight(192, 320, 0)
    with pytest.raises(InputError, match="w_scale: shape"):
        ref.dequantize_block_fp8(w, s[:1])
