"""Device time (profiler, per kernel) of the fused index / latent writes vs their standalone chains, and the
index write under a few num_warps, at T=64 and 8192 (the graph-replay figures have a ~10 us launch floor)."""
import json, os, sys, statistics
import torch
sys.path.insert(0, ".")
from bench.harness import capture_graph, kernel_times
from fxglm5.lowering.reference import norm_rope as nr, paged as ref
from fxglm5.lowering.triton import norm_rope as tnr, paged_cache as pc

out = {}
def prof(name, fn):
    g = capture_graph(fn)
    k, span = kernel_times(g, 30)
    out[name] = dict(span_us=round(span, 2), kernels={f"{i}:{n}": round(v, 2) for (i, n), v in k.items()})
    print(name, out[name], flush=True)

BS = 64
for T in (64, 8192):
    kv = torch.randn(T, 576, dtype=torch.bfloat16).cuda()
    kv_c, k_pe = kv[:, :512], kv[:, 512:]
    norm = (1 + 0.1 * torch.randn(512)).bfloat16().cuda(), 1e-6
    a = torch.rand(T, 1) * 1000 * torch.logspace(0, -6, 32)[None]
    rope = a.cos().cuda(), a.sin().cuda()
    slots = torch.arange(T, device="cuda") + BS
    for cdt, w in ((torch.bfloat16, 576), (torch.uint8, 656)):
        cache = torch.zeros(T // BS + 8, BS, w, dtype=cdt, device="cuda")
        tag = "fp8" if cdt == torch.uint8 else "bf16"
        prof(f"latent_{tag}_fused_T{T}", lambda: pc.write_latent_cache(cache, kv_c, k_pe, slots, validate=False, norm=norm, rope=rope))
        prof(f"latent_{tag}_plain_T{T}", lambda: pc.write_latent_cache(cache, kv_c, k_pe, slots, validate=False))
        prof(f"latent_{tag}_split_T{T}", lambda: pc.write_latent_cache(cache, tnr.rms_norm(kv_c, *norm, validate=False),
             tnr.rope_interleaved(k_pe[:, None], *rope, validate=False)[:, 0], slots, validate=False))
    k = torch.randn(T, 128, dtype=torch.bfloat16).cuda()
    ln = (1 + 0.1 * torch.randn(128)).bfloat16().cuda(), (0.1 * torch.randn(128)).bfloat16().cuda(), 1e-6
    ic = torch.zeros(T // BS + 8, BS, 132, dtype=torch.uint8, device="cuda")
    for nw in (1, 2, 4):
        def fused(nw=nw):
            w_, b_, eps = ln
            cos, sin = rope
            pc._write_index_kernel[(T,)](k, slots, ic, ic.view(torch.float32), w_, b_, cos, sin, k.stride(0), cos.stride(0),
                                        128, 32, eps, D=128, BS=BS, NORM=True, ROPE=True, DT=1, num_warps=nw)
        prof(f"index_fused_w{nw}_T{T}", fused)
    prof(f"index_plain_T{T}", lambda: pc.write_indexer_cache(ic, k, slots, validate=False))
    prof(f"index_split_T{T}", lambda: pc.write_indexer_cache(ic, tnr.rope_interleaved(torch.nn.functional.layer_norm(k, (128,), *ln)[:, None], *rope, validate=False)[:, 0], slots, validate=False))
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "norm_rope_probe.json"), "w"), indent=1)
