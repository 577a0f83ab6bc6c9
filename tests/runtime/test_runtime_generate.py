"""The paged runtime (compiled graph + RTP cached ops + block manager) generates what the cache-less model
generates: same greedy tokens and per-step logits within 1e-4 relative with compute-dtype caches in
float32, across batches of mixed prompt lengths (shorter and longer than index_topk), prefix reuse, block
sizes and kernel block sizes; with FP8 caches it tracks the model (top-1 >= 95%, cosine >= 0.99 per step).

Per-step logits are compared teacher-forced: the model runs once on prompt + generated tokens, and a
generated token equal to that logit row's argmax at every step is exactly greedy full recompute.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fxglm5.lowering.reference.paged as paged
from fxglm5.model.config import Glm5Config
from fxglm5.model.generate import greedy_generate
from fxglm5.runtime.runner import Runner
from tests.helpers import random_model
from tests.paged_helpers import model_and_graph, prompts, reference_logits, runner

NEW_TOKENS = 32


def check_exact(model, seqs, rel=1e-4):
    for seq in seqs:
        assert seq.error is None
        ref = reference_logits(model, seq)
        got = torch.stack(seq.logits)
        assert len(seq.output) == ref.shape[0]
        scale = ref.abs().amax(dim=1)
        worst = ((got - ref).abs().amax(dim=1) / scale).max().item()
        assert worst <= rel, f"request {seq.id}: per-step logits differ by {worst:.2e} relative"
        assert seq.output == ref.argmax(dim=1).tolist()


def test_generate_matches_full_recompute_with_prefix_reuse():
    model, _ = model_and_graph("exact")
    r = runner("exact", block_size=4)
    first = prompts(torch.Generator().manual_seed(0), [5, 20, 11])
    seqs = r.run(first, NEW_TOKENS)
    check_exact(model, seqs)
    assert seqs[0].output == greedy_generate(model, first[0], NEW_TOKENS)  # the literal reference, once
    # second batch: prefixes of the first batch's prompts (blocks freed but cached) plus fresh tokens
    second = [first[1][:17] + [3, 4, 5], first[2][:9] + [7], [9, 9, 9]]
    seqs = r.run(second, NEW_TOKENS)
    check_exact(model, seqs)
    assert [s.prefix_reused for s in seqs] == [16, 8, 0]


@pytest.mark.parametrize("kernel_block_size", [4, 2])
def test_resent_whole_block_prompts_reuse_all_but_their_last_block(kernel_block_size, monkeypatch):
    """Prompts of exactly 2 and 4 blocks, sent twice: the second time every block but the last comes from the
    cache (the last token must be computed for its logits, so its block is recomputed), and the tokens are
    those of a fresh runner and of full recompute."""
    model, _ = model_and_graph("exact")
    batch = prompts(torch.Generator().manual_seed(5), [8, 16])
    r = runner("exact", block_size=4, kernel_block_size=kernel_block_size)
    tables, allocate = [], r.blocks.allocate

    def record(seq_id, tokens):
        cached = allocate(seq_id, tokens)
        tables.append(list(r.blocks.tables[seq_id]))
        return cached

    monkeypatch.setattr(r.blocks, "allocate", record)
    first, again = r.run(batch, 8), r.run(batch, 8)
    assert [s.prefix_reused for s in first] == [0, 0] and [s.prefix_reused for s in again] == [4, 12]
    for before, after, prompt in zip(tables[:2], tables[2:], batch):
        kept = len(prompt) // 4 - 1
        assert after[:kept] == before[:kept] and after[kept] != before[kept]  # the cached last block is not written
    check_exact(model, again)
    fresh = runner("exact", block_size=4, kernel_block_size=kernel_block_size).run(batch, 8)
    assert [s.output for s in again] == [s.output for s in first] == [s.output for s in fresh]


def test_kernel_block_size_gives_the_same_tokens():
    model, _ = model_and_graph("exact")
    batch = prompts(torch.Generator().manual_seed(1), [9, 14])
    whole = runner("exact", block_size=8).run(batch, 8)
    split = runner("exact", block_size=8, kernel_block_size=2).run(batch, 8)
    check_exact(model, split)
    assert [s.output for s in whole] == [s.output for s in split]


@settings(max_examples=max(2, settings.default.max_examples // 4))
@given(data=st.data(), block_size=st.sampled_from([2, 4, 16]), ratio=st.sampled_from([1, 2]),
       lengths=st.lists(st.integers(1, 20), min_size=1, max_size=3))
def test_generate_property(data, block_size, ratio, lengths):
    model, _ = model_and_graph("exact")
    r = runner("exact", block_size=block_size, kernel_block_size=block_size // ratio)
    seed = data.draw(st.integers(0, 2**16), label="seed")
    first = prompts(torch.Generator().manual_seed(seed), lengths)
    check_exact(model, r.run(first, NEW_TOKENS))
    # a second request sharing a drawn prefix of an earlier prompt
    src = data.draw(st.sampled_from(first), label="prefix source")
    cut = data.draw(st.integers(1, len(src)), label="prefix length")
    tail = data.draw(st.lists(st.integers(0, 255), min_size=1, max_size=6), label="new tokens")
    seqs = r.run([src[:cut] + tail], NEW_TOKENS)
    check_exact(model, seqs)
    assert seqs[0].prefix_reused >= (cut // block_size) * block_size  # more only if the tail repeats the output


def check_close(model, seqs):
    agree = total = 0
    for seq in seqs:
        assert seq.error is None
        ref = reference_logits(model, seq)
        got = torch.stack(seq.logits)
        cos = torch.nn.functional.cosine_similarity(got, ref, dim=1)
        assert cos.min().item() >= 0.99, f"request {seq.id}: cosine {cos.min().item():.4f}"
        agree += sum(int(a == b) for a, b in zip(ref.argmax(dim=1).tolist(), seq.output))
        total += len(seq.output)
    assert agree / total >= 0.95, f"top-1 agreement {agree}/{total}"


def test_fp8_caches_track_full_recompute():
    """FP8 ds_mla latent rows + the block-major FP8 indexer cache (RTP's FP8_KV_CACHE=1 layouts)."""
    model, _ = model_and_graph("fp8")
    batch = prompts(torch.Generator().manual_seed(2), [30, 7, 26, 12])
    check_close(model, runner("fp8", kv_cache="fp8", block_size=16, kernel_block_size=8).run(batch, NEW_TOKENS))


def test_compute_dtype_latent_with_fp8_indexer_tracks_full_recompute():
    """RTP's default layout: latent rows in the compute dtype, indexer keys always FP8."""
    model, _ = model_and_graph("fp8")
    batch = prompts(torch.Generator().manual_seed(3), [28, 10])
    check_close(model, runner("fp8", kv_cache="bf16", index_cache="fp8", block_size=8).run(batch, NEW_TOKENS))


def test_bf16_model_gives_the_attention_kernels_bf16_queries(monkeypatch):
    """The absorbed query reaches the MLA kernels in the model's dtype. A float32 query made a bf16 model's
    sparse MLA take the generic Triton kernel's float32 dot (no tensor cores) instead of the Hopper kernel:
    35.6 ms vs 109 us for the lowered step at B=64 / 32k on an H200 (bench/results/hopper_mla_runtime_3bd8b1b)."""
    seen = []
    sparse_mla = paged.sparse_mla_paged

    def record(q, *args, **kwargs):
        seen.append(q.dtype)
        return sparse_mla(q, *args, **kwargs)

    monkeypatch.setattr(paged, "sparse_mla_paged", record)
    model = random_model(Glm5Config.preset("tiny"), torch.bfloat16)
    Runner(model, kv_cache="fp8", index_cache="fp8", block_size=16, dtype=torch.bfloat16, max_cache_tokens=64,
           backend="reference").generate([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38]], 2)
    assert seen and set(seen) == {torch.bfloat16}, seen
