"""Kernel benchmarks at GLM-5 shapes: block-FP8 GEMM and fused FP8 MoE (more sections register themselves).

    python bench/kernels.py --only gemm,moe      # writes bench/results/kernels_gemm_moe.{json,md}
    python bench/kernels.py --only fused         # the shared-input GEMMs stacked into one (qkv_a, ...) vs apart
    python bench/kernels.py --only norm_gemm     # the residual add + RMSNorm in the decode GEMM vs its own kernel

Decode rows (M <= 16, MoE batch 1/64) are timed as CUDA-graph replays where every captured call reads a
different weight copy (or routes to different experts), so weights come from HBM, not L2; bandwidth is
reported against the copy bandwidth measured in the same run. Prefill rows (M = 4096) are compute bound
and report TFLOPS. Baselines run in the same process: cuBLAS bf16 (torch.matmul on dequantized weights)
and cuBLAS FP8 with one tensor-wise scale each (torch._scaled_mm). Sections live in ``harness.SECTIONS``;
``bench/kernels_attention.py``, when present, adds its own.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness  # noqa: E402
from bench.harness import Results, rotating, section, time_graph_us  # noqa: E402

FP8 = torch.float8_e4m3fn

GEMM_SHAPES = [  # (name, N, K)
    ("q_a / expert gate|up", 2048, 6144),
    ("q_b", 16384, 2048),
    ("kv_a", 576, 6144),
    ("kv_b", 28672, 512),
    ("o_proj", 6144, 16384),
    ("idx wq_b", 4096, 2048),
    ("idx wk", 128, 6144),
    ("dense gate|up", 12288, 6144),
    ("dense gate_up", 24576, 6144),
    ("dense down", 6144, 12288),
    ("expert down", 6144, 2048),
]


def _rand_fp8(*shape, device="cuda"):
    return (torch.randn(*shape, device=device) * 0.5).to(FP8)


def _cfg_str(cfg):
    keys = ("BLOCK_M", "BLOCK_N", "BLOCK_N1", "BLOCK_N2", "SPLIT_K", "SPLIT2", "FIXUP", "num_warps", "num_stages", "STAGES",
            "UNROLL", "WS")
    return " ".join(f"{k}={cfg[k]}" for k in keys if k in cfg)


def _weights(n, k):
    w = _rand_fp8(n, k)
    s = torch.rand(-(-n // 128), -(-k // 128), device="cuda") * 1e-2 + 1e-3
    return w, s


def _timed(fn_of_copy, make, nbytes, cold=True):
    """Time fn over rotated copies (cold weights) or one copy (compute-bound rows)."""
    if cold:
        copies, nxt = rotating(make, None, bytes_per_copy=nbytes)
    else:
        copies, nxt = rotating(make, 1)
    us = time_graph_us(lambda: fn_of_copy(*nxt()), calls_per_graph=len(copies))
    del copies
    return us


def _try(fn):
    try:
        return fn()
    except Exception as e:  # a baseline cuBLAS refuses (shape/alignment) is recorded, not fatal
        print(f"  baseline failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
        return None


@section("gemm")
def bench_gemm(res: Results, args):
    from fxglm5.lowering.triton import fp8_gemm_hopper
    from fxglm5.lowering.triton.fp8_gemm import fp8_linear, pick_config

    ms = [int(m) for m in args.gemm_m.split(",")]
    for name, n, k in GEMM_SHAPES:
        for m in ms:
            cold = m <= 64
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            wbytes = n * k + 4 * (-(-n // 128)) * (-(-k // 128))
            us = _timed(lambda w, s: fp8_linear(x, w, s, None, True), lambda i: _weights(n, k), wbytes, cold)
            us_bf16 = _try(lambda: _timed(lambda w: torch.matmul(x, w.T),
                                          lambda i: (torch.randn(n, k, device="cuda", dtype=torch.bfloat16),),
                                          2 * n * k, cold))
            one = torch.ones((), device="cuda")
            xq = x.to(FP8)
            us_fp8 = _try(lambda: _timed(lambda w: torch._scaled_mm(xq, w.T, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                                         lambda i: (_rand_fp8(n, k),), n * k, cold))
            # where fp8_linear takes the Gluon Hopper kernel, the Triton kernel of the same call, measured in the
            # same run (the baseline the Gluon kernel must beat)
            gluon = fp8_gemm_hopper.supported(x, torch.empty(n, k, dtype=FP8, device="cuda"), True)
            us_triton = (_timed(lambda w, s: fp8_linear(x, w, s, None, True, config={"kernel": "triton"}),
                                lambda i: _weights(n, k), wbytes, cold) if gluon else None)
            nbytes = wbytes + m * k * 2 + m * n * 2
            row = dict(section="gemm", shape=f"{name} {n}x{k}", M=m, us=us, TBps=nbytes / us / 1e6,
                       pct_copy=100 * nbytes / us / 1e3 / res.copy_gbs, TFLOPS=2 * m * n * k / us / 1e6,
                       kernel="gluon" if gluon else "triton", triton_us=us_triton,
                       x_vs_triton=(us_triton / us) if us_triton else None,
                       bf16_us=us_bf16, fp8_tensorwise_us=us_fp8,
                       x_vs_bf16=(us_bf16 / us) if us_bf16 else None, x_vs_fp8tw=(us_fp8 / us) if us_fp8 else None,
                       cfg=_cfg_str(fp8_gemm_hopper.pick_config(m, n) if gluon else
                                    pick_config(m, n, k, True, torch.cuda.get_device_properties(0).multi_processor_count)))
            res.add(**row)
            del x
        torch.cuda.empty_cache()


FUSED_GROUPS = [  # (name, the members' N, K): what fuse_shared_input_gemms makes one GEMM of, per GLM-5 layer
    ("qkv_a: q_a | kv_a | idx wk", (2048, 576, 128), 6144),
    ("q_b | idx wq_b", (16384, 4096), 2048),
    ("shared expert gate | up", (2048, 2048), 6144),
    ("dense gate | up", (12288, 12288), 6144),
]


@section("fused")
def bench_fused(res: Results, args):
    """One GEMM over the stacked weights (as fuse_shared_input_gemms lays them out) against its members' GEMMs run
    one after the other, same activation, same cold-weight rotation, both CUDA-graph replays."""
    from fxglm5.lowering.triton.fp8_gemm import fp8_linear
    from fxglm5.passes.fuse_shared_input_gemms import stack, stacked_layout

    for name, sizes, k in FUSED_GROUPS:
        order, rows = stacked_layout(list(sizes))
        members = [sizes[i] for i in order]
        scale_rows = tuple(-(-r // 128) for r in rows)
        wbytes = sum(n * k + 4 * (-(-n // 128)) * (-(-k // 128)) for n in members)

        def make(i):
            weights = [_weights(n, k) for n in members]
            return (*weights, (stack(rows, *(w for w, _ in weights)), stack(scale_rows, *(s for _, s in weights))))

        for m in [int(v) for v in args.fused_m.split(",")]:
            cold = m <= 64
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            copies, nxt = rotating(make, None if cold else 1, bytes_per_copy=wbytes)  # each replay reads one half
            calls = len(copies)
            separate = time_graph_us(lambda: [fp8_linear(x, w, s, None, True) for w, s in nxt()[:-1]],
                                     calls_per_graph=calls)
            fused = time_graph_us(lambda: fp8_linear(x, *nxt()[-1], None, True), calls_per_graph=calls)
            del copies
            nbytes = wbytes + m * k * 2 + m * sum(members) * 2
            res.add(section="fused", shape=f"{name} {'+'.join(map(str, members))}x{k}", M=m, fused_us=fused,
                    separate_us=separate, x_fused_vs_separate=separate / fused,
                    fused_pct_copy=100 * nbytes / fused / 1e3 / res.copy_gbs,
                    separate_pct_copy=100 * (nbytes + (len(members) - 1) * m * k * 2) / separate / 1e3 / res.copy_gbs,
                    TFLOPS=2 * m * sum(members) * k / fused / 1e6)
            del x
        torch.cuda.empty_cache()


NORMED_GEMMS = [  # (name, N, K, keep_normed): a TP8 rank's GEMMs fuse_add_rms_norm_into_gemm gives their add + norm
    ("qkv_a: q_a | kv_a | idx wk", 2048 + 576 + 128, 6144, True),
    ("dense gate | up / 8", 3072, 6144, False),
]


@section("norm_gemm")
def bench_norm_gemm(res: Results, args):
    """add_rms_norm_fp8_linear (one launch up to fp8_gemm.NORM_ROWS rows: every CTA sums its rows' squares over the
    whole row, then forms its A tiles as the normed rows) against add_rms_norm's kernel then fp8_linear's, W8A16 and
    W8A8, the same rows (hot in L2, as an all-reduce leaves them), the same cold-weight rotation, both CUDA-graph
    replays: where the norm in the GEMM stops paying (the rows every CTA reads grow with M), NORM_ROWS should stop."""
    from fxglm5.lowering.triton.fp8_gemm import NORM_ROWS, add_rms_norm_fp8_linear, fp8_linear
    from fxglm5.lowering.triton.norm_rope import add_rms_norm

    for name, n, k, keep in NORMED_GEMMS:
        wbytes = n * k + 4 * (-(-n // 128)) * (-(-k // 128))
        for m in [int(v) for v in args.norm_m.split(",")]:
            x, r = (torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            nw = torch.ones(k, device="cuda", dtype=torch.bfloat16)
            for act_quant in (False, True):
                copies, nxt = rotating(lambda i: _weights(n, k), None, bytes_per_copy=wbytes)

                def two_launches():
                    return fp8_linear(add_rms_norm(x, r, nw, 1e-5)[0], *nxt(), None, act_quant)

                separate = time_graph_us(two_launches, calls_per_graph=len(copies))
                fused = time_graph_us(lambda: add_rms_norm_fp8_linear(x, r, nw, 1e-5, *nxt(), None, act_quant, keep),
                                      calls_per_graph=len(copies))
                del copies
                res.add(section="norm_gemm", shape=f"{name} {n}x{k}", M=m, act_quant=act_quant, fused_us=fused,
                        separate_us=separate, x_fused_vs_separate=separate / fused, in_gemm=m <= NORM_ROWS)
            del x, r
        torch.cuda.empty_cache()


def _moe_weights(e, h, inter):
    w13 = torch.empty(e, 2 * inter, h, dtype=FP8, device="cuda")
    w2 = torch.empty(e, h, inter, dtype=FP8, device="cuda")
    for i in range(e):
        w13[i] = _rand_fp8(2 * inter, h)
        w2[i] = _rand_fp8(h, inter)
    s13 = torch.rand(e, 2 * inter // 128, h // 128, device="cuda") * 1e-2 + 1e-3
    s2 = torch.rand(e, h // 128, inter // 128, device="cuda") * 1e-2 + 1e-3
    return w13, s13, w2, s2


def _eager_us(fn, reps=3):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(ts)


@section("moe")
def bench_moe(res: Results, args):
    e, h, inter, k = 256, 6144, 2048, 8
    w13, s13, w2, s2 = _moe_weights(e, h, inter)
    sh_gu, sh_gu_s = _weights(2 * inter, h)
    sh_d, sh_d_s = _weights(h, inter)
    gate = torch.randn(e, h, device="cuda", dtype=torch.bfloat16) * 0.02
    bias = torch.randn(e, device="cuda") * 0.01
    expert_bytes = 3 * h * inter + 4 * (s13[0].numel() + s2[0].numel())
    bf16_w = []
    for t in [int(v) for v in args.moe_t.split(",")]:
        try:
            _bench_moe_t(res, t, e, h, inter, k, w13, s13, w2, s2, sh_gu, sh_gu_s, sh_d, sh_d_s, gate, bias,
                         expert_bytes, bf16_w)
        except Exception as ex:  # one batch size failing keeps the others
            import traceback

            traceback.print_exc()
            res.add(section="moe", M=t, error=f"{type(ex).__name__}: {str(ex)[:200]}")
        torch.cuda.empty_cache()


def _bench_moe_t(res, t, e, h, inter, k, w13, s13, w2, s2, sh_gu, sh_gu_s, sh_d, sh_d_s, gate, bias, expert_bytes,
                 bf16_w):
    """One batch size: routed experts alone, and the whole MoE block (router + experts + shared expert)."""
    from fxglm5.lowering.reference.fp8 import dequantize_block_fp8, moe_fp8 as moe_ref
    from fxglm5.lowering.triton.fp8_gemm import fp8_linear
    from fxglm5.lowering.triton.moe import moe_fp8, moe_route, pick_moe_config

    shared_bytes = expert_bytes
    n_copies = 8 if t <= 64 else 1
    xs = [torch.randn(t, h, device="cuda", dtype=torch.bfloat16) for _ in range(n_copies)]
    routes = [moe_route((x @ gate.T).float(), bias, k, 1, 1, True, 2.5) for x in xs]
    distinct = statistics.mean(int(torch.unique(r[1]).numel()) for r in routes)
    state = {"i": 0}

    def routed():
        i = state["i"] % n_copies
        state["i"] += 1
        w, ids = routes[i]
        return moe_fp8(xs[i], ids, w, w13, s13, w2, s2, True)

    def layer():
        i = state["i"] % n_copies
        state["i"] += 1
        x = xs[i]
        w, ids = moe_route((x @ gate.T).float(), bias, k, 1, 1, True, 2.5)
        y = moe_fp8(x, ids, w, w13, s13, w2, s2, True)
        gu = fp8_linear(x, sh_gu, sh_gu_s, None, True)
        hmid = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
        return y + fp8_linear(hmid, sh_d, sh_d_s, None, True)

    us = time_graph_us(routed, calls_per_graph=n_copies)
    us_layer = time_graph_us(layer, calls_per_graph=n_copies)
    nbytes = distinct * expert_bytes
    us_ref = _eager_us(lambda: moe_ref(xs[0], routes[0][1], routes[0][0], w13, s13, w2, s2, True), reps=1)
    if not bf16_w and t <= 64:
        bf16_w.extend(([dequantize_block_fp8(w13[i], s13[i]).bfloat16() for i in range(e)],
                       [dequantize_block_fp8(w2[i], s2[i]).bfloat16() for i in range(e)]))
    us_loop = _eager_us(lambda: _hf_expert_loop(xs[0], routes[0][1], routes[0][0], *bf16_w, inter)) \
        if bf16_w and t <= 64 else None
    res.add(section="moe", shape=f"E{e} top{k} H{h} I{inter}", M=t, us=us, distinct_experts=distinct,
            TBps=nbytes / us / 1e6, pct_copy=100 * nbytes / us / 1e3 / res.copy_gbs,
            layer_us=us_layer, layer_pct_copy=100 * (nbytes + shared_bytes) / us_layer / 1e3 / res.copy_gbs,
            TFLOPS=2 * 3 * t * k * h * inter / us / 1e6,
            hf_bf16_loop_us=us_loop, reference_us=us_ref,
            x_vs_hf_loop=(us_loop / us) if us_loop else None, x_vs_reference=us_ref / us,
            cfg=_cfg_str(pick_moe_config(t, k, e)))


def _hf_expert_loop(x, ids, w, w13b, w2b, inter):
    """transformers' eager expert loop (GlmMoeDsaExperts), bf16 weights."""
    out = torch.zeros_like(x)
    mask = torch.nn.functional.one_hot(ids.long(), num_classes=len(w13b)).permute(2, 1, 0)
    for ex in (mask.sum(dim=(-1, -2)) > 0).nonzero():
        slot, tok = torch.where(mask[ex[0]])
        gu = x[tok] @ w13b[ex[0]].T
        hmid = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
        y = (hmid @ w2b[ex[0]].T) * w[tok, slot, None].to(x.dtype)
        out.index_add_(0, tok, y)
    return out


def _geomean(vals):
    vals = [v for v in vals if v]
    return statistics.geometric_mean(vals) if vals else 0.0


GEMM_SWEEP = {  # regime -> (token counts, shapes, configs); the first config is the committed default
    "decode": ((16,), [("o_proj", 6144, 16384), ("dense gate_up", 24576, 6144), ("dense down", 6144, 12288)],
               [dict(BLOCK_N=bn, CTAS_PER_SM=c, num_stages=st, num_warps=w) for bn, c, st, w in (
                   (128, 4, 3, 4), (128, 4, 4, 4), (128, 2, 6, 4), (128, 1, 8, 4), (64, 8, 3, 4), (128, 4, 3, 8))]),
    "prefill": ((4096,), [("o_proj", 6144, 16384), ("q_b", 16384, 2048), ("kv_a", 576, 6144)],
                [dict(kernel="triton", BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st) for bm, bn, w, st in (
                    (64, 128, 4, 3), (64, 128, 4, 4), (128, 128, 8, 3), (128, 256, 8, 3))]),
    "gluon": ((4096,), [("o_proj", 6144, 16384), ("dense gate_up", 24576, 6144), ("q_b", 16384, 2048)],
              [dict(kernel="gluon", **c) for c in (
                  dict(), dict(WS=False), dict(WS=True, STAGES=5), dict(WS=True, STAGES=3))]),
    "gluon_narrow": ((4096,), [("kv_a", 576, 6144)],
                     [dict(kernel="gluon", **c) for c in (dict(), dict(WS=False, BLOCK_M=64))]),
    "gluon_small": ((4096,), [("idx wk", 128, 6144)],
                    [dict(kernel="gluon", **c) for c in (dict(), dict(WS=False, BLOCK_M=64), dict(BLOCK_N=128))]),
}
RANK_DECODE_SHAPES = [  # (name, N, K): one TP8 rank's decode GEMMs (8 of 64 heads, the indexer whole, 1/8 of the MLPs)
    ("qkv_a | idx wk", 2752, 6144),
    ("q_b | idx wq_b", 6144, 2048),
    ("o_proj", 6144, 2048),
    ("dense gate|up", 3072, 6144),
    ("dense down", 6144, 1536),
    ("shared gate|up", 512, 6144),
    ("shared down", 6144, 256),
]
GEMM_SWEEP["gemv_rank"] = (  # the tiled split-K kernel (today's decode path) against the GEMV's launches
    (1, 8), RANK_DECODE_SHAPES,
    [dict(kernel="triton"), dict(kernel="gemv")]
    + [dict(kernel="triton", **c) for c in (
        dict(CTAS_PER_SM=2), dict(CTAS_PER_SM=1), dict(CTAS_PER_SM=2, num_stages=4), dict(BLOCK_N=64, CTAS_PER_SM=2))]
    + [dict(kernel="gemv", **c) for c in (
        dict(BLOCK_N=32), dict(BLOCK_N=128), dict(num_warps=4), dict(num_stages=2), dict(num_stages=6),
        dict(CTAS_PER_SM=1), dict(CTAS_PER_SM=4), dict(CTAS_PER_SM=4, num_warps=4, BLOCK_N=32),
        dict(M_PAD=16), dict(M_PAD=16, BLOCK_N=128, num_warps=4), dict(M_PAD=16, CTAS_PER_SM=4, num_warps=4),
        dict(PREFETCH=True), dict(PREFETCH=True, CTAS_PER_SM=4), dict(PREFETCH=True, BLOCK_N=128),
        dict(PREFETCH=True, CTAS_PER_SM=4, num_warps=4))])
MOE_SWEEP = {  # regime -> (token counts, configs); the first config is the committed default
    "decode": ((1, 64), [dict(), dict(SPLIT1=1), dict(CTAS_PER_SM1=8), dict(num_stages=4), dict(SPLIT2=4)]),
    "prefill": ((2048,), [dict(BLOCK_M=bm, BLOCK_N1=n1, BLOCK_N2=n2, num_warps=w, num_stages=st)
                          for bm, n1, n2, w, st in ((64, 64, 128, 4, 3), (64, 128, 128, 4, 3), (128, 64, 128, 8, 3),
                                                    (128, 128, 128, 8, 3), (64, 128, 128, 4, 4))]),
}


def _apply_winner(res, section_name, regime, scores, defaults):
    """Record every config's geometric-mean speed over the swept shapes, apply the fastest to ``defaults`` (the
    sections after this one in the same process run with it) and record it as the ``applied`` row."""
    for key, (score, _) in scores.items():
        res.add(section=section_name, shape=f"{regime} geomean", cfg=key, score_per_ms=1e3 * score)
    best = max(scores.values(), key=lambda v: v[0])[1]
    defaults.update({key: v for key, v in best.items() if key != "kernel"})  # "kernel" is a call's choice
    res.add(section=section_name, shape=f"{regime} applied", cfg=str(best))


@section("sweep")
def bench_sweep(res: Results, args):
    """Config sweep of the block-FP8 GEMM's regimes (``GEMM_SWEEP``): the Triton kernel's decode and prefill
    configs, and the Gluon Hopper kernel's wide, narrow (N <= 1024) and small (N <= 256) configs.

    Each config is timed on every swept shape and token count as in the ``gemm`` section (cold weights at decode);
    the winner of each regime (geometric mean) is applied to the module defaults for the sections that run after
    it in the same process and recorded as an ``applied`` row; the committed defaults in fp8_gemm.py are copied
    from those rows.
    """
    from fxglm5.lowering.triton import fp8_gemm, fp8_gemm_hopper, fp8_gemv
    from fxglm5.lowering.triton.fp8_gemm import fp8_linear

    defaults = dict(decode=fp8_gemm.DECODE, prefill=fp8_gemm.PREFILL, gluon=fp8_gemm_hopper.WIDE,
                    gluon_narrow=fp8_gemm_hopper.NARROW, gluon_small=fp8_gemm_hopper.SMALL, gemv_rank=fp8_gemv.GEMV)
    for regime, (ms, shapes, cfgs) in GEMM_SWEEP.items():
        if args.regimes and regime not in args.regimes.split(","):
            continue
        scores = {}
        for cfg in cfgs:
            vals = []
            for m in ms:
                for name, n, k in shapes:
                    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                    us = _try(lambda: _timed(lambda w, s: fp8_linear(x, w, s, None, True, config=cfg),
                                             lambda i: _weights(n, k), n * k, m <= 64))
                    if us:
                        res.add(section="sweep", shape=f"{name} {n}x{k}", M=m, cfg=str(cfg), us=us,
                                pct_copy=100 * n * k / us / 1e3 / res.copy_gbs, TFLOPS=2 * m * n * k / us / 1e6)
                    vals.append(1 / us if us else None)
            scores[str(cfg)] = (_geomean(vals) if all(vals) else 0.0, cfg)
        _apply_winner(res, "sweep", regime, scores, defaults[regime])
        torch.cuda.empty_cache()


@section("moe_sweep")
def bench_moe_sweep(res: Results, args):
    """Config sweep of the fused MoE's decode and prefill regimes (``MOE_SWEEP``), routed experts only, timed as
    in the ``moe`` section; winners applied and recorded as in ``sweep``."""
    from fxglm5.lowering.triton import moe
    from fxglm5.lowering.triton.moe import moe_fp8, moe_route

    e, h, inter, k = 256, 6144, 2048, 8
    w13, s13, w2, s2 = _moe_weights(e, h, inter)
    gate = torch.randn(e, h, device="cuda", dtype=torch.bfloat16) * 0.02
    bias = torch.randn(e, device="cuda") * 0.01
    for regime, (ts, cfgs) in MOE_SWEEP.items():
        scores = {}
        for cfg in cfgs:
            vals = []
            for t in ts:
                n_copies = 8 if t <= 64 else 1
                xs = [torch.randn(t, h, device="cuda", dtype=torch.bfloat16) for _ in range(n_copies)]
                routes = [moe_route((x @ gate.T).float(), bias, k, 1, 1, True, 2.5) for x in xs]
                state = {"i": 0}

                def routed():
                    i = state["i"] % n_copies
                    state["i"] += 1
                    return moe_fp8(xs[i], routes[i][1], routes[i][0], w13, s13, w2, s2, True, config=cfg)

                us = _try(lambda: time_graph_us(routed, calls_per_graph=n_copies))
                if us:
                    res.add(section="moe_sweep", shape=f"E{e} top{k} H{h} I{inter}", M=t, cfg=str(cfg), us=us,
                            TFLOPS=2 * 3 * t * k * h * inter / us / 1e6)
                vals.append(1 / us if us else None)
            scores[str(cfg)] = (_geomean(vals) if all(vals) else 0.0, cfg)
        _apply_winner(res, "moe_sweep", regime, scores, moe.MOE_DECODE if regime == "decode" else moe.MOE_PREFILL)
        torch.cuda.empty_cache()
    del w13, w2


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default="gemm,moe", help="comma-separated sections: " + ",".join(harness.SECTIONS))
    p.add_argument("--gemm-m", default="1,4,16,4096")
    p.add_argument("--moe-t", default="1,64,2048")
    p.add_argument("--fused-m", default="1,16,64,4096", help="token counts of the fused-GEMM section")
    p.add_argument("--norm-m", default="1,2,4,8,16", help="rows of the norm_gemm section")
    p.add_argument("--regimes", default=None, help="sweep only these regimes (comma-separated): "
                   + ",".join(GEMM_SWEEP))
    p.add_argument("--name", default=None, help="results name (default kernels_<sections>)")
    args = p.parse_args()
    only = [s for s in args.only.split(",") if s]
    unknown = [s for s in only if s not in harness.SECTIONS]
    if unknown:
        p.error(f"unknown sections {unknown}; known: {list(harness.SECTIONS)}")
    res = Results(harness.copy_bandwidth_gbs())
    print(f"device {harness.device_info()} copy {res.copy_gbs:.0f} GB/s", flush=True)
    for s in only:
        try:
            harness.SECTIONS[s](res, args)
        except Exception as e:  # keep the other sections' rows
            import traceback

            traceback.print_exc()
            res.add(section=s, error=f"{type(e).__name__}: {str(e)[:200]}")
        paths = res.save(args.name or "kernels_" + "_".join(only))  # after each section: a timeout keeps rows
    print("wrote", *paths)


try:  # the attention engineer's sections (registered with harness.section), when present
    import bench.kernels_attention  # noqa: F401,E402
except ImportError:
    pass
except Exception as e:  # a broken neighbour must not take the GEMM/MoE figures down
    print(f"bench/kernels_attention.py not loaded: {type(e).__name__}: {e}", file=sys.stderr)

if __name__ == "__main__":
    main()
