"""The fuse_kernels stage's Triton kernels at GLM-5's per-rank shapes (TP8 / EP8) on the GPU, against the torch
references: add_rms_norm at 6144, alone and in the A loads of the decode GEMMs that read it (the attention's
q_a | kv_a | wk, a dense MLP's gate | up: add_rms_norm_fp8_linear, also replayed from a CUDA graph), the router's and
the indexer head weights' f32_linear (its 3xTF32 GEMM against
float64 too), moe_route_local over a rank's 32 of 256 experts, the router's GEMV and routing in one launch
(moe_router, also replayed from a CUDA graph), and the gated down GEMMs (dense MLP 1536, shared expert 256
intermediate features per rank) on the decode path and the prefill path, also replayed from a CUDA graph (the
split-K counters reset), and a rank's routed experts at decode batches, their split gate|up GEMM reduced by its last
split CTAs, from a graph, alone and with the rank's shared expert run inside their launches (moe_fp8_shared), and
the combine run by the down launch (each token's output tile by the CTA whose ticket completes it) against the
combine kernel after the align kernel's layout, and the router run as the first tasks of the gate|up launch
(moe_router_fp8_shared) against the router's own launch followed by the MoE's, with the residual add and norm
before it as the first tasks of that launch (add_rms_norm_moe_router_fp8_shared) against add_rms_norm's kernel, the
router's launch and the MoE's, and the latent query run as the last
tasks of the q_b | wq_b GEMM's launch (fp8_linear_latent_query) against the GEMM's launch followed by the latent
query's, also replayed from a CUDA graph, and the DSA indexer run as the tasks after those
(fp8_linear_latent_query_indexer) against that launch followed by the indexer's, at 2k and 8k contexts, also replayed
from a CUDA graph."""

import pytest
import torch

from fxglm5.lowering.reference import fp8 as ref_fp8
from fxglm5.lowering.reference import fused as ref
from fxglm5.lowering.triton import f32_linear, fp8_gemm, fp8_parts, moe, norm_rope, tasks
from tests.helpers import tf32_rounded

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("all_decode_joins")]  # the joined kernels (opt-in)
ROWS = [1, 8, 64, 4096]


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("rows", ROWS)
def test_add_rms_norm(rows):
    g = torch.Generator(device="cuda").manual_seed(rows)
    x, r = (torch.randn(rows, 6144, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    w = (1 + 0.1 * torch.randn(6144, device="cuda", generator=g)).to(torch.bfloat16)
    (normed, total), (want_normed, want_total) = norm_rope.add_rms_norm(x, r, w, 1e-5), ref.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(total, want_total)
    assert _rel(normed, want_normed) < 5e-3


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n, scales", [(256, []), (32, [32 ** -0.5, 128 ** -0.5])], ids=["router", "index_weights"])
def test_f32_linear(rows, n, scales):
    g = torch.Generator(device="cuda").manual_seed(rows + n)
    x = torch.randn(rows, 6144, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(n, 6144, device="cuda", generator=g) / 6144 ** 0.5
    assert _rel(f32_linear.f32_linear(x, w, scales), ref.f32_linear(x, w, scales)) < 1e-5


@pytest.mark.parametrize("rows", [r for r in ROWS if r > f32_linear.MAX_GEMV_ROWS])
@pytest.mark.parametrize("n, scales", [(256, []), (32, [32 ** -0.5, 128 ** -0.5])], ids=["router", "index_weights"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_f32_linear_gemm_is_float32_class(monkeypatch, rows, n, scales, dtype):
    """Past MAX_GEMV_ROWS the 3xTF32 tensor-core GEMM runs (64 rows: K split over CTAs) and is float32-class: as
    close to float64 as cuBLAS's float32 GEMM, within a factor 2 (at least 1e-6: both are about 1e-7 to 1e-6 off at
    K = 6144, from the order of their float32 sums). One TF32 MMA is not: the same kernel on TF32-rounded weights
    (what a TF32 dot reads of them; a bf16 x is exact in TF32) is about 1e-4 off, over ten times the bound, and with
    a float32 x only the x split keeps the result in it."""
    launched = []
    config = f32_linear.gemm_config
    monkeypatch.setattr(f32_linear, "gemm_config", lambda *a: launched.append(config(*a)) or launched[-1])
    g = torch.Generator(device="cuda").manual_seed(rows + n)
    x = torch.randn(rows, 6144, device="cuda", generator=g).to(dtype)
    w = torch.randn(n, 6144, device="cuda", generator=g) / 6144 ** 0.5
    exact = x.double() @ w.double().T
    for s in scales:
        exact = exact * s
    bound = max(1e-6, 2 * _rel(ref.f32_linear(x, w, scales).double(), exact))
    assert _rel(f32_linear.f32_linear(x, w, scales).double(), exact) < bound
    assert _rel(f32_linear.f32_linear(x, tf32_rounded(w), scales).double(), exact) > 10 * bound
    assert len(launched) == 2 and (rows > 64 or launched[0]["SPLIT"] > 1), launched


@pytest.mark.parametrize("rows", [1, 64])
def test_f32_linear_replays_from_a_cuda_graph(rows):
    """The GEMV (1 row) and the GEMM (64 rows), both with K split over CTAs: each replay's fix-up finds its tile
    counters reset by the last."""
    x, w = torch.randn(rows, 6144, device="cuda"), torch.randn(256, 6144, device="cuda")
    out = f32_linear.f32_linear(x, w, [0.5])  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = f32_linear.f32_linear(x, w, [0.5])
    for seed in range(3):
        x.copy_(torch.randn(rows, 6144, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)))
        graph.replay()
        assert _rel(out, ref.f32_linear(x, w, [0.5])) < 1e-5


@pytest.mark.parametrize("tokens", [1, 64, 4096])
@pytest.mark.parametrize("rank", [0, 7])
def test_moe_route_local(tokens, rank):
    g = torch.Generator(device="cuda").manual_seed(tokens)
    logits = torch.randn(tokens, 256, device="cuda", generator=g)
    bias = 0.01 * torch.randn(256, device="cuda", generator=g)
    offset = torch.tensor(32 * rank, dtype=torch.int32, device="cuda")
    weights, ids = moe.moe_route(logits, bias, 8, 1, 1, True, 2.5, offset, 32)
    want_weights, want_ids = ref.moe_route_local(logits, bias, 8, 1, 1, True, 2.5, offset, 32)
    assert torch.equal(ids, want_ids) and torch.allclose(weights, want_weights, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("tokens", [1, 8, 16])
@pytest.mark.parametrize("rank", [None, 7], ids=["global", "ep8_rank7"])
def test_moe_router_one_launch(tokens, rank):
    """GLM-5's router (6144 features -> 256 experts, top-8, n_group 1, renormalized, x 2.5) in one launch at decode
    batches, the ids global or local to EP8 rank 7's 32 experts: bit for bit the two launches (f32_linear's GEMV,
    then the route kernel), over several rows at once; the reference's ids and its weights within float32 rounding.
    Called twice back to back (the step's counter reset by the first call's last CTA), then replayed twice from a
    CUDA graph over new tokens: the eager bits every time, and every arrival counter back at 0."""
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, 6144, device="cuda", generator=g).bfloat16()
    w = torch.randn(256, 6144, device="cuda", generator=g) / 6144 ** 0.5
    bias = 0.01 * torch.randn(256, device="cuda", generator=g)
    offset = None if rank is None else torch.tensor(32 * rank, dtype=torch.int32, device="cuda")
    args = (bias, 8, 1, 1, True, 2.5, offset, 32)
    assert moe.router_fuses(tokens, 1)
    counters = fp8_parts.tile_counters(x.device, 1)

    def both():
        return moe.moe_router(x, w, *args), moe.moe_route(f32_linear.f32_linear(x, w, []), *args)

    for _ in range(2):
        (weights, ids), (want_weights, want_ids) = both()
        assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)
        assert int(counters.abs().sum()) == 0
    ref_weights, ref_ids = ref.moe_router(x, w, *args)
    assert torch.equal(ids, ref_ids) and torch.allclose(weights, ref_weights, rtol=1e-5, atol=1e-6)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        (weights, ids), (want_weights, want_ids) = both()
    for seed in range(2):
        x.copy_(torch.randn(tokens, 6144, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)
        assert torch.equal(ids, moe.moe_router(x, w, *args)[1]) and int(counters.abs().sum()) == 0


@pytest.mark.parametrize("rows", [1, 8, 64, 65, 2048])
@pytest.mark.parametrize("inter", [1536, 256], ids=["dense_down", "shared_down"])
@pytest.mark.parametrize("fixup", [False, True])
def test_silu_mul_fp8_linear(rows, inter, fixup):
    g = torch.Generator(device="cuda").manual_seed(rows + inter)
    both = torch.randn(rows, 2 * inter, device="cuda", generator=g).to(torch.bfloat16)
    gate, up = both[:, :inter], both[:, inter:]
    w = (torch.randn(6144, inter, device="cuda", generator=g) * 0.5).to(torch.float8_e4m3fn)
    s = torch.rand(48, -(-inter // 128), device="cuda", generator=g) * 0.02 + 0.005
    config = {"FIXUP": fixup}
    fused = fp8_gemm.fp8_linear(gate, w, s, None, False, up=up, config=config)
    unfused = fp8_gemm.fp8_linear(ref.silu_mul(gate, up), w, s, None, False, config=config)
    assert torch.equal(fused, unfused)
    assert _rel(fused, ref.silu_mul_fp8_linear(gate, up, w, s, None, False)) < 1e-2


NORMED_GEMMS = [(2752, True), (3072, False)]  # q_a | kv_a | wk (2048 + 576 + 128, the normed rows kept), gate | up


def _normed_gemm_inputs(rows, n, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x, r = (torch.randn(rows, 6144, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    nw = (1 + 0.1 * torch.randn(6144, device="cuda", generator=g)).to(torch.bfloat16)
    w = (torch.randn(n, 6144, device="cuda", generator=g) * 0.5).to(torch.float8_e4m3fn)
    s = torch.rand(-(-n // 128), 48, device="cuda", generator=g) * 0.01 + 0.002
    return x, r, nw, w, s


def _one_launch(monkeypatch):
    """add_rms_norm_fp8_linear may not fall back to add_rms_norm's kernel (the first of the launches it replaces)."""
    def fallback(*args, **kwargs):
        raise AssertionError("add_rms_norm_fp8_linear ran add_rms_norm's kernel: not the decode path")

    monkeypatch.setattr(fp8_gemm, "add_rms_norm", fallback)


def _assert_normed_close(normed, want, bound):
    """Normed rows against add_rms_norm's kernel's: at most ``bound`` of the values differ, each by one bf16 unit."""
    off = normed != want
    assert off.float().mean().item() <= bound
    assert ((normed.float() - want.float()).abs() <= want.float().abs() * 2 ** -7)[off].all()
    return off


@pytest.mark.parametrize("kernel", ["triton", "gemv"])
@pytest.mark.parametrize("act_quant", [False, True], ids=["w8a16", "w8a8"])
@pytest.mark.parametrize("rows", [1, 8, 16])
@pytest.mark.parametrize("n, keep_normed", NORMED_GEMMS, ids=["q_a_kv_a_wk", "dense_gate_up"])
def test_add_rms_norm_fp8_linear_against_its_two_launches(monkeypatch, n, keep_normed, rows, act_quant, kernel):
    """One TP8 rank's residual add + RMSNorm in the A loads of the GEMM that reads it (fxglm5::add_rms_norm_fp8_linear,
    one launch of the tiled kernel or the GEMV) against add_rms_norm's kernel then fp8_linear's: the sum bitwise; the
    normed rows equal but where the two kernels' sums of squares (in other orders) give factors an ulp apart and a
    value rounds differently for it (at most 1 in 1000 values, each one bf16 unit off); the output bitwise the same
    GEMM's of the fused op's own normed rows (its A operand), so bitwise the two launches' where the normed rows are
    equal, within 1e-2 where not; the reference op's value within 1e-2. Replayed from a CUDA graph on new rows: an
    eager call's bits each time, the split-K counters back at 0."""
    _one_launch(monkeypatch)
    x, r, nw, w, s = _normed_gemm_inputs(rows, n, rows + n)
    config = dict(kernel=kernel)

    def step():
        return fp8_gemm.add_rms_norm_fp8_linear(x, r, nw, 1e-5, w, s, None, act_quant, True, config=config)

    out, total, normed = step()
    want_normed, want_total = norm_rope.add_rms_norm(x, r, nw, 1e-5)
    want = fp8_gemm.fp8_linear(want_normed, w, s, None, act_quant, config=config)
    assert torch.equal(total, want_total)
    off = _assert_normed_close(normed, want_normed, 1e-3)
    assert torch.equal(out, fp8_gemm.fp8_linear(normed, w, s, None, act_quant, config=config))
    assert torch.equal(out, want) if not off.any() else _rel(out, want) < 1e-2
    reference = ref.add_rms_norm_fp8_linear(x, r, nw, 1e-5, w, s, None, act_quant, keep_normed)
    assert _rel(out, reference[0]) < 1e-2 and reference[2].shape[-1] == (6144 if keep_normed else 0)
    alone = fp8_gemm.add_rms_norm_fp8_linear(x, r, nw, 1e-5, w, s, None, act_quant, keep_normed, config=config)
    assert torch.equal(alone[0], out) and torch.equal(alone[1], total) and alone[2].shape == reference[2].shape
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for seed in range(2):
        new = _normed_gemm_inputs(rows, n, 100 + seed)
        x.copy_(new[0])
        r.copy_(new[1])
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(outs, step()))
        assert int(fp8_parts.tile_counters(x.device, 1).abs().sum()) == 0


@pytest.mark.parametrize("kernel", ["triton", "gemv"])
def test_add_rms_norm_in_the_gemm_differs_from_its_kernel_rarely(monkeypatch, kernel, capsys):
    """How often the normed rows (the GEMM's A operand) differ from add_rms_norm's kernel's on the GPU, whose
    reductions run in their own orders: 64 draws of 16 rows of 6144 bf16 values, at most 1 in 10000 values, each one
    bf16 unit off. The counts are printed for the record."""
    _one_launch(monkeypatch)
    values = values_off = rows_off = 0
    for seed in range(64):
        x, r, nw, w, s = _normed_gemm_inputs(16, 2752, 1000 + seed)
        normed = fp8_gemm.add_rms_norm_fp8_linear(x, r, nw, 1e-5, w, s, None, False, True,
                                                  config=dict(kernel=kernel))[2]
        off = _assert_normed_close(normed, norm_rope.add_rms_norm(x, r, nw, 1e-5)[0], 1e-3)
        values, values_off = values + off.numel(), values_off + int(off.sum())
        rows_off += int(off.any(1).sum())
    with capsys.disabled():
        print(f"\nadd_rms_norm in the {kernel} GEMM: {values_off} of {values} normed values, in {rows_off} of "
              f"{64 * 16} rows, differ from add_rms_norm's kernel's")
    assert values_off <= values * 1e-4


@pytest.mark.parametrize("tokens", [1, 8, 64, 2048])
def test_moe_fp8_add_is_the_routed_sum_then_the_shared_add(tokens):
    """moe_fp8 with the shared expert's output added in its combine kernel (fxglm5::moe_fp8_add) at a rank's 32 of
    256 experts (EP8, GLM-5 widths): bit for bit the unfused kernel followed by the add, and the reference op's value."""
    g = torch.Generator(device="cuda").manual_seed(tokens)
    experts, h, inter = 32, 6144, 2048
    w13 = (torch.randn(experts, 2 * inter, h, device="cuda", generator=g) * 0.5).to(torch.float8_e4m3fn)
    s13 = torch.rand(experts, 2 * inter // 128, h // 128, device="cuda", generator=g) * 0.02 + 0.005
    w2 = (torch.randn(experts, h, inter, device="cuda", generator=g) * 0.5).to(torch.float8_e4m3fn)
    s2 = torch.rand(experts, h // 128, inter // 128, device="cuda", generator=g) * 0.02 + 0.005
    x = torch.randn(tokens, h, device="cuda", generator=g).bfloat16()
    shared = torch.randn(tokens, h, device="cuda", generator=g).bfloat16()
    ids = (torch.rand(tokens, experts + 1, device="cuda", generator=g).topk(8).indices - 1).to(torch.int32)  # -1: remote
    weights = torch.rand(tokens, 8, device="cuda", generator=g)
    args = (x, ids, weights, w13, s13, w2, s2, True)
    fused = moe.moe_fp8(*args, addend=shared)
    assert torch.equal(fused, moe.moe_fp8(*args) + shared)
    assert _rel(fused, ref.moe_fp8_add(*args, shared)) < 1e-2


@pytest.fixture(scope="module")
def rank_experts():
    """A rank's 32 of GLM-5's 256 experts (EP8): w13 [32, 2x2048, 6144], w2 [32, 6144, 2048] e4m3, 128x128 scales."""
    g = torch.Generator(device="cuda").manual_seed(5)
    experts, h, inter = 32, 6144, 2048
    w13 = torch.empty(experts, 2 * inter, h, dtype=torch.float8_e4m3fn, device="cuda")
    w2 = torch.empty(experts, h, inter, dtype=torch.float8_e4m3fn, device="cuda")
    for i in range(experts):  # one expert at a time: the fp32 draws of all 32 would take 4.8 GB
        w13[i] = (torch.randn(2 * inter, h, device="cuda", generator=g) * 0.5).to(torch.float8_e4m3fn)
        w2[i] = (torch.randn(h, inter, device="cuda", generator=g) * 0.5).to(torch.float8_e4m3fn)
    s13 = torch.rand(experts, 2 * inter // 128, h // 128, device="cuda", generator=g) * 0.01 + 0.002
    s2 = torch.rand(experts, h // 128, inter // 128, device="cuda", generator=g) * 0.01 + 0.002
    return w13, s13, w2, s2


@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_moe_rank_decode_split_gate_up_replays_from_a_cuda_graph(tokens, rank_experts):
    """Route (ids local to rank 0's experts, -1 for the others) + routed experts at decode batches: the gate|up GEMM
    is split over K and its last split CTA of each tile applies the gate; at batches 1 and 8 (up to BLOCK_M tokens)
    the GEMMs find their rows from the ids (no align kernel), giving the align path's bits. Replayed twice from a
    CUDA graph: the same bits as the eager call both times (deterministic), the reference's value, and every arrival
    counter back at 0."""
    w13, s13, w2, s2 = rank_experts
    experts, h, inter = w13.shape[0], w13.shape[2], w2.shape[2]
    cfg = moe.pick_moe_config(tokens, 8, experts)
    assert moe.scans(tokens, cfg) == (tokens < 64)
    split1 = moe._split1(moe.num_blocks(tokens, 8, experts, cfg), h, inter, cfg,
                         torch.cuda.get_device_properties(0).multi_processor_count)
    assert split1 > 1
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, h, device="cuda", generator=g).bfloat16()
    logits = torch.randn(tokens, 256, device="cuda", generator=g)
    logits[0, :4] += 4.0  # token 0 picks local experts; the others mostly pick a few or none
    bias = 0.01 * torch.randn(256, device="cuda", generator=g)
    offset = torch.zeros((), dtype=torch.int32, device="cuda")

    def step():
        weights, ids = moe.moe_route(logits, bias, 8, 1, 1, True, 2.5, offset, experts)
        return moe.moe_fp8(x, ids, weights, w13, s13, w2, s2, True)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compiles outside the capture
        eager = step()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    replays = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        replays.append(out.clone())
        assert int(fp8_parts.tile_counters(x.device, 1).abs().sum()) == 0
    assert torch.equal(replays[0], eager) and torch.equal(replays[1], eager)
    weights, ids = ref.moe_route_local(logits, bias, 8, 1, 1, True, 2.5, offset, experts)
    assert (ids >= 0).any() and (ids < 0).any()
    assert _rel(eager, ref_fp8.moe_fp8(x.float(), ids, weights, w13, s13, w2, s2, True)) < 2e-2
    if moe.scans(tokens, cfg):  # the align kernel's layout, the same splits: the same bits
        weights, ids = moe.moe_route(logits, bias, 8, 1, 1, True, 2.5, offset, experts)
        aligned = moe.moe_fp8(x, ids, weights, w13, s13, w2, s2, True, config=dict(scan=False, SPLIT1=split1))
        assert torch.equal(aligned, eager)


@pytest.mark.parametrize("act_quant", [False, True], ids=["w8a16", "w8a8"])
@pytest.mark.parametrize("tokens", [1, 8])
def test_moe_rank_decode_with_the_shared_expert_in_its_launches(tokens, act_quant, rank_experts):
    """One TP8 / EP8 rank's MoE layer at decode (fxglm5::moe_fp8_shared): the rank's 32 experts with the shared
    expert's 1/8 (gate|up 512 x 6144 stacked, down 6144 x 256) as extra CTAs of the routed gate|up and down
    launches: bit for bit the shared expert's own two launches then moe_fp8_add's, and the reference op's value.
    Replayed twice from a CUDA graph: the eager bits both times and every arrival counter back at 0."""
    w13, s13, w2, s2 = rank_experts
    experts, h = w13.shape[0], w13.shape[2]
    shared_inter = 2048 // 8
    g = torch.Generator(device="cuda").manual_seed(tokens + 10)
    sw13 = (torch.randn(2 * shared_inter, h, device="cuda", generator=g) * 0.5).to(torch.float8_e4m3fn)
    ss13 = torch.rand(2 * shared_inter // 128, h // 128, device="cuda", generator=g) * 0.01 + 0.002
    sw2 = (torch.randn(h, shared_inter, device="cuda", generator=g) * 0.5).to(torch.float8_e4m3fn)
    ss2 = torch.rand(h // 128, shared_inter // 128, device="cuda", generator=g) * 0.01 + 0.002
    shared = moe.SharedExpert(sw13, ss13, sw2, ss2, act_quant, shared_inter)
    x = torch.randn(tokens, h, device="cuda", generator=g).bfloat16()
    ids = (torch.rand(tokens, experts + 1, device="cuda", generator=g).topk(8).indices - 1).to(torch.int32)
    weights = torch.rand(tokens, 8, device="cuda", generator=g)
    routed = (x, ids, weights, w13, s13, w2, s2, act_quant)
    assert moe.scans(tokens, moe.pick_moe_config(tokens, 8, experts))
    joined = moe._shared_launches(x, shared, (0, 0), moe.pick_moe_config(tokens, 8, experts))
    assert joined is not None and all(launch.meta["SPLIT_K"] > 1 for launch in joined[:2])

    def step():
        return moe.moe_fp8(*routed, shared=shared)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compiles outside the capture
        eager = step()
        separate = moe.moe_fp8(*routed, addend=moe.shared_expert(x, shared))
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    assert torch.equal(eager, separate)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
        assert int(fp8_parts.tile_counters(x.device, 1).abs().sum()) == 0
    reference = ref.moe_fp8_shared(*routed, sw13, ss13, sw2, ss2, shared_inter)
    assert _rel(eager, reference) < 2e-2


def _shared_expert_of_rank(g, act_quant):
    """The shared expert's TP8 slice at GLM-5's widths: gate|up 512 x 6144 stacked, down 6144 x 256."""
    h, shared_inter = 6144, 2048 // 8
    sw13 = (torch.randn(2 * shared_inter, h, device="cuda", generator=g) * 0.5).to(torch.float8_e4m3fn)
    ss13 = torch.rand(2 * shared_inter // 128, h // 128, device="cuda", generator=g) * 0.01 + 0.002
    sw2 = (torch.randn(h, shared_inter, device="cuda", generator=g) * 0.5).to(torch.float8_e4m3fn)
    ss2 = torch.rand(h // 128, shared_inter // 128, device="cuda", generator=g) * 0.01 + 0.002
    return moe.SharedExpert(sw13, ss13, sw2, ss2, act_quant, shared_inter)


def _rank_ids(tokens, experts, g):
    """Top-8 ids local to a rank of ``experts`` (-1: another rank's), token 0 routed to no local expert."""
    ids = (torch.rand(tokens, experts + 1, device="cuda", generator=g).topk(8).indices - 1).to(torch.int32)
    ids[0] = -1
    return ids


@pytest.mark.parametrize("act_quant", [False, True], ids=["w8a16", "w8a8"])
@pytest.mark.parametrize("shared", [True, False], ids=["shared", "routed_only"])
@pytest.mark.parametrize("tokens", [1, 8, 16])
def test_moe_rank_decode_combines_in_the_down_launch(tokens, shared, act_quant, rank_experts):
    """A rank's MoE layer at decode (EP8's 32 experts, GLM-5 widths, with or without the shared expert's TP8 slice):
    the down launch combines (two launches, no combine kernel), bit for bit today's separate launches (the shared
    expert's own two, then the align kernel, the two grouped GEMMs at the same K splits and the combine kernel),
    token 0 routed to no local expert. Replayed twice from a CUDA graph over new ids (other ticket counts per
    token): the separate launches' bits each time, and every counter back at 0."""
    w13, s13, w2, s2 = rank_experts
    experts, h = w13.shape[0], w13.shape[2]
    g = torch.Generator(device="cuda").manual_seed(tokens + 20)
    expert = _shared_expert_of_rank(g, act_quant) if shared else None
    x = torch.randn(tokens, h, device="cuda", generator=g).bfloat16()
    ids = _rank_ids(tokens, experts, g)
    weights = torch.rand(tokens, 8, device="cuda", generator=g)
    routed = (x, ids, weights, w13, s13, w2, s2, act_quant)
    cfg = moe.pick_moe_config(tokens, 8, experts)
    split1 = moe._split1(moe.num_blocks(tokens, 8, experts, cfg), h, w2.shape[2], cfg,
                         torch.cuda.get_device_properties(0).multi_processor_count)

    def separate():
        addend = None if expert is None else moe.shared_expert(x, expert)
        return moe.moe_fp8(*routed, addend=addend, config=dict(scan=False, SPLIT1=split1))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compiles outside the capture
        eager, want = moe.moe_fp8(*routed, shared=expert), separate()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    assert torch.equal(eager, want)
    assert int(fp8_parts.tile_counters(x.device, 1).abs().sum()) == 0
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.moe_fp8(*routed, shared=expert)
    for seed in range(2):
        ids.copy_(_rank_ids(tokens, experts, torch.Generator(device="cuda").manual_seed(seed)))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, separate())
        assert int(fp8_parts.tile_counters(x.device, 1).abs().sum()) == 0


@pytest.mark.parametrize("act_quant", [False, True], ids=["w8a16", "w8a8"])
@pytest.mark.parametrize("tokens", [1, 8, 16])
def test_moe_rank_decode_routes_in_the_gate_up_launch(tokens, act_quant, rank_experts):
    """A TP8 / EP8 rank's MoE layer with its router at decode (fxglm5::moe_router_fp8_shared): GLM-5's router (256
    experts of 6144, top-8, x 2.5, ids local to rank 7's 32 experts), the rank's experts and the shared expert's
    TP8 slice, in two launches: the router's tiles, the shared gate|up and the routed gate|up as tasks of one launch
    (the routed tiles spin until the routing CTA signals), then the down launch with the combine. Bit for bit the
    router's own launch followed by moe_fp8's, 20 calls in a row (the tasks' interleavings differ from call to
    call), then from a CUDA graph replayed twice over new tokens; every counter (the GEMMs' and the tasks') back at 0
    after each; the reference op's value."""
    w13, s13, w2, s2 = rank_experts
    experts, h = w13.shape[0], w13.shape[2]
    g = torch.Generator(device="cuda").manual_seed(tokens + 30)
    shared = _shared_expert_of_rank(g, act_quant)
    router = moe.Router(torch.randn(256, h, device="cuda", generator=g) / h ** 0.5,
                        0.01 * torch.randn(256, device="cuda", generator=g), 8, 1, 1, True, 2.5,
                        torch.tensor(32 * 7, dtype=torch.int32, device="cuda"), experts)
    router.correction_bias[32 * 7:32 * 7 + 3] += 1.0  # every token picks three of the rank's experts, and five others
    x = torch.randn(tokens, h, device="cuda", generator=g).bfloat16()
    routed = (w13, s13, w2, s2, act_quant)
    assert moe.router_joins(x, router, experts)

    def fused():
        return moe.moe_router_fp8(x, router, *routed, shared=shared)

    def separate():
        weights, ids = moe.moe_router(x, *router)
        return moe.moe_fp8(x, ids, weights, *routed, shared=shared)

    def counters_at_zero():
        return not fp8_parts.tile_counters(x.device, 1).any() and not tasks.counters(x.device, 1).any()

    out = _bits_eager_then_replayed(lambda: (fused(),), lambda: (separate(),), counters_at_zero,
                                    lambda g: x.copy_(torch.randn(x.shape, device="cuda", generator=g)))[0]
    reference = ref.moe_router_fp8_shared(x, *router, *routed, shared.w13, shared.w13_scale, shared.w2,
                                          shared.w2_scale, shared.up_start)
    assert _rel(out, reference) < 2e-2


@pytest.mark.parametrize("act_quant", [False, True], ids=["w8a16", "w8a8"])
@pytest.mark.parametrize("tokens", [1, 8, 16])
def test_moe_rank_decode_expert_walk_gives_the_bits_of_its_split(tokens, act_quant, rank_experts):
    """The expert walk (WALK_CTAS_PER_SM 2, opt-in) at a TP8 / EP8 rank's decode shapes: the routed gate|up CTAs are
    two an SM (at least a block and column tile each) and size their K split from the routing, so the layer is the
    fixed-split launch's (SPLIT1 = the split the walk picks from the picked experts) bit for bit, 20 calls in a row,
    then from a CUDA graph replayed over new tokens (another routing, another split); every counter back at 0; the
    reference op's value."""
    w13, s13, w2, s2 = rank_experts
    experts, h, inter = w13.shape[0], w13.shape[2], w2.shape[2]
    g = torch.Generator(device="cuda").manual_seed(tokens + 40)
    shared = _shared_expert_of_rank(g, act_quant)
    router = moe.Router(torch.randn(256, h, device="cuda", generator=g) / h ** 0.5,
                        0.01 * torch.randn(256, device="cuda", generator=g), 8, 1, 1, True, 2.5,
                        torch.tensor(32 * 7, dtype=torch.int32, device="cuda"), experts)
    router.correction_bias[32 * 7:32 * 7 + 3] += 1.0  # every token picks three of the rank's experts
    x = torch.randn(tokens, h, device="cuda", generator=g).bfloat16()
    routed = (w13, s13, w2, s2, act_quant)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    columns, kg = inter // moe.MOE_DECODE["BLOCK_N1"], h // 128
    walkers = max(2 * sms, min(experts, 8 * tokens) * columns)

    def split_of_the_walk():
        picked = len(set(moe.moe_router(x, *router)[1].flatten().tolist()) - {-1})
        split = max(1, min(kg, walkers // (picked * columns)))
        return -(-kg // -(-kg // split))

    def walked():
        return moe.moe_router_fp8(x, router, *routed, shared=shared, config={"WALK_CTAS_PER_SM": 2})

    def fixed(split):
        return moe.moe_router_fp8(x, router, *routed, shared=shared, config={"SPLIT1": split})

    def counters_at_zero():
        return not fp8_parts.tile_counters(x.device, 1).any() and not tasks.counters(x.device, 1).any()

    assert split_of_the_walk() > 1
    out = _bits_eager_then_replayed(lambda: (walked(),), lambda: (fixed(split_of_the_walk()),), counters_at_zero,
                                    lambda g: x.copy_(torch.randn(x.shape, device="cuda", generator=g)))[0]
    reference = ref.moe_router_fp8_shared(x, *router, *routed, shared.w13, shared.w13_scale, shared.w2,
                                          shared.w2_scale, shared.up_start)
    assert _rel(out, reference) < 2e-2


@pytest.mark.parametrize("pdl", ["0", "1"], ids=["no_pdl", "pdl"])
@pytest.mark.parametrize("act_quant", [False, True], ids=["w8a16", "w8a8"])
@pytest.mark.parametrize("tokens", [1, 8, 16])
def test_moe_rank_decode_norms_in_the_gate_up_launch(monkeypatch, tokens, act_quant, pdl, rank_experts):
    """A TP8 / EP8 rank's MoE layer at decode with the residual add and RMSNorm before it
    (fxglm5::add_rms_norm_moe_router_fp8_shared): GLM-5's hidden 6144 (bf16 attention output, residual and norm
    weight), its router (256 experts of 6144, top-8, x 2.5, ids local to rank 7's 32 experts), the rank's experts and
    the shared expert's TP8 slice, in two launches: the norm's rows (a task each, signalling), the router's tiles and
    the shared gate|up (spinning until every row is normed), the routed gate|up (until the routing) in one launch of
    tasks, then the down launch with the combine. Bit for bit the separate launches (add_rms_norm's kernel, at its
    own warp count, the router's launch, moe_fp8's two), both outputs (the MoE's and the sum, the next residual), 20
    calls in a row (the tasks' interleavings differ from call to call), then from a CUDA graph replayed twice over new
    attention outputs and residuals; every counter (the GEMMs' and the tasks') back at 0 after each; without and with
    programmatic dependent launch; the reference op's sum, and close to its MoE output."""
    monkeypatch.setenv("FXGLM5_PDL", pdl)
    w13, s13, w2, s2 = rank_experts
    experts, h = w13.shape[0], w13.shape[2]
    g = torch.Generator(device="cuda").manual_seed(tokens + 60)
    shared = _shared_expert_of_rank(g, act_quant)
    router = moe.Router(torch.randn(256, h, device="cuda", generator=g) / h ** 0.5,
                        0.01 * torch.randn(256, device="cuda", generator=g), 8, 1, 1, True, 2.5,
                        torch.tensor(32 * 7, dtype=torch.int32, device="cuda"), experts)
    router.correction_bias[32 * 7:32 * 7 + 3] += 1.0  # every token picks three of the rank's experts, and five others
    x, r = torch.empty(tokens, h, device="cuda", dtype=torch.bfloat16), torch.empty(tokens, h, device="cuda",
                                                                                    dtype=torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(h, device="cuda", generator=g)).bfloat16()
    routed = (w13, s13, w2, s2, act_quant)

    def draw(gen):  # an attention output and a residual stream four times its size
        x.copy_(torch.randn(tokens, h, device="cuda", generator=gen))
        r.copy_(4 * torch.randn(tokens, h, device="cuda", generator=gen))

    draw(g)
    assert moe.router_joins(x, router, experts)

    def fused():
        return moe.add_rms_norm_moe_router_fp8(x, r, nw, 1e-5, router, *routed, shared=shared)

    def separate():
        normed, total = norm_rope.add_rms_norm(x, r, nw, 1e-5)
        weights, ids = moe.moe_router(normed, *router)
        return moe.moe_fp8(normed, ids, weights, *routed, shared=shared), total

    def counters_at_zero():
        return not fp8_parts.tile_counters(x.device, 1).any() and not tasks.counters(x.device, 2).any()

    out = _bits_eager_then_replayed(fused, separate, counters_at_zero, draw)
    reference = ref.add_rms_norm_moe_router_fp8_shared(x, r, nw, 1e-5, *router, *routed, shared.w13,
                                                       shared.w13_scale, shared.w2, shared.w2_scale, shared.up_start)
    assert torch.equal(out[1], reference[1]) and _rel(out[0], reference[0]) < 2e-2


@pytest.mark.parametrize("pdl", ["0", "1"], ids=["no_pdl", "pdl"])
@pytest.mark.parametrize("act_quant", [False, True], ids=["w8a16", "w8a8"])
@pytest.mark.parametrize("tokens", [1, 8, 16, 64])
def test_q_b_gemm_runs_the_latent_query_in_its_launch(monkeypatch, tokens, act_quant, pdl):
    """A TP8 rank's q_b | wq_b GEMM at decode with the latent query of its heads (fxglm5::fp8_linear_latent_query):
    GLM-5's 8 heads of 192 + 64 query columns, then the indexer's 32 x 128, over the query latent's 2048 features,
    W_UK [8, 192, 512] and the RoPE tables of 64 features (bf16 tokens). Up to 16 tokens one launch: the GEMM's tiles
    (split over K, each tile's last split signalling its head) and then the latent query's 128 programs (8 heads x 16
    column tiles), each spinning until its head's two tiles are done. Bit for bit fp8_linear's launch followed by the
    latent query's (what the attention op's body launched), both outputs, 20 calls in a row (the tasks' interleavings
    differ from call to call), then from a CUDA graph replayed twice over new tokens; every counter (the split-K and
    the tasks') back at 0 after each; without and with programmatic dependent launch; close to the reference op.
    At 64 tokens (prefill) the two launches themselves."""
    from fxglm5.lowering.triton import paged_cache

    monkeypatch.setenv("FXGLM5_PDL", pdl)
    heads, nope, rope_dim, n = 8, 192, 64, 8 * 256 + 32 * 128
    g = torch.Generator(device="cuda").manual_seed(tokens + 50)
    w = (torch.randn(n, 2048, device="cuda", generator=g) * 0.5).to(torch.float8_e4m3fn)
    s = torch.rand(n // 128, 2048 // 128, device="cuda", generator=g) * 0.02 + 0.005
    w_uk = (torch.randn(heads, nope, 512, device="cuda", generator=g) / nope ** 0.5).bfloat16()
    angles = torch.rand(tokens, rope_dim // 2, device="cuda", generator=g) * 100
    rope = (angles.cos(), angles.sin())
    x = torch.randn(tokens, 2048, device="cuda", generator=g).bfloat16()
    joins = paged_cache.latent_query_joins(x, w, s, None, act_quant, torch.empty(tokens, n, dtype=x.dtype,
                                                                                device="cuda"))
    assert (joins is not None) == (tokens <= 16)

    def fused():
        return paged_cache.fp8_linear_latent_query(x, w, s, None, act_quant, w_uk, 0, rope_dim, rope)

    def separate():
        out = fp8_gemm.fp8_linear(x, w, s, None, act_quant)
        q_nope, q_pe = ref.query_heads(out, 0, heads, nope, rope_dim)
        return out, paged_cache.latent_query(q_nope, w_uk, q_pe, rope)

    def counters_at_zero():
        return not fp8_parts.tile_counters(x.device, 1).any() and not tasks.counters(x.device, heads).any()

    out = _bits_eager_then_replayed(fused, separate, counters_at_zero,
                                    lambda g: x.copy_(torch.randn(x.shape, device="cuda", generator=g)))
    ref_out, ref_q = ref.fp8_linear_latent_query(x, w, s, None, act_quant, w_uk, 0, rope_dim, *rope)
    assert _rel(out[0], ref_out) < 2e-2 and _rel(out[1], ref_q) < 2e-2


def _bits_eager_then_replayed(fused, separate, counters_at_zero, draw):
    """``fused()`` (a tuple of tensors; None fails) against ``separate()`` bit for bit: once, compiled on a side stream
    (outside any capture), 20 times in a row (a launch of tasks interleaves differently each time), then from a CUDA
    graph replayed twice after ``draw(generator)`` refills the inputs; every counter back at 0 after each. Returns
    the graph's outputs."""
    def same(a, b):
        return a is not None and all(torch.equal(u, v) for u, v in zip(a, b))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compiles outside the capture
        eager, want = fused(), separate()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    assert same(eager, want) and counters_at_zero()
    for _ in range(20):
        assert same(fused(), want)
    torch.cuda.synchronize()
    assert counters_at_zero()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused()
    for seed in range(2):
        draw(torch.Generator(device="cuda").manual_seed(seed))
        graph.replay()
        torch.cuda.synchronize()
        assert same(out, separate()) and counters_at_zero()
    return out


def _index_step(tokens, ctx, g):
    """A decode step of ``tokens`` requests over GLM-5's FP8 index cache (64-token blocks, rows of ``ctx`` keys: the
    block table's width): request r holds ``ctx - 37 * r`` keys (2k: windows of 1493 to 2011 keys, inside the
    top-2048, and request 0's 2112 past it, the table one block wider; 8k: 7637 to 8192, every row selects) and its
    token is at its last position."""
    from fxglm5.lowering.reference import paged

    width = ctx // 64 + (1 if ctx <= 2048 else 0)
    lens = [min(ctx - 37 * r, width * 64) for r in range(tokens)]
    if ctx <= 2048:
        lens[0] = width * 64  # one row past the top-k
    blocks = sum(-(-n // 64) for n in lens) + 1
    cache = torch.zeros(blocks, 64, 132, dtype=torch.uint8, device="cuda")
    table = torch.zeros(tokens, width, dtype=torch.int32, device="cuda")
    free = (torch.randperm(blocks - 1, device="cuda", generator=g) + 1).int()
    for r, n in enumerate(lens):
        table[r, :-(-n // 64)] = free[:-(-n // 64)]
        free = free[-(-n // 64):]
        p = torch.arange(n, device="cuda")
        keys = torch.randn(n, 128, device="cuda", generator=g).bfloat16()
        paged.write_indexer_cache(cache, keys, paged.slots_from_positions(table, torch.full_like(p, r), p, 64))
    req = torch.arange(tokens, dtype=torch.int32, device="cuda")
    pos = torch.tensor([n - 1 for n in lens], dtype=torch.int32, device="cuda")
    return cache, table, req, pos


@pytest.mark.parametrize("pdl", ["0", "1"], ids=["no_pdl", "pdl"])
@pytest.mark.parametrize("ctx", [2048, 8192], ids=["2k", "8k"])
@pytest.mark.parametrize("tokens", [1, 8, 16])
def test_q_b_gemm_runs_the_latent_query_and_the_indexer_in_its_launch(monkeypatch, tokens, ctx, pdl):
    """A TP8 rank's q_b | wq_b GEMM at decode with the latent query of its heads and the DSA indexer over its wq_b
    columns (fxglm5::fp8_linear_latent_query_indexer): GLM-5's 8 heads of 192 + 64 query columns, then the indexer's
    32 x 128 (its query turned by the RoPE tables), over the query latent's 2048 features, top-2048 over an FP8 index
    cache of 64-token blocks at 2k (rows inside the top-k and one past it) and 8k contexts (bf16 tokens, W8A16). One
    launch: the GEMM's tiles, the latent query's 128 programs, then the indexer's logits programs, each waiting for
    the tiles of its query's columns, each row's last selecting it. Bit for bit the latent query's launch followed by
    the indexer's one launch under the same logits configuration (indexer.gather_config), all three outputs, 20
    calls in a row (the tasks' interleavings differ from call to call), then from a CUDA graph replayed twice over
    new tokens; every counter (the tasks', the split-K's, the rows' tickets) back at 0 after each; without and with
    programmatic dependent launch; the top-k sets close to the reference op's."""
    import fxglm5.ops  # noqa: F401  (the reference op)
    from fxglm5.lowering.reference.fused import index_query
    from fxglm5.lowering.triton import indexer, latent_query_indexer, paged_cache

    monkeypatch.setenv("FXGLM5_PDL", pdl)
    heads, nope, rope_dim, hi, topk = 8, 192, 64, 32, 2048
    n = heads * (nope + rope_dim) + hi * 128
    g = torch.Generator(device="cuda").manual_seed(tokens + ctx)
    w = (torch.randn(n, 2048, device="cuda", generator=g) * 0.5).to(torch.float8_e4m3fn)
    s = torch.rand(n // 128, 2048 // 128, device="cuda", generator=g) * 0.02 + 0.005
    w_uk = (torch.randn(heads, nope, 512, device="cuda", generator=g) / nope ** 0.5).bfloat16()
    angles = torch.rand(1, tokens, rope_dim // 2, device="cuda", generator=g) * 100
    cos, sin = angles.cos(), angles.sin()
    x = torch.randn(1, tokens, 2048, device="cuda", generator=g).bfloat16()
    weights = torch.randn(1, tokens, hi, device="cuda", generator=g) * hi ** -0.5
    cache, table, req, pos = _index_step(tokens, ctx, g)
    start = heads * (nope + rope_dim)
    assert indexer.one_launch_round(tokens, table.shape[1] * 64, topk, False) is not None

    def fused():
        return latent_query_indexer.fp8_linear_latent_query_indexer(
            x, w, s, None, False, w_uk, 0, rope_dim, cos, sin, start, hi, 128, weights, topk, cache, table, req, pos,
            True, 1)

    def separate():
        rope = (cos.view(tokens, -1), sin.view(tokens, -1))
        out, q = paged_cache.fp8_linear_latent_query(x, w, s, None, False, w_uk, 0, rope_dim, rope)
        top = indexer.indexer_topk_paged(index_query(out, start, hi, 128).reshape(tokens, hi, 128),
                                         weights.view(tokens, hi), cache, table, req, pos, topk, rope=rope,
                                         cfg=indexer.gather_config(64, False))
        return out, q, top.view(1, tokens, topk)

    def counters_at_zero():
        return not fp8_parts.tile_counters(x.device, 1).any() and not tasks.counters(x.device, heads + 1).any()

    out = _bits_eager_then_replayed(fused, separate, counters_at_zero,
                                    lambda g: x.copy_(torch.randn(x.shape, device="cuda", generator=g)))
    reference = ref.fp8_linear_latent_query(x, w, s, None, False, w_uk, 0, rope_dim, cos, sin)
    assert _rel(out[0], reference[0]) < 2e-2 and _rel(out[1], reference[1]) < 2e-2
    slots = torch.full((tokens,), -1, dtype=torch.int32, device="cuda")
    ref_top = torch.ops.fxglm5.fp8_linear_latent_query_indexer(
        x, w, s, None, False, w_uk, 0, rope_dim, cos, sin, start, hi, 128, weights, topk, cache, slots, table, req,
        pos, 1 << 20, True)[2]
    for row, want_row in zip(out[2][0], ref_top[0]):  # the same set, up to near ties of the FP8 scores
        got, wanted = set(row.tolist()) - {-1}, set(want_row.tolist()) - {-1}
        assert len(got) == len(wanted) and len(got & wanted) >= 0.98 * len(wanted)
