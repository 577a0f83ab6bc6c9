"""A long mixed workload through the Runner loses nothing (issue 37, item 6), CI-sized, on the CPU.

120 requests arrive in waves, driven the way a server drives the Runner:
- prompts of 1 to 40 tokens, across index_topk (8) and the 4-token block edges;
- a third of them sharing one of three 12-token prefixes (prefix reuse);
- a 48-block cache too small for a wave, so requests get CacheFullError and wait for the next wave, and cached
  prefixes are evicted;
- stop tokens met mid-batch, chunked prefill of at most 24 tokens a step;
- the same workload with MTP speculative decoding (no stop tokens: a verify step emits several).

It asserts:
- every request's tokens equal its own full recompute (float32 with exact index caches, so bit-comparable);
- no block holds two requests' rows, except a committed prefix block, which is then the same prefix in both;
- every block comes back;
- the index cache follows the latent cache through reuse and eviction: every committed block's latent and index
  rows equal those a fresh runner writes for its prefix alone.

The tokens per second of each run are printed.
"""

import collections

import pytest
import torch

from fxglm5.model.generate import greedy_generate
from fxglm5.model.modeling import Glm5ForCausalLM
from fxglm5.model.tiny import make_tiny_checkpoint
from fxglm5.runtime.runner import Runner
from fxglm5.runtime.speculative import SpeculativeConfig
from tests.long_workload import Workload, all_blocks_back, checked_blocks, committed_rows_match_their_prefix, serve

BLOCK, BLOCKS, STEP = 4, 48, 24
WORKLOAD = Workload(requests=120, wave=12, short=40, prefix=12, max_new=8)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("workload") / "tiny", seed=5)
    return Glm5ForCausalLM.from_pretrained(path, dtype=torch.float32, progress=False, mtp=True)


class Recompute:
    """Each distinct prompt's greedy tokens by the full recompute, once, as long as any request needs them."""

    def __init__(self, model, requests):
        longest = {}
        for prompt, n in requests:
            longest[tuple(prompt)] = max(n, longest.get(tuple(prompt), 0))
        self.tokens = {p: greedy_generate(model, list(p), n) for p, n in longest.items()}

    def __call__(self, prompt, n, stop=frozenset()) -> list[int]:
        want = self.tokens[tuple(prompt)][:n]  # a resumed request's are the same: greedy is a function of the prefix
        end = next((i + 1 for i, t in enumerate(want) if t in stop), len(want))
        return want[:end]


def mid_tokens(recompute: Recompute, requests, count: int = 4) -> frozenset:
    """The tokens the recompute generates most often before a request's last token: stop tokens met mid-batch."""
    seen = collections.Counter(t for prompt, n in requests for t in recompute(prompt, n)[:-1])
    return frozenset(t for t, _ in seen.most_common(count))


@pytest.fixture(scope="module")
def recompute(model):
    return Recompute(model, WORKLOAD.draw(model.config.vocab_size))


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "mtp"])
def test_a_long_mixed_workload_loses_nothing(model, recompute, speculative, capsys):
    requests = WORKLOAD.draw(model.config.vocab_size)
    stop = frozenset() if speculative else mid_tokens(recompute, requests)
    runner = Runner(model, block_size=BLOCK, num_blocks=BLOCKS, max_step_tokens=STEP,
                    speculative=SpeculativeConfig("mtp", 2) if speculative else None)
    checks = checked_blocks(runner)
    served = serve(runner, requests, stop, WORKLOAD.wave)
    assert sorted(served.tokens) == list(range(WORKLOAD.requests))
    for i, (prompt, n) in enumerate(requests):
        assert served.tokens[i] == recompute(prompt, n, stop), f"request {i}"
    stopped = sum(1 for i, (p, n) in enumerate(requests) if len(recompute(p, n, stop)) < n)
    if not speculative:
        assert stopped >= 5  # the stop tokens were met mid-batch
    # the cache was too small for a wave, and every growth was checked
    assert served.waits > 0 and len(checks) > WORKLOAD.requests
    all_blocks_back(runner, BLOCKS)

    def fresh(num_blocks):
        return Runner(model, block_size=BLOCK, num_blocks=num_blocks, program=runner.program)

    assert committed_rows_match_their_prefix(runner, fresh, requests, BLOCK) > 0
    with capsys.disabled():
        print(f"\nworkload ({'mtp' if speculative else 'plain'}): {WORKLOAD.requests} requests, {served.generated} "
              f"tokens in {served.seconds:.1f} s, {served.generated / served.seconds:.1f} tokens/s, "
              f"{served.waits} waits, {stopped} stopped early")
