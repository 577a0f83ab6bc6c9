"""Host time of BlockManager.commit per decode step (what Runner._advance calls for every request every step):
64 requests of 2048 tokens, block size 64, old (re-hash the whole sequence) vs incremental; CPU only."""
import importlib.util, json, os, platform, sys, time
sys.path.insert(0, ".")
from fxglm5.runtime.block_manager import BlockManager as New
spec = importlib.util.spec_from_file_location("bm_old", sys.argv[1]); old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
B, ctx, bs, steps = 64, 2048, 64, 20
rows = []
for name, cls in (("re-hash whole sequence (before)", old.BlockManager), ("incremental (now)", New)):
    bm = cls(B * (ctx + steps + bs) // bs + 2, bs)
    seqs = {i: [(i * 7 + j) % 1000 for j in range(ctx)] for i in range(B)}
    for i, t in seqs.items():
        bm.allocate(i, t)
        bm.commit(i, t)
    per_step = []
    for s in range(steps):
        t0 = time.perf_counter()
        for i, t in seqs.items():
            t.append(s)
            bm.extend(i, len(t))
            bm.commit(i, t)
        per_step.append((time.perf_counter() - t0) * 1e3)
    rows.append(dict(version=name, ms_per_step_median=round(sorted(per_step)[steps // 2], 3)))
    print(rows[-1], flush=True)
out = os.environ.get("OUT", "bench/results/attention_s10")
json.dump(dict(command="python .exp/commit_host_time.py <old block_manager.py>", machine=platform.processor() or platform.machine(),
               B=B, ctx=ctx, block_size=bs, rows=rows), open(os.path.join(out, "commit_host_time.json"), "w"), indent=1)
