"""The lowered rtp_sparse_mla step (absorb the query, write the cache row, sparse MLA, project out) at GLM-5
decode shapes, bf16 model, B=64, context 32k, top-k 2048: the absorbed query in the model's dtype (now: the Hopper
kernel) vs in float32 (before: the Triton kernel), both cache layouts."""
import json, os, sys
import torch
sys.path.insert(0, ".")
from bench.harness import time_graph_us
from bench.kernels_attention import _paged, H, TOPK, SCALE
from fxglm5.lowering.triton import mla, paged_ops
from fxglm5.ops import cached
from fxglm5.ops.cached import validation

new_q = cached._absorbed_query
def old_q(q_nope, q_pe, w_uk):
    return new_q(q_nope.float(), q_pe.float(), w_uk)

rows = []
B, ctx = 64, 32768
for cdt, width in ((torch.bfloat16, 576), (torch.uint8, 656)):
    cache, bt = _paged(B, ctx, width, cdt)
    g = torch.Generator(device="cuda").manual_seed(0)
    q_nope = torch.randn(1, B, H, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    q_pe = torch.randn(1, B, H, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    kv_c = torch.randn(1, B, 512, device="cuda", dtype=torch.bfloat16, generator=g)
    k_pe = torch.randn(1, B, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    w_uk = torch.randn(H, 128, 512, device="cuda", dtype=torch.bfloat16, generator=g) * 0.05
    w_uv = torch.randn(H, 128, 512, device="cuda", dtype=torch.bfloat16, generator=g) * 0.05
    topk = torch.rand(B, ctx, device="cuda").topk(TOPK, dim=1).indices.int()[None]
    positions = torch.full((B,), ctx - 1, device="cuda", dtype=torch.int32)
    req = torch.arange(B, device="cuda", dtype=torch.int32)
    slots = (bt[:, -1].long() * 64 + 63)  # each request's last position
    outs = {}
    for name, fn in (("query float32 (before)", old_q), ("query bf16 (now)", new_q)):
        cached._absorbed_query = fn
        def step():
            return cached.sparse_mla_step(paged_ops, q_nope, q_pe, kv_c, k_pe, w_uk, w_uv, topk, SCALE, cache, slots,
                                          bt, req, positions, ctx)
        with validation(False):
            outs[name] = step()
            impl = mla._LAST["impl"]
            us = time_graph_us(step)
        r = dict(cache="fp8" if cdt == torch.uint8 else "bf16", case=name, mla_kernel=impl, us=round(us, 1))
        print(r, flush=True); rows.append(r)
    cached._absorbed_query = new_q
    a, b = outs.values()
    err = ((a.float() - b.float()).abs().max() / a.float().abs().max()).item()
    rows.append(dict(cache="fp8" if cdt == torch.uint8 else "bf16", rel_diff_before_vs_now=err)); print(rows[-1], flush=True)
    del cache
json.dump(dict(command="python .exp/op_query_dtype.py", device=torch.cuda.get_device_name(), rows=rows),
          open(os.path.join(os.environ.get("OUT", "/tmp"), "op_query_dtype.json"), "w"), indent=1)
