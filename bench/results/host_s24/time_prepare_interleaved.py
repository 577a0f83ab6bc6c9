import sys, time, statistics
sys.path.insert(0, ".")
from bench.rtpllm_host_time import time_prepare, MAX_POS, BLOCK
for _ in range(3):
    print(time_prepare(64, 2048, -(-MAX_POS // BLOCK), n=200), time_prepare(64, 2048, 33, n=200))
