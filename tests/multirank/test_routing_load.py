"""bench/routing_load: the busiest rank's routed load (issue 45, item 1), simulated and steered into a rank's graph.

The simulation's figures are checked against what uniform top-k routing gives in closed form (an average group's
distinct experts, every group's at ep = 1) and against the issue's estimate (a batch-1 token's 8 experts put about 2.5
on the busiest of 8 ranks). The steering is checked on rank 0 of a fake TP8 world at EP8 and at the mixed ep 2: a runner
compiled while it is open routes its decode steps by the patterns (changing a pattern's contents changes the logits, the
same contents give the same logits), and a prefill passes through."""

import pytest
import torch

from bench.routing_load import SteeredRouting, simulate
from fxglm5.model.random_reader import RandomReader
from fxglm5.runtime.runner import Runner
from tests.helpers import fake_process_group
from tests.multirank.test_fake_group import CONFIG


def test_batch_one_lands_about_two_and_a_half_experts_on_the_busiest_of_eight_ranks():
    sim = simulate(256, 8, 8, 1, 4096)
    assert 2.3 < sim.busiest_distinct.mean().item() < 2.8
    assert torch.equal(sim.busiest_distinct, sim.busiest_pairs)  # one token: every pair is its own expert
    assert sim.mean_distinct == pytest.approx(1.0) and sim.mean_pairs == pytest.approx(1.0)


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_ep1_has_no_busiest_rank_and_the_average_group_matches_the_closed_form(batch):
    whole = simulate(256, 8, 1, batch, 512)
    assert whole.busiest_distinct.mean().item() == pytest.approx(whole.mean_distinct)  # one group: it is the busiest
    closed = 256 * (1 - (1 - 8 / 256) ** batch)
    assert whole.mean_distinct == pytest.approx(closed, rel=0.02)
    for ep in (2, 8):  # the mixed layout's two groups of 128, and 8 of 32
        grouped = simulate(256, 8, ep, batch, 2048)
        assert grouped.mean_distinct == pytest.approx(closed / ep, rel=0.02)
        assert grouped.busiest_distinct.mean().item() > grouped.mean_distinct


def test_the_busiest_ids_are_that_groups_own_experts_each_token_choosing_distinct_ones():
    sim = simulate(64, 4, 4, 8, 256, seed=3)
    ids = sim.busiest_ids
    assert ids.shape == (256, 8, 4) and ids.dtype == torch.int32
    assert bool(((ids == -1) | ((ids >= 0) & (ids < 16))).all())
    for trial in range(256):
        local = ids[trial][ids[trial] >= 0]
        assert local.unique().numel() == sim.busiest_distinct[trial].item()
        assert local.numel() == sim.busiest_pairs[trial].item()
        for row in ids[trial]:
            mine = row[row >= 0]
            assert mine.unique().numel() == mine.numel()


@pytest.mark.parametrize("ep", [8, 2])
def test_a_runner_compiled_under_steering_routes_its_decode_steps_by_the_patterns(ep):
    """At ep 8 and at the mixed ep 2, where rank 0's local ids are its group's (group 0: experts 0-7 of 16)."""
    layers = sum(CONFIG.is_moe_layer(i) for i in range(CONFIG.num_hidden_layers))
    local = CONFIG.n_routed_experts // ep
    k = CONFIG.num_experts_per_tok
    first = torch.full((layers, 1, k), -1, dtype=torch.int32)
    first[:, 0, 0] = 0
    with fake_process_group(0, 8):
        steering = SteeredRouting({1: first}, "cpu")
        with steering:
            runner = Runner(RandomReader(CONFIG, seed=0), tp=8, ep=ep, kv_cache="fp8", block_size=16,
                            max_cache_tokens=256, keep_logits=True)
        prompt = [5, 9, 2, 33, 7, 1, 8, 21]

        def decoded():
            before = steering.calls[1]
            seq, = runner.run([prompt], 3)
            assert steering.calls[1] - before == 2 * layers  # two decode steps; the 8-token prefill passed through
            return torch.stack(seq.logits[1:])

        a, again = decoded(), decoded()
        steering.patterns[1][:, 0, 0] = local - 1  # another of the rank's experts
        other = decoded()
    assert torch.equal(a, again)
    assert not torch.allclose(a, other)
