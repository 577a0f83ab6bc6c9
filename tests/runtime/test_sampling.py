"""On-device sampling (fxglm5.runtime.sampling), against references written here: greedy is torch's argmax with
its tie rule (the lowest id wins); a sampled row follows softmax(logits / temperature) cut to its top-k and then to
the smallest top-p prefix (counts of many seeded draws against that distribution, Pearson's chi-square at
tests/stats.SIGNIFICANCE, and never a token outside it); a seed repeats its tokens in any batch; log-probabilities
are log_softmax of the logits; speculative sampling's first, second and third emitted tokens follow the target's
rows whatever the drafts. Through the runtime: a seeded request repeats itself and gives the same tokens alone,
in a batch and in the overlapped loop; greedy requests beside sampled ones keep their tokens; logprobs per token."""

import math

import pytest
import torch

from fxglm5.runtime.engine import Engine
from fxglm5.runtime.sampling import GREEDY, SamplingParams, generator_for, sample, verify_sampled
from tests.paged_helpers import prompts, runner
from tests.stats import SIGNIFICANCE, chi_square_p

N = 4000
LOGITS = torch.tensor([2.0, 1.5, 1.4, 0.3, -0.2, 1.9, -1.0, 0.9, 0.0, 1.2])


def reference(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> dict[int, float]:
    """The distribution a row is sampled from, by the definition: sorted by logit, the first top_k kept, softmax at
    the temperature over them, then the shortest prefix whose probability reaches top_p, renormalized."""
    order = sorted(range(len(logits)), key=lambda i: -float(logits[i]))[:top_k or None]
    weights = [math.exp(float(logits[i]) / temperature) for i in order]
    probs = [w / sum(weights) for w in weights]
    kept, mass = [], 0.0
    for i, p in zip(order, probs):
        kept.append((i, p))
        mass += p
        if mass >= top_p:
            break
    total = sum(p for _, p in kept)
    return {i: p / total for i, p in kept}


def draws(params: SamplingParams, logits=LOGITS, n=N) -> dict[int, int]:
    """One draw from each of ``n`` rows of ``logits``, row i with its generator seeded i."""
    rows = [params.replace(seed=i) for i in range(n)]
    tokens = sample(logits.expand(n, -1), rows, [generator_for(p, "cpu", 0) for p in rows]).tokens.tolist()
    return {t: tokens.count(t) for t in set(tokens)}


def test_the_chi_square_p_value():
    assert chi_square_p({0: 50, 1: 50}, {0: 0.5, 1: 0.5}, 100) == 1.0
    p = chi_square_p({0: 60, 1: 40}, {0: 0.5, 1: 0.5}, 100)  # stat 4, df 1: p = erfc(sqrt(2))
    assert abs(p - math.erfc(math.sqrt(2))) < 1e-9
    assert chi_square_p({0: 99, 2: 1}, {0: 0.5, 1: 0.5}, 100) == 0.0  # an impossible outcome


def test_greedy_is_argmax_and_keeps_its_tie_rule():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -2.0, 7.0, 7.0]])
    want = [1, 0, 2]  # the lowest id among equal maxima
    for params in (GREEDY, SamplingParams(temperature=0.7, top_k=1), GREEDY.replace(logprobs=2)):
        assert sample(logits, [params] * 3, [generator_for(params, "cpu", 0)] * 3).tokens.tolist() == want


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.6, 0, 1.0), (1.3, 4, 1.0), (1.0, 0, 0.7),
                                                       (0.8, 5, 0.9)])
def test_sampled_rows_follow_temperature_top_k_top_p(temperature, top_k, top_p):
    want = reference(LOGITS, temperature, top_k, top_p)
    counts = draws(SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    assert set(counts) <= set(want)  # nothing outside the top-k / top-p set is ever drawn
    assert chi_square_p(counts, want, N) > SIGNIFICANCE, (counts, want)


def test_a_seed_repeats_in_any_batch():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(seed=7), GREEDY, SamplingParams(seed=8, top_k=5), SamplingParams(seed=7),
              SamplingParams(seed=9, top_p=0.5), SamplingParams(seed=7)]
    gens = [generator_for(p, "cpu", 0) for p in params]
    first = sample(logits, params, gens).tokens.tolist()
    again = [sample(logits[i:i + 1], [params[i]], [generator_for(params[i], "cpu", 0)]).tokens.item() for i in range(6)]
    assert first == again
    later = sample(logits, params, gens).tokens.tolist()  # the streams moved on: a second draw is a new one
    assert later != first and sample(logits, params, [generator_for(p, "cpu", 0) for p in params]).tokens.tolist() \
        == first


def test_logprobs_are_log_softmax_of_the_logits():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(1))
    params = [GREEDY.replace(logprobs=3), SamplingParams(seed=1, logprobs=0, temperature=0.5), GREEDY]
    out = sample(logits, params, [generator_for(p, "cpu", 0) for p in params])
    lp = torch.log_softmax(logits, -1)
    torch.testing.assert_close(out.logprobs, lp.gather(1, out.tokens[:, None])[:, 0])
    top = lp[0].topk(3)
    torch.testing.assert_close(out.top_logprobs[0, :3], top.values)
    assert out.top_ids[0, :3].tolist() == top.indices.tolist()


# each row's argmax; each row's second; a first draft outside the top-k (never accepted)
@pytest.mark.parametrize("drafts", [[0, 9], [5, 4], [3, 9]])
def test_speculative_sampling_emits_the_target_distribution(drafts):
    """Rows 0..2 are the target's distributions at the three positions a verify step with 2 drafts scores (row i+1
    given the drafts before it were accepted). Over N seeds: the first emitted token follows row 0, the second
    (where the first draft was accepted) row 1, the third (both accepted: the bonus token) row 2."""
    rows = torch.stack([LOGITS, LOGITS.flip(0), LOGITS.roll(3)])
    params = SamplingParams(temperature=0.9, top_k=6)
    first, second, third = {}, {}, {}
    for seed in range(N // 2):
        a, token = verify_sampled(rows, drafts, params, generator_for(params.replace(seed=seed), "cpu", 0)).tolist()
        emitted = drafts[:a] + [token]
        for place, t in zip((first, second, third), emitted):
            place[t] = place.get(t, 0) + 1
    for place, row in zip((first, second, third), rows):
        if place:
            want = reference(row, 0.9, 6)
            assert chi_square_p(place, want, sum(place.values())) > SIGNIFICANCE, (place, want)
    support = [reference(row, 0.9, 6) for row in rows]
    # the drafts were accepted often enough to test the later positions, and never where they cannot be
    assert (sum(second.values()) > 200) == (drafts[0] in support[0])
    assert (sum(third.values()) > 100) == (drafts[0] in support[0] and drafts[1] in support[1])


def test_seeded_requests_repeat_through_the_engine_in_any_company():
    """Through the runtime (the overlapped loop and the step-by-step one): a seeded request's tokens alone, beside
    other sampled and greedy requests, and again; greedy requests beside sampled ones keep their greedy tokens;
    each token's logprobs are there where asked."""
    batch = prompts(torch.Generator().manual_seed(3), [6, 9, 4])
    seeded = SamplingParams(seed=11, top_k=20, max_tokens=10, logprobs=2)
    greedy_alone = runner("exact", block_size=4).run([batch[1]], 10)[0].output

    def run(items, overlap=True):
        engine = Engine(runner("exact", block_size=4, overlap=overlap), seed=123)
        ids, seqs = [engine.add(p, params) for p, params in items], {}
        while engine.has_work():
            seqs.update((out.id, out.sequence) for out in engine.step())
        return [seqs[i] for i in ids]

    solo = run([(batch[0], seeded)])[0]
    crowd = run([(batch[2], SamplingParams(max_tokens=7)), (batch[0], seeded), (batch[1], GREEDY.replace(max_tokens=10))],
                overlap=False)
    assert solo.output == crowd[1].output and len(solo.output) == 10
    assert crowd[2].output == greedy_alone
    assert len(solo.token_logprobs) == 10 and all(len(lp.top) == 2 and lp.logprob <= 0 for lp in solo.token_logprobs)
    assert [lp.logprob for lp in solo.token_logprobs] == pytest.approx([lp.logprob for lp in crowd[1].token_logprobs],
                                                                        abs=1e-4)
    other = run([(batch[0], seeded.replace(seed=12))])[0]
    assert other.output != solo.output  # the seed, not the prompt alone, decides

