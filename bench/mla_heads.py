"""MLA / sparse MLA decode at a tensor-parallel rank's head count: the Hopper kernel's two forms side by side.

At 8 heads (a TP8 rank of GLM-5's 64) the Hopper kernel with the heads as its 64 MMA rows (``hopper64``, the
form above 16 heads) does the 64-head MMA work for an eighth of the useful output; the default launch
makes the 64 keys of a tile the MMA rows and the heads, padded to 8 or 16, the N (``mla_hopper.rows_for``).
This times both in one run at B=64 (dense 32k context, sparse top-2048 of 32k), bf16 and FP8 (656-byte) caches,
and the sparse prefill of one 8k-token request (each token's 2048 gathered rows are its bytes),
the default at a few split counts, and, with ``--triton``, the generic Triton kernel at explicit launches
(slower than both at every shape measured: ``bench/results/mla_heads_h8_speculative_a39a923/``). Every output is compared
with the ``hopper64`` one (max abs difference in the note).

    python bench/mla_heads.py [--heads 8] [--triton]   # saves mla_heads_h<heads>.{json,md} under $OUT or bench/results
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness  # noqa: E402
from bench.harness import Results, copy_bandwidth_gbs, time_graph_us  # noqa: E402
from bench.kernels_attention import BS, D, R, SCALE, TOPK, _paged, _row, sparse_prefill_inputs  # noqa: E402

HEADS = int(sys.argv[sys.argv.index("--heads") + 1]) if "--heads" in sys.argv else 8
HOPPER64 = {"kernel": "hopper64"}
TRITON_CFGS = {False: [dict(BLOCK_N=64, USE_TMA=True, num_warps=8, num_stages=2)],
               True: [dict(BLOCK_N=64, num_warps=4, num_stages=3), dict(BLOCK_N=32, num_warps=4, num_stages=4)]}


def _sweep(results, name, shape, run, bytes_, flops, sparse):
    from fxglm5.lowering.triton import mla

    out_ref = run(HOPPER64, None).clone()
    launches = [(None, None), (None, 4), (None, 8), (HOPPER64, None), (None, None)]  # the default first and last
    if "--triton" in sys.argv:
        launches += [(c, None) for c in TRITON_CFGS[sparse]]
    for cfg, ns in launches:
        try:
            us = time_graph_us(lambda: run(cfg, ns))
            diff = (run(cfg, ns).float() - out_ref.float()).abs().max().item()
            _row(results, name, f"{shape} splits={ns}", us, bytes_=bytes_, flops=flops,
                 note=f"{'default' if cfg is None else cfg}: {mla.tuned_config()}; max|d| vs hopper64 {diff:.2e}")
        except Exception as e:  # noqa: BLE001 - a launch that fails is reported, the others still run
            print("launch failed", cfg, ns, type(e).__name__, str(e)[:300], flush=True)


def _sparse_prefill(results, cdt, tag, T=8192):
    """Sparse MLA prefill of one 8k-token request at HEADS heads, beside the floor of its gathered rows."""
    from fxglm5.lowering.triton import mla, sparse_mla

    cache, bt, q, req, topk, out = sparse_prefill_inputs(T, HEADS, cdt)
    nvalid = int((topk >= 0).sum())
    for cfg in (None, HOPPER64):
        try:
            us = time_graph_us(lambda: sparse_mla.sparse_mla_prefill_paged(q, cache, bt, req, topk, SCALE,
                                                                           validate=False, out=out, cfg=cfg))
            _row(results, f"sparse_mla_prefill[{tag}]", f"T={T} H={HEADS} topk={TOPK}", us,
                 bytes_=nvalid * cache.shape[-1] * cache.element_size(), flops=2 * HEADS * nvalid * (D + R),
                 note=f"{'default' if cfg is None else cfg}: {mla.tuned_config()}; bytes = the gathered rows")
        except Exception as e:  # noqa: BLE001 - a launch that fails is reported, the others still run
            print("launch failed", cfg, type(e).__name__, str(e)[:300], flush=True)
    torch.cuda.empty_cache()


def main():
    harness.answer_help(__doc__)
    from fxglm5.lowering.triton import mla, sparse_mla

    results = Results(copy_gbs=copy_bandwidth_gbs())
    print(f"copy bandwidth: {results.copy_gbs:.0f} GB/s", flush=True)
    B, ctx = 64, 32768
    for cdt in (torch.bfloat16, torch.uint8):
        width = 656 if cdt == torch.uint8 else 576
        tag = "fp8" if cdt == torch.uint8 else "bf16"
        cache, bt = _paged(B, ctx, width, cdt)
        q = torch.randn(B, HEADS, D, device="cuda", dtype=torch.bfloat16)
        req = torch.arange(B, device="cuda", dtype=torch.int32)
        out = torch.empty(B, HEADS, R, device="cuda", dtype=torch.bfloat16)
        pos = torch.full((B,), ctx - 1, device="cuda", dtype=torch.int32)

        def dense(cfg, ns):
            return mla.mla_decode_paged(q, cache, bt, req, pos, SCALE, validate=False, out=out, cfg=cfg,
                                        num_splits=ns)

        _sweep(results, f"mla_decode[{tag}]", f"B={B} H={HEADS} ctx={ctx} bs={BS}", dense,
               B * ctx * width * cache.element_size(), 2 * B * HEADS * ctx * (D + R), False)
        topk = torch.rand(B, ctx, device="cuda").topk(TOPK, dim=1).indices.int()

        def sparse(cfg, ns):
            return sparse_mla.sparse_mla_decode_paged(q, cache, bt, req, topk, SCALE, validate=False, out=out,
                                                      cfg=cfg, num_splits=ns)

        _sweep(results, f"sparse_mla_decode[{tag}]", f"B={B} H={HEADS} topk={TOPK} ctx={ctx}", sparse,
               B * TOPK * width * cache.element_size(), 2 * B * HEADS * TOPK * (D + R), True)
        del cache, bt
        torch.cuda.empty_cache()
        _sparse_prefill(results, cdt, tag)
    print("saved", results.save(f"mla_heads_h{HEADS}"), flush=True)


if __name__ == "__main__":
    main()
