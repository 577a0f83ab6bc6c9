"""The long mixed workload's driver (issue 37, item 6), shared by the CPU test (tests/runtime/test_long_workload.py)
and the GPU run at GLM-5's widths (bench/long_workload.py): requests of mixed lengths with shared prefixes, served in
waves the way a server drives the Runner, with the checks that hold whatever the numerics:

- no block holds two requests' rows unless it is a committed prefix block (checked after every allocation and
  growth);
- every block comes back;
- every committed block still cached holds, in its latent and index rows, what a fresh runner writes for the
  prefix that ends at that block (the index cache follows the latent cache through reuse and eviction).

What a request's tokens are compared with is the caller's: the CPU test's full recompute, the GPU run's eager
model over the runtime's own tokens.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import torch

from fxglm5.errors import CacheFullError
from fxglm5.runtime.runner import Runner, Sequence


@dataclasses.dataclass(frozen=True)
class Workload:
    """The shape of a workload: ``requests`` prompts of 1 to ``short`` tokens, every ``long_every``-th one of
    ``long`` (lo, hi) tokens instead (past index_topk), one in three behind one of ``prefixes`` shared prefixes of
    ``prefix`` tokens; each asks for 1 to ``max_new`` tokens. Served ``wave`` at a time."""

    requests: int
    wave: int
    short: int
    prefix: int
    max_new: int
    long: tuple[int, int] | None = None
    long_every: int = 0
    prefixes: int = 3
    seed: int = 7

    def draw(self, vocab: int) -> list[tuple[list[int], int]]:
        """(prompt, max_new_tokens) per request."""
        gen = torch.Generator().manual_seed(self.seed)
        shared = [torch.randint(2, vocab, (self.prefix,), generator=gen).tolist() for _ in range(self.prefixes)]
        out = []
        for i in range(self.requests):
            lo, hi = self.long if self.long_every and i % self.long_every == self.long_every - 1 else (1, self.short)
            n = int(torch.randint(lo, hi + 1, (1,), generator=gen))
            tail = torch.randint(2, vocab, (n,), generator=gen).tolist()
            prompt = shared[i % self.prefixes] + tail[:max(1, n - self.prefix)] if i % 3 == 0 else tail
            out.append((prompt, int(torch.randint(1, self.max_new + 1, (1,), generator=gen))))
        return out


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


@dataclasses.dataclass
class Served:
    """What :func:`serve` returns: each request's tokens, how many times one had to wait, the seconds spent in
    ``Runner.run`` (what the throughput counts) and the tokens generated."""

    tokens: dict[int, list[int]]
    waits: int
    seconds: float

    @property
    def generated(self) -> int:
        return sum(len(t) for t in self.tokens.values())


OnWave = Callable[[list[list[int]], list[Sequence]], None]


def serve(runner: Runner, requests, stop, wave: int, on_wave: OnWave | None = None) -> Served:
    """The requests in waves of ``wave``, as a server drives the Runner: a request that gets CacheFullError (no room
    for its prompt, or for its next token) waits for a later wave and resumes from its prompt and the tokens it
    has. ``on_wave(prompts, seqs)`` sees each wave's prompts and sequences, outside the timed part."""
    if not isinstance(wave, int) or wave < 1:  # (None would slice every request into every wave, each twice)
        raise ValueError(f"serve: wave must be a positive number of requests, got {wave!r}")
    pending = [(i, []) for i in range(len(requests))]  # (request, the tokens it has)
    done, waits, seconds = {}, 0, 0.0
    while pending:
        batch, pending = pending[:wave], pending[wave:]
        left = [requests[i][1] - len(have) for i, have in batch]
        prompts = [requests[i][0] + have for i, have in batch]
        start = time.perf_counter()
        seqs = runner.run(prompts, max(left), stop_tokens=stop)
        if torch.device(runner.device).type == "cuda":
            torch.cuda.synchronize()
        seconds += time.perf_counter() - start
        if on_wave is not None:
            on_wave(prompts, seqs)
        for (i, have), n, seq in zip(batch, left, seqs):
            tokens = have + seq.output[:n]
            if len(seq.output) >= n or seq.stopped:  # (room may run out later, for tokens past its own n)
                done[i] = tokens
            else:
                assert isinstance(seq.error, CacheFullError), seq.error
                pending.append((i, tokens))  # no room now: it waits, and resumes where it stopped
                waits += 1
    return Served(done, waits, seconds)


def all_blocks_back(runner: Runner, num_blocks: int) -> None:
    assert runner.blocks.num_free == num_blocks - 1 and not runner.blocks.tables, "a block did not come back"
    assert not any(runner.blocks._ref), "a block is still referenced"


def committed_rows_match_their_prefix(runner: Runner, fresh: Callable[[int], Runner], requests, block: int,
                                      rtol: float = 1e-5, atol: float = 1e-5, limit: int | None = None,
                                      row_rel_err: float | None = None) -> int:
    """Every committed block still cached holds, in its latent and index rows, what a fresh runner
    (``fresh(num_blocks)``, the same program and caches) writes for the prefix that ends at that block; returns how
    many blocks were compared (at most ``limit``). Element by element (``rtol``, ``atol``), or with
    ``row_rel_err`` each token's row within that relative distance: a bf16 run's deeper layers read activations
    that FP8 quantization rounds by batch, so a few elements of a right row move by an FP8 step while a wrong or
    stale row is as far away as its norm."""
    keyed = dict(runner.blocks._block_of)
    by_key = {}
    for prompt, _ in requests:
        full = len(prompt) // block
        for j, key in enumerate(runner.blocks._keys(prompt, full)):
            by_key.setdefault(key, prompt[:(j + 1) * block])
    compared = 0
    for key, cached_block in keyed.items():
        if key not in by_key:  # a block of generated tokens: its prefix is not a prompt's
            continue
        if limit is not None and compared >= limit:
            break
        prefix = by_key[key]
        other = fresh(len(prefix) // block + 3)
        other.run([prefix + [1]], 1)
        fresh_block = other.blocks._block_of[key]
        for name, tensor in runner.cache.tensors.items():
            ours, theirs = tensor[cached_block].float(), other.cache.tensors[name][fresh_block].float()
            if row_rel_err is None:
                torch.testing.assert_close(ours, theirs, rtol=rtol, atol=atol,
                                           msg=lambda m, name=name: f"{name} block {cached_block}: {m}")
                continue
            rows = ours.flatten(1) - theirs.flatten(1)
            err = rows.norm(dim=1) / theirs.flatten(1).norm(dim=1).clamp_min(1e-12)
            assert err.max() <= row_rel_err, (f"{name} block {cached_block}: row {int(err.argmax())} is "
                                              f"{err.max():.4f} away (relative), more than {row_rel_err}")
        compared += 1
    return compared
