"""One decode step of a GLM-5-width model (random FP8 weights, 2 layers: 1 dense, 1 MoE) through the paged runtime
and the Triton backend, bf16 compute: wall time per step and device time per kernel (torch.profiler), so that
any op outside the kernels we benchmark (a float32 detour, a copy, a torch fallback) shows up.
Usage: python .exp/decode_step_profile.py [--tiny] [B] [ctx] [kv_cache]"""
import collections, json, os, sys, time
import torch
sys.path.insert(0, ".")
from fxglm5.model.config import Glm5Config
from fxglm5.model.modeling import Glm5ForCausalLM
from fxglm5.runtime.runner import Runner

tiny = "--tiny" in sys.argv
args = [a for a in sys.argv[1:] if not a.startswith("--")]
B, ctx = (int(args[0]), int(args[1])) if len(args) >= 2 else ((2, 24) if tiny else (64, 2048))
kv = args[2] if len(args) >= 3 else "fp8"
dev = "cpu" if tiny else "cuda"
if tiny:
    cfg = Glm5Config.preset("tiny").replace(num_hidden_layers=2, mlp_layer_types=None, indexer_types=None)
else:
    cfg = Glm5Config.preset("glm5").replace(num_hidden_layers=2, first_k_dense_replace=1, mlp_layer_types=None,
                                            indexer_types=None, num_nextn_predict_layers=0)
t0 = time.time()
with torch.device(dev):
    model = Glm5ForCausalLM(cfg, dtype=torch.bfloat16, device=dev)
g = torch.Generator(device=dev).manual_seed(0)
with torch.no_grad():
    for name, p in model.named_parameters():
        if p.dtype == torch.float8_e4m3fn:
            p.copy_(torch.randn(p.shape, generator=g, device=dev).to(torch.float8_e4m3fn))
        elif name.endswith("scale_inv"):
            p.copy_((torch.rand(p.shape, generator=g, device=dev) + 0.5) / (p.shape[-1] * 128) ** 0.5)
        elif p.dim() == 1:
            p.copy_(((0.0 if "bias" in name else 1.0) + 0.1 * torch.randn(p.shape, generator=g, device=dev)).to(p.dtype))
        else:
            p.copy_((torch.randn(p.shape, generator=g, device=dev) / p.shape[-1] ** 0.5).to(p.dtype))
model.eval()
print(f"model: {time.time() - t0:.1f} s", flush=True)
t0 = time.time()
runner = Runner(model, kv_cache=kv, index_cache="fp8", block_size=64, dtype=torch.bfloat16,
                max_cache_tokens=B * (ctx + 64), device=dev, backend="triton")
print(f"runner (capture + passes): {time.time() - t0:.1f} s", flush=True)
prompts = torch.randint(0, cfg.vocab_size, (B, ctx), generator=torch.Generator().manual_seed(1)).tolist()
t0 = time.time()
chunk = max(1, 16384 // ctx)  # prefill in chunks of requests (activation memory)
for i in range(0, B, chunk):
    runner.prefill(prompts[i:i + chunk])
sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
sync()
print(f"prefill: {time.time() - t0:.1f} s", flush=True)
for _ in range(3):  # warm-up: compiles / autotunes at the decode shapes
    runner.decode()
sync()
steps = []
for _ in range(5):
    t0 = time.perf_counter()
    runner.decode()
    sync()
    steps.append((time.perf_counter() - t0) * 1e6)
acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev == "cuda" else [])
with torch.profiler.profile(activities=acts) as prof:
    for _ in range(3):
        runner.decode()
    sync()
per = collections.defaultdict(float)
if dev == "cuda":
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            per[e.name[:90]] += e.device_time / 3
host = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=35)
print(host, flush=True)
open(os.path.join(os.environ.get("OUT", "/tmp"), f"decode_step_{kv}_host.txt"), "w").write(host)
top = sorted(per.items(), key=lambda kv_: -kv_[1])[:25]
res = dict(command="python .exp/decode_step_profile.py " + " ".join(sys.argv[1:]),
           device=torch.cuda.get_device_name() if dev == "cuda" else "cpu", B=B, ctx=ctx, kv_cache=kv,
           layers="1 dense + 1 MoE (GLM-5 widths)" if not tiny else "tiny", step_wall_us=[round(s, 1) for s in steps],
           device_us_per_step=round(sum(per.values()), 1), kernels_us_per_step={k: round(v, 1) for k, v in top})
print(json.dumps(res, indent=1), flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), f"decode_step_{kv}_B{B}_ctx{ctx}.json"), "w"), indent=1)
