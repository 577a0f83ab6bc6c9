"""Sampled requests under speculative decoding follow the target model's distribution (issue 46, item 3), on the
tiny FP8 checkpoint in float32.

One prompt, top-k 2 at temperature 1, four new tokens: the exact distribution of the 16 possible continuations is
computed with the cache-less model (p(t1) p(t2 | t1) p(t3 | t1 t2) p(t4 | ...), 15 forwards). N requests with seeds
0..N-1 run through the engine three ways: plain sampling, speculative decoding with the checkpoint's MTP layer
(k = 2; its random weights rarely propose a token in the top 2, so nearly every draft is rejected), and with a
drafter that proposes the target's own argmax (k = 2: accepted about as often as it is likely, so acceptance,
rejection with the residual, and the bonus token all occur). Each way's counts pass Pearson's chi-square test
against the exact distribution at significance tests/stats.SIGNIFICANCE (0.001); the tokens after the first come
from verify steps, so a wrong acceptance rule or residual shows there.
"""

import pytest
import torch

from fxglm5.model.modeling import Glm5ForCausalLM
from fxglm5.model.tiny import make_tiny_checkpoint
from fxglm5.runtime.engine import Engine
from fxglm5.runtime.runner import Runner
from fxglm5.runtime.sampling import SamplingParams
from fxglm5.runtime.speculative import SpeculativeConfig
from tests.stats import SIGNIFICANCE, chi_square_p

PROMPT = [1, 17, 42, 7, 99]
N, NEW, TOP_K = 500, 4, 2
PARAMS = SamplingParams(temperature=1.0, top_k=TOP_K, max_tokens=NEW)
OPTIONS = dict(block_size=4, max_cache_tokens=4 * N * 4)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("spec-sampling") / "fp8", fp8=True)
    return Glm5ForCausalLM.from_pretrained(ckpt, dtype=torch.float32, progress=False, mtp=True)


@pytest.fixture(scope="module")
def exact(model):
    """(continuation -> probability, context -> the target's argmax token) by full recompute."""
    joint, argmax = {}, {}

    @torch.no_grad()
    def expand(context: tuple, p: float):
        logits = model(torch.tensor([PROMPT + list(context)]))[0, -1].float()
        argmax[context] = int(logits.argmax())
        top = logits.topk(TOP_K)
        for token, q in zip(top.indices.tolist(), top.values.softmax(-1).tolist()):
            if len(context) + 1 == NEW:
                joint[context + (token,)] = p * q
            else:
                expand(context + (token,), p * q)

    expand((), 1.0)
    return joint, argmax


class TargetArgmax:
    """Drafts the target's argmax continuation of each request's tokens so far (from the exact table)."""

    def __init__(self, argmax):
        self.argmax = argmax

    def start(self, chunks, hidden):
        pass

    def propose(self, seqs, counts):
        out = []
        for seq, n in zip(seqs, counts):
            context, drafts = tuple(seq.output), []
            for _ in range(n):
                drafts.append(self.argmax[context])
                context += (drafts[-1],)
            out.append(drafts)
        return out

    def accepted(self, seqs, counts, accepted, hidden):
        pass

    def release(self, seq):
        pass


def counts(runner) -> dict:
    engine = Engine(runner)
    for seed in range(N):
        engine.add(PROMPT, PARAMS.replace(seed=seed))
    found = {}
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                assert out.finish_reason == "length"
                key = tuple(out.sequence.output)
                found[key] = found.get(key, 0) + 1
    return found


@pytest.mark.parametrize("way", ["plain", "mtp", "target-argmax"])
def test_sampled_tokens_follow_the_target_distribution(model, exact, way):
    joint, argmax = exact
    if way == "plain":
        runner = Runner(model, **OPTIONS)
    elif way == "mtp":
        runner = Runner(model, speculative=SpeculativeConfig(num_tokens=2), **OPTIONS)
    else:
        runner = Runner(model, speculative=SpeculativeConfig(num_tokens=2), drafter=TargetArgmax(argmax), **OPTIONS)
    found = counts(runner)
    assert sum(found.values()) == N
    p = chi_square_p(found, joint, N)
    assert p > SIGNIFICANCE, (way, p, found, joint)
    if way != "plain":
        rate = runner.acceptance.rate
        assert (rate > 0.3) if way == "target-argmax" else (rate < 0.2), rate
    assert runner.blocks.num_free == runner.blocks.num_blocks - 1
