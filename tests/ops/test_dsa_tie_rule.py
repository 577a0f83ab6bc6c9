"""One tie rule for the DSA indexer's top-k on every path: among equal scores the lower token position wins.

The indexer's score is a weighted sum of ReLUs, so whenever few indexer heads fire many keys score exactly 0.0
(as +0.0 or -0.0, which are equal scores). torch.topk's choice among ties is unspecified (it changes with the
row's length and the device), so without one rule two correct paths keep different keys and generate different
tokens. Checked here against an independent oracle (Python's sort on (-score, position)): all-tied scores select
positions 0..k-1 in the eager model's selection, the canonical op, the cached ops (exact and FP8 index caches,
reference and Triton) and the Triton top-k (both methods, over several tournament rounds); a property test with
scores drawn from a few values; and a 2-indexer-head model decoding through the paged runtime with exactly the
tokens of full recompute. The selection is a set for sparse attention: kernels may list it in any order, so
kernel outputs are compared as sorted sets; the reference lists it by descending score, ties by position.
"""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fxglm5.ops  # noqa: F401  (registers the canonical and cached ops)
from fxglm5.lowering.reference import paged as ref
from fxglm5.lowering.reference.attention import topk_lowest_index_ties
from fxglm5.model.attention import Indexer
from fxglm5.model.config import Glm5Config
from fxglm5.model.generate import greedy_generate
from fxglm5.model.layers import rope_cos_sin
from fxglm5.lowering.reference.paged_steps import indexer_step
from fxglm5.runtime.forward_context import ForwardContext
from tests.helpers import randomize_
from tests.paged_helpers import make_config, model_and_graph, prompts, runner

triton = pytest.importorskip("triton")

from fxglm5.lowering.triton import paged_ops  # noqa: E402
from fxglm5.lowering.triton.topk import topk_from_logits  # noqa: E402

# a few values, so most comparisons are ties; -0.0 and 0.0 are equal scores, -inf a (legal) lowest one. Zeros
# are drawn most often, as from an indexer whose heads rarely fire: the threshold usually falls among them.
FEW_VALUES = torch.tensor([-math.inf, -1.0, -0.0, 0.0, 0.5, 2.0])
FEW_WEIGHTS = torch.tensor([1.0, 1.0, 4.0, 4.0, 1.0, 1.0])


def _few_values(shape, g: torch.Generator) -> torch.Tensor:
    n = math.prod(shape)
    return FEW_VALUES[torch.multinomial(FEW_WEIGHTS, n, replacement=True, generator=g)].view(shape)


def _oracle(row: list[float], k: int) -> list[int]:
    """The rule, independently: the k best positions by (score descending, position ascending)."""
    return sorted(range(len(row)), key=lambda i: (-row[i], i))[:k]


def _signed_zeros(n: int) -> torch.Tensor:
    """n zero scores, every other one -0.0."""
    x = torch.zeros(n)
    x[1::2] = -0.0
    return x


@given(st.integers(1, 200), st.integers(1, 40), st.integers(0, 2**16))
def test_reference_rule_against_the_oracle(L, k, seed):
    """The rule's one implementation (shared by the eager model and the reference ops): exact indices and order."""
    x = _few_values((L,), torch.Generator().manual_seed(seed))
    k = min(k, L)
    values, idx = topk_lowest_index_ties(x[None], k)
    assert idx[0].tolist() == _oracle(x.tolist(), k)
    assert torch.equal(values[0], x[idx[0]])


def test_eager_model_selection_takes_the_first_positions_when_all_tie():
    cfg = Glm5Config.preset("tiny").replace(index_topk=8, index_n_heads=2, quantization_config=None)
    indexer = randomize_(Indexer(cfg, torch.float32)).eval()
    with torch.no_grad():
        indexer.wq_b.weight.zero_()  # q = 0: every causal score is 0.0
    B, S = 2, 20
    x, q_latent = torch.randn(B, S, cfg.hidden_size), torch.randn(B, S, cfg.q_lora_rank)
    cos, sin = rope_cos_sin(torch.arange(S)[None].expand(B, S), cfg.qk_rope_head_dim, cfg.rope_theta)
    causal = torch.ones(S, S, dtype=torch.bool).tril()[None]
    with torch.no_grad():
        selected = indexer(x, q_latent, cos, sin, causal)
    want = torch.arange(S)[None, :] < torch.clamp(torch.arange(S) + 1, max=8)[:, None]
    assert torch.equal(selected & causal, want[None].expand(B, S, S))


def test_canonical_op_takes_the_first_positions_when_all_tie():
    B, S, HI, D, K = 2, 10, 2, 16, 4
    q, k = torch.zeros(B, S, HI, D), torch.randn(B, S, D)
    w = torch.randn(B, S, HI)  # negative weights too: 0.0 * w gives -0.0
    idx = torch.ops.fxglm5.indexer_topk(q, k, w, K)
    for s in range(S):
        n = min(K, s + 1)
        assert idx[:, s].tolist() == [list(range(n)) + [-1] * (K - n)] * B, s


def _paged_tokens(lengths, block_size, index_kind):
    """A prefill forward context over fresh blocks and an index cache of ``index_kind``."""
    tables, nxt = [], 1
    for n in lengths:
        nb = -(-n // block_size)
        tables.append(list(range(nxt, nxt + nb)))
        nxt += nb
    ctx = ForwardContext.build(True, lengths, [0] * len(lengths), tables, block_size=block_size,
                               kernel_block_size=block_size, num_blocks=nxt, max_position_embeddings=64).validate()
    cache = (torch.zeros(nxt, block_size, 132, dtype=torch.uint8) if index_kind == "fp8"
             else torch.zeros(nxt, block_size, 128))
    return ctx, cache


@pytest.mark.parametrize("index_kind, kernels", [("compute", ref), ("fp8", ref), ("fp8", paged_ops)],
                         ids=["exact-reference", "fp8-reference", "fp8-triton"])
def test_cached_indexer_takes_the_first_positions_when_all_tie(index_kind, kernels):
    ctx, cache = _paged_tokens([20, 13], 4, index_kind)
    T, HI, K = 33, 2, 8
    g = torch.Generator().manual_seed(0)
    q, k, w = torch.zeros(1, T, HI, 128), torch.randn(1, T, 128, generator=g), torch.randn(1, T, HI, generator=g)
    args = (q, k, w, K, cache, ctx.slot_mapping, ctx.kernel_block_table, ctx.req_idx, ctx.positions, 64)
    top = indexer_step(kernels, *args)[0]
    for t, p in enumerate(ctx.positions.tolist()):
        n = min(K, p + 1)
        assert sorted(top[t, :n].tolist()) == list(range(n)) and (top[t, n:] == -1).all(), t


@pytest.mark.parametrize("method, chunk", [("segments", 64), ("multi", 64), ("multi", 128)])
def test_triton_topk_takes_the_first_positions_when_all_tie(method, chunk):
    """Rows of one value, +0.0 and -0.0 mixed, and -inf (a legal score): 300 entries, top-40, so the tournament
    runs rounds of 128-entry segments (twice top-k) and the multi radix several segments."""
    x = torch.stack([_signed_zeros(300), -_signed_zeros(300), torch.full((300,), -math.inf), torch.full((300,), 3.0)])
    pos = torch.tensor([299, 299, 299, 150], dtype=torch.int32)
    out = topk_from_logits(x, pos, 40, chunk=chunk, method=method)
    assert [sorted(row) for row in out.tolist()] == [list(range(40))] * 4


@given(st.integers(1, 3), st.integers(1, 400), st.integers(1, 80), st.sampled_from([64, 128]), st.integers(0, 2**16),
       st.sampled_from(["multi", "segments"]))
def test_triton_topk_follows_the_rule_with_many_ties(T, L, K, chunk, seed, method):
    """Scores from six values (ties at every threshold, signed zeros, -inf): the Triton top-k selects exactly the
    reference's set."""
    g = torch.Generator().manual_seed(seed)
    x = _few_values((T, L), g)
    pos = torch.randint(0, L, (T,), generator=g).int()
    out = topk_from_logits(x, pos, K, chunk=chunk, method=method)
    for t in range(T):
        n = int(pos[t]) + 1
        k = min(K, n)
        want = topk_lowest_index_ties(x[t, :n][None], k)[1][0]
        assert want.tolist() == _oracle(x[t, :n].tolist(), k)
        assert sorted(out[t, :k].tolist()) == sorted(want.tolist()) and (out[t, k:] == -1).all(), t


def test_two_indexer_heads_decode_through_the_paged_runtime_as_full_recompute():
    """With 2 indexer heads most keys tie at 0.0 at the selection's boundary; the paged runtime (float32, exact
    caches, reference kernels) and the cache-less model must keep the same keys, so greedy decoding gives exactly
    the tokens of full recompute."""
    model, _ = model_and_graph("ties")
    assert make_config("ties").index_n_heads == 2
    batch = prompts(torch.Generator().manual_seed(4), [30, 12, 25])
    seqs = runner("ties", block_size=4).run(batch, 12)
    for prompt, seq in zip(batch, seqs):
        assert seq.error is None
        assert seq.output == greedy_generate(model, prompt, 12)
