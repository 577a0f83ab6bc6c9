"""Chunked prefill (``Runner(max_step_tokens=...)``): the admitted prompts run in prefill steps of at most
max_step_tokens flat tokens, a prompt longer than a step's room going on behind its cached rows. The tokens are
those of one unchunked prefill step (the default, 16384 >> these prompts) and the per-step logits full
recompute's, for a batch of mixed lengths (one longer than every step, one longer than index_topk 8), with prefix
reuse, FP8 caches and speculative decoding; no step computes more than max_step_tokens tokens."""

import pytest
import torch

from fxglm5.errors import InputError
from fxglm5.runtime.runner import Runner
from fxglm5.runtime.speculative import ScriptedDrafter, SpeculativeConfig
from tests.paged_helpers import model_and_graph, prompts, runner
from tests.runtime.test_runtime_generate import check_close, check_exact

NEW = 6
LENGTHS = [5, 20, 11]  # 20 > index_topk (8) and > every max_step_tokens below


@pytest.fixture
def step_sizes(monkeypatch):
    """The flat token count of every Runner.step (prefill, decode and verify steps alike)."""
    sizes, step = [], Runner.step

    def spy(self, ctx, input_ids, rows=None):
        sizes.append(input_ids.numel())
        return step(self, ctx, input_ids, rows)

    monkeypatch.setattr(Runner, "step", spy)
    return sizes


@pytest.mark.parametrize("max_step_tokens", [1, 5, 7, 16])
def test_chunked_prefill_gives_unchunked_tokens_with_prefix_reuse(max_step_tokens):
    model, _ = model_and_graph("exact")
    first = prompts(torch.Generator().manual_seed(0), LENGTHS)
    second = [first[1][:17] + [3, 4, 5], first[2][:9] + [7], [9, 9, 9]]  # reuses 16 and 8 tokens of the first
    plain = runner("exact", block_size=4)
    chunked = runner("exact", block_size=4, max_step_tokens=max_step_tokens)
    for batch in (first, second):
        want, got = plain.run(batch, NEW), chunked.run(batch, NEW)
        check_exact(model, got)
        assert [s.output for s in got] == [s.output for s in want]
        assert [s.prefix_reused for s in got] == [s.prefix_reused for s in want]
    assert [s.prefix_reused for s in got] == [16, 8, 0]


def test_prefill_steps_never_exceed_max_step_tokens(step_sizes):
    batch = prompts(torch.Generator().manual_seed(2), LENGTHS)
    runner("exact", block_size=4, max_step_tokens=7).run(batch, NEW)
    prefill, decode = step_sizes[:6], step_sizes[6:]
    assert prefill == [7, 7, 7, 7, 7, 1]  # 36 prompt tokens packed in order, requests split across steps
    assert decode == [len(batch)] * (NEW - 1)  # decode steps unchanged


@pytest.fixture
def prefill_steps(monkeypatch):
    """The uncached prompt tokens of every prefill step (Runner._prefill_step)."""
    sizes, prefill_step = [], Runner._prefill_step

    def spy(self, step):
        sizes.append(sum(n for _, _, n in step))
        return prefill_step(self, step)

    monkeypatch.setattr(Runner, "_prefill_step", spy)
    return sizes


@pytest.mark.parametrize("max_step_tokens", [1, 2, 3, 4, 6, 10, 12, 35, 36, 64])
def test_prefill_takes_the_fewest_steps(max_step_tokens, prefill_steps):
    """Every prefill step but the last is full: ceil(T / max_step_tokens) steps for T uncached prompt tokens, also
    where a request leaves one token of a step's room (6: the first prompt's 5 tokens, then 1 of the second's), and
    with a reused prefix (only the uncached tokens count). The tokens are the unchunked run's."""
    first = prompts(torch.Generator().manual_seed(5), LENGTHS)
    second = [first[1][:17] + [3, 4], [9, 9, 9, 9, 9, 9, 9], first[2][:9] + [7]]  # 16 and 8 tokens reused
    chunked = runner("exact", block_size=4, max_step_tokens=max_step_tokens)
    plain = runner("exact", block_size=4)
    for batch, uncached in ((first, sum(LENGTHS)), (second, 3 + 7 + 2)):
        prefill_steps.clear()
        seqs = chunked.run(batch, 2)
        full, rest = divmod(uncached, max_step_tokens)
        assert prefill_steps == [max_step_tokens] * full + ([rest] if rest else []), (batch, prefill_steps)
        assert [s.output for s in seqs] == [s.output for s in plain.run(batch, 2)]


def test_fp8_caches_with_chunked_prefill():
    model, _ = model_and_graph("fp8")
    batch = prompts(torch.Generator().manual_seed(3), [30, 7, 26, 12])
    options = dict(kv_cache="fp8", block_size=16, kernel_block_size=8)
    want = runner("fp8", **options).run(batch, NEW)
    got = runner("fp8", max_step_tokens=16, **options).run(batch, NEW)
    check_close(model, got)
    assert [s.output for s in got] == [s.output for s in want]


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_with_chunked_prefill(k, step_sizes):
    """Forced acceptance (ScriptedDrafter with the plain run's tokens): every draft is accepted, the drafter is
    started on every chunk, and the prefill steps stay within max_step_tokens."""
    model, _ = model_and_graph("exact")
    batch = prompts(torch.Generator().manual_seed(4), LENGTHS)
    plain = runner("exact", block_size=4).run(batch, NEW)
    step_sizes.clear()
    drafter = ScriptedDrafter({tuple(p): s.output for p, s in zip(batch, plain)})
    chunks, start = [], drafter.start
    drafter.start = lambda step, hidden: (chunks.append([(s.id, a, n) for s, a, n in step]), start(step, hidden))
    r = runner("exact", block_size=4, max_step_tokens=5, speculative=SpeculativeConfig(num_tokens=k), drafter=drafter)
    seqs = r.run(batch, NEW)
    check_exact(model, seqs)
    assert [s.output for s in seqs] == [s.output for s in plain]
    assert r.acceptance.rate == 1.0
    assert [sum(n for _, _, n in step) for step in chunks] == [5] * 7 + [1] == step_sizes[:8]
    for seq, prompt in zip(seqs, batch):  # each prompt's chunks are consecutive and cover it
        mine = [(a, n) for step in chunks for i, a, n in step if i == seq.id]
        assert [a for a, _ in mine] == [0] + [a + n for a, n in mine[:-1]] and sum(n for _, n in mine) == len(prompt)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "16", None])
def test_bad_max_step_tokens_is_refused(bad):
    model, graph = model_and_graph("exact")
    with pytest.raises(InputError, match="max_step_tokens"):
        Runner(model, program=graph, block_size=4, max_step_tokens=bad)
