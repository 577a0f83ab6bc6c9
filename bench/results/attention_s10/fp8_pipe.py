"""Hopper MLA, FP8 caches: dequantization pipelined under P @ V / QK^T (PIPE) vs serial, and timing bounds
(DEQ=1: no scale multiply, DEQ=2: no dequantization at all; wrong numbers, timing only)."""
import functools, json, os, sys
import torch
sys.path.insert(0, ".")
from bench.harness import time_graph_us, copy_bandwidth_gbs
from bench.kernels_attention import _paged, H, D, R, SCALE, TOPK
from fxglm5.lowering.triton import mla, mla_hopper, sparse_mla
from fxglm5.lowering.reference import paged as ref

orig = mla_hopper.launch
copy = copy_bandwidth_gbs()
print(f"copy bandwidth: {copy:.0f} GB/s", flush=True)
rows = []
VARIANTS = [(False, 0), (True, 0), (False, 1), (True, 1), (False, 2), (True, 2)]
def run(name, fn, bytes_=None, flops=None):
    for pipe, deq in VARIANTS:
        mla_hopper.launch = functools.partial(orig, pipe=pipe, deq=deq)
        us = time_graph_us(fn)
        assert mla._LAST["impl"] == "hopper"
        r = dict(case=name, pipe=pipe, deq=deq, us=round(us, 1))
        if bytes_: r["pct_copy"] = round(100 * bytes_ / us / 1e3 / copy, 1)
        if flops: r["TFLOPS"] = round(flops / us / 1e6, 1)
        print(r, flush=True); rows.append(r)
    mla_hopper.launch = orig

for B, ctx in ((64, 32768), (1, 32768)):
    cache, bt = _paged(B, ctx, 656, torch.uint8)
    q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16)
    pos = torch.full((B,), ctx - 1, device="cuda", dtype=torch.int32)
    req = torch.arange(B, device="cuda", dtype=torch.int32)
    out = torch.empty(B, H, R, device="cuda", dtype=torch.bfloat16)
    # correctness of the pipelined launch against the reference op (B=1 only: the reference is slow)
    if B == 1:
        for pipe in (False, True):
            mla_hopper.launch = functools.partial(orig, pipe=pipe)
            o = mla.mla_decode_paged(q, cache, bt, req, pos, SCALE, validate=False)
            r_ = ref.mla_paged(q, cache, bt, req, pos, SCALE)
            err = ((o.float() - r_.float()).abs().max() / r_.float().abs().max()).item()
            print(dict(check="dense fp8 B=1", pipe=pipe, rel_err=err), flush=True); rows.append(dict(check="dense", pipe=pipe, rel_err=err))
        mla_hopper.launch = orig
    run(f"dense decode fp8 B={B} {ctx}", lambda: mla.mla_decode_paged(q, cache, bt, req, pos, SCALE, validate=False, out=out),
        bytes_=B * ctx * 656)
    topk = torch.rand(B, ctx, device="cuda").topk(TOPK, dim=1).indices.int()
    run(f"sparse decode fp8 B={B}", lambda: sparse_mla.sparse_mla_decode_paged(q, cache, bt, req, topk, SCALE, validate=False, out=out),
        flops=2 * B * H * TOPK * (D + R))
    del cache
T = 8192
cache, bt = _paged(1, T, 656, torch.uint8)
qp = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
reqp = torch.zeros(T, device="cuda", dtype=torch.int32)
posp = torch.arange(T, device="cuda", dtype=torch.int32)
outp = torch.empty(T, H, R, device="cuda", dtype=torch.bfloat16)
tk = (torch.rand(T, TOPK, device="cuda") * (posp[:, None] + 1)).long().int()
tk = torch.where(torch.arange(TOPK, device="cuda")[None] <= posp[:, None], tk, -1)
nvalid = int((tk >= 0).sum())
run("sparse prefill fp8 8k", lambda: sparse_mla.sparse_mla_prefill_paged(qp, cache, bt, reqp, tk, SCALE, validate=False, out=outp),
    flops=2 * H * nvalid * (D + R))
out_dir = os.environ.get("OUT", "/tmp")
json.dump(dict(copy_gbs=copy, device=torch.cuda.get_device_name(), command="python .exp/fp8_pipe.py", rows=rows),
          open(os.path.join(out_dir, "fp8_pipe.json"), "w"), indent=1)
