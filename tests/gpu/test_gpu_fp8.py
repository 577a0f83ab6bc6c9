"""Triton block-FP8 GEMM and FP8 MoE at full GLM-5 shapes on the GPU, against the fp32 torch reference;
also at GLM-5-like widths that are not multiples of 128 (short edge blocks: masked K tails, N tails, the
MoE's gate / up halves with their own short blocks), and a tiny model of such widths end to end."""

import pytest
import torch

pytestmark = pytest.mark.gpu

SHAPES = {  # N x K of every FP8 linear in GLM-5
    "q_a": (2048, 6144),
    "q_b": (16384, 2048),
    "kv_a": (576, 6144),
    "kv_b": (28672, 512),
    "o_proj": (6144, 16384),
    "idx_wq_b": (4096, 2048),
    "idx_wk": (128, 6144),
    "dense_gate": (12288, 6144),
    "dense_gate_up": (24576, 6144),
    "dense_down": (6144, 12288),
    "expert_gate": (2048, 6144),
    "expert_down": (6144, 2048),
}
PARTIAL_SHAPES = {  # GLM-5-like widths with a short last block along K, N or both
    "partial_k": (2048, 6144 + 64),
    "partial_n": (6144 + 64, 2048),
    "partial_nk": (6144 + 64, 2048 - 64),
    "partial_expert_down": (6144, 2048 - 64),
    "partial_small_n": (576 + 24, 6144 + 64),
}
ALL_SHAPES = {**SHAPES, **PARTIAL_SHAPES}


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _weight(n, k, gen):
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.5).to(torch.float8_e4m3fn)
    s = torch.rand(-(-n // 128), -(-k // 128), device="cuda", generator=gen) * 0.02 + 0.005
    return w, s


@pytest.fixture(scope="module")
def gen():
    return torch.Generator(device="cuda").manual_seed(0)


@pytest.mark.parametrize("m", [1, 16, 64, 300, 4096])
@pytest.mark.parametrize("name", list(ALL_SHAPES))
def test_fp8_linear_glm5_shapes(name, m, gen):
    from fxglm5.lowering.reference.fp8 import fp8_linear as ref
    from fxglm5.lowering.triton.fp8_gemm import fp8_linear

    n, k = ALL_SHAPES[name]
    w, s = _weight(n, k, gen)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    for act_quant in (True, False):
        out = fp8_linear(x, w, s, None, act_quant)
        assert out.shape == (m, n) and out.dtype == torch.bfloat16
        err = _rel(out, ref(x.float(), w, s, None, act_quant))
        assert err < 1e-2, (name, m, act_quant, err)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("name", list(ALL_SHAPES))
def test_fp8_gemv_glm5_shapes(name, m, gen):
    """The decode GEMV (fp8_gemv.py) at GLM-5's shapes, both product paths (FMA up to 4 rows, MMA above), W8A8 and
    W8A16, a bias, split over K as the one-wave plan splits it on this GPU; its split-K counters end at zero."""
    from fxglm5.lowering.reference.fp8 import fp8_linear as ref
    from fxglm5.lowering.triton import fp8_parts
    from fxglm5.lowering.triton.fp8_gemm import fp8_linear

    n, k = ALL_SHAPES[name]
    w, s = _weight(n, k, gen)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    b = torch.randn(n, device="cuda", generator=gen).bfloat16()
    for act_quant in (True, False):
        out = fp8_linear(x, w, s, b, act_quant, config=dict(kernel="gemv"))
        assert out.shape == (m, n) and out.dtype == torch.bfloat16
        err = _rel(out, ref(x.float(), w, s, b.float(), act_quant))
        assert err < 1e-2, (name, m, act_quant, err)
    torch.cuda.synchronize()
    counters = fp8_parts._COUNTERS.get(("cuda", x.device.index))
    assert counters is None or int(counters.abs().sum()) == 0


@pytest.mark.parametrize("name", ["kv_a", "o_proj", "partial_nk", "partial_small_n"])
def test_fp8_linear_fp32_exact(name):
    """fp32 activations: IEEE fp32 dot, only the accumulation order differs. W8A8 also has rare fp8 rounding
    ties (the kernel divides by the scale through a reciprocal + one FMA correction): one activation landing on
    the other side of a tie moves by one e4m3 step (2**-3 of its value), about 1e-4 of a 16k-wide row's norm
    each, so that bound is 5e-4 (a wrong block scale or a missed K tail costs 1e-2 and more). Own generator per
    shape: the data does not depend on which tests ran before (the module's shared one made o_proj's W8A8 check
    land on 1.3e-4 once the partial shapes were added ahead of it)."""
    from fxglm5.lowering.reference.fp8 import fp8_linear as ref
    from fxglm5.lowering.triton.fp8_gemm import fp8_linear

    gen = torch.Generator(device="cuda").manual_seed(sorted(ALL_SHAPES).index(name))
    n, k = ALL_SHAPES[name]
    w, s = _weight(n, k, gen)
    b = torch.randn(n, device="cuda", generator=gen)
    x = torch.randn(16, k, device="cuda", generator=gen)
    assert _rel(fp8_linear(x, w, s, b, False), ref(x, w, s, b, False)) < 1e-5
    assert _rel(fp8_linear(x, w, s, b, True), ref(x, w, s, b, True)) < 5e-4


@pytest.mark.parametrize("fixup", [False, True])
def test_fp8_linear_split_k_graph_replay(fixup, gen):
    """Decode split-K, with the reduce kernel or the in-kernel last-CTA fixup, replayed from a CUDA graph
    (the fixup's tile counters must be back at zero after every call)."""
    from fxglm5.lowering.reference.fp8 import fp8_linear as ref
    from fxglm5.lowering.triton.fp8_gemm import fp8_linear

    n, k = SHAPES["o_proj"]
    w, s = _weight(n, k, gen)
    b = torch.randn(n, device="cuda", generator=gen).bfloat16()
    x = torch.randn(3, k, device="cuda", generator=gen).bfloat16()
    cfg = dict(FIXUP=fixup, SPLIT_K=8)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fp8_linear(x, w, s, b, True, config=cfg)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_linear(x, w, s, b, True, config=cfg)
    for _ in range(3):
        x.copy_(torch.randn(3, k, device="cuda", generator=gen).bfloat16())
        graph.replay()
        assert _rel(out, ref(x.float(), w, s, b, True)) < 1e-2


def test_fp8_linear_past_int32_offsets(gen):
    """The fused q_b|wq_b GEMM of a 131072-token prefill step: M x N = 131072 x 16384 = 2^31 elements, past the
    kernel's int32 offsets (an illegal memory access before fp8_gemm.row_chunk): row chunks, each row right."""
    from fxglm5.lowering.reference.fp8 import fp8_linear as ref
    from fxglm5.lowering.triton.fp8_gemm import fp8_linear

    m, (n, k) = 131072, (16384, 2048)
    w, s = _weight(n, k, gen)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    out = fp8_linear(x, w, s, None, True)
    torch.cuda.synchronize()
    for rows in (slice(0, 64), slice(m // 2 - 32, m // 2 + 32), slice(m - 64, m)):  # ends and the chunk boundary
        assert _rel(out[rows], ref(x[rows].float(), w, s, None, True)) < 1e-2, rows


GLUON_SHAPES = ["o_proj", "dense_gate_up", "dense_down", "q_b", "q_a", "kv_a", "idx_wk", "kv_b"]


@pytest.mark.parametrize("ws", [{}, dict(WS=False), dict(STAGES=5)], ids=["default", "nows", "ws5"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("m", [4096, 777])
@pytest.mark.parametrize("name", GLUON_SHAPES)
def test_gluon_hopper_gemm_glm5_shapes(name, m, bias, ws, gen):
    """The Gluon Hopper prefill GEMM (what fp8_linear takes at M > 512 on an H200) against the reference op and
    the Triton kernel of the same call, at full GLM-5 shapes, ragged M (777: a partial 128-row tile) and narrow
    ragged N (kv_a 576, the indexer's 128), with and without bias; fp16 activations at one shape. ``ws``: the
    default config (warp-specialized, 128-row tiles at every width, so the narrow shapes check its ragged N), the
    kernel without warp specialization (64-row tiles where N <= 1024), or a 5-stage ring."""
    from fxglm5.lowering.reference.fp8 import fp8_linear as ref
    from fxglm5.lowering.triton import fp8_gemm_hopper
    from fxglm5.lowering.triton.fp8_gemm import fp8_linear

    n, k = SHAPES[name]
    if ws.get("WS") is False and n <= 1024:  # the non-WS kernel's 64-row tiles (the WS default covers 128 rows)
        ws = {**ws, "BLOCK_M": 64}
    w, s = _weight(n, k, gen)
    for dtype in (torch.bfloat16, torch.float16) if name == "kv_a" else (torch.bfloat16,):
        x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
        b = torch.randn(n, device="cuda", generator=gen).to(dtype) if bias else None
        assert fp8_gemm_hopper.supported(x, w, True)
        out = fp8_linear(x, w, s, b, True, config=dict(kernel="gluon", **ws))
        assert out.shape == (m, n) and out.dtype == dtype
        tri = fp8_linear(x, w, s, b, True, config={"kernel": "triton"})
        want = ref(x.float(), w, s, None if b is None else b.float(), True)
        assert _rel(out, want) < 1e-2, (name, m, dtype, _rel(out, want))
        assert _rel(out, tri) < 1e-2, (name, m, dtype, _rel(out, tri))
        # without "kernel": the default choice takes it, deterministically
        assert torch.equal(fp8_linear(x, w, s, b, True, config=ws or None), out)


def test_gluon_hopper_gemm_is_not_taken_where_it_does_not_apply(gen):
    """Decode / medium M, the W8A16 path, fp32 activations and a K that is not a multiple of 512 take the Triton
    kernel; forcing the Gluon kernel there is a clear error."""
    from fxglm5.lowering.triton import fp8_gemm_hopper
    from fxglm5.lowering.triton.fp8_gemm import fp8_linear

    w, s = _weight(*SHAPES["q_a"], gen)
    x = torch.randn(4096, 6144, device="cuda", generator=gen).bfloat16()
    assert fp8_gemm_hopper.supported(x, w, True)
    assert not fp8_gemm_hopper.supported(x[:512], w, True)
    assert not fp8_gemm_hopper.supported(x, w, False)
    assert not fp8_gemm_hopper.supported(x.float(), w, True)
    w2, s2 = _weight(*PARTIAL_SHAPES["partial_k"], gen)
    assert not fp8_gemm_hopper.supported(torch.zeros(4096, w2.shape[1], device="cuda").bfloat16(), w2, True)
    with pytest.raises(ValueError, match="does not serve these inputs"):
        fp8_linear(x[:64], w, s, None, True, config={"kernel": "gluon"})


@pytest.fixture(scope="module", params=[(6144, 2048), (6144 + 64, 2048 - 64)], ids=["glm5", "partial"])
def experts(request):
    """256 experts of hidden H, intermediate I; w13's scales: the gate half's ceil(I/128) block rows, then
    the up half's (the per-expert checkpoint scales stacked)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    e, (h, inter) = 256, request.param
    ib, hb = -(-inter // 128), -(-h // 128)
    w13 = torch.empty(e, 2 * inter, h, dtype=torch.float8_e4m3fn, device="cuda")
    w2 = torch.empty(e, h, inter, dtype=torch.float8_e4m3fn, device="cuda")
    for i in range(e):
        w13[i] = (torch.randn(2 * inter, h, device="cuda", generator=g) * 0.5).to(torch.float8_e4m3fn)
        w2[i] = (torch.randn(h, inter, device="cuda", generator=g) * 0.5).to(torch.float8_e4m3fn)
    s13 = torch.rand(e, 2 * ib, hb, device="cuda", generator=g) * 0.01 + 0.002
    s2 = torch.rand(e, hb, ib, device="cuda", generator=g) * 0.01 + 0.002
    return w13, s13, w2, s2


@pytest.mark.parametrize("t", [1, 64, 2048])
def test_moe_glm5(t, experts):
    from fxglm5.lowering.reference import fp8 as ref
    from fxglm5.lowering.triton import moe

    w13, s13, w2, s2 = experts
    h = w2.shape[1]
    g = torch.Generator(device="cuda").manual_seed(t)
    logits = torch.randn(t, 256, device="cuda", generator=g)
    bias = torch.randn(256, device="cuda", generator=g) * 0.05
    w, ids = moe.moe_route(logits, bias, 8, 1, 1, True, 2.5)
    wr, idr = ref.moe_route(logits, bias, 8, 1, 1, True, 2.5)
    assert torch.equal(ids, idr) and _rel(w, wr) < 1e-5
    x = torch.randn(t, h, device="cuda", generator=g).bfloat16()
    for act_quant in (True, False):
        out = moe.moe_fp8(x, ids, w, w13, s13, w2, s2, act_quant)
        err = _rel(out, ref.moe_fp8(x.float(), ids, w, w13, s13, w2, s2, act_quant))
        assert err < 2e-2, (t, act_quant, err)
    x32 = torch.randn(min(t, 64), h, device="cuda", generator=g)  # fp32: the same math up to summation order
    ids, w = ids[: x32.shape[0]], w[: x32.shape[0]]
    assert _rel(moe.moe_fp8(x32, ids, w, w13, s13, w2, s2, False), ref.moe_fp8(x32, ids, w, w13, s13, w2, s2, False)) < 1e-5


def test_moe_past_int32_offsets(experts):
    """65536 tokens x top-8: the [SPLIT2, T*k, H] partials hold 3.2e9 elements, the padded gate|up rows x 2I 2^31:
    past the kernels' int32 offsets, so the tokens run in chunks; each token's output right."""
    from fxglm5.lowering.reference import fp8 as ref
    from fxglm5.lowering.triton import moe

    w13, s13, w2, s2 = experts
    t, h = 65536, w2.shape[1]
    g = torch.Generator(device="cuda").manual_seed(2)
    w, ids = moe.moe_route(torch.randn(t, 256, device="cuda", generator=g), torch.zeros(256, device="cuda"), 8, 1, 1,
                           True, 2.5)
    x = torch.randn(t, h, device="cuda", generator=g).bfloat16()
    out = moe.moe_fp8(x, ids, w, w13, s13, w2, s2, True)
    torch.cuda.synchronize()
    for rows in (slice(0, 64), slice(t - 64, t)):
        assert _rel(out[rows], ref.moe_fp8(x[rows].float(), ids[rows], w[rows], w13, s13, w2, s2, True)) < 2e-2, rows


def test_moe_graph_capture(experts):
    """Decode MoE (route + experts) replays from a CUDA graph with new inputs copied in."""
    from fxglm5.lowering.reference import fp8 as ref
    from fxglm5.lowering.triton import moe

    w13, s13, w2, s2 = experts
    h = w2.shape[1]
    x = torch.randn(4, h, device="cuda").bfloat16()
    logits = torch.randn(4, 256, device="cuda")
    bias = torch.zeros(256, device="cuda")

    def step():
        w, ids = moe.moe_route(logits, bias, 8, 1, 1, True, 2.5)
        return moe.moe_fp8(x, ids, w, w13, s13, w2, s2, True)

    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    x.copy_(torch.randn(4, h, device="cuda").bfloat16())
    logits.copy_(torch.randn(4, 256, device="cuda"))
    graph.replay()
    w, ids = ref.moe_route(logits, bias, 8, 1, 1, True, 2.5)
    assert _rel(out, ref.moe_fp8(x.float(), ids, w, w13, s13, w2, s2, True)) < 2e-2


def test_odd_width_model_triton_same_tokens_as_reference():
    """A tiny model whose every FP8 weight has short blocks (hidden 200, intermediate 40, moe 24) through
    the paged runtime: compiled Triton kernels (decode replayed from CUDA graphs) give the reference's tokens."""
    from fxglm5.model.config import Glm5Config
    from fxglm5.runtime.runner import Runner
    from tests.helpers import random_model

    cfg = Glm5Config.preset("tiny").replace(hidden_size=200, intermediate_size=40, moe_intermediate_size=24)
    model = random_model(cfg, torch.float32).cuda()
    prompts = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43], [7, 1, 8]]
    outputs = {}
    for backend in ("reference", "triton"):
        runner = Runner(model, kv_cache="bf16", block_size=16, dtype=torch.float32, max_cache_tokens=256,
                        device="cuda", backend=backend)
        assert runner.pass_results[-1].details["backends"].startswith(backend)
        outputs[backend] = runner.generate(prompts, 16)
    assert outputs["triton"] == outputs["reference"]
