"""The q_b | wq_b GEMM, the latent query and the DSA indexer in one launch of tasks
(``latent_query_indexer._gemm_latent_query_indexer_kernel``, fxglm5::fp8_linear_latent_query_indexer at decode),
interpreted on the CPU: bit for bit the separate launches (fp8_linear_latent_query's one launch, then
``indexer_topk_paged``'s one launch under the fused path's logits configuration), all three outputs, at 1, 3, 8 and
16 tokens over an FP8 index cache (and the exact mode's) whose rows' windows lie below the top-k (the window path, no
scores) and above it (logits, then the selection by the row's last program); the index query's programs wait for
exactly the tiles of its columns, which each signal once; every counter is back at zero. Elsewhere (past 16 tokens,
rows past one top-k round, a top-k split over ranks) the op is the separate launches. Small shapes: CI runs it on 2
cores; tests/gpu/test_gpu_fused.py runs GLM-5's TP8 shapes."""

import os

import torch

if not torch.cuda.is_available():  # CPU CI: interpret; set before triton is imported in this process
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fxglm5.ops  # noqa: E402,F401  (registers the ops)
from fxglm5.lowering.reference import collectives  # noqa: E402
from fxglm5.lowering.reference import paged as ref  # noqa: E402
from fxglm5.lowering.reference.fused import index_query  # noqa: E402

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("CPU-tensor kernel tests run interpreted (TRITON_INTERPRET=1); on a GPU host "
                "tests/gpu/test_gpu_fused.py covers the kernels", allow_module_level=True)

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from fxglm5.lowering import implementations  # noqa: E402
from fxglm5.lowering.triton import fp8_gemm, fp8_parts, indexer, latent_query_indexer, paged_cache, tasks  # noqa: E402

pytestmark = pytest.mark.usefixtures("all_decode_joins")  # the joined kernels (an opt-in, settings.DECODE_JOINS)

# 3 attention heads of 40 + 32 columns from column 100, then the indexer's 4 heads of DI columns from column 316 (on
# column tiles 2 to 4 or 6 of 128), 20 more columns, over K = 256 (two K steps: split in two on the interpreter's SMs);
# 3 requests of 40, 5 and 60 cached keys in 16-key blocks (rows of 64 keys: one top-k round) against a top-8
H, NOPE, ROPE, Q_START, HI, K, BS, WIDTH, TOPK = 3, 40, 32, 100, 4, 256, 16, 4, 8
I_START = Q_START + H * (NOPE + ROPE)
LENS = (40, 5, 60)


def _step(tokens, dim, dtype, exact=False, seed=0):
    """The op's arguments for ``tokens`` decode tokens: token i of request i % 3 at its last position less i // 3
    (request 1's windows of 1 to 5 keys fit in the top-k, the others' of 27 to 60 do not)."""
    g = torch.Generator().manual_seed(seed + tokens)
    n = I_START + HI * dim + 20
    x = torch.randn(1, tokens, K, generator=g).to(dtype)
    w = (torch.randn(n, K, generator=g) * 0.5).to(torch.float8_e4m3fn)
    s = torch.rand(-(-n // 128), K // 128, generator=g) * 0.02 + 0.005
    w_uk = (torch.randn(H, NOPE, 96, generator=g) / 6).to(dtype)
    angles = torch.rand(1, tokens, ROPE // 2, generator=g) * 10
    weights = torch.randn(1, tokens, HI, generator=g)
    nb = sum(-(-n // BS) for n in LENS) + 2
    cache = torch.zeros(nb, BS, 128, dtype=dtype) if exact else torch.zeros(nb, BS, 132, dtype=torch.uint8)
    table = torch.zeros(len(LENS), WIDTH, dtype=torch.int32)
    free = (torch.randperm(nb - 1, generator=g) + 1).tolist()
    for r, length in enumerate(LENS):
        blocks = -(-length // BS)
        table[r, :blocks] = torch.tensor(free[:blocks], dtype=torch.int32)
        free = free[blocks:]
        p = torch.arange(length)
        slots = ref.slots_from_positions(table, torch.full_like(p, r), p, BS)
        write = ref.write_exact_index_keys if exact else ref.write_indexer_cache
        write(cache, torch.randn(length, 128, generator=g).to(dtype), slots)
    req = torch.arange(tokens, dtype=torch.int32) % 3
    pos = torch.tensor([max(LENS[i % 3] - 1 - i // 3, 0) for i in range(tokens)], dtype=torch.int32)
    return dict(x=x, weight=w, weight_scale_inv=s, bias=None, act_quant=False, w_uk=w_uk, q_start=Q_START,
                rope_dim=ROPE, rope_cos=angles.cos(), rope_sin=angles.sin(), index_start=I_START, index_heads=HI,
                index_dim=dim, weights=weights, topk=TOPK, index_cache=cache,
                slot_mapping=ref.slots_from_positions(table, req, pos, BS), block_table=table, req_idx=req,
                positions=pos, max_positions=4096)


def _fused(a, rope_q=True, world=1):
    return latent_query_indexer.fp8_linear_latent_query_indexer(
        *(a[name] for name in ("x", "weight", "weight_scale_inv", "bias", "act_quant", "w_uk", "q_start", "rope_dim",
                               "rope_cos", "rope_sin", "index_start", "index_heads", "index_dim", "weights", "topk",
                               "index_cache", "block_table", "req_idx", "positions")), rope_q, world)


def _separate(a, rope_q=True):
    """fp8_linear_latent_query's launches, then the indexer's (what the graph ran before fuse_indexer_into_q_b: its
    query the view of the GEMM's columns, zero-padded to 128 as rtp_indexer's body pads it) under the fused path's
    logits configuration."""
    tokens = a["x"].shape[1]
    rope = (a["rope_cos"].reshape(tokens, -1), a["rope_sin"].reshape(tokens, -1))
    out, q = paged_cache.fp8_linear_latent_query(a["x"], a["weight"], a["weight_scale_inv"], a["bias"],
                                                 a["act_quant"], a["w_uk"], Q_START, ROPE, rope)
    dim = a["index_dim"]
    query = F.pad(index_query(out, I_START, HI, dim), (0, 128 - dim)).reshape(tokens, HI, 128)
    cache = a["index_cache"]
    cfg = indexer.gather_config(BS, True, cache.dtype != torch.uint8)
    top = indexer.indexer_topk_paged(query, a["weights"].reshape(tokens, HI), cache, a["block_table"], a["req_idx"],
                                     a["positions"], TOPK, rope=rope if rope_q else None, cfg=cfg, validate=False)
    return out, q, top.view(1, tokens, TOPK)


class _Record:
    """The interpreted launches, and each wait (dependency, signals awaited, signals there) and signal of the tasks."""

    def __init__(self, monkeypatch, counters):
        self.launched, self.waits, self.signals = [], [], []
        run, call = InterpretedFunction.run, InterpretedFunction.__call__

        def value(v):
            return int(v.handle.data.reshape(-1)[0]) if hasattr(v, "handle") else int(v)

        def record(fn, *a, **k):
            if fn.fn is tasks.wait.fn:
                self.waits.append((value(a[1]), value(a[2]), int(counters[tasks.DEPS.value + value(a[1])])))
                assert self.waits[-1][2] >= self.waits[-1][1], self.waits[-1]  # else the spin never ends
            if fn.fn is tasks.signal.fn:
                self.signals.append(value(a[1]))
            return call(fn, *a, **k)

        monkeypatch.setattr(InterpretedFunction, "run", lambda fn, *a, **k: self.launched.append(fn.fn.__name__)
                            or run(fn, *a, **k))
        monkeypatch.setattr(InterpretedFunction, "__call__", record)


def _index_tiles(a, block_n):
    """The GEMM's column tiles that hold some of the index query's columns."""
    return range(I_START // block_n, (I_START + HI * a["index_dim"] - 1) // block_n + 1)


@pytest.mark.parametrize("tokens", [1, 3, 8, 16])
@pytest.mark.parametrize("dim, dtype, cache, rope_q", [
    (128, torch.bfloat16, "fp8", True), (64, torch.float32, "fp8", False), (64, torch.bfloat16, "exact", True)],
    ids=["glm5_heads_bf16", "tiny_heads_f32_no_rope", "exact_cache"])
def test_one_launch_is_the_separate_launches(monkeypatch, tokens, dim, dtype, cache, rope_q):
    """One launch of tasks, bit for bit the separate launches, the GEMM's output, the latent query and the indices (in
    their order); the index query's programs of each row that computes logits wait for dependency H (after the H
    heads') to reach exactly the number of tiles its columns lie on, each of which signals it once, and a row whose
    window fits waits for nothing; the tasks' counters, the GEMM's FIXUP counters and the rows' ticket counters are
    back at zero."""
    a = _step(tokens, dim, dtype, cache == "exact")
    counters = tasks.counters(a["x"].device, H + 1)
    block_n = paged_cache.latent_query_joins(a["x"].reshape(tokens, K), a["weight"], a["weight_scale_inv"], None,
                                             False, torch.empty(tokens, a["weight"].shape[0]))[0].meta["BLOCK_N"]
    rec = _Record(monkeypatch, counters)
    out, q, top = _fused(a, rope_q)
    assert rec.launched == ["_gemm_latent_query_indexer_kernel"]
    tiles = len(_index_tiles(a, block_n))
    programs = -(-WIDTH * BS // (indexer.gather_config(BS, True)["BLOCK_N"] * indexer.gather_config(BS, True)["TILES"]))
    scored = sum(min(int(p) + 1, WIDTH * BS) > TOPK for p in a["positions"])  # rows whose window exceeds the top-k
    index_waits = [w for w in rec.waits if w[0] == H]
    assert len(index_waits) == scored * programs and all(w == (H, tiles, tiles) for w in index_waits)
    assert rec.signals.count(H) == tiles
    assert 0 < scored < tokens or tokens == 1  # both paths of the selection (one token: a scored row)
    assert not counters.any() and not fp8_parts.tile_counters(a["x"].device, 1).any()
    rec.launched.clear()
    want = _separate(a, rope_q)
    assert rec.launched == ["_gemm_latent_query_kernel", "_indexer_topk_kernel"]
    assert torch.equal(out, want[0].view(1, tokens, -1)) and torch.equal(q, want[1].view(1, tokens, H, 576))
    assert torch.equal(top, want[2])


def test_the_op_runs_the_one_launch_through_its_body(monkeypatch):
    """The Triton body the lower pass binds (checked, and without the host-syncing checks for a validated program)
    launches the one kernel and gives its bits; the reference op the same top-k sets."""
    a = _step(5, 64, torch.float32)
    impl = implementations.implementations("fp8_linear_latent_query_indexer")["triton"]
    rec = _Record(monkeypatch, tasks.counters(a["x"].device, H + 1))
    args = tuple(a.values()) + (True, None, 1)
    checked, unchecked = impl.fn(*args), impl.unchecked(*args)
    assert rec.launched == ["_gemm_latent_query_indexer_kernel"] * 2
    fused = _fused(a)
    assert all(torch.equal(x, y) and torch.equal(x, z) for x, y, z in zip(checked, unchecked, fused))
    reference = torch.ops.fxglm5.fp8_linear_latent_query_indexer(*args)
    assert torch.equal(reference[2].sort(-1).values, fused[2].sort(-1).values)


@pytest.mark.parametrize("case", ["prefill", "long_rows", "split_top_k"])
def test_elsewhere_the_op_is_the_separate_launches(monkeypatch, case):
    """Past 16 tokens, with rows longer than one top-k round, and where the top-k splits over ranks (a row count of
    the step at the threshold), the one launch does not apply: the op's body runs fp8_linear_latent_query's launches
    and then the indexer's, with their bits."""
    tokens = 17 if case == "prefill" else 4
    a = _step(tokens, 64, torch.float32)
    if case == "long_rows":  # rows of 192 keys: past the interpreter's one round (128 entries)
        a["block_table"] = torch.cat([a["block_table"], torch.zeros(3, 8, dtype=torch.int32)], 1)
        assert indexer.one_launch_round(tokens, 12 * BS, TOPK, True) is None
    if case == "split_top_k":
        monkeypatch.setattr(collectives, "MIN_ROWS_PER_RANK", 1)
        assert _fused(a, world=2) is None
        return
    assert _fused(a) is None
    impl = implementations.implementations("fp8_linear_latent_query_indexer")["triton"]
    rec = _Record(monkeypatch, tasks.counters(a["x"].device, H + 1))
    out, q, top = impl.unchecked(*a.values(), True, None, 1)
    assert "_gemm_latent_query_indexer_kernel" not in rec.launched and "_indexer_topk_kernel" not in rec.launched
    assert "_indexer_logits_kernel" in rec.launched  # the logits' launch, then the top-k's
    # the GEMM and the latent query one launch where they still join (the indexer's rows are the only obstacle)
    assert (rec.launched[0] == "_gemm_latent_query_kernel") == (case == "long_rows")
    monkeypatch.undo()
    want = _separate(a)
    assert torch.equal(out.flatten(), want[0].flatten()) and torch.equal(q.flatten(), want[1].flatten())
    assert torch.equal(top, want[2])


def test_the_logits_configuration_runs_the_launch_s_warps():
    """A launch has one warp count: the fixed logits configuration's is the latent query's and the decode GEMM's
    (latent_query_joins admits only that one), on the GPU and interpreted, gathers without TMA."""
    for interp in (True, False):
        cfg = indexer.gather_config(64, interp)
        assert cfg["num_warps"] == paged_cache.LATENT_QUERY_WARPS == fp8_gemm.DECODE["num_warps"]
        assert not cfg.get("USE_TMA")
    assert indexer.gather_config(64, False)["BLOCK_N"] * indexer.gather_config(64, False)["TILES"] == 512
