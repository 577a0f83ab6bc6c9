"""One kernel row of issue 24's table, launched once for a profiler (Nsight Compute) at the row's shape.

    python bench/profile_rows.py --list
    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section MemoryWorkloadAnalysis --csv --page details \
        python bench/profile_rows.py mla_decode_fp8_h64 > $OUT/ncu_mla_decode_fp8_h64.csv

Each row builds its inputs the way the benchmark that measures it does (``bench/kernels.py``,
``bench/kernels_attention.py``), runs the op twice to compile and warm it, then runs it once between
``cudaProfilerStart`` / ``cudaProfilerStop``: with ``--profile-from-start off`` only that call's kernels are
profiled. The timings of record stay the benchmarks' (CUDA-graph replays over cold weights); a profile says why a
row reaches what it does (DRAM and SM throughput, occupancy, registers, shared memory per block).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness  # noqa: E402


def _mla(cdt, heads, sparse, B=64, ctx=32768):
    from bench.kernels_attention import D, R, SCALE, TOPK, _paged
    from fxglm5.lowering.triton import mla, sparse_mla

    cache, bt = _paged(B, ctx, 656 if cdt == torch.uint8 else 576, cdt)
    q = torch.randn(B, heads, D, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(B, heads, R, device="cuda", dtype=torch.bfloat16)
    req = torch.arange(B, device="cuda", dtype=torch.int32)
    if sparse:
        topk = torch.rand(B, ctx, device="cuda").topk(TOPK, dim=1).indices.int()
        return lambda: sparse_mla.sparse_mla_decode_paged(q, cache, bt, req, topk, SCALE, validate=False, out=out)
    pos = torch.full((B,), ctx - 1, device="cuda", dtype=torch.int32)
    return lambda: mla.mla_decode_paged(q, cache, bt, req, pos, SCALE, validate=False, out=out)


def _sparse_prefill(cdt, heads, T=8192):
    from bench.kernels_attention import SCALE, sparse_prefill_inputs
    from fxglm5.lowering.triton import sparse_mla

    cache, bt, q, req, topk, out = sparse_prefill_inputs(T, heads, cdt)
    return lambda: sparse_mla.sparse_mla_prefill_paged(q, cache, bt, req, topk, SCALE, validate=False, out=out)


def _gemm(n, k, m):
    from bench.kernels import _weights
    from fxglm5.lowering.triton.fp8_gemm import fp8_linear

    w, s = _weights(n, k)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    return lambda: fp8_linear(x, w, s, None, True)


def _moe(t):
    from bench.kernels import _moe_weights
    from fxglm5.lowering.triton.moe import moe_fp8, moe_route

    e, h, inter, k = 256, 6144, 2048, 8
    w13, s13, w2, s2 = _moe_weights(e, h, inter)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    gate = torch.randn(e, h, device="cuda", dtype=torch.bfloat16) * 0.02
    w, ids = moe_route((x @ gate.T).float(), torch.randn(e, device="cuda") * 0.01, k, 1, 1, True, 2.5)
    return lambda: moe_fp8(x, ids, w, w13, s13, w2, s2, True)


def _indexer(B=64, ctx=32768):
    from bench.kernels_attention import TOPK, indexer_inputs
    from fxglm5.lowering.triton import indexer

    kc, bt, q, w, pos, req, logits, top = indexer_inputs(B, ctx)
    return lambda: indexer.indexer_topk_paged(q, w, kc, bt, req, pos, TOPK, validate=False, logits_buf=logits,
                                              out=top)


ROWS = {  # name -> builder of a zero-argument call (issue 24's rows at their shapes)
    "mla_decode_fp8_h64": lambda: _mla(torch.uint8, 64, False),
    "mla_decode_fp8_h8": lambda: _mla(torch.uint8, 8, False),
    "sparse_mla_decode_bf16_h64": lambda: _mla(torch.bfloat16, 64, True),
    "sparse_mla_decode_fp8_h64": lambda: _mla(torch.uint8, 64, True),
    "sparse_mla_decode_bf16_h8": lambda: _mla(torch.bfloat16, 8, True),
    "sparse_mla_decode_fp8_h8": lambda: _mla(torch.uint8, 8, True),
    "sparse_mla_prefill_bf16_h64": lambda: _sparse_prefill(torch.bfloat16, 64),
    "sparse_mla_prefill_fp8_h64": lambda: _sparse_prefill(torch.uint8, 64),
    "sparse_mla_prefill_fp8_h8": lambda: _sparse_prefill(torch.uint8, 8),
    "gemm_decode_o_proj_m1": lambda: _gemm(6144, 16384, 1),
    "gemm_decode_gate_up_m16": lambda: _gemm(24576, 6144, 16),
    "gemm_prefill_o_proj_m4096": lambda: _gemm(6144, 16384, 4096),
    "gemm_prefill_kv_a_m4096": lambda: _gemm(576, 6144, 4096),
    "gemm_prefill_qkv_a_m4096": lambda: _gemm(2048 + 576 + 128, 6144, 4096),  # q_a | kv_a | wk, fused
    "moe_decode_b1": lambda: _moe(1),
    "moe_decode_b64": lambda: _moe(64),
    "moe_prefill_t2048": lambda: _moe(2048),
    "indexer_topk_b64": _indexer,
}


def main():
    harness.answer_help(__doc__)
    if "--list" in sys.argv[1:]:
        print("\n".join(ROWS))
        return
    names = [a for a in sys.argv[1:] if not a.startswith("--")]
    unknown = [n for n in names if n not in ROWS]
    if not names or unknown:
        raise SystemExit(f"profile_rows: name rows to run (unknown: {unknown}); known: {', '.join(ROWS)}")
    for name in names:
        call = ROWS[name]()
        call(), call()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        call()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        print(f"profiled {name}", file=sys.stderr)


if __name__ == "__main__":
    main()
