"""Decode from static, bucket-padded buffers (what the CUDA graphs replay; on a CPU the same steps run without
capture): the exact tokens and logits of full recompute, whatever the bucket padding, with eager fallback for
batches past the largest bucket. The GPU test (tests/gpu/test_gpu_e2e.py) checks the captured replays."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fxglm5.runtime.decode_graphs import pow2_buckets
from tests.paged_helpers import model_and_graph, prompts, runner
from tests.runtime.test_runtime_generate import check_exact


def test_buckets():
    assert pow2_buckets(1) == [1]
    assert pow2_buckets(6) == [1, 2, 4, 6]
    assert pow2_buckets(64) == [1, 2, 4, 8, 16, 32, 64]


def test_padded_decode_steps_give_the_exact_tokens():
    model, _ = model_and_graph("exact")
    r = runner("exact", block_size=4, decode_graphs=True, max_decode_batch=4)
    seqs = r.run(prompts(torch.Generator().manual_seed(4), [5, 20, 11]), 12)  # batch 3 in bucket 4
    check_exact(model, seqs)
    assert r.decode_graphs.steps == 11
    assert set(r.decode_graphs.tables) == {8}  # 6 to 8 blocks of 4 tokens: one width bucket


@settings(max_examples=max(2, settings.default.max_examples // 4))
@given(lengths=st.lists(st.integers(1, 24), min_size=1, max_size=5), max_batch=st.sampled_from([1, 2, 3, 4]),
       seed=st.integers(0, 99))
def test_static_decode_same_tokens_as_eager(lengths, max_batch, seed):
    batch = prompts(torch.Generator().manual_seed(seed), lengths)
    eager = runner("exact", block_size=4, keep_logits=False).run(batch, 6)
    static = runner("exact", block_size=4, keep_logits=False, decode_graphs=True, max_decode_batch=max_batch)
    assert [s.output for s in static.run(batch, 6)] == [s.output for s in eager]
    # every step fits a bucket, or none does (then all ran eagerly)
    assert static.decode_graphs.steps == (5 if len(lengths) <= max_batch else 0)
