"""``fxglm5::f32_linear`` at prefill rows: the 3xTF32 tensor-core GEMM against the cuBLAS float32 path it replaced.

The router (N = 256, no scale) and the indexer head weights (N = 32, two scales) at K = 6144, x bf16 (the hidden
states; ``--dtypes bf16,float32`` adds a float32 x, which takes a third MMA per K step), M = 2048, 8192 and 32768
rows (``--rows``):

    python bench/f32_linear_prefill.py [--rows 2048,8192,32768] [--dtypes bf16]

Each row: ``cublas_us``, what the op ran past MAX_GEMV_ROWS before the GEMM (``ref.f32_linear``: the cast of x to
float32, cuBLAS's float32 GEMM, one multiply per scale), ``cublas_gemm_us`` (its GEMM alone, x cast beforehand),
``tc_us`` (``f32_linear``: the Triton 3xTF32 GEMM, its launch config beside it), microseconds per call (CUDA events
around eager calls, median of 10 after 3 warm-ups), and each path's relative error (Frobenius norm) against a
float64 product. Saves ``f32_linear_prefill.{json,md}`` (a table of the rows) under ``harness.out_dir()``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness  # noqa: E402
from fxglm5.lowering.reference import fused as ref  # noqa: E402

K = 6144
SHAPES = [("router", 256, []), ("index_weights", 32, [32 ** -0.5, 128 ** -0.5])]
DTYPES = {"bf16": torch.bfloat16, "float32": torch.float32}


def _us(fn) -> float:
    for _ in range(3):
        fn()
    return statistics.median(harness.events_us(fn, 10))


def _rel(out: torch.Tensor, exact: torch.Tensor) -> float:
    return ((out.double() - exact).norm() / exact.norm()).item()


def main() -> None:
    harness.answer_help(__doc__)
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="2048,8192,32768")
    parser.add_argument("--dtypes", default="bf16")
    args = parser.parse_args()
    from fxglm5.lowering.triton import f32_linear
    from fxglm5.lowering.triton.device import num_sms

    sms = num_sms(torch.device("cuda"))
    results = harness.Results()
    for dtype_name in args.dtypes.split(","):
        for m in (int(r) for r in args.rows.split(",")):
            g = torch.Generator(device="cuda").manual_seed(m)
            x = torch.randn(m, K, device="cuda", generator=g).to(DTYPES[dtype_name])
            xf = x.float()
            for name, n, scales in SHAPES:
                w = torch.randn(n, K, device="cuda", generator=g) / K ** 0.5
                exact = x.double() @ w.double().T
                for s in scales:
                    exact = exact * s
                row = dict(x=dtype_name, m=m, op=name, n=n,
                           cublas_us=_us(lambda: ref.f32_linear(x, w, scales)),
                           cublas_gemm_us=_us(lambda: F.linear(xf, w)),
                           tc_us=_us(lambda: f32_linear.f32_linear(x, w, scales, validate=False)))
                row.update(speedup=row["cublas_us"] / row["tc_us"],
                           err_cublas=_rel(ref.f32_linear(x, w, scales), exact),
                           err_tc=_rel(f32_linear.f32_linear(x, w, scales), exact),
                           config=f32_linear.gemm_config(m, n, K, sms))
                results.add(**row)
                del exact
            del x, xf
    for path in results.save("f32_linear_prefill", notes=f"\nK = {K}; us per call, errors against float64.\n"):
        print(path)


if __name__ == "__main__":
    main()
