"""Speculative decoding with the checkpoint's own MTP layer (fxglm5.runtime.mtp_drafter) on the tiny FP8
checkpoint, float32: the tokens are plain greedy decoding's for k = 1..4 on a batch of mixed lengths (one
past index_topk), every draft is the one full recompute proposes (fxglm5.model.generate.mtp_drafts: target and MTP
recomputed over the whole sequence so far), so the MTP cache's draft prefill, chained drafts and rollback keep
the right rows, and each request's acceptance lengths are the eager reference's (speculative_greedy_generate).
(The tiny checkpoint's random MTP rarely guesses the target's token: the drafts, not the acceptance, are what
these tests pin down.)"""

import functools

import pytest
import torch

from fxglm5.model.generate import greedy_generate, mtp_drafts, speculative_greedy_generate
from fxglm5.model.modeling import Glm5ForCausalLM
from fxglm5.model.tiny import make_tiny_checkpoint
from fxglm5.runtime.runner import Runner
from fxglm5.runtime.speculative import SpeculativeConfig

PROMPTS = [[1, 17, 42, 7, 99, 3, 250, 11, 300, 5, 64, 128], [5, 6, 7]]  # 12 > index_topk (8)
NEW = 10


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("mtp") / "fp8", fp8=True)
    return Glm5ForCausalLM.from_pretrained(ckpt, dtype=torch.float32, progress=False, mtp=True)


@functools.lru_cache(maxsize=None)
def graphs(model):
    r = Runner(model, block_size=4, max_cache_tokens=128, speculative=SpeculativeConfig(num_tokens=1))
    return r.program, r.drafter.program


@functools.lru_cache(maxsize=None)
def greedy(model, prompt: tuple[int, ...]) -> list[int]:
    """Full recompute's greedy tokens for ``prompt``: the same for every k and step size, so computed once."""
    return greedy_generate(model, list(prompt), NEW)


@functools.lru_cache(maxsize=None)
def speculative(model, prompt: tuple[int, ...], k: int) -> tuple[list[int], list[int]]:
    """The eager reference's tokens and acceptance lengths for ``prompt`` at k drafts (shared by both step sizes)."""
    return speculative_greedy_generate(model, list(prompt), NEW, k)


# max_step_tokens 5 and 7 split the 15 prompt tokens into chunked prefill steps (5+5+2|3 and 7|5+2|1): the
# draft prefill runs per chunk and must leave the MTP cache the rows of one unchunked step
@pytest.mark.parametrize("k, max_step_tokens", [(1, 16384), (2, 16384), (3, 16384), (4, 16384), (2, 5), (3, 7)])
def test_mtp_drafts_give_greedy_tokens_and_the_reference_acceptance(model, k, max_step_tokens):
    graph, mtp_graph = graphs(model)
    r = Runner(model, block_size=4, max_cache_tokens=128, speculative=SpeculativeConfig(num_tokens=k),
               program=graph, mtp_program=mtp_graph, max_step_tokens=max_step_tokens)
    propose, checked = r.drafter.propose, []

    def check(seqs, counts):
        drafts = propose(seqs, counts)
        for seq, n, got in zip(seqs, counts, drafts):
            ids = list(seq.tokens)
            with torch.no_grad():
                hidden = model(torch.tensor([ids[:-1]]), return_hidden=True)[1]
            assert got == mtp_drafts(model, torch.tensor([ids]), hidden, n)
            checked.append(n)
        return drafts

    r.drafter.propose = check
    seqs = r.run(PROMPTS, NEW)
    assert len(checked) == r.acceptance.steps and max(checked) == k  # every step's drafts, chains of k checked
    for seq, prompt in zip(seqs, PROMPTS):
        tokens, acceptance = speculative(model, tuple(prompt), k)
        assert seq.output == tokens == greedy(model, tuple(prompt))
        assert seq.acceptance == acceptance
    assert r.acceptance.mean_length == sum(map(sum, (s.acceptance for s in seqs))) / r.acceptance.steps


def test_prefix_reuse_and_static_verify_steps(model):
    """A second request sharing full blocks of the first (its MTP rows reused too), verify steps from the
    padded static buffers (decode_graphs=True on a CPU): greedy tokens."""
    graph, mtp_graph = graphs(model)
    r = Runner(model, block_size=4, max_cache_tokens=128, speculative=SpeculativeConfig(num_tokens=2),
               program=graph, mtp_program=mtp_graph, decode_graphs=True, max_decode_batch=2)
    first = r.run(PROMPTS[:1], NEW)
    again = r.run([PROMPTS[0][:9] + [2, 3]], NEW)
    assert again[0].prefix_reused == 8 and r.decode_graphs.steps > 0
    assert first[0].output == greedy(model, tuple(PROMPTS[0]))
    assert again[0].output == greedy_generate(model, PROMPTS[0][:9] + [2, 3], NEW)
