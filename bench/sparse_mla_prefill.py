"""Sparse MLA of one prefill at one TP8 rank's heads: the query-tile kernel against the per-token kernel.

One request's prompt of ``--ctx`` tokens (8192 by default) attends at once, ``--heads`` heads (8: 64 heads over
TP8), top-k 2048, 64-token cache blocks, the bf16 and the FP8 (ds_mla) latent cache. The top-k lists are
indexer-like: every token lists its last ``--window`` positions and random ones before them (all of its prefix
while that is shorter than the top-k), -1 padded. Rows of the cache no token wrote hold NaN bytes.

    python bench/sparse_mla_prefill.py [--ctx 8192] [--heads 8] [--window 512] [--sweep]

Each row: kernel (``per_token``: ``sparse_mla_prefill_paged``, what the paged program ran at a prefill before the
tile kernel; ``tile``: ``sparse_mla_tile_paged``'s Triton tile kernel with its default launch, ``--sweep`` adds
other launches; ``tile_gluon``: its Gluon tile, ``sparse_mla_tile_hopper``, on sm_90 only), cache, ms per call (CUDA
events around eager calls, median of 10 after 3 warm-ups), and the largest difference from the per-token kernel's
output. Saves ``sparse_mla_prefill.json`` under ``harness.out_dir()``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness  # noqa: E402
from fxglm5.lowering.reference import paged as ref  # noqa: E402

BS, R, DR, D = 64, 512, 64, 576
TOPK = 2048
SCALE = 1.0 / 16
# launches the sweep times (8 warps: the two [64, 256] fp32 accumulators need them; a 64-row key tile's three
# stages would not fit shared memory beside the 64 x 576 queries)
SWEEP = [dict(BLOCK_N=bn, num_warps=8, num_stages=s) for bn in (32, 64) for s in (1, 2, 3) if not (bn == 64 and s == 3)]


def prefill_lists(positions: torch.Tensor, topk: int, window: int, generator: torch.Generator) -> torch.Tensor:
    """int32 [T, topk] indexer-like lists: each token's last ``window`` positions, then random earlier ones (the
    whole prefix when it is no longer than ``topk``), -1 padded, in descending-score order as the indexer lists."""
    ctx = int(positions.max()) + 1
    keys = torch.arange(ctx, device=positions.device)
    p = positions.long()[:, None]
    scores = torch.rand(len(positions), ctx, generator=generator, device=positions.device)
    scores = scores + 2.0 * (keys[None] > p - window)
    scores = scores.masked_fill(keys[None] > p, float("-inf"))
    k = min(topk, ctx)
    values, idx = scores.topk(k, dim=1)
    top = torch.full((len(positions), topk), -1, dtype=torch.int32, device=positions.device)
    top[:, :k] = torch.where(torch.isfinite(values), idx, -1).int()
    return top


def prefill_case(lens, prefill, heads: int, cdtype: torch.dtype, window: int = 512, seed: int = 0):
    """Requests of ``lens`` cached tokens (blocks permuted over a shared cache whose unwritten rows hold NaN
    bytes), and a flat prefill of positions ``prefill[b] = (start, end)`` of each: (q, cache, block_table,
    req_idx, positions, topk_pos) on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    need = [-(-n // BS) for n in lens]
    nb = sum(need) + 2
    perm = torch.randperm(nb - 1, generator=g, device="cuda") + 1
    bt = torch.zeros(len(lens), max(need) + 1, dtype=torch.int32, device="cuda")
    i = 0
    for b, n in enumerate(need):
        bt[b, :n] = perm[i:i + n].int()
        i += n
    if cdtype == torch.uint8:
        cache = torch.full((nb, BS, 656), 0xFF, dtype=torch.uint8, device="cuda")
    else:
        cache = torch.full((nb, BS, D), float("nan"), dtype=cdtype, device="cuda")
    for b, n in enumerate(lens):
        pos = torch.arange(n, device="cuda")
        slots = ref.slots_from_positions(bt, torch.full_like(pos, b), pos, BS)
        ref.write_latent_cache(cache, torch.randn(n, R, device="cuda", generator=g),
                               torch.randn(n, DR, device="cuda", generator=g), slots)
    req = torch.cat([torch.full((e - s,), b, dtype=torch.int32, device="cuda") for b, (s, e) in enumerate(prefill)])
    pos = torch.cat([torch.arange(s, e, dtype=torch.int32, device="cuda") for s, e in prefill])
    top = torch.cat([prefill_lists(pos[req == b], TOPK, window, g) for b in range(len(lens))])
    q = torch.randn(len(pos), heads, D, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, cache, bt, req, pos, top


def _ms(fn) -> float:
    for _ in range(3):
        fn()
    return statistics.median(harness.events_us(fn, 10)) / 1e3


def main() -> None:
    harness.answer_help(__doc__)
    parser = argparse.ArgumentParser()
    parser.add_argument("--ctx", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    from fxglm5.lowering.triton import sparse_mla, sparse_mla_tile

    rows = []
    for cdtype, name in ((torch.bfloat16, "bf16"), (torch.uint8, "fp8")):
        q, cache, bt, req, _, top = prefill_case([args.ctx], [(0, args.ctx)], args.heads, cdtype, args.window)
        base = sparse_mla.sparse_mla_prefill_paged(q, cache, bt, req, top, SCALE, validate=False)
        rows.append(dict(kernel="per_token", cache=name, ms=_ms(
            lambda: sparse_mla.sparse_mla_prefill_paged(q, cache, bt, req, top, SCALE, validate=False))))
        gluon = sparse_mla_tile.uses_gluon(q, cache)
        launches = [("tile", {"kernel": "triton"})] + [("tile", cfg) for cfg in (SWEEP if args.sweep else [])]
        launches += [("tile_gluon", {"kernel": "gluon"})] if gluon else []
        for kernel, cfg in launches:
            def tile(cfg=cfg):
                return sparse_mla_tile.sparse_mla_tile_paged(q, cache, bt, req, top, SCALE, validate=False, cfg=cfg)
            diff = (tile().float() - base.float()).abs().max().item()
            shown = "default" if cfg.get("kernel") else cfg
            rows.append(dict(kernel=kernel, cfg=shown, cache=name, ms=_ms(tile), max_diff=diff))
        print(rows[-1 - len(launches):], flush=True)
    harness.save_run("sparse_mla_prefill.json", ctx=args.ctx, heads=args.heads, topk=TOPK, window=args.window,
                     tile_applies=sparse_mla_tile.tile_applies(q, cache, bt, top), gluon_applies=gluon, rows=rows)


if __name__ == "__main__":
    main()
