"""The exact-mode indexer on the Triton kernels (TRITON_INTERPRET=1 on the CPU): a compute-dtype index cache
(``index_cache="bf16"`` / float32) keeps the keys unquantized. Its write and its selection run as kernels with no host
sync, so a decode step with that cache can be captured in a CUDA graph (the reference loops over the tokens on the
host, which broke the capture of every decode graph of the long workload at GLM-5's widths on an H100)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fxglm5.lowering.reference import paged as ref  # noqa: E402
from fxglm5.lowering.reference import paged_steps  # noqa: E402
from tests.kernels.test_kernels_attention import _queries, paged_setup  # noqa: E402

triton = pytest.importorskip("triton")

from fxglm5.lowering.triton import indexer as tindexer  # noqa: E402
from fxglm5.lowering.triton import paged_cache as tpc  # noqa: E402
from fxglm5.lowering.triton import paged_ops  # noqa: E402


def _norm_rope(T, dtype, g):
    norm = (torch.rand(128, generator=g) + 0.5, 0.1 * torch.randn(128, generator=g), 1e-6)
    angles = torch.rand(T, 32, generator=g) * 6.0
    return norm, (angles.cos(), angles.sin())


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("key_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("folded", [False, True], ids=["plain", "norm+rope"])
def test_exact_write_equals_the_reference(cache_dtype, key_dtype, folded):
    g = torch.Generator().manual_seed(3)
    T, nb, bs = 9, 5, 4
    k = torch.randn(T, 128, generator=g).to(key_dtype)
    slots = torch.tensor([5, -1, 0, 19, 7, -1, 12, 3, 8])
    norm, rope = _norm_rope(T, key_dtype, g) if folded else (None, None)
    norm = None if norm is None else (norm[0].to(key_dtype), norm[1].to(key_dtype), norm[2])
    poison = torch.full((nb, bs, 128), 7.0, dtype=cache_dtype)
    want, got = poison.clone(), poison.clone()
    ref.write_exact_index_keys(want, k, slots, norm=norm, rope=rope)
    tpc.write_exact_index_keys(got, k, slots, norm=norm, rope=rope)
    if key_dtype == torch.float32 and folded:  # the LayerNorm's float32 sums run in another order: ulps apart
        torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
    else:  # a bf16 rounding or no arithmetic at all: the same bits
        assert torch.equal(got, want)
    written = torch.zeros(nb * bs, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    assert (got.view(-1, 128)[~written] == 7.0).all()  # padding slots (-1) write nothing
    assert not (got.view(-1, 128)[written] == 7.0).all(dim=1).any()


def _exact_cache(s, dtype):
    g = torch.Generator().manual_seed(s["seed"] + 1)
    cache = torch.full((s["nb"], s["bs"], 128), float("nan"), dtype=dtype)  # unwritten rows are never read
    for b, n in enumerate(s["lens"]):
        pos = torch.arange(n)
        ref.write_exact_index_keys(cache, torch.randn(n, 128, generator=g).to(dtype),
                                   ref.slots_from_positions(s["bt"], torch.full_like(pos, b), pos, s["bs"]))
    return cache


def _float64_scores(q, w, cache, bt, req, pos, bs):
    out = []
    for t in range(q.shape[0]):
        n = int(pos[t]) + 1
        slots = ref.slots_from_positions(bt, req[t].expand(n), torch.arange(n), bs)
        keys = cache.view(-1, 128)[slots].double()
        out.append((w[t].double()[:, None] * torch.relu(q[t].double() @ keys.T)).sum(0))
    return out


@given(paged_setup(), st.sampled_from([1, 2, 4]), st.integers(1, 16), st.sampled_from([torch.bfloat16, torch.float32]),
       st.data())
def test_exact_selection_is_a_top_k_of_the_exact_scores(s, HI, K, dtype, data):
    cache = _exact_cache(s, dtype)
    req, pos = _queries(s, lambda b, n: sorted({n - 1, data.draw(st.integers(0, n - 1))}))
    T = len(req)
    g = torch.Generator().manual_seed(s["seed"] + 4)
    q = torch.randn(T, HI, 128, generator=g).to(dtype)
    w = torch.randn(T, HI, generator=g)
    exact = _float64_scores(q, w, cache, s["bt"], req, pos, s["bs"])
    logits = tindexer.indexer_logits_paged(q, w, cache, s["bt"], req, pos, validate=False)
    for t in range(T):
        n = int(pos[t]) + 1
        torch.testing.assert_close(logits[t, :n].double(), exact[t], atol=1e-4, rtol=1e-5)
        assert torch.isinf(logits[t, n:]).all() and (logits[t, n:] < 0).all()
    for name, sel in [("ref", ref.exact_indexer_topk_paged(q, w, cache, s["bt"], req, pos, K)),
                      ("triton", tindexer.exact_indexer_topk_paged(q, w, cache, s["bt"], req, pos, K))]:
        assert sel.dtype == torch.int32 and sel.shape == (T, K), name
        for t in range(T):
            n = int(pos[t]) + 1
            k = min(K, n)
            got = sel[t, :k].long()
            assert (sel[t, k:] == -1).all(), name
            assert got.unique().numel() == k and int(got.min()) >= 0 and int(got.max()) < n, name
            best = exact[t].topk(k).values.sort().values
            torch.testing.assert_close(exact[t][got].sort().values, best, atol=1e-3, rtol=0, msg=name)


def test_the_indexer_step_runs_the_exact_mode_on_the_kernels_with_no_host_sync(monkeypatch):
    """rtp_indexer's body over the Triton kernel set reaches the kernels (never the reference's host loop) and
    selects what the reference body selects."""
    g = torch.Generator().manual_seed(11)
    T, HI, bs, topk = 6, 4, 4, 5
    q = torch.randn(1, T, HI, 128, generator=g).bfloat16()
    k = torch.randn(1, T, 128, generator=g).bfloat16()
    w = torch.rand(1, T, HI, generator=g)
    block_table = torch.tensor([[1, 2]], dtype=torch.int32)
    req_idx, positions = torch.zeros(T, dtype=torch.int32), torch.arange(T, dtype=torch.int32)
    slots = ref.slots_from_positions(block_table, req_idx, positions, bs)
    (nw, nb, eps), rope = _norm_rope(T, torch.bfloat16, g)
    norm = (nw.bfloat16(), nb.bfloat16(), eps)
    outputs = {}
    for name, kern in (("reference", ref), ("triton", paged_ops)):
        cache = torch.zeros(3, bs, 128, dtype=torch.bfloat16)
        if name == "triton":
            def host_loop(*a, **kw):
                raise AssertionError("the reference's host loop ran")
            monkeypatch.setattr(ref, "exact_indexer_topk_paged", host_loop)
            monkeypatch.setattr(ref, "write_exact_index_keys", host_loop)
        outputs[name] = (paged_steps.indexer_step(
            kern, q, k, w, topk, cache, slots, block_table, req_idx, positions, 64, rope[0][None], rope[1][None],
            *norm), cache)
    (sel_ref, cache_ref), (sel_tri, cache_tri) = outputs["reference"], outputs["triton"]
    assert torch.equal(cache_tri, cache_ref)
    assert torch.equal(sel_tri.sort(-1).values, sel_ref.sort(-1).values)
