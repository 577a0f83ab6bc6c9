"""The DSA indexer's top-k split over tensor-parallel ranks by query token (``shard_indexer``; the ops' ``group`` /
``world``; ``fxglm5.lowering.reference.collectives.gather_split_rows``), one process standing in for every rank:
torch's fake process group as rank r of W, with the all_gather replaced by one that knows every rank's share (a
first pass over the ranks records each share, a second runs every rank against all of them).

- ``split_rows``: no split at world 1 or below ``MIN_ROWS_PER_RANK * world`` rows, a split from exactly that many on,
  padded to a multiple of the world.
- ``rtp_indexer`` (exact and FP8 index caches; the torch reference and, over the exact cache, the Triton kernel set)
  and ``indexer_topk``: every rank's result equals the unsplit selection, for a step of two requests (one behind a
  cached prefix) whose 15 tokens no world here divides and for one of exactly the threshold's 16; rank r computed
  the rows r, r + W, ... only, a padding row as one key at position 0; a step below the threshold never gathers.
- The fake group of ``bench/rank_at_depth.py`` (its all_gather repeats rank 0's share): every token t = i W + j
  gets token i W's selection, positions at most its own, so a one-request prefill stays a valid input for sparse
  attention.
- A graph split for 2 ranks run without a group of 2 is refused, naming the sizes.
"""

import functools

import pytest
import torch

import fxglm5.ops  # noqa: F401  (registers the ops)
from fxglm5.errors import InputError
from fxglm5.lowering.reference import collectives, paged, paged_steps
from fxglm5.runtime.forward_context import ForwardContext
from tests.helpers import fake_process_group

ops = torch.ops.fxglm5
BS, NB, TOPK, HEADS = 4, 10, 4, 4
PREFIX = 5  # request 0's cached tokens
TABLES = [[1, 2, 3, 4], [5, 6, 7]]  # request 0: 5 + up to 10 tokens, request 1: up to 10


def context(specs) -> ForwardContext:
    """specs: (cached prefix, new tokens) per request."""
    return ForwardContext.build(True, [n for _, n in specs], [p for p, _ in specs], TABLES[:len(specs)], block_size=BS,
                                kernel_block_size=BS, num_blocks=NB, max_position_embeddings=64).validate()


def indexer_inputs(tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(1, tokens, HEADS, 128, generator=gen), torch.randn(1, tokens, 128, generator=gen),
            torch.rand(1, tokens, HEADS, generator=gen))


def filled_cache(fp8: bool) -> torch.Tensor:
    """An index cache holding request 0's prefix keys (written by an unsplit step)."""
    cache = torch.zeros(NB, BS, 132, dtype=torch.uint8) if fp8 else torch.zeros(NB, BS, 128)
    ctx = context([(0, PREFIX)])
    ops.rtp_indexer(*indexer_inputs(PREFIX, 0), TOPK, cache, ctx.slot_mapping, ctx.kernel_block_table, ctx.req_idx,
                    ctx.positions, 64)
    return cache


def split_run(monkeypatch, world: int, fn):
    """``fn()`` on each of ``world`` ranks, every share gathered: (each rank's result, each rank's share, how many
    all_gathers the second pass ran)."""
    shares, calls, rank = {}, [0], [0]

    def gather(x, dim, group, size):
        assert (dim, group, size) == (0, "tp", world)
        shares[rank[0]] = x.clone()
        calls[0] += 1
        return torch.cat([shares.get(r, torch.full_like(x, -7)) for r in range(world)])

    monkeypatch.setattr(collectives, "all_gather_c10d", gather)
    outs = []
    for record in (True, False):
        calls[0] = 0
        for rank[0] in range(world):
            with fake_process_group(rank[0], world):
                out = fn()
            if not record:
                outs.append(out)
    return outs, shares, calls[0]


def test_split_rows_threshold():
    least = collectives.MIN_ROWS_PER_RANK
    assert collectives.split_rows(10 ** 6, 1) == 0
    assert collectives.split_rows(least * 8 - 1, 8) == 0  # a decode step of 8 x 64 requests' worth - 1
    assert collectives.split_rows(least * 8, 8) == least * 8
    assert collectives.split_rows(least * 8 + 1, 8) == least * 8 + 8
    assert collectives.split_rows(8193, 8) == 8200


# (world, MIN_ROWS_PER_RANK, new tokens per request): 15 tokens over 2 ranks (1 padding row) and over 4 (1 padding
# row), 16 over 4 at exactly the threshold (no padding), 15 over 4 one row below it (no split)
CASES = [(2, 2, (10, 5)), (4, 2, (10, 5)), (4, 4, (10, 6)), (4, 4, (10, 5))]


def _check_split(monkeypatch, world, least, run, want, rows, tokens):
    """Every rank's ``run()`` gives ``want``; rank r's share holds the rows (``rows(want)``, token-major) r, r + W, ...
    and a padding row's selection of one key."""
    monkeypatch.setattr(collectives, "MIN_ROWS_PER_RANK", least)
    outs, shares, gathers = split_run(monkeypatch, world, run)
    for out in outs:
        assert torch.equal(out, want)
    if tokens < least * world:
        assert gathers == 0 and not shares
        return
    padded = -(-tokens // world) * world
    assert gathers == world and sorted(shares) == list(range(world))
    for r, share in shares.items():
        assert share.shape[0] == padded // world
        for i, token in enumerate(range(r, padded, world)):
            if token < tokens:
                assert torch.equal(share[i], rows(want)[token]), (r, token)
            else:  # a padding row: one key, at position 0
                assert (share.reshape(share.shape[0], -1, TOPK)[i] == torch.tensor([0] + [-1] * (TOPK - 1))).all()


@pytest.mark.parametrize("world, least, new", CASES)
@pytest.mark.parametrize("cache_kind", ["exact", "fp8"])
def test_rtp_indexer_split_equals_unsplit(monkeypatch, world, least, new, cache_kind):
    ctx = context([(PREFIX, new[0]), (0, new[1])])
    q, k, w = indexer_inputs(sum(new), 1)
    args = (ctx.slot_mapping, ctx.kernel_block_table, ctx.req_idx, ctx.positions, 64)
    base = filled_cache(cache_kind == "fp8")
    written = base.clone()
    want = ops.rtp_indexer(q, k, w, TOPK, written, *args)
    assert bool((want[0, :new[0], -1] >= 0).all())  # request 0: windows longer than top-k

    def run():
        cache = base.clone()
        out = ops.rtp_indexer(q, k, w, TOPK, cache, *args, group="tp", world=world)
        assert torch.equal(cache, written)  # every rank writes every key
        return out

    _check_split(monkeypatch, world, least, run, want, lambda t: t[0], sum(new))


def test_rtp_indexer_split_on_the_triton_kernels(monkeypatch):
    """The Triton kernel set's body (what ``lower`` binds on a GPU), over the exact cache: the same split."""
    from fxglm5.lowering.triton import paged_ops

    ctx = context([(PREFIX, 10), (0, 5)])
    q, k, w = indexer_inputs(15, 2)
    args = (ctx.slot_mapping, ctx.kernel_block_table, ctx.req_idx, ctx.positions, 64)
    base = filled_cache(False)
    step = functools.partial(paged_steps.indexer_step, paged_ops, validate=False)
    want = step(q, k, w, TOPK, base.clone(), *args)
    assert torch.equal(want.sort(-1).values, ops.rtp_indexer(q, k, w, TOPK, base.clone(), *args).sort(-1).values)
    _check_split(monkeypatch, 4, 2, lambda: step(q, k, w, TOPK, base.clone(), *args, None, None, None, None, 0.0,
                                                 "tp", 4), want, lambda t: t[0], 15)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("world, least, seq", [(4, 2, 13), (4, 4, 16), (4, 4, 15)])
def test_indexer_topk_split_equals_unsplit(monkeypatch, batch, world, least, seq):
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(batch, seq, HEADS, 32, generator=gen), torch.randn(batch, seq, 32, generator=gen)
    w = torch.rand(batch, seq, HEADS, generator=gen)
    want = ops.indexer_topk(q, k, w, TOPK)
    _check_split(monkeypatch, world, least, lambda: ops.indexer_topk(q, k, w, TOPK, "tp", world), want,
                 lambda t: t.transpose(0, 1), seq)


def test_the_bench_fake_group_gives_each_token_a_causal_selection(monkeypatch):
    """bench/rank_at_depth.py's rank 0 of a fake world of 4 (all_gather repeats rank 0's share) on one request's
    prefill behind a prefix: token i W + j holds token i W's selection, positions at most its own."""
    world = 4
    monkeypatch.setattr(collectives, "MIN_ROWS_PER_RANK", 2)
    ctx = context([(PREFIX, 10)])
    q, k, w = indexer_inputs(10, 4)
    args = (ctx.slot_mapping, ctx.kernel_block_table, ctx.req_idx, ctx.positions, 64)
    base = filled_cache(True)
    want = ops.rtp_indexer(q, k, w, TOPK, base.clone(), *args)[0]
    with fake_process_group(0, world):
        got = ops.rtp_indexer(q, k, w, TOPK, base.clone(), *args, group="tp", world=world)[0]
    for t in range(10):
        assert torch.equal(got[t], want[t - t % world]), t
        assert int(got[t].max()) <= int(ctx.positions[t])
    assert not torch.equal(got, want)


def test_a_split_graph_without_its_group_is_refused(monkeypatch):
    monkeypatch.setattr(collectives, "MIN_ROWS_PER_RANK", 2)
    gen = torch.Generator().manual_seed(5)
    q, k, w = torch.randn(1, 6, HEADS, 32, generator=gen), torch.randn(1, 6, 32, generator=gen), torch.rand(1, 6, HEADS)
    with pytest.raises(InputError, match="the graph was sharded for 2 ranks, the group has 1"):
        ops.indexer_topk(q, k, w, TOPK, "tp", 2)
    assert torch.equal(ops.indexer_topk(q[:, :3], k[:, :3], w[:, :3], TOPK, "tp", 2),  # below the threshold
                       ops.indexer_topk(q[:, :3], k[:, :3], w[:, :3], TOPK))


def _rope_tables(tokens: int, seed: int):
    angles = torch.rand(1, tokens, 32, generator=torch.Generator().manual_seed(seed)) * 6.0
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("kern", ["reference", "triton"])
@pytest.mark.parametrize("world, least, new", [(1, 2, (10, 5)), *CASES])
@pytest.mark.parametrize("cache_kind", ["exact", "fp8"])
def test_rtp_indexer_rotating_the_query_equals_the_unfused_chain(monkeypatch, kern, world, least, new, cache_kind):
    """``rope_q``: the op rotates the query by the key's tables inside its selection; it selects what the op selects
    for the query rotated before it (``rope_interleaved``, the unfused chain), bit for bit, whole or split over the
    ranks (each rank's rows taking their own rows of the tables), on either kernel set (the Triton one under the
    interpreter here)."""
    from fxglm5.lowering.triton import paged_ops

    ctx = context([(PREFIX, new[0]), (0, new[1])])
    q, k, w = indexer_inputs(sum(new), 6)
    cos, sin = _rope_tables(sum(new), 7)
    args = (ctx.slot_mapping, ctx.kernel_block_table, ctx.req_idx, ctx.positions, 64)
    base = filled_cache(cache_kind == "fp8")
    step = functools.partial(paged_steps.indexer_step, paged if kern == "reference" else paged_ops, validate=False)
    rotated = ops.rope_interleaved(q, cos, sin)
    assert not torch.equal(rotated, q)
    written = base.clone()
    want = step(rotated, k, w, TOPK, written, *args, cos, sin)

    def run():
        cache = base.clone()
        out = step(q, k, w, TOPK, cache, *args, cos, sin, None, None, 0.0, "tp" if world > 1 else None, world, True)
        assert torch.equal(cache, written)
        return out

    if world == 1:
        assert torch.equal(run(), want)
        plain = step(q, k, w, TOPK, base.clone(), *args, cos, sin)
        assert not torch.equal(plain, want)  # the query's rotation changes what is selected
    else:
        _check_split(monkeypatch, world, least, run, want, lambda t: t[0], sum(new))


def test_rtp_indexer_rope_q_needs_the_tables():
    ctx = context([(0, 3)])
    with pytest.raises(InputError, match="rope_q: the query's RoPE needs rope_cos / rope_sin"):
        ops.rtp_indexer(*indexer_inputs(3, 0), TOPK, filled_cache(True), ctx.slot_mapping, ctx.kernel_block_table,
                        ctx.req_idx, ctx.positions, 64, rope_q=True)
