"""Attention-half kernel benchmarks: paged MLA (decode split-KV / prefill), sparse MLA, DSA indexer.

Every row: kernel, shape, us (CUDA-graph replay, median), TB/s or TFLOPS, % of the copy bandwidth measured in
this run, and a torch baseline measured in this run (gathered rows + scaled_dot_product_attention for MLA /
sparse MLA, torch.topk for the top-k, torch gather + einsum for the indexer logits); the reference ops' top-k
(the tie rule's stable sort) has its own row. Decode caches are larger
than L2 (60 MB): every request owns its own blocks (a random permutation), and small-batch rows rotate over
many requests inside one graph so each captured call reads different memory.

    python bench/kernels_attention.py            # all sections, saves bench/results/kernels_attention.{json,md}
    python bench/kernels_attention.py mla        # one section
    python bench/kernels_attention.py --sweep    # also time a few launch configs per kernel (tuning aid)
"""

from __future__ import annotations

import functools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness  # noqa: E402
from bench.harness import (  # noqa: E402
    Results, capture_graph, copy_bandwidth_gbs, events_us, kernel_times, rotating, time_graph_us,
)
from fxglm5.lowering.reference import paged as ref  # noqa: E402
from fxglm5.lowering.reference.attention import topk_lowest_index_ties  # noqa: E402

H, R, DR, D = 64, 512, 64, 576
BS = 64
SCALE = 1.0 / 16
TOPK = 2048
HI = 32
SWEEP = "--sweep" in sys.argv
NO_TORCH = "--no-torch" in sys.argv
QUICK = "--quick" in sys.argv  # fewer shapes (the GLM-5 target shapes only)


def _configs(configs):
    """The autotuner's candidate launches as explicit cfg dicts (the sweep times each one)."""
    return [dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages) for c in configs]


_STATE: dict = {}


def _copy_gbs(results) -> float:
    if getattr(results, "copy_gbs", None):
        return results.copy_gbs
    if "copy" not in _STATE:
        _STATE["copy"] = copy_bandwidth_gbs()
    results.copy_gbs = _STATE["copy"]
    return results.copy_gbs


def _request_batches(B, nreq, ncalls):
    """``ncalls`` batches of B request ids (batch i: requests iB .. iB+B-1 mod nreq) and a round-robin getter:
    captured once per batch, each replay of a small-batch decode graph reads different cache memory."""
    return rotating(lambda i: torch.arange(i * B, (i + 1) * B, device="cuda", dtype=torch.int32) % nreq,
                    n_copies=ncalls)


def indexer_inputs(B, ctx):
    """One decode step of the indexer at B requests of ``ctx`` tokens (the last position each): the paged FP8 key
    cache and block table, queries, head weights, positions, request ids, and the logits / top-k outputs."""
    kc, bt = _paged(B, ctx, 132, torch.uint8)
    q = torch.randn(B, HI, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(B, HI, device="cuda")
    pos = torch.full((B,), ctx - 1, device="cuda", dtype=torch.int32)
    req = torch.arange(B, device="cuda", dtype=torch.int32)
    logits = torch.empty(B, bt.shape[1] * BS, device="cuda")
    top = torch.empty(B, TOPK, device="cuda", dtype=torch.int32)
    return kc, bt, q, w, pos, req, logits, top


def sparse_prefill_inputs(T, heads, cdt):
    """One request's prefill of T tokens at ``heads`` heads: each token attends to TOPK random rows of its causal
    window (all of it, -1 padded, when shorter). Returns the paged cache, block table, queries, request ids,
    top-k positions and the output buffer."""
    cache, bt = _paged(1, T, 656 if cdt == torch.uint8 else 576, cdt)
    q = torch.randn(T, heads, D, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(T, device="cuda")
    sc = torch.rand(T, T, device="cuda").masked_fill(torch.arange(T, device="cuda")[None, :] > pos[:, None], -1)
    top = sc.topk(TOPK, dim=1)
    topk = torch.where(top.values >= 0, top.indices, torch.full_like(top.indices, -1)).int()
    req = torch.zeros(T, device="cuda", dtype=torch.int32)
    return cache, bt, q, req, topk, torch.empty(T, heads, R, device="cuda", dtype=torch.bfloat16)


def _paged(B, ctx, width, dtype, seed=0):
    """B requests of ``ctx`` tokens each, own blocks in random order; cache filled with random bytes/values."""
    nblk = -(-ctx // BS)
    total = B * nblk + 1
    g = torch.Generator(device="cuda").manual_seed(seed)
    perm = torch.randperm(total - 1, device="cuda", generator=g) + 1
    bt = perm.view(B, nblk).int().contiguous()
    if dtype == torch.uint8:
        cache = torch.randint(0, 256, (total, BS, width), dtype=torch.uint8, device="cuda")
        if width == 656:  # sane fp8 bytes (no NaN), unit scales, random bf16 k_pe
            cache[..., :512] = torch.randn(total, BS, 512, device="cuda").to(torch.float8_e4m3fn).view(torch.uint8)
            cache[..., 512:528] = torch.full((total, BS, 4), 1 / 64, device="cuda").view(torch.uint8)
            cache[..., 528:] = torch.randn(total, BS, 64, device="cuda", dtype=torch.bfloat16).view(torch.uint8)
        else:  # the block-major indexer cache
            keys, scales = ref.indexer_cache_parts(cache)
            keys.copy_(torch.randn(total, BS, 128, device="cuda").to(torch.float8_e4m3fn).view(torch.uint8))
            scales.fill_(1 / 64)
    else:
        cache = (torch.randn(total, BS, width, device="cuda") * 0.5).to(dtype)
    return cache, bt


def _row(results, kernel, shape, us, *, bytes_=None, flops=None, torch_us=None, note=""):
    copy = _copy_gbs(results)
    row = dict(kernel=kernel, shape=shape, us=round(us, 2))
    if bytes_ is not None:
        tbs = bytes_ / (us * 1e-6) / 1e12
        row["TB/s"] = round(tbs, 3)
        row["pct_copy"] = round(100 * tbs * 1e3 / copy, 1)
    if flops is not None:
        row["TFLOPS"] = round(flops / (us * 1e-6) / 1e12, 1)
    if torch_us is not None:
        row["torch_us"] = round(torch_us, 2)
        row["speedup"] = round(torch_us / us, 2)
    if note:
        row["note"] = note
    return results.add(**row)


def _sdpa_gathered(q, cache, slots, valid=None):
    """Torch baseline: gather (+ dequant) the rows, then SDPA. One KV head shared by all heads and one query
    per row set, so the heads are folded into the query-length dimension (no K/V expansion)."""
    T, Hh, _ = q.shape
    n = slots.shape[1]
    rows = ref.read_latent_rows(cache, slots.reshape(-1).clamp_min(0), validate=False).view(T, 1, n, D)
    rows = rows.to(q.dtype)
    mask = None if valid is None else valid.view(T, 1, 1, n)
    return torch.nn.functional.scaled_dot_product_attention(
        q.view(T, 1, Hh, D), rows, rows[..., :R], attn_mask=mask, scale=SCALE)


def _time_torch(fn):
    if NO_TORCH:
        return None
    try:
        return time_graph_us(fn, n_warmup=2, n_iters=5)
    except Exception as e:  # noqa: BLE001 - not capturable: time it eagerly (CUDA events)
        print(f"torch baseline not graph-capturable ({type(e).__name__}); timing it eagerly")
    try:
        import statistics

        fn()
        torch.cuda.synchronize()
        return statistics.median(events_us(fn, 5))
    except Exception as e:  # noqa: BLE001 - a baseline that cannot run is reported, not fatal
        print(f"torch baseline failed: {type(e).__name__}: {e}")
        return None


# ------------------------------------------------------------------------------------------------------------
# cfg={} launches the generic Triton kernel, autotuned, timed beside the Hopper kernel where that one runs
TRITON = {}


def bench_mla(results):
    from fxglm5.lowering.triton import mla

    shapes = [(torch.bfloat16, 64, 32768), (torch.uint8, 64, 32768), (torch.bfloat16, 1, 32768),
              (torch.uint8, 1, 32768), (torch.bfloat16, 8, 8192)]
    for cdt, B, ctx in shapes[:3] if QUICK else shapes:
        width = 656 if cdt == torch.uint8 else 576
        cache, bt = _paged(max(B, 32), ctx, width, cdt)
        nreq = bt.shape[0]
        q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16)
        pos = torch.full((B,), ctx - 1, device="cuda", dtype=torch.int32)
        out = torch.empty(B, H, R, device="cuda", dtype=torch.bfloat16)
        ncalls = 1 if B * ctx * width > 3 * 60 * 2**20 else nreq // B
        reqs, next_reqs = _request_batches(B, nreq, ncalls)

        def run(cfg=None, num_splits=None):
            mla.mla_decode_paged(q, cache, bt, next_reqs(), pos, SCALE, validate=False, out=out, cfg=cfg,
                                 num_splits=num_splits)

        bytes_ = B * ctx * width * cache.element_size()  # bf16 rows are 576 x 2 bytes
        flops = 2 * B * H * ctx * (D + R)
        name = f"mla_decode[{'fp8' if cdt == torch.uint8 else 'bf16'}]"
        shape = f"B={B} H={H} ctx={ctx} bs={BS}"
        if SWEEP and B == 64:
            for cfg in _configs(mla._DENSE_CONFIGS):
                try:
                    us = time_graph_us(lambda: run(cfg), calls_per_graph=ncalls)
                    _row(results, name + " sweep", shape + " " + str(cfg), us, bytes_=bytes_, flops=flops)
                except Exception as e:  # noqa: BLE001
                    print("sweep config failed", cfg, type(e).__name__, str(e)[:200])
            for ns in (1, 3, 4):
                us = time_graph_us(lambda: run(None, ns), calls_per_graph=ncalls)
                _row(results, name + " sweep", f"{shape} splits={ns}", us, bytes_=bytes_, flops=flops)
        us = time_graph_us(run, calls_per_graph=ncalls)
        tus = None
        if B * ctx * D * 2 < 4 * 2**30:
            slots = ref.slots_from_positions(bt, reqs[0].repeat_interleave(ctx),
                                             torch.arange(ctx, device="cuda").repeat(B), BS).view(B, ctx)
            tus = _time_torch(lambda: _sdpa_gathered(q, cache, slots))
        _row(results, name, shape, us, bytes_=bytes_, flops=flops, torch_us=tus, note=f"cfg={mla.tuned_config()}")
        if mla._LAST["impl"] == "hopper":  # the generic Triton kernel, side by side
            us = time_graph_us(lambda: run(TRITON), calls_per_graph=ncalls)
            _row(results, name + " triton", shape, us, bytes_=bytes_, flops=flops, note=f"cfg={mla.tuned_config()}")

    # prefill (causal, one request, 4k new tokens after a 0 / 4k cached prefix)
    for prefix, n in [(0, 4096)] if QUICK else [(0, 4096), (4096, 2048)]:
        ctx = prefix + n
        cache, bt = _paged(1, ctx, 576, torch.bfloat16)
        q = torch.randn(n, H, D, device="cuda", dtype=torch.bfloat16)
        req = torch.zeros(n, device="cuda", dtype=torch.int32)
        pos = torch.arange(prefix, ctx, device="cuda", dtype=torch.int32)
        out = torch.empty(n, H, R, device="cuda", dtype=torch.bfloat16)
        us = time_graph_us(lambda: mla.mla_prefill_paged(q, cache, bt, req, pos, SCALE, validate=False, out=out))
        note = f"cfg={mla.tuned_config()}"
        if mla._LAST["impl"] == "hopper":
            tri = time_graph_us(lambda: mla.mla_prefill_paged(q, cache, bt, req, pos, SCALE, validate=False, out=out,
                                                              cfg=TRITON))
            note += f"; Triton kernel {tri:.0f} us ({mla.tuned_config()})"
        flops = 2 * H * (D + R) * sum(range(prefix + 1, ctx + 1))
        slots = ref.slots_from_positions(bt, torch.zeros(ctx, dtype=torch.int32, device="cuda"),
                                         torch.arange(ctx, device="cuda"), BS)
        rows = cache.view(-1, 576)[slots]
        causal = (torch.arange(ctx, device="cuda")[None, :] <= pos[:, None]).view(1, 1, n, ctx)

        def tfn():
            k = cache.view(-1, 576)[slots].view(1, 1, ctx, D)
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1).unsqueeze(0), k, k[..., :R], attn_mask=causal, scale=SCALE, enable_gqa=True)

        del rows
        _row(results, "mla_prefill[bf16]", f"T={n} prefix={prefix} H={H}", us, flops=flops, torch_us=_time_torch(tfn),
             note=note)


def bench_sparse_mla(results):
    from fxglm5.lowering.triton import mla, sparse_mla

    ctx = 32768
    for cdt in (torch.bfloat16, torch.uint8):
        width = 656 if cdt == torch.uint8 else 576
        tag = "fp8" if cdt == torch.uint8 else "bf16"
        cache, bt = _paged(64, ctx, width, cdt)
        for B in (1, 64):
            q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16)
            topk = torch.rand(B, ctx, device="cuda").topk(TOPK, dim=1).indices.int()
            out = torch.empty(B, H, R, device="cuda", dtype=torch.bfloat16)
            ncalls = 64 // B if B < 64 else 1
            reqs, next_reqs = _request_batches(B, 64, ncalls)

            def run(cfg=None, ns=None):
                sparse_mla.sparse_mla_decode_paged(q, cache, bt, next_reqs(), topk, SCALE, validate=False, out=out,
                                                   cfg=cfg, num_splits=ns)

            flops = 2 * B * H * TOPK * (D + R)
            bytes_ = B * TOPK * width * cache.element_size()
            shape = f"B={B} H={H} topk={TOPK} ctx={ctx}"
            if SWEEP:
                splits = (8, 16, 64) if B == 1 else (1, 3, 4)
                for cfg, ns in [(c, None) for c in _configs(mla._SPARSE_CONFIGS)] + [(None, n) for n in splits]:
                    try:
                        us = time_graph_us(lambda: run(cfg, ns), calls_per_graph=ncalls)
                        _row(results, f"sparse_mla_decode[{tag}] sweep", f"{shape} {cfg} splits={ns}", us,
                             bytes_=bytes_, flops=flops)
                    except Exception as e:  # noqa: BLE001
                        print("sweep config failed", cfg, type(e).__name__, str(e)[:200])
            us = time_graph_us(run, calls_per_graph=ncalls)
            slots = ref._slots_2d(bt, reqs[0], topk, BS)
            tus = _time_torch(lambda: _sdpa_gathered(q, cache, slots))
            _row(results, f"sparse_mla_decode[{tag}]", shape, us, bytes_=bytes_, flops=flops, torch_us=tus,
                 note=f"cfg={mla.tuned_config()}")
            if mla._LAST["impl"] == "hopper":
                us = time_graph_us(lambda: run(TRITON), calls_per_graph=ncalls)
                _row(results, f"sparse_mla_decode[{tag}] triton", shape, us, bytes_=bytes_, flops=flops,
                     note=f"cfg={mla.tuned_config()}")

    # prefill: 8k tokens of one request, each attends to 2048 of its causal window (all of it when shorter)
    T = 8192
    for cdt in (torch.bfloat16, torch.uint8):
        tag = "fp8" if cdt == torch.uint8 else "bf16"
        cache, bt, q, req, topk, out = sparse_prefill_inputs(T, H, cdt)
        nvalid = int((topk >= 0).sum())
        flops = 2 * H * nvalid * (D + R)
        shape = f"T={T} H={H} topk={TOPK}"

        def runp(cfg=None):
            sparse_mla.sparse_mla_prefill_paged(q, cache, bt, req, topk, SCALE, validate=False, out=out, cfg=cfg)

        if SWEEP and tag == "bf16":
            for cfg in _configs(mla._SPARSE_CONFIGS):
                try:
                    _row(results, f"sparse_mla_prefill[{tag}] sweep", f"{shape} {cfg}",
                         time_graph_us(lambda: runp(cfg)), flops=flops)
                except Exception as e:  # noqa: BLE001
                    print("sweep config failed", cfg, type(e).__name__, str(e)[:200])
        us = time_graph_us(runp)
        tus = None
        if tag == "bf16":  # baseline on 1k tokens (the gathered rows of 8k would be 19 GB), scaled by 8
            sl = ref._slots_2d(bt, req[:1024], topk[:1024], BS)
            t1 = _time_torch(lambda: _sdpa_gathered(q[:1024], cache, sl, valid=(topk[:1024] >= 0)))
            tus = None if t1 is None else t1 * (T / 1024)
        note = f"cfg={mla.tuned_config()}" + ("; torch_us: 1024-token gathered SDPA x 8" if tus else "")
        if mla._LAST["impl"] == "hopper":
            note += f"; Triton kernel {time_graph_us(lambda: runp(TRITON)):.0f} us ({mla.tuned_config()})"
        _row(results, f"sparse_mla_prefill[{tag}]", shape, us, flops=flops, torch_us=tus, note=note)


def bench_indexer(results):
    from bench.read_stream import paged_read, stream_read
    from fxglm5.lowering.triton import indexer
    from fxglm5.lowering.triton import topk as topk_mod
    from fxglm5.lowering.triton.device import num_sms

    # the ceiling of a kernel that only streams (the logits kernel reads 277 MB and writes 8 MB): a copy's
    # reads and writes share the bus, so this can exceed 100 % of the copy
    src = torch.zeros(2**29, dtype=torch.int32, device="cuda")
    _row(results, "stream_read (read ceiling)", "2 GiB", time_graph_us(functools.partial(stream_read, src)),
         bytes_=2**31, note="bench/read_stream.py")
    del src
    for B, ctx in [(64, 32768)] if QUICK else [(64, 32768), (1, 131072), (8, 65536)]:
        nreq = max(B, 8)
        kc, bt = _paged(nreq, ctx, 132, torch.uint8)
        q = torch.randn(B, HI, 128, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(B, HI, device="cuda")
        pos = torch.full((B,), ctx - 1, device="cuda", dtype=torch.int32)
        L = bt.shape[1] * BS
        logits = torch.empty(B, L, device="cuda")
        top = torch.empty(B, TOPK, device="cuda", dtype=torch.int32)
        # a call over more than 3x L2 reads DRAM again when repeated; four calls per graph amortize the graph's
        # launch (10-15 us per replay: docs/perf/indexer_topk.md), as inside a model's graph
        ncalls = 4 if B * ctx * 132 > 3 * 60 * 2**20 else nreq // B
        reqs, nxt = _request_batches(B, nreq, ncalls)

        def run_logits(cfg=None):
            indexer.indexer_logits_paged(q, w, kc, bt, nxt(), pos, out=logits, validate=False, cfg=cfg)

        def run_all():
            indexer.indexer_topk_paged(q, w, kc, bt, nxt(), pos, TOPK, validate=False, logits_buf=logits, out=top)

        shape = f"B={B} HI={HI} ctx={ctx} topk={TOPK}"
        kbytes = B * ctx * 132
        if SWEEP and B == 64:
            extra = [dict(BLOCK_N=128, TILES=4, PROMOTE=32, num_warps=4)]
            extra += [dict(BLOCK_N=64, TILES=t, USE_TMA=True, num_warps=4, num_stages=ns)
                      for t, ns in ((8, 2), (8, 4), (16, 4), (16, 6), (32, 3), (32, 4), (32, 6), (64, 3), (64, 4))]
            extra += [dict(BLOCK_N=32, TILES=t, USE_TMA=True, num_warps=4, num_stages=ns)
                      for t, ns in ((32, 4), (64, 6))]
            for cfg in _configs(indexer._LOGITS_CONFIGS) + extra:
                try:
                    _row(results, "indexer_logits sweep", f"{shape} {cfg}",
                         time_graph_us(lambda: run_logits(cfg), calls_per_graph=ncalls), bytes_=kbytes)
                except Exception as e:  # noqa: BLE001
                    print("sweep config failed", cfg, type(e).__name__, str(e)[:200])
            for ch in (8192, 16384, 32768):
                _row(results, "radix_topk sweep", f"B={B} L={L} method=segments chunk={ch}",
                     time_graph_us(lambda: indexer.topk_from_logits(logits, pos, TOPK, out=top, chunk=ch)))
                # the same after the logits kernel, as a model runs it
                _row(results, "indexer_topk sweep (logits+topk)", f"{shape} chunk={ch}",
                     time_graph_us(lambda: (run_logits(), indexer.topk_from_logits(logits, pos, TOPK, out=top,
                                                                                   chunk=ch, validate=False)),
                                   calls_per_graph=ncalls), bytes_=kbytes)
        if SWEEP:  # the multi radix's segment length, for every shape (the default picks it from T, L, SMs)
            run_logits()  # real scores to select from
            default_chunk = topk_mod.multi_segment_length(B, L, num_sms(logits.device))
            for ch in (512, 1024, 2048, 4096, 8192):
                _row(results, "radix_topk sweep", f"B={B} L={L} method=multi chunk={ch}",
                     time_graph_us(lambda: indexer.topk_from_logits(logits, pos, TOPK, out=top, chunk=ch,
                                                                    method="multi")),
                     note="default" if ch == default_chunk else "")
        us_l = time_graph_us(run_logits, calls_per_graph=ncalls)

        def torch_logits():
            r = reqs[0]
            sl = ref.slots_from_positions(bt, r.repeat_interleave(ctx), torch.arange(ctx, device="cuda").repeat(B),
                                          BS)
            k = ref.read_indexer_rows(kc, sl, validate=False).view(B, ctx, 128)
            qq, qs = ref.quantize_fp8_groups(q)
            s = torch.relu(torch.einsum("bhd,bnd->bhn", qq.float() * qs, k))
            return (s * w.unsqueeze(-1)).sum(1)

        if B == 64:  # the ceiling of the logits kernel's access pattern: its blocks, boxes and order (nreq == B:
            # every call reads all 277 MB again)
            for tma in (True, False):
                _row(results, "paged_read (paged read ceiling)", f"B={B} ctx={ctx}",
                     time_graph_us(lambda: paged_read(kc, bt, use_tma=tma), calls_per_graph=ncalls),
                     bytes_=kbytes, note="bench/read_stream.py, " + ("TMA boxes" if tma else "16-byte loads"))
        _row(results, "indexer_logits", shape, us_l, bytes_=kbytes,
             torch_us=_time_torch(torch_logits) if B * ctx <= 2**21 else None,
             note=f"cfg={indexer.tuned_config()}")
        default = "segments" if L <= indexer.SEGMENT_MAX else "multi"
        for method in ("segments", "multi"):  # both top-k methods side by side; the note marks the default
            us_t = time_graph_us(lambda: indexer.topk_from_logits(logits, pos, TOPK, out=top, method=method))
            _row(results, "radix_topk", f"B={B} L={L} topk={TOPK}", us_t,
                 torch_us=_time_torch(lambda: torch.topk(logits, TOPK, dim=1)) if method == default else None,
                 note=method + (" (default)" if method == default else ""))
        ref_us = _time_torch(lambda: topk_lowest_index_ties(logits, TOPK))
        if ref_us is not None:  # the torch reference's tie rule, beside torch.topk (the radix_topk rows' baseline)
            _row(results, "reference topk (tie rule)", f"B={B} L={L} topk={TOPK}", ref_us,
                 note="fxglm5.lowering.reference.attention.topk_lowest_index_ties: a stable descending sort")
        us_a = time_graph_us(run_all, calls_per_graph=ncalls)
        _row(results, "indexer_topk (logits+topk)", shape, us_a, bytes_=kbytes,
             torch_us=_time_torch(lambda: (run_logits(), torch.topk(logits, TOPK, dim=1))),
             note="bytes = FP8 keys read; torch_us = our logits + torch.topk")


def bench_cache_write(results):
    from fxglm5.lowering.triton import paged_cache as pc

    for T in (8192,) if QUICK else (64, 8192):
        for cdt, width in ((torch.bfloat16, 576), (torch.uint8, 656)):
            cache = torch.zeros(T // BS + 8, BS, width, dtype=cdt, device="cuda")
            # host RNG: a torch baseline whose capture failed leaves the CUDA generator unusable for later draws
            kv = torch.randn(T, R, dtype=torch.bfloat16).cuda()
            pe = torch.randn(T, DR, dtype=torch.bfloat16).cuda()
            slots = torch.arange(T, device="cuda") + BS
            us = time_graph_us(lambda: pc.write_latent_cache(cache, kv, pe, slots, validate=False))
            tus = _time_torch(lambda: ref.write_latent_cache(cache, kv, pe, slots, validate=False))
            _row(results, f"write_latent_cache[{'fp8' if cdt == torch.uint8 else 'bf16'}]", f"T={T}", us,
                 bytes_=T * (576 * 2 + width), torch_us=tus)


def _device_span_us(fn):
    """Device time of one captured ``fn()``: first kernel start to last kernel end (torch.profiler over graph
    replays). Kernels of 1-10 us sit below the ~10 us floor that timing a whole graph replay has, and three
    chained kernels against one fused kernel is exactly what that floor would hide."""
    return kernel_times(capture_graph(fn), replays=30)[1]


def bench_norm_rope_fusion(results):
    """The RMSNorm / RoPE (/ LayerNorm) that produce the cached values, three ways at GLM-5 widths (bf16 model),
    in device time: the model's torch ops + the plain write (torch_us), the standalone Triton kernels + the plain
    write (note), and everything inside one cache-write / query-assembly kernel (us). Rows are read from strided
    splits, as the graph hands them over."""
    from fxglm5.lowering.reference import norm_rope as nr
    from fxglm5.lowering.triton import norm_rope as tnr
    from fxglm5.lowering.triton import paged_cache as pc

    def row(kernel, shape, fused, split, eager, bytes_, what="standalone Triton kernels"):
        _row(results, kernel, shape, _device_span_us(fused), bytes_=bytes_,
             torch_us=None if NO_TORCH else _device_span_us(eager),
             note=f"device span; {what} {_device_span_us(split):.2f} us")

    for T in (64, 8192):
        kv = torch.randn(T, R + DR, dtype=torch.bfloat16).cuda()
        kv_c, k_pe = kv[:, :R], kv[:, R:]
        norm = (1 + 0.1 * torch.randn(R)).bfloat16().cuda(), 1e-6
        angles = torch.rand(T, 1) * 1000 * torch.logspace(0, -6, DR // 2)[None]
        rope = angles.cos().cuda(), angles.sin().cuda()
        slots = torch.arange(T, device="cuda") + BS
        for cdt, width in ((torch.bfloat16, 576), (torch.uint8, 656)):
            cache = torch.zeros(T // BS + 8, BS, width, dtype=cdt, device="cuda")
            row(f"write_latent_cache[{'fp8' if cdt == torch.uint8 else 'bf16'}]+rmsnorm+rope", f"T={T}",
                lambda: pc.write_latent_cache(cache, kv_c, k_pe, slots, validate=False, norm=norm, rope=rope),
                lambda: pc.write_latent_cache(cache, tnr.rms_norm(kv_c, *norm, validate=False),
                                              tnr.rope_interleaved(k_pe[:, None], *rope, validate=False)[:, 0], slots,
                                              validate=False),
                lambda: pc.write_latent_cache(cache, nr.rms_norm(kv_c, *norm), nr.rope_interleaved(k_pe, *rope), slots,
                                              validate=False),
                T * ((R + DR) * 2 + width))
        k = torch.randn(T, 128, dtype=torch.bfloat16).cuda()
        ln = (1 + 0.1 * torch.randn(128)).bfloat16().cuda(), (0.1 * torch.randn(128)).bfloat16().cuda(), 1e-6
        icache = torch.zeros(T // BS + 8, BS, 132, dtype=torch.uint8, device="cuda")
        row("write_indexer_cache+layernorm+rope", f"T={T}",
            lambda: pc.write_indexer_cache(icache, k, slots, validate=False, norm=ln, rope=rope),
            lambda: pc.write_indexer_cache(icache, tnr.rope_interleaved(nr.layer_norm(k, *ln)[:, None], *rope,
                                                                        validate=False)[:, 0], slots, validate=False),
            lambda: pc.write_indexer_cache(icache, nr.rope_interleaved(nr.layer_norm(k, *ln), *rope), slots,
                                           validate=False),
            T * (128 * 2 + 132), what="torch LayerNorm + Triton RoPE + write")
        if T == 64:  # the query assembly: decode batch 64, 64 heads, W_UK [192 -> 512] applied in the kernel
            q_b = torch.randn(T, H, 192 + DR, dtype=torch.bfloat16).cuda()
            q_nope, q_pe = q_b[..., :192], q_b[..., 192:]
            w_uk = (torch.randn(H, 192, R) * 192**-0.5).bfloat16().cuda()
            row("latent_query+W_UK+rope", f"T={T} H={H}", lambda: pc.latent_query(q_nope, w_uk, q_pe, rope),
                lambda: pc.latent_query(q_nope, w_uk, tnr.rope_interleaved(q_pe, *rope, validate=False)),
                lambda: torch.cat([torch.einsum("thd,hdr->thr", q_nope, w_uk), nr.rope_interleaved(q_pe, *rope)],
                                  dim=-1),
                T * H * (192 + DR + R + DR) * 2 + H * 192 * R * 2, what="Triton RoPE + the query kernel")


SECTIONS = {
    "mla": bench_mla,
    "sparse_mla": bench_sparse_mla,
    "indexer": bench_indexer,
    "cache_write": bench_cache_write,
    "norm_rope": bench_norm_rope_fusion,
}

try:  # also reachable as `python bench/kernels.py --only mla,sparse_mla,...` (harness sections take (results, args))
    from bench import harness as _harness

    for _name, _fn in SECTIONS.items():
        _harness.SECTIONS.setdefault(_name, lambda res, args, _fn=_fn: _fn(res))
except Exception:  # noqa: BLE001 - an older harness without SECTIONS
    pass


def main(argv=None):
    harness.answer_help(__doc__)
    import time

    argv = [a for a in (argv if argv is not None else sys.argv[1:]) if not a.startswith("--")]
    names = argv or list(SECTIONS)
    results = Results(copy_gbs=copy_bandwidth_gbs())
    print(f"copy bandwidth: {results.copy_gbs:.0f} GB/s")
    name = "kernels_attention" + ("_sweep" if SWEEP else "")
    for n in names:
        t0 = time.time()
        try:
            SECTIONS[n](results)
        except Exception as e:  # noqa: BLE001 - keep the other sections' figures
            import traceback

            traceback.print_exc()
            results.add(kernel=n, shape="section failed", us=None, note=f"{type(e).__name__}: {str(e)[:200]}")
        torch.cuda.empty_cache()
        print(f"section {n}: {time.time() - t0:.0f} s; saved", results.save(name), flush=True)


if __name__ == "__main__":
    main()
