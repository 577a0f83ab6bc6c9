"""Bad requests and bad forward contexts fail cleanly: a request that does not fit the cache is rejected
with CacheFullError while the others produce exactly what they produce without it; positions past
max_position_embeddings, block ids outside the cache and malformed contexts raise InputError naming the
field, before any kernel runs (the caches keep their contents).
"""

import dataclasses
import functools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fxglm5.errors import CacheFullError, InputError
from fxglm5.compiler import compile_model
from fxglm5.program import StepInputs
from fxglm5.runtime.forward_context import ForwardContext
from fxglm5.runtime import cache
from fxglm5.runtime import parts as parts_module
from fxglm5.runtime.cache import PagedCache
from fxglm5.runtime.runner import Runner, Tokens
from tests.paged_helpers import model_and_graph, prompts, runner


def snapshot(r):
    return {name: t.clone() for name, t in r.cache.tensors.items()}


def assert_unchanged(r, before):
    for name, t in r.cache.tensors.items():
        assert torch.equal(t, before[name]), f"{name} was written"


def outputs(seqs):
    return [s.output for s in seqs]


def test_full_cache_rejects_only_the_request_that_does_not_fit():
    a, big, c = prompts(torch.Generator().manual_seed(5), [6, 30, 5])
    r = runner("exact", block_size=4, num_blocks=10)  # 9 usable blocks; `big` alone needs 8
    seqs = r.run([a, big, c], 8)
    assert isinstance(seqs[1].error, CacheFullError) and seqs[1].output == []
    assert "full" in str(seqs[1].error) and "request" in str(seqs[1].error)
    alone = runner("exact", block_size=4, num_blocks=10).run([a, c], 8)
    assert outputs(alone) == [seqs[0].output, seqs[2].output]
    for x, y in zip(alone, [seqs[0], seqs[2]]):
        torch.testing.assert_close(torch.stack(x.logits), torch.stack(y.logits), rtol=1e-5, atol=1e-5)
    with pytest.raises(CacheFullError):
        runner("exact", block_size=4, num_blocks=10).generate([a, big, c], 8)


def test_request_out_of_room_while_decoding_stops_alone():
    a, c = prompts(torch.Generator().manual_seed(6), [8, 8])
    r = runner("exact", block_size=4, num_blocks=7)  # 6 usable blocks; each request wants 5 by the end
    first, second = r.run([a, c], 12)
    assert isinstance(first.error, CacheFullError) and second.error is None
    assert len(first.output) < 12 and len(second.output) == 12
    solo_c = runner("exact", block_size=4, num_blocks=7).run([c], 12)[0]
    solo_a = runner("exact", block_size=4, num_blocks=7).run([a], 12)[0]
    assert second.output == solo_c.output
    assert first.output == solo_a.output[: len(first.output)]


def test_prompt_past_max_position_embeddings_is_rejected_up_front():
    r = runner("short", block_size=4)
    with pytest.raises(InputError, match="max_position_embeddings"):
        r.run([[1] * 20], 8)  # 28 > 24 positions
    with pytest.raises(InputError, match="out of range"):
        r.run([[1, 2, 999]], 2)


def _no_compile(*args, **kwargs):
    raise AssertionError("compiled: the bad option was not refused before capture")


def test_cache_larger_than_the_available_memory_is_refused_before_compiling(monkeypatch):
    model, graph = model_and_graph("exact")
    small = Runner(model, program=graph, block_size=4, num_blocks=5)
    allocated = sum(t.numel() * t.element_size() for t in small.cache.tensors.values())
    spec = graph.cache_spec("bf16", "bf16", torch.float32)  # layers: indexed, shared, indexed
    assert cache.check_cache_size(5, 4, spec, "cpu") == allocated
    monkeypatch.setattr(cache, "available_memory", lambda device: allocated - 1)
    monkeypatch.setattr(parts_module, "compile_model", _no_compile)
    with pytest.raises(InputError, match=r"paged cache: 5 blocks of block_size 4 tokens for 3 layers need .* GiB, "
                                         r"more than .* available on cpu"):
        Runner(model, block_size=4, num_blocks=5)
    with pytest.raises(InputError, match="paged cache"):  # the caches' own check (RTP's scratch steps use it)
        PagedCache(spec, 5, 4)
    Runner(model, program=graph, block_size=4, num_blocks=4)  # one block fewer fits


def test_block_longer_than_any_sequence_is_refused_before_compiling(monkeypatch):
    model, _ = model_and_graph("short")  # max_position_embeddings 24
    monkeypatch.setattr(parts_module, "compile_model", _no_compile)
    with pytest.raises(InputError, match=r"block_size: 1000000 exceeds max_position_embeddings \(24\)"):
        Runner(model, block_size=1000000)


@pytest.mark.parametrize("env, option, shown", [("nonsense", None, "environment variable FXGLM5_BACKEND"),
                                                (None, "cutlass", "backend")])
def test_unknown_kernel_backend_is_refused_before_compiling(monkeypatch, env, option, shown):
    model, _ = model_and_graph("short")
    if env:
        monkeypatch.setenv("FXGLM5_BACKEND", env)
    monkeypatch.setattr(parts_module, "compile_model", _no_compile)
    with pytest.raises(InputError) as err:
        Runner(model, block_size=4, backend=option)
    assert str(err.value) == (f"{shown} must be one of 'aiter', 'triton', 'reference' (or unset: the best for the "
                              f"device), got {env or option!r}")


def base_context(r, prefill=True):
    """A valid context: request 0 with 6 tokens in blocks [1, 2]."""
    c = r.cache
    starts = [0] if prefill else [5]
    return ForwardContext.build(prefill, [6], starts, [[1, 2]], block_size=c.block_size,
                                kernel_block_size=c.kernel_block_size, num_blocks=c.num_blocks,
                                max_position_embeddings=r.config.max_position_embeddings, prompt_lengths=[5])


def malformed(r):
    """(field named in the error, a context that is malformed in that field)."""
    ctx = base_context(r)
    i32 = torch.int32
    yield "input_lengths", dataclasses.replace(ctx, input_lengths=ctx.input_lengths.float())
    yield "input_lengths", dataclasses.replace(ctx, input_lengths=torch.tensor([0], dtype=i32))
    yield "prefix_lengths", dataclasses.replace(ctx, prefix_lengths=torch.tensor([0, 0], dtype=i32))
    yield "prefix_lengths", dataclasses.replace(ctx, prefix_lengths=torch.tensor([-1], dtype=i32))
    yield "sequence_lengths", dataclasses.replace(ctx, sequence_lengths=torch.tensor([3], dtype=i32))
    yield "block_table", dataclasses.replace(ctx, block_table=torch.tensor([[1, 2], [3, 4]], dtype=i32))
    yield "kernel_block_table", dataclasses.replace(ctx, kernel_block_table=ctx.kernel_block_table + 1)
    yield "block_table", dataclasses.replace(ctx, block_table=torch.tensor([[1, r.cache.num_blocks]], dtype=i32),
                                             kernel_block_table=torch.tensor([[1, r.cache.num_blocks]], dtype=i32))
    yield "block_table", dataclasses.replace(ctx, block_table=torch.tensor([[1, 0]], dtype=i32),
                                             kernel_block_table=torch.tensor([[1, 0]], dtype=i32))
    yield "slot_mapping", dataclasses.replace(ctx, slot_mapping=torch.arange(6) + 5)
    yield "cu_seqlens", dataclasses.replace(ctx, cu_seqlens=torch.tensor([0, 5], dtype=i32))
    dec = base_context(r, prefill=False)
    yield "sequence_lengths", dataclasses.replace(dec, sequence_lengths=torch.tensor([1, 2], dtype=i32))
    yield "positions", dataclasses.replace(dec, sequence_lengths=torch.tensor([24], dtype=i32),
                                           block_table=torch.tensor([[1, 2, 3, 4, 5, 6, 7]], dtype=i32),
                                           kernel_block_table=torch.tensor([[1, 2, 3, 4, 5, 6, 7]], dtype=i32))


def test_malformed_contexts_are_rejected_before_any_write():
    r = runner("short", block_size=4, num_blocks=12)
    r.run([[3, 1, 4, 1, 5, 9, 2]], 3)  # leave real data in the caches
    before = snapshot(r)
    cases = list(malformed(r))
    for field, ctx in cases:
        ids = torch.zeros(6 if ctx.is_prefill else 1, dtype=torch.long)
        with pytest.raises(InputError, match=field):
            r.step(ctx, ids)
        assert_unchanged(r, before)
    assert len(cases) == 13
    r.step(base_context(r), torch.zeros(6, dtype=torch.long))  # the unmodified context runs


@functools.lru_cache(maxsize=None)
def validating_program(name: str):
    """The model's program compiled for a caller that does not validate its steps: the ops check them."""
    model, _ = model_and_graph(name)
    return compile_model(model, max_tokens=64, inputs_validated=False).program


def graph_call(r, block_table, positions, slots=None):
    """A step of ``r``'s model straight into a program that validates, on ``r``'s caches (no runtime in front)."""
    T = positions.shape[0]
    slots = slots if slots is not None else torch.arange(T) + 4  # blocks [1, 2] of 4
    step = StepInputs(positions, slots, block_table, torch.zeros(T, dtype=torch.long), torch.arange(T))
    return validating_program("short")(step, torch.zeros(T, dtype=torch.long), r.cache.graph_inputs())


@pytest.mark.parametrize("case", ["block id", "position", "slot", "padding block"])
def test_cached_ops_validate_before_writing(case):
    """The graph called directly (no runtime in front): the first cached op rejects the step."""
    r = runner("short", block_size=4, num_blocks=12)
    r.run([[2, 7, 1, 8]], 2)
    before = snapshot(r)
    table = torch.tensor([[1, 2]])
    pos = torch.arange(6)
    if case == "block id":
        args, match = (torch.tensor([[1, 99]]), pos), "block_table"
    elif case == "position":
        big = torch.tensor([[1, 2, 3, 4, 5, 6, 7]])
        args, match = (big, torch.tensor([24])), "max_position_embeddings"
    elif case == "slot":
        args, match = (table, pos, torch.arange(6) + 20), "slot_mapping"
    else:
        args, match = (torch.tensor([[1, 0]]), pos), "block 0"
    with pytest.raises(InputError, match=match):
        graph_call(r, *args)
    assert_unchanged(r, before)
    graph_call(r, table, pos)  # valid inputs go through


def test_validation_is_decided_when_the_program_is_compiled():
    """The Runner's program (its steps validated by the Runner) binds the cached ops' bodies without their checks; a
    program for callers that do not validate binds the checking ones. No switch is consulted at run time."""
    def cached(program):
        return [n.target for n in program.graph.graph.nodes
                if "fxglm5_backend" in n.meta and n.target.op.startswith("rtp_")]

    checked, unchecked = cached(validating_program("short")), cached(runner("short", block_size=4).program)
    assert len(checked) == len(unchecked) == 2  # the one layer's rtp_indexer and rtp_sparse_mla
    assert all(getattr(t.fn, "keywords", {}).get("validate") is False for t in unchecked)
    assert not any(getattr(t.fn, "keywords", {}).get("validate") is False for t in checked)


def test_block_manager_rejection_changes_nothing_and_prefixes_are_refcounted():
    from fxglm5.runtime.block_manager import BlockManager

    bm = BlockManager(num_blocks=6, block_size=2)  # blocks 1..5
    a = [1, 2, 3, 4, 5]
    assert bm.allocate("a", a) == 0 and len(bm.tables["a"]) == 3
    bm.commit("a", a)  # blocks holding [1, 2] and [3, 4] become reusable
    state = (list(bm._free), dict(bm._block_of), list(bm._ref))
    with pytest.raises(CacheFullError, match="'big'"):
        bm.allocate("big", list(range(9)))
    assert (list(bm._free), dict(bm._block_of), list(bm._ref)) == state and "big" not in bm.tables
    assert bm.allocate("b", [1, 2, 3, 4, 9]) == 4  # shares a's two full blocks
    assert bm.tables["b"][:2] == bm.tables["a"][:2] and bm._ref[bm.tables["a"][0]] == 2
    with pytest.raises(CacheFullError):
        bm.extend("b", 9)  # 5 blocks for b: 2 more, but a holds 3 of 5 and b 1 of its own: 1 free
    assert len(bm.tables["b"]) == 3
    bm.free("a")
    bm.free("b")
    assert bm.num_free == 5
    assert bm.allocate("c", [1, 2, 3, 4, 7, 7]) == 4  # the prefix outlives both owners (cached, evictable)
    bm.free("c")
    assert bm.allocate("d", [8] * 10) == 0  # 5 blocks: the 3 free ones, then the 2 cached ones are evicted
    bm.free("d")
    assert bm.allocate("e", [1, 2, 3, 4, 5]) == 0  # evicted: nothing to reuse


@given(st.integers(1, 5), st.lists(st.integers(0, 3), min_size=1, max_size=24), st.integers(1, 30))
def test_block_manager_commits_incrementally_the_keys_of_the_whole_sequence(block_size, prompt, steps):
    """Committing after every decode step (as the runner does) hashes only the newly filled blocks; the
    block -> key maps must equal those of one commit of the whole sequence, and a later request must reuse
    every full block of it."""
    from fxglm5.runtime.block_manager import BlockManager

    step_by_step, at_once = BlockManager(64, block_size), BlockManager(64, block_size)
    tokens = list(prompt)
    for bm in (step_by_step, at_once):
        bm.allocate("a", tokens)
    for i in range(steps):
        step_by_step.commit("a", tokens)
        tokens.append(i % 4)
        step_by_step.extend("a", len(tokens))
    step_by_step.commit("a", tokens)
    at_once.extend("a", len(tokens))
    at_once.commit("a", tokens)
    assert step_by_step._key_of == at_once._key_of and step_by_step._block_of == at_once._block_of
    full = len(tokens) // block_size
    assert len(step_by_step._key_of) == full
    step_by_step.free("a")
    assert step_by_step.allocate("b", tokens + [0]) == full * block_size


@given(st.lists(st.integers(0, 9), max_size=12), st.lists(st.integers(0, 9), max_size=12), st.data())
def test_tokens_view_reads_like_the_concatenation(head, tail, data):
    whole, view = head + tail, Tokens(head, tail)
    assert len(view) == len(whole) and list(view) == whole
    start = data.draw(st.integers(-15, 15))
    stop = data.draw(st.integers(-15, 15))
    assert view[start:stop] == whole[start:stop] and view[start:] == whole[start:] and view[::2] == whole[::2]
    if whole:
        index = data.draw(st.integers(-len(whole), len(whole) - 1))
        assert view[index] == whole[index]
    with pytest.raises(IndexError):
        view[len(whole)]
