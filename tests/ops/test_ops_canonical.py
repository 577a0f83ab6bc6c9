"""The canonical ops: opcheck (schema, fake impl, dispatch) and agreement with an independent naive form."""

import math

import pytest
import torch
from torch.library import opcheck

import fxglm5.ops  # noqa: F401  (registers the ops)
from fxglm5.lowering.reference.fp8 import dequantize_block_fp8

torch.manual_seed(0)
B, S, H, DN, DR, R, DV = 2, 7, 3, 16, 8, 32, 12


def _mla_inputs():
    return (
        torch.randn(B, S, H, DN), torch.randn(B, S, H, DR), torch.randn(B, S, R), torch.randn(B, S, DR),
        torch.randn(H, DN, R) * 0.2, torch.randn(H, DV, R) * 0.2,
    )


def _naive_mla(q_nope, q_pe, kv_c, k_pe, w_uk, w_uv, scale, allowed):
    """Per-head keys/values expanded from the latent (the non-absorbed form), float64."""
    k_nope = torch.einsum("btr,hdr->bhtd", kv_c.double(), w_uk.double())
    v = torch.einsum("btr,hvr->bhtv", kv_c.double(), w_uv.double())
    q = torch.cat([q_nope, q_pe], -1).double().transpose(1, 2)
    k = torch.cat([k_nope, k_pe.double()[:, None].expand(-1, H, -1, -1)], -1)
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed[:, None], -math.inf)
    return (scores.softmax(-1) @ v).transpose(1, 2)


def test_mla_matches_naive_form():
    args = _mla_inputs()
    causal = torch.ones(S, S, dtype=torch.bool).tril()[None].expand(B, S, S)
    out = torch.ops.fxglm5.mla(*args, 0.125)
    torch.testing.assert_close(out.double(), _naive_mla(*args, 0.125, causal), rtol=1e-5, atol=1e-5)


def test_sparse_mla_attends_only_to_selected():
    args = _mla_inputs()
    idx = torch.full((B, S, 3), -1, dtype=torch.int32)
    allowed = torch.zeros(B, S, S, dtype=torch.bool)
    for b in range(B):
        for s in range(S):
            picks = torch.randperm(s + 1)[:3]
            idx[b, s, : len(picks)] = picks.to(torch.int32)
            allowed[b, s, picks] = True
    out = torch.ops.fxglm5.sparse_mla(*args, idx, 0.2)
    torch.testing.assert_close(out.double(), _naive_mla(*args, 0.2, allowed), rtol=1e-5, atol=1e-5)


def test_indexer_topk_selects_best_causal_keys():
    q, k, w = torch.randn(B, S, 4, 16), torch.randn(B, S, 16), torch.rand(B, S, 4)
    topk = 3
    idx = torch.ops.fxglm5.indexer_topk(q, k, w, topk)
    assert idx.dtype == torch.int32 and idx.shape == (B, S, topk)
    for b in range(B):
        for s in range(S):
            scores = [(w[b, s].double() * torch.relu(q[b, s].double() @ k[b, t].double())).sum().item() for t in range(s + 1)]
            got = [i for i in idx[b, s].tolist() if i >= 0]
            assert len(got) == len(set(got)) == min(topk, s + 1) and all(0 <= i <= s for i in got)
            rest = [scores[t] for t in range(s + 1) if t not in got]
            assert not rest or min(scores[i] for i in got) >= max(rest) - 1e-5


def test_moe_fp8_plain_and_quantized_agree():
    t, e, hd, inter, k = 5, 4, 128, 128, 2
    w13 = (torch.randn(e, 2 * inter, hd) * 0.1).to(torch.float8_e4m3fn)
    w2 = (torch.randn(e, hd, inter) * 0.1).to(torch.float8_e4m3fn)
    s13, s2 = torch.rand(e, 2, 1) + 0.5, torch.rand(e, 1, 1) + 0.5
    x = torch.randn(t, hd)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)]).to(torch.int32)
    wts = torch.rand(t, k)
    fp8 = torch.ops.fxglm5.moe_fp8(x, ids, wts, w13, s13, w2, s2, False)
    plain = torch.ops.fxglm5.moe_fp8(x, ids, wts, dequantize_block_fp8(w13, s13), None, dequantize_block_fp8(w2, s2), None, False)
    torch.testing.assert_close(fp8, plain, rtol=1e-5, atol=1e-5)


OPCHECKED = ["fp8_linear", "moe_route", "moe_fp8", "mla", "indexer_topk", "sparse_mla", "rms_norm", "rope_interleaved",
             "all_reduce", "all_gather",  # the collectives at world 1 here; over gloo ranks in tests/parallel
             "add_rms_norm", "f32_linear", "moe_route_local", "moe_router", "silu_mul_fp8_linear",
             "moe_fp8_add", "moe_fp8_shared", "moe_router_fp8_shared", "add_rms_norm_fp8_linear",
             "fp8_linear_latent_query", "add_rms_norm_moe_router_fp8_shared"]  # fxglm5.ops.fused
# tests/ops/test_cache_layout.py::test_opcheck_cached_ops (fp8_linear_latent_query_indexer: fxglm5.ops.fused, over a
# cached op's index cache and context)
OPCHECKED_CACHED = ["rtp_indexer", "rtp_sparse_mla", "rtp_mla", "fp8_linear_latent_query_indexer"]
OPCHECKED_WRITES = ["rms_norm_write_caches"]  # fxglm5.ops.fused, tests/ops/test_norm_write_caches.py::test_opcheck


def test_every_fxglm5_op_is_opchecked():
    """A new fxglm5:: op needs an opcheck case (here or beside the cached ops) before this passes."""
    import fxglm5.ops.cached  # noqa: F401  (registers the cached ops)

    registered = {n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("fxglm5::")}
    assert registered == set(OPCHECKED) | set(OPCHECKED_CACHED) | set(OPCHECKED_WRITES)


@pytest.mark.parametrize("name", OPCHECKED)
def test_opcheck(name):
    q, k, w = torch.randn(B, S, 4, 16), torch.randn(B, S, 16), torch.rand(B, S, 4)
    mla_args = _mla_inputs()
    e, hd, inter = 4, 128, 128
    cases = {
        "fp8_linear": (torch.randn(3, 200), (torch.randn(150, 200) * 0.1).to(torch.float8_e4m3fn), torch.rand(2, 2), None, True),
        "moe_route": (torch.randn(5, 8), torch.randn(8) * 0.1, 2, 1, 1, True, 2.5),
        "moe_fp8": (
            torch.randn(5, hd), torch.randint(0, e, (5, 2), dtype=torch.int32), torch.rand(5, 2),
            (torch.randn(e, 2 * inter, hd) * 0.1).to(torch.float8_e4m3fn), torch.rand(e, 2, 1),
            (torch.randn(e, hd, inter) * 0.1).to(torch.float8_e4m3fn), torch.rand(e, 1, 1), True,
        ),
        "mla": (*mla_args, 0.125),
        "indexer_topk": (q, k, w, 3),
        "sparse_mla": (*mla_args, torch.ops.fxglm5.indexer_topk(q, k, w, 3), 0.125),
        "rms_norm": (torch.randn(B, S, 24), torch.rand(24) + 0.5, 1e-6),
        "rope_interleaved": (torch.randn(B, S, H, DR + 4), torch.randn(B, S, DR // 2), torch.randn(B, S, DR // 2)),
        "all_reduce": (torch.randn(B, S, 24), "tp", 1),
        "all_gather": (torch.randn(B, S, 24), -1, "tp", 1),
        "add_rms_norm": (torch.randn(B, S, 24), torch.randn(B, S, 24), torch.rand(24) + 0.5, 1e-6),
        "f32_linear": (torch.randn(B, S, 24).bfloat16(), torch.randn(6, 24), [0.5, 0.25]),
        "moe_route_local": (torch.randn(5, 8), torch.randn(8) * 0.1, 2, 1, 1, True, 2.5, torch.tensor(4, dtype=torch.int32),
                            4),
        "moe_router": (torch.randn(5, 24).bfloat16(), torch.randn(8, 24), torch.randn(8) * 0.1, 2, 1, 1, True, 2.5,
                       torch.tensor(4, dtype=torch.int32), 4),
        "silu_mul_fp8_linear": (torch.randn(3, 200), torch.randn(3, 200), (torch.randn(150, 200) * 0.1).to(
            torch.float8_e4m3fn), torch.rand(2, 2), None, True),
    }
    # the GEMM of the sum's normed rows (200 features: a K tail), the normed rows kept
    cases["add_rms_norm_fp8_linear"] = (torch.randn(B, S, 200), torch.randn(B, S, 200), torch.rand(200) + 0.5, 1e-6,
                                        *cases["fp8_linear"][1:], True)
    cases["moe_fp8_add"] = (*cases["moe_fp8"], torch.randn(5, hd))  # the shared expert's row added in the combine
    # the shared expert's stacked gate|up (an intermediate of 96, the gate padded to 128 rows) and down GEMMs
    cases["moe_fp8_shared"] = (*cases["moe_fp8"], (torch.randn(224, hd) * 0.1).to(torch.float8_e4m3fn),
                               torch.rand(2, 1), (torch.randn(hd, 96) * 0.1).to(torch.float8_e4m3fn), torch.rand(1, 1),
                               128)
    # the router of the MoE's tokens (5 x 128, 8 experts: ids local to experts [4, 8)), then that MoE layer
    cases["moe_router_fp8_shared"] = (cases["moe_fp8"][0], torch.randn(8, hd), torch.randn(8) * 0.1, 2, 1, 1, True,
                                      2.5, torch.tensor(4, dtype=torch.int32), 4, *cases["moe_fp8_shared"][3:])
    # the residual add and norm of the MoE's tokens [B, S, 128] (B * S = 6 rows), then that MoE layer with its router
    cases["add_rms_norm_moe_router_fp8_shared"] = (torch.randn(B, S, hd), torch.randn(B, S, hd), torch.rand(hd) + 0.5,
                                                   1e-6, *cases["moe_router_fp8_shared"][1:])
    # the q_b | wq_b GEMM (3 heads of 16 + 8 query columns from column 0, 78 more after them) with its heads' latent
    # query (W_UK [3, 16, 40]) and their RoPE tables [B, S, 4]
    cases["fp8_linear_latent_query"] = (torch.randn(B, S, 200), *cases["fp8_linear"][1:], torch.randn(H, 16, 40), 0,
                                        DR, torch.randn(B, S, DR // 2), torch.randn(B, S, DR // 2))
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    if name in ("fp8_linear", "moe_fp8", "moe_fp8_add", "moe_fp8_shared", "moe_router_fp8_shared",
                "silu_mul_fp8_linear", "add_rms_norm_fp8_linear", "fp8_linear_latent_query",
                "add_rms_norm_moe_router_fp8_shared"):
        utils = utils[1:]  # test_schema's alias checker multiplies tensors, which CPU float8 does not support
    opcheck(getattr(torch.ops.fxglm5, name).default, cases[name], test_utils=utils)
