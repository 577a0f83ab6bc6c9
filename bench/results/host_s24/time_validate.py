import sys, time, statistics, torch
sys.path.insert(0, ".")
from fxglm5.runtime.forward_context import ForwardContext
B, W = 64, 33
tables = [[1 + b * W + j for j in range(W)] for b in range(B)]
ctx = ForwardContext.build(False, [], [2048] * B, tables, block_size=64, kernel_block_size=64, num_blocks=B * W + 1,
                           max_position_embeddings=202752, prompt_lengths=[2048] * B)
import dataclasses
ts = []
for _ in range(400):
    c = dataclasses.replace(ctx)
    t0 = time.perf_counter(); c.validate(); ts.append((time.perf_counter() - t0) * 1e3)
print("validate ms median %.3f min %.3f" % (statistics.median(ts), min(ts)))
