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
import time

import pytest
import torch

from fxglm5.errors import CacheFullError
from fxglm5.model.generate import greedy_generate
from fxglm5.model.modeling import Glm5ForCausalLM
from fxglm5.model.tiny import make_tiny_checkpoint
from fxglm5.runtime.runner import Runner
from fxglm5.runtime.speculative import SpeculativeConfig

BLOCK, BLOCKS, STEP = 4, 48, 24
REQUESTS, WAVE = 120, 12


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("workload") / "tiny", seed=5)
    return Glm5ForCausalLM.from_pretrained(path, dtype=torch.float32, progress=False, mtp=True)


def workload(vocab: int) -> list[tuple[list[int], int]]:
    """(prompt, max_new_tokens) per request: mixed lengths, a third behind shared prefixes."""
    gen = torch.Generator().manual_seed(7)
    prefixes = [torch.randint(2, vocab, (12,), generator=gen).tolist() for _ in range(3)]
    out = []
    for i in range(REQUESTS):
        n = int(torch.randint(1, 41, (1,), generator=gen))
        tail = torch.randint(2, vocab, (n,), generator=gen).tolist()
        prompt = prefixes[i % 3] + tail[:max(1, n - 12)] if i % 3 == 0 else tail
        out.append((prompt, int(torch.randint(1, 9, (1,), generator=gen))))
    return out


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


def checked_blocks(runner: Runner) -> list[int]:
    """Wrap the block manager so that after every allocation and growth no block serves two requests unless it is a
    committed prefix block (then they share that prefix); returns a list that counts the checks."""
    blocks, checks = runner.blocks, []

    def check():
        owners: dict[int, list] = {}
        for seq_id, table in blocks.tables.items():
            for block in table:
                owners.setdefault(block, []).append(seq_id)
        shared = [b for b, ids in owners.items() if len(ids) > 1]
        assert all(b in blocks._key_of for b in shared), f"blocks {shared} hold rows of two requests"
        assert 0 not in owners, "a request was given the reserved block 0"
        checks.append(len(owners))

    for name in ("allocate", "extend"):
        original = getattr(blocks, name)

        def wrapped(*args, _original=original, **kwargs):
            out = _original(*args, **kwargs)
            check()
            return out

        setattr(blocks, name, wrapped)
    return checks


def serve(runner: Runner, requests, stop) -> tuple[dict[int, list[int]], int]:
    """The requests in waves of WAVE, as a server drives the Runner: a request that gets CacheFullError (no room for
    its prompt, or for its next token) waits for a later wave and resumes from its prompt and the tokens it has.
    Returns each request's tokens and how many times one had to wait."""
    pending = [(i, []) for i in range(len(requests))]  # (request, the tokens it has)
    done, waits = {}, 0
    while pending:
        wave, pending = pending[:WAVE], pending[WAVE:]
        left = [requests[i][1] - len(have) for i, have in wave]
        seqs = runner.run([requests[i][0] + have for i, have in wave], max(left), stop_tokens=stop)
        for (i, have), n, seq in zip(wave, left, seqs):
            tokens = have + seq.output[:n]
            if len(seq.output) >= n or seq.stopped:  # (room may run out later, for tokens past its own n)
                done[i] = tokens
            else:
                assert isinstance(seq.error, CacheFullError), seq.error
                pending.append((i, tokens))  # no room now: it waits, and resumes where it stopped
                waits += 1
    return done, waits


def committed_rows_match_their_prefix(runner: Runner, model, requests) -> int:
    """Every committed block still cached holds, in its latent and index rows, what a fresh runner writes for the
    prefix that ends at that block; returns how many blocks were compared."""
    keyed = dict(runner.blocks._block_of)
    by_key = {}
    for prompt, _ in requests:
        full = len(prompt) // BLOCK
        for j, key in enumerate(runner.blocks._keys(prompt, full)):
            by_key.setdefault(key, prompt[:(j + 1) * BLOCK])
    compared = 0
    for key, block in keyed.items():
        if key not in by_key:  # a block of generated tokens: its prefix is not a prompt's
            continue
        prefix = by_key[key]
        fresh = Runner(model, block_size=BLOCK, num_blocks=len(prefix) // BLOCK + 3, program=runner.program)
        fresh.run([prefix + [1]], 1)
        fresh_block = fresh.blocks._block_of[key]
        for name, tensor in runner.cache.tensors.items():
            torch.testing.assert_close(tensor[block], fresh.cache.tensors[name][fresh_block], rtol=1e-5, atol=1e-5,
                                       msg=lambda m, name=name: f"{name} block {block}: {m}")
        compared += 1
    return compared


@pytest.fixture(scope="module")
def recompute(model):
    return Recompute(model, workload(model.config.vocab_size))


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "mtp"])
def test_a_long_mixed_workload_loses_nothing(model, recompute, speculative, capsys):
    requests = workload(model.config.vocab_size)
    stop = frozenset() if speculative else mid_tokens(recompute, requests)
    runner = Runner(model, block_size=BLOCK, num_blocks=BLOCKS, max_step_tokens=STEP,
                    speculative=SpeculativeConfig("mtp", 2) if speculative else None)
    checks = checked_blocks(runner)
    start = time.perf_counter()
    done, waits = serve(runner, requests, stop)
    seconds = time.perf_counter() - start
    assert sorted(done) == list(range(REQUESTS))
    for i, (prompt, n) in enumerate(requests):
        assert done[i] == recompute(prompt, n, stop), f"request {i}"
    stopped = sum(1 for i, (p, n) in enumerate(requests) if len(recompute(p, n, stop)) < n)
    if not speculative:
        assert stopped >= 5  # the stop tokens were met mid-batch
    assert waits > 0 and len(checks) > REQUESTS  # the cache was too small for a wave, and every growth was checked
    assert runner.blocks.num_free == BLOCKS - 1 and not runner.blocks.tables  # every block came back
    assert not any(runner.blocks._ref)
    assert committed_rows_match_their_prefix(runner, model, requests) > 0
    tokens = sum(len(t) for t in done.values())
    with capsys.disabled():
        print(f"\nworkload ({'mtp' if speculative else 'plain'}): {REQUESTS} requests, {tokens} tokens in "
              f"{seconds:.1f} s, {tokens / seconds:.1f} tokens/s, {waits} waits, {stopped} stopped early")
