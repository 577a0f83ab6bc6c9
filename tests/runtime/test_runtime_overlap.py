"""The overlapped decode loop (Runner.decode_steps with overlap, the default) gives the tokens, per-step logits,
stop behaviour and block bookkeeping of the step-by-step loop (overlap=False), on the eager and the static-buffer
paths: mixed prompt lengths, stop tokens met at different steps (a request stopped while the next step was already
launched for it), max_new_tokens, prefix reuse of a later batch and a cache too small for every request."""

import pytest
import torch

from fxglm5.errors import InputError
from tests.paged_helpers import model_and_graph, prompts, runner
from tests.runtime.test_runtime_generate import check_exact

LENGTHS = [5, 20, 11, 3]


def pair(**kwargs):
    return runner("exact", block_size=4, overlap=False, **kwargs), runner("exact", block_size=4, **kwargs)


def same(a, b):
    assert [s.output for s in a] == [s.output for s in b]
    assert [s.stopped for s in a] == [s.stopped for s in b]
    assert [type(s.error) for s in a] == [type(s.error) for s in b]
    assert [s.prefix_reused for s in a] == [s.prefix_reused for s in b]
    for x, y in zip(a, b):
        # within float32 rounding, not bitwise: a step launched for a request that had just stopped is one row
        # taller than the plain loop's, and torch's CPU linear rounds a row of a taller batch differently (~1e-6)
        assert len(x.logits) == len(y.logits)
        assert all(torch.allclose(p, q, rtol=0, atol=1e-5 * p.abs().max().item()) for p, q in zip(x.logits, y.logits))


@pytest.mark.parametrize("static", [False, True])
def test_overlapped_tokens_equal_step_by_step_with_stops_and_prefix_reuse(static):
    model, _ = model_and_graph("exact")
    opts = dict(decode_graphs=True, max_decode_batch=4) if static else {}
    plain, overlapped = pair(**opts)
    batch = prompts(torch.Generator().manual_seed(7), LENGTHS)
    free_run = runner("exact", block_size=4).run(batch, 14)
    # stop tokens that the requests emit at different steps (the first at its 3rd token, another at its 8th)
    stop = {free_run[0].output[2], free_run[2].output[7]}
    a, b = plain.run(batch, 14, stop), overlapped.run(batch, 14, stop)
    same(a, b)
    assert any(s.stopped for s in b) and any(not s.stopped and len(s.output) == 14 for s in b)
    for seq in b:  # a stopped request ends at its first stop token; the others run to max_new_tokens
        if seq.stopped:
            assert seq.output[-1] in stop and not set(seq.output[:-1]) & stop
    check_exact(model, b)
    # a later batch reusing the prefixes both runners committed, without stops
    second = [batch[1][:17] + [3, 4], batch[2] + free_run[2].output[:9], [9, 9, 9]]
    same(plain.run(second, 10), overlapped.run(second, 10))
    assert plain.blocks.num_free == overlapped.blocks.num_free and plain.blocks._block_of.keys() == \
        overlapped.blocks._block_of.keys()  # the same prefixes stay cached
    if static:
        assert overlapped.decode_graphs.steps == plain.decode_graphs.steps > 0


def cache_state(r, seqs):
    """What the decode loop leaves in the cache bookkeeping: the free list in order, the evictable blocks in order,
    the blocks the live requests hold and how many each holds, each request's cached length and whether it stopped.
    (Which live request holds which of those blocks may differ: where the overlapped loop took a block for the
    stopped request's wasted row in the step another request grew into a new block, that request took the next
    one, and the stopped request's block went back to the front of the free list for the next request that grows.)"""
    tables = r.blocks.tables
    return dict(free=list(r.blocks._free), evictable=list(r.blocks._evictable),
                held=sorted(b for t in tables.values() for b in t), blocks={i: len(t) for i, t in tables.items()},
                cached=[s.cached for s in seqs], stopped=[s.stopped for s in seqs], outputs=[s.output for s in seqs])


@pytest.mark.parametrize("static", [False, True])
def test_a_mid_batch_stop_leaves_the_cache_as_the_plain_loop_does(static):
    """One request stops while the others go on (the overlapped loop has already launched a step for it and taken
    room for that step's row). Stops at four consecutive positions, so in one of them that row is the first of a
    new block. After decode_steps, before the live requests are released: the same free list (in order), the same
    blocks held and as many for each live request, the same cached length for every request (the stopped one's
    ends before its stop token's row)."""
    batch = prompts(torch.Generator().manual_seed(14), [5, 9, 6])
    opts = dict(decode_graphs=True, max_decode_batch=4) if static else {}
    free_run = runner("exact", block_size=4).run(batch, 10)
    crossed = 0
    for k in range(1, 5):
        stop = {free_run[0].output[k]}
        # only request 0 stops, at its (k+1)-th token
        assert not stop & set(free_run[0].output[:k]) and not any(stop & set(s.output) for s in free_run[1:])
        states = []
        for r in pair(num_blocks=24, **opts):
            seqs = r.prefill(batch)
            r.decode_steps(10, stop)
            states.append(cache_state(r, seqs))
            for seq in seqs:
                r.release(seq)
        plain, overlapped = states
        assert overlapped == plain, (k, plain, overlapped)
        assert plain["stopped"] == [True, False, False] and len(plain["outputs"][0]) == k + 1
        assert plain["cached"][0] == len(batch[0]) + k  # the stop token's row is not cached
        assert len(plain["blocks"]) == 2  # the live requests' blocks, not yet released
        crossed += plain["cached"][0] % 4 == 0  # the overlapped loop's wasted row took a new block
    assert crossed == 1


@pytest.mark.parametrize("max_new", [1, 2, 9])
def test_max_new_tokens_and_a_first_token_stop(max_new):
    plain, overlapped = pair()
    batch = prompts(torch.Generator().manual_seed(8), LENGTHS)
    first = runner("exact", block_size=4).run(batch, 1)[1].output[0]
    a, b = plain.run(batch, max_new, [first]), overlapped.run(batch, max_new, [first])
    same(a, b)
    assert b[1].output == [first] and b[1].stopped
    assert all(len(s.output) == max_new for s in b if not s.stopped)


def test_a_full_cache_fails_the_same_requests():
    """Room for fewer tokens than the batch needs: the overlapped loop falls back to reading before it grows,
    so the same requests get CacheFullError at the same length."""
    batch = prompts(torch.Generator().manual_seed(9), [10, 10, 10])
    plain, overlapped = pair(num_blocks=12)
    free_run = runner("exact", block_size=4).run(batch, 12)
    stop = {free_run[0].output[4]}
    for s in (set(), stop):
        a, b = plain.run(batch, 12, s), overlapped.run(batch, 12, s)
        same(a, b)
        assert any(x.error is not None for x in b)


def test_stop_tokens_are_checked():
    r = runner("exact", block_size=4)
    for bad in ([256], [-1], "ab", [True]):
        with pytest.raises(InputError, match="stop_tokens"):
            r.run([[1, 2, 3]], 4, bad)


def test_warm_up_runs_every_key_and_writes_no_cache_row():
    """warm_up runs (on a GPU: captures) one padding-only step per (batch bucket, width bucket, tokens per request)
    the limits allow; no cache row changes, and the tokens afterwards are a fresh runner's."""
    batch = prompts(torch.Generator().manual_seed(10), [5, 9, 3])
    fresh = runner("exact", block_size=4, decode_graphs=True, max_decode_batch=4).run(batch, 6)
    r = runner("exact", block_size=4, decode_graphs=True, max_decode_batch=4)
    before = [t.clone() for t in r.cache.graph_inputs()]
    assert r.warm_up(max_batch=3, max_tokens=17) == 3 * 4  # batches 1, 2, 4 x widths 1, 2, 4, 8 blocks of 4
    assert r.decode_graphs.keys(3, 5) == [(b, w, 1) for b in (1, 2, 4) for w in (1, 2, 4, 8)]
    assert all(torch.equal(x, y) for x, y in zip(before, r.cache.graph_inputs()))
    same(fresh, r.run(batch, 6))
