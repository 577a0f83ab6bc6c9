"""The lowered rtp_sparse_mla step (absorb the query, write the cache row, sparse MLA, project out) at GLM-5
decode shapes, bf16 model, B=64, context 32k, top-k 2048, three versions of the step's torch parts:
  s9:      query and projection in float32 (the query float32 -> the Triton kernel's float32 dot)
  3bd8b1b: float32 products, the query rounded to bf16 (-> the Hopper kernel), projection in float32
  now:     both products in bf16 (float32 accumulation), no per-call weight conversion
and the per-kernel device times of one step now (torch.profiler over CUDA-graph replays)."""
import json, os, sys
import torch
sys.path.insert(0, ".")
from bench.harness import time_graph_us, capture_graph, kernel_times
from bench.kernels_attention import _paged, H, TOPK, SCALE
from fxglm5.lowering.reference import paged
from fxglm5.lowering.triton import mla, paged_ops
from fxglm5.ops import cached
from fxglm5.ops.cached import validation

now_q, now_o = cached._absorbed_query, cached._project_out

def f32_query(q_nope, q_pe, w_uk):
    q_abs = torch.einsum("thd,hdr->thr", cached._flat(q_nope, "q_nope", 4).float(), w_uk.float())
    q_abs = cached._pad(q_abs, paged.KV_LORA_RANK, "w_uk")
    return torch.cat([q_abs, cached._pad(cached._flat(q_pe, "q_pe", 4).float(), paged.ROPE_DIM, "q_pe")], dim=-1)

def f32_project(o_lat, w_uv, like):
    o = torch.einsum("thr,hvr->thv", o_lat[..., : w_uv.shape[2]].float(), w_uv.float())
    return o.to(like.dtype).reshape(*like.shape[:3], w_uv.shape[1]).contiguous()

VERSIONS = {"s9": (f32_query, f32_project),
            "3bd8b1b": (lambda *a: f32_query(*a).to(a[0].dtype), f32_project),
            "now": (now_q, now_o)}
rows = []
B, ctx = 64, 32768
for cdt, width in ((torch.bfloat16, 576), (torch.uint8, 656)):
    tag = "fp8" if cdt == torch.uint8 else "bf16"
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
    slots = bt[:, -1].long() * 64 + 63
    def step():
        return cached.sparse_mla_step(paged_ops, q_nope, q_pe, kv_c, k_pe, w_uk, w_uv, topk, SCALE, cache, slots,
                                      bt, req, positions, ctx)
    outs = {}
    for name, (fq, fo) in VERSIONS.items():
        cached._absorbed_query, cached._project_out = fq, fo
        with validation(False):
            outs[name] = step()
            impl = mla._LAST["impl"]
            us = time_graph_us(step)
            if name == "now":
                per_kernel, span = kernel_times(capture_graph(step, 3, 1))
        r = dict(cache=tag, version=name, mla_kernel=impl, us=round(us, 1))
        if name != "s9":
            r["rel_diff_vs_s9"] = ((outs[name].float() - outs["s9"].float()).abs().max() / outs["s9"].float().abs().max()).item()
        print(r, flush=True); rows.append(r)
    rows.append(dict(cache=tag, version="now", per_kernel_us={f"{i} {n}": round(v, 1) for (i, n), v in per_kernel.items()},
                     span_us=round(span, 1)))
    print(rows[-1], flush=True)
    cached._absorbed_query, cached._project_out = now_q, now_o
    del cache
json.dump(dict(command="python .exp/op_sparse_mla_step.py", device=torch.cuda.get_device_name(), rows=rows),
          open(os.path.join(os.environ.get("OUT", "/tmp"), "op_sparse_mla_step.json"), "w"), indent=1)
