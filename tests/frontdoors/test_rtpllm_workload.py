"""The long mixed workload of tests/runtime/test_long_workload.py through RTP-LLM's stand-in engine and the plugin
(issue 37, item 6): waves of requests of mixed lengths, a third behind shared prefixes (RTP's prefix cache,
``reuse_prefix``), an RTP cache of 12 blocks that a wave can exhaust (the wave is then retried request by request,
as a server would make them wait). Every request's tokens equal fxglm5's own runtime's on the same checkpoint, and
every RTP block comes back: unreferenced, free or in RTP's prefix cache. The runtime keeps an FP8 index cache, as
RTP does: with the exact one the top-k of contexts past index_topk differs. The tokens per second are printed."""

import time

import pytest
import torch

from fxglm5.model.tiny import make_tiny_checkpoint
from tests.frontdoors.test_rtpllm_plugin import RTP_TINY, engine, rtp, runner  # noqa: F401  (rtp: a fixture)

REQUESTS, WAVE, BLOCKS = 40, 4, 12


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """bf16 weights: RTP computes them in fp32 (ACT_TYPE=FP32), so its tokens and the runtime's compare exactly."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("workload-bf16"), fp8=False, config=RTP_TINY)


def workload() -> list[tuple[list[int], int]]:
    gen = torch.Generator().manual_seed(11)
    prefixes = [torch.randint(2, 512, (n,), generator=gen).tolist() for n in (16, 32)]
    out = []
    for i in range(REQUESTS):
        n = int(torch.randint(1, 41, (1,), generator=gen))
        tail = torch.randint(2, 512, (n,), generator=gen).tolist()
        prompt = (prefixes[i % 2] + tail)[:56] if i % 3 == 0 else tail
        out.append((prompt, int(torch.randint(1, 7, (1,), generator=gen))))
    return out


def serve(eng, requests) -> tuple[dict[int, list[int]], int]:
    """Waves through ``Engine.generate`` with RTP's prefix reuse; a wave the cache cannot hold is retried one
    request at a time. Returns each request's tokens and how many waves had to be split."""
    done, splits, pending = {}, 0, [list(range(i, min(i + WAVE, REQUESTS))) for i in range(0, REQUESTS, WAVE)]
    while pending:
        wave = pending.pop(0)
        n = max(requests[i][1] for i in wave)
        try:
            got = eng.generate([requests[i][0] for i in wave], n, reuse_prefix=True)
        except RuntimeError as err:
            assert "KV cache exhausted" in str(err) and len(wave) > 1, err
            pending = [[i] for i in wave] + pending
            splits += 1
            continue
        for i, tokens in zip(wave, got):
            done[i] = tokens[:requests[i][1]]
    return done, splits


def test_a_long_mixed_workload_through_rtp_loses_nothing(rtp, ckpt, capsys):  # noqa: F811
    requests = workload()
    runtime = runner(ckpt, "bf16", 0, torch.float32, num_blocks=400)  # RTP's FP8 indexer cache, as the plugin's
    want = {i: runtime.generate([p], n)[0] for i, (p, n) in enumerate(requests)}
    eng = engine(rtp, ckpt, act_type="FP32", num_blocks=BLOCKS)
    start = time.perf_counter()
    done, splits = serve(eng, requests)
    seconds = time.perf_counter() - start
    assert done == want
    assert splits > 0  # the cache was too small for some wave
    blocks = eng.block_manager
    assert not any(blocks.refs.values())  # every block came back ...
    assert len(blocks.free) + len(blocks.cached) == BLOCKS - 1 and blocks.cached  # ... free, or a cached prefix
    tokens = sum(len(t) for t in done.values())
    with capsys.disabled():
        print(f"\nRTP stand-in workload: {REQUESTS} requests, {tokens} tokens in {seconds:.1f} s, "
              f"{tokens / seconds:.1f} tokens/s, {splits} waves split")
