"""The request-level engine (fxglm5.runtime.engine): requests added while others decode join at step boundaries,
their prompt chunks in the same forward as the running decodes (within max_step_tokens), and every request gets the
tokens it gets alone, with full recompute's per-step logits; an abort, a stop id, a stop string or max_tokens ends
a request at once and its blocks come back; a request that does not fit waits for room; the overlapped and the
step-by-step loops and the static-buffer steps give the same tokens; speculative decoding (forced acceptance) and
stops inside a verify step's tokens."""

import pytest
import torch

from fxglm5.errors import CacheFullError, InputError
from fxglm5.runtime.engine import Engine
from fxglm5.runtime.runner import Runner
from fxglm5.runtime.sampling import GREEDY, SamplingParams
from fxglm5.runtime.speculative import ScriptedDrafter, SpeculativeConfig
from tests.paged_helpers import model_and_graph, prompts, runner
from tests.runtime.test_runtime_generate import check_exact

NEW = 8


def greedy(n=NEW, **kwargs):
    return GREEDY.replace(max_tokens=n, **kwargs)


def alone(batch, n=NEW, **kwargs):
    """Each prompt's tokens run by itself on a fresh runner."""
    return [runner("exact", block_size=4, **kwargs).run([p], n)[0].output for p in batch]


def drive(engine, arrivals: dict, params=None):
    """Step ``engine``, adding arrivals[i] (prompts) before step i, until every request is done; the requests'
    Sequences in the order added, and every Output returned."""
    seqs, outs, i = [], [], 0
    while i <= max(arrivals, default=0) or engine.has_work():
        for prompt in arrivals.get(i, []):
            seqs.append(engine.request(engine.add(prompt, params or greedy())))
        outs += engine.step()
        i += 1
    return seqs, outs


@pytest.fixture
def mixed_steps(monkeypatch):
    """Each Runner._mixed_step's (prompt tokens, decode tokens), and each Runner.step's flat token count."""
    calls, sizes = [], []
    mixed, step = Runner._mixed_step, Runner.step

    def spy_mixed(self, chunks, decodes):
        calls.append((sum(n for _, _, n in chunks), len(decodes)))
        return mixed(self, chunks, decodes)

    def spy_step(self, ctx, input_ids, rows=None):
        sizes.append(input_ids.numel())
        return step(self, ctx, input_ids, rows)

    monkeypatch.setattr(Runner, "_mixed_step", spy_mixed)
    monkeypatch.setattr(Runner, "step", spy_step)
    return calls, sizes


@pytest.mark.parametrize("overlap", [True, False])
def test_requests_joining_mid_decode_get_their_own_tokens(overlap, mixed_steps):
    model, _ = model_and_graph("exact")
    early, late, later = (prompts(torch.Generator().manual_seed(s), n) for s, n in ((1, [5, 9]), (2, [20]), (3, [7, 3])))
    want = alone(early + late + later)
    calls, sizes = mixed_steps
    calls.clear(), sizes.clear()
    r = runner("exact", block_size=4, max_step_tokens=6, overlap=overlap)
    seqs, outs = drive(Engine(r), {0: early, 4: late, 9: later})
    check_exact(model, seqs)  # per-step logits of full recompute, greedy tokens
    assert [s.output for s in seqs] == want
    joined = [(p, d) for p, d in calls if p and d]
    assert joined, calls  # prompt chunks ran beside running decodes
    assert max(sizes) <= 6  # the budget holds decodes and chunks together
    assert r.blocks.num_free == r.blocks.num_blocks - 1 and not r.active
    for seq in seqs:  # the Outputs carry each token once, in order, and end with "length"
        mine = [o for o in outs if o.id == seq.id]
        assert [t for o in mine for t in o.tokens] == seq.output
        assert mine[-1].finish_reason == "length" and not any(o.finished for o in mine[:-1])


def test_overlap_static_buffers_and_plain_steps_agree():
    batch = prompts(torch.Generator().manual_seed(4), [6, 11, 4])
    runs = []
    for options in (dict(overlap=False), dict(), dict(decode_graphs=True, max_decode_batch=4)):
        r = runner("exact", block_size=4, max_step_tokens=8, **options)
        runs.append([s.output for s in drive(Engine(r), {0: batch[:2], 3: batch[2:]})[0]])
    assert runs[0] == runs[1] == runs[2] == alone(batch)


def test_abort_frees_the_blocks_at_once():
    """Aborted while waiting, while its prompt is being prefilled (chunked) and while decoding (with a step in
    flight): each gives its blocks back before the next step, its last Output says "abort", and the others' tokens
    are those they get alone."""
    batch = prompts(torch.Generator().manual_seed(5), [6, 30, 5, 9])
    r = runner("exact", block_size=4, max_step_tokens=8)
    engine = Engine(r)
    start = engine.num_free_blocks
    ids = [engine.add(p, greedy(12)) for p in batch[:3]]
    outs = engine.step()  # request 0 and 2 prefill; request 1 (30 tokens) is chunked
    held = start - engine.num_free_blocks
    assert engine.abort(ids[1]) and engine.num_free_blocks == start - held + 8  # its 8 blocks back (30 tokens / 4)
    outs += engine.step() + engine.step()
    waiting = engine.add(batch[3], greedy())
    assert engine.abort(waiting) and not engine.abort(waiting)
    for _ in range(3):
        outs += engine.step()
    assert engine.abort(ids[0])  # decoding, a step in flight
    while engine.has_work():
        outs += engine.step()
    ends = {o.id: o.finish_reason for o in outs if o.finished}
    assert ends == {ids[0]: "abort", ids[1]: "abort", ids[2]: "length", waiting: "abort"}
    assert engine.num_free_blocks == start and not r.active and not r.blocks.tables
    full = alone([batch[0], batch[2]], 12)
    tokens = {i: [t for o in outs if o.id == i for t in o.tokens] for i in ids}
    assert tokens[ids[2]] == full[1] and tokens[ids[0]] == full[0][:len(tokens[ids[0]])]
    assert not tokens[ids[1]]


def test_a_request_that_does_not_fit_waits_for_room():
    """Room for one request at a time: with wait_for_room (the server's engine) each waits for the one before it
    and all finish with their own tokens; without (run's batch semantics) the ones that do not fit fail."""
    batch = prompts(torch.Generator().manual_seed(6), [14, 13, 15])
    r = runner("exact", block_size=4, num_blocks=7)  # 6 usable blocks: one request of <= 24 tokens
    seqs, _ = drive(Engine(r), {0: batch})
    assert [s.error for s in seqs] == [None] * 3 and [s.output for s in seqs] == alone(batch)
    failed = runner("exact", block_size=4, num_blocks=7).run(batch, NEW)
    assert [isinstance(s.error, CacheFullError) for s in failed] == [False, True, True]


def test_admission_reserves_the_room_to_finish():
    """Every prompt fits at once but not every request's growth: the waiting engine admits a request only with room
    for it and the running ones to reach max_tokens, so none runs out of room; run's batch semantics admit them all
    and one fails while decoding."""
    batch = prompts(torch.Generator().manual_seed(9), [5, 6, 7])
    r = runner("exact", block_size=4, num_blocks=9)  # 8 usable blocks; each request ends at 5 blocks (<= 19 tokens)
    seqs, _ = drive(Engine(r), {0: batch}, greedy(12))
    assert [s.error for s in seqs] == [None] * 3 and [s.output for s in seqs] == alone(batch, 12)
    failed = runner("exact", block_size=4, num_blocks=9).run(batch, 12)
    assert any(isinstance(s.error, CacheFullError) for s in failed) and all(s.prefix_reused == 0 for s in failed)


class Letters:
    """A tokenizer stand-in: token t is the letter 'a' + t % 26 (so stop strings can be planted in the text)."""

    def decode(self, ids):
        return "".join(chr(ord("a") + t % 26) for t in ids)


def test_max_tokens_stop_ids_and_stop_strings_end_requests():
    batch = prompts(torch.Generator().manual_seed(7), [5, 9, 6, 8])
    free = alone(batch, 12)
    text = [Letters().decode(o) for o in free]
    stops = [greedy(12, stop_token_ids={free[0][3]}) if free[0][3] not in free[0][:3] else greedy(4),
             greedy(5), greedy(12, stop=(text[2][4:7],)), greedy(12, stop=("zzzzzz",))]
    r = runner("exact", block_size=4)
    engine = Engine(r, Letters())
    ids = [engine.add(p, s) for p, s in zip(batch, stops)]
    outs = []
    while engine.has_work():
        outs += engine.step()
    last = {o.id: o for o in outs if o.finished}
    got = {i: "".join(o.text for o in outs if o.id == i) for i in ids}
    assert [last[i].finish_reason for i in ids] == ["stop", "length", "stop", "length"]
    assert last[ids[0]].sequence.output == free[0][:4] and last[ids[0]].sequence.stopped
    assert last[ids[1]].sequence.output == free[1][:5]
    cut = text[2].index(text[2][4:7])
    assert got[ids[2]] == text[2][:cut]  # the text ends before the stop string, never showed part of it
    assert last[ids[2]].sequence.output == free[2][:cut + 3]  # the tokens up to the one that completed it
    assert got[ids[3]] == text[3] and last[ids[3]].sequence.output == free[3]
    assert r.blocks.num_free == r.blocks.num_blocks - 1


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_requests_join_and_stop_inside_a_verify_step(k):
    """Forced acceptance: a verify step emits k+1 tokens; a stop id among them cuts the output there (the tokens
    after it are dropped) and the request leaves; a request added later is prefilled beside the verify steps."""
    batch = prompts(torch.Generator().manual_seed(8), [5, 11, 7])
    free = alone(batch, 12)
    stop = free[0][5]
    r = runner("exact", block_size=4, speculative=SpeculativeConfig(num_tokens=k),
               drafter=ScriptedDrafter({tuple(p): o for p, o in zip(batch, free)}))
    engine = Engine(r)
    seqs, _ = drive(engine, {0: batch[:2], 2: batch[2:]}, greedy(12, stop_token_ids={stop}))
    for seq, want in zip(seqs, free):
        cut = want.index(stop) + 1 if stop in want else len(want)
        assert seq.output == want[:cut] and seq.stopped == (stop in want)
    assert r.acceptance.rate == 1.0 and r.blocks.num_free == r.blocks.num_blocks - 1


def test_add_refuses_bad_requests_by_field():
    engine = Engine(runner("short", block_size=4))
    for bad, params, match in (([1, 2], greedy(stop_token_ids={256}), "stop_token_ids"),
                               ([1, 2], greedy(stop=("x",)), "tokenizer"),
                               ([1] * 20, greedy(8), "max_position_embeddings"),
                               ([1, 999], greedy(), "out of range"),
                               ([], greedy(), "empty"),
                               ([1], {"max_tokens": 3}, "SamplingParams")):
        with pytest.raises(InputError, match=match):
            engine.add(bad, params)
    assert not engine.has_work()


@pytest.mark.parametrize("field, value", [("temperature", -0.1), ("temperature", float("nan")), ("top_p", 0.0),
                                          ("top_p", 1.5), ("top_k", -1), ("top_k", 2.0), ("max_tokens", 0),
                                          ("seed", 1.5), ("logprobs", 21), ("stop", [""]),
                                          ("stop_token_ids", [-1]), ("stop_token_ids", "12")])
def test_sampling_params_are_checked(field, value):
    with pytest.raises(InputError, match=field):
        SamplingParams(**{field: value})
