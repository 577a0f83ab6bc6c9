"""The indexer's top-k split over 2 gloo CPU ranks (``shard_indexer``; real collectives) against one rank, on a
2-layer tiny-tp FP8 checkpoint through the paged runtime, the split threshold lowered to 4 tokens a rank
(``collectives.MIN_ROWS_PER_RANK``, set in each spawned rank) so that a small prefill splits:

- a prefill of two requests (25 + 6 tokens, 31 flat tokens: one padding row) splits on both ranks in both layers,
  and every layer's selection is the single rank's, and so are the tokens generated after it;
- the decode steps (2 tokens, below the threshold) do not split, and select what one rank selects.
"""

import pytest
import torch

from fxglm5.lowering.reference import collectives, paged_steps
from fxglm5.model.config import Glm5Config
from fxglm5.model.tiny import make_tiny_checkpoint
from fxglm5.runtime.distributed import spawn
from fxglm5.runtime.runner import Runner

PROMPTS = [[7 + 3 * i for i in range(25)], [5, 6, 7, 8, 9, 10]]
NEW = 3
OPTIONS = dict(block_size=16, max_cache_tokens=256)
LEAST = 4  # MIN_ROWS_PER_RANK in these runs: steps of 8 tokens or more split over 2 ranks
TIMEOUT = 1200


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    config = Glm5Config.preset("tiny-tp").replace(num_hidden_layers=2, mlp_layer_types=None, indexer_types=None)
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-tp") / "fp8", config=config, seed=1))


def recorded_run(ckpt, tp: int) -> tuple:
    """The tokens and, per indexer call in order, (tokens, whether the step split, the selection sorted by row)."""
    calls = []
    select, split = paged_steps._selection, paged_steps.gather_split_rows

    def recording_split(*args):
        out = split(*args)
        calls.append([out is not None])
        return out

    def recording_select(*args):
        out = select(*args)
        calls[-1] += [out.shape[0], out.sort(-1).values.clone()]
        return out

    paged_steps.gather_split_rows, paged_steps._selection = recording_split, recording_select
    try:
        seqs = Runner(ckpt, tp=tp, **OPTIONS).run(PROMPTS, NEW)
    finally:
        paged_steps.gather_split_rows, paged_steps._selection = split, select
    return [s.output for s in seqs], calls


def split_job(rank, ckpt):
    collectives.MIN_ROWS_PER_RANK = LEAST
    return recorded_run(ckpt, rank.world)


def test_two_ranks_split_the_prefill_top_k_and_select_what_one_rank_selects(ckpt):
    tokens, single = recorded_run(ckpt, 1)
    assert [t for _, t, _ in single[:2]] == [31, 31] and not any(s for s, _, _ in single)
    for got_tokens, calls in spawn(split_job, 2, ckpt, timeout=TIMEOUT):
        assert got_tokens == tokens
        assert len(calls) == len(single) == 2 * NEW  # both layers: the prefill, then NEW - 1 decode steps
        for (did_split, count, selection), (_, want_count, want) in zip(calls, single):
            assert did_split == (count >= 2 * LEAST) and count == want_count
            assert torch.equal(selection, want)
        assert [s for s, _, _ in calls] == [True, True] + [False] * (2 * NEW - 2)
