"""Speculative decoding in the paged runtime (fxglm5.runtime.speculative): whatever the drafts, the tokens are
plain greedy decoding's and the per-step logits full recompute's; a draft equal to the target's own token is
always accepted; rejected drafts leave no trace in either cache (KV, index), the block tables or the prefix hashes.

The reference is plain decoding of the same runtime (and, through check_exact, the cache-less model). Cache
rows are compared byte for byte on every row a live block table reaches up to the request's length, against
plain decoding and between two runs whose drafts differ. Plain decoding writes a token's rows in steps of
another shape than a verify step, and torch's CPU kernels round a row by the rows beside it (GEMM blocking,
vectorized tails; ~1e-6 here); those byte compares run under tests/row_invariant.RowInvariant, which takes that
dependence out of the arithmetic, so what they test is which rows the runtime writes, rolls back and reuses."""

import pytest
import torch

from fxglm5.errors import CacheFullError, InputError
from fxglm5.runtime.block_manager import BlockManager
from fxglm5.runtime.runner import Runner
from fxglm5.runtime.speculative import ScriptedDrafter, SpeculativeConfig
from tests.paged_helpers import model_and_graph, prompts, runner
from tests.row_invariant import RowInvariant
from tests.runtime.test_runtime_generate import check_exact

NEW = 12
LENGTHS = [5, 20, 11]  # mixed, 20 > index_topk (8) of the "exact" config


class Rejecting(ScriptedDrafter):
    """Proposes tokens that differ from the target's next greedy token (``shift`` + that token, mod vocab)."""

    def __init__(self, continuations, shift=1):
        super().__init__(continuations)
        self.shift = shift

    def propose(self, seqs, counts):
        return [[(self.continuations[tuple(s.prompt)][len(s.output)] + self.shift + i) % 256 for i in range(n)]
                for s, n in zip(seqs, counts)]


class Random(ScriptedDrafter):
    """Random drafts, each the target's own token with probability 1/2 (so acceptance lengths vary)."""

    def __init__(self, continuations, seed):
        super().__init__(continuations)
        self.gen = torch.Generator().manual_seed(seed)

    def propose(self, seqs, counts):
        good = super().propose(seqs, counts)
        return [[t if torch.rand((), generator=self.gen) < 0.5 else int(torch.randint(0, 256, (), generator=self.gen))
                 for t in d] for d in good]


def plain_run(name, batch, n=NEW, **kwargs):
    """Plain greedy decoding, left live (not released) so that its caches can be read; its continuations."""
    r = runner(name, **kwargs)
    seqs = r.prefill(batch)
    for _ in range(n - 1):
        r.decode()
    return r, seqs, {tuple(p): s.output for p, s in zip(batch, seqs)}


def spec_run(name, batch, k, drafter, n=NEW, **kwargs):
    r = runner(name, speculative=SpeculativeConfig(num_tokens=k), drafter=drafter, **kwargs)
    seqs = r.prefill(batch)
    while r.speculate(n):
        pass
    return r, seqs


def live_rows(r, seqs) -> dict[str, list[torch.Tensor]]:
    """Per cache, per request: the rows at positions 0 .. cached-1, read through the request's block table."""
    return {name: [t[r.blocks.tables[s.id]].reshape(-1, t.shape[-1])[:s.cached] for s in seqs]
            for name, t in r.cache.tensors.items()}


# ---- bad input ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [0, 5, -1, 2.0, True, "2"])
def test_num_tokens_out_of_range(k):
    with pytest.raises(InputError, match="num_tokens"):
        SpeculativeConfig(num_tokens=k)


def test_unknown_method():
    with pytest.raises(InputError, match="method"):
        SpeculativeConfig(method="eagle", num_tokens=2)


def test_speculative_on_a_model_without_mtp_layer():
    model, graph = model_and_graph("exact")
    with pytest.raises(InputError, match="no MTP layer"):
        Runner(model, program=graph, speculative=SpeculativeConfig(num_tokens=2))


def test_bad_drafts_are_refused():
    batch = prompts(torch.Generator().manual_seed(0), [5])

    class Short(ScriptedDrafter):
        def propose(self, seqs, counts):
            return [[1] * (n - 1) for n in counts]

    class OutOfVocab(ScriptedDrafter):
        def propose(self, seqs, counts):
            return [[256] * n for n in counts]

    for drafter, match in ((Short({tuple(batch[0]): []}), "expected 2 draft tokens"),
                           (OutOfVocab({tuple(batch[0]): []}), "out of range")):
        with pytest.raises(InputError, match=match):
            runner("exact", speculative=SpeculativeConfig(num_tokens=2), drafter=drafter).run(batch, 4)


# ---- block rollback ---------------------------------------------------------------------------------------
def test_truncate_gives_blocks_back_in_order_and_keeps_committed_ones():
    bm = BlockManager(8, 4)
    bm.allocate("a", list(range(5)))  # blocks 1, 2
    bm.extend("a", 13)  # 3, 4
    bm.commit("a", list(range(8)))  # blocks 1, 2 full and keyed
    bm.truncate("a", 9)
    assert bm.tables["a"] == [1, 2, 3]
    bm.extend("a", 16)
    assert bm.tables["a"] == [1, 2, 3, 4]  # block 4 again: the order plain growth takes them in
    with pytest.raises(InputError, match="committed"):
        bm.truncate("a", 4)


# ---- tokens and caches ---------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_forced_acceptance_accepts_every_draft(k):
    model, _ = model_and_graph("exact")
    batch = prompts(torch.Generator().manual_seed(k), LENGTHS)
    _, plain, script = plain_run("exact", batch, block_size=4)
    r = runner("exact", block_size=4, speculative=SpeculativeConfig(num_tokens=k), drafter=ScriptedDrafter(script))
    seqs = r.run(batch, NEW)
    check_exact(model, seqs)  # per-step logits of full recompute
    assert [s.output for s in seqs] == [s.output for s in plain]
    full, last = divmod(NEW - 1, k + 1)  # every step emits k+1 tokens but the last, cut at max_new_tokens
    for s in seqs:
        assert s.acceptance == [k + 1] * full + ([last] if last else [])
    assert r.acceptance.rate == 1.0 and r.acceptance.steps == len(seqs) * len(seqs[0].acceptance)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_forced_rejection_leaves_caches_and_tables_as_plain_decoding(k):
    """Byte for byte: both runs under RowInvariant, so that a token's rows do not depend on the step's other rows
    (CPU matmul blocking and vectorized tails round by them; the module docstring of tests/row_invariant.py)."""
    batch = prompts(torch.Generator().manual_seed(10 + k), LENGTHS)
    model_and_graph("exact")  # compiled outside the mode
    with RowInvariant():
        plain, ps, script = plain_run("exact", batch, block_size=4)
        r1, s1 = spec_run("exact", batch, k, Rejecting(script, 1), block_size=4)
        r2, s2 = spec_run("exact", batch, k, Rejecting(script, 7), block_size=4)
    assert [s.output for s in s1] == [s.output for s in s2] == [s.output for s in ps]
    assert all(s.acceptance == [1] * (NEW - 1) for s in s1) and r1.acceptance.rate == 0.0
    for spec, seqs in ((r1, s1), (r2, s2)):
        assert [spec.blocks.tables[s.id] for s in seqs] == [plain.blocks.tables[s.id] for s in ps]
        assert spec.blocks._block_of.keys() == plain.blocks._block_of.keys()  # no hash over a rejected token
    a, b, want = live_rows(r1, s1), live_rows(r2, s2), live_rows(plain, ps)
    assert want.keys() == a.keys() == b.keys() and len(want) == 5  # KV of 3 layers, the index keys of 2 ("shared")
    for name in want:
        for x, y, z in zip(a[name], b[name], want[name]):
            assert torch.equal(x, z) and torch.equal(y, z), name


@pytest.mark.parametrize("kv_cache,index_cache", [("bf16", "bf16"), ("fp8", "fp8"), ("bf16", "fp8")])
def test_rejected_drafts_leave_no_byte_on_a_live_row(kv_cache, index_cache):
    """Compute-dtype, FP8 latent and block-major FP8 index caches, a prompt past index_topk: two runs rejecting
    different drafts and plain decoding have byte-identical caches on every live row (under RowInvariant, as
    above). A verify step reads the new tokens' index keys quantized from the cache, as a decode step does
    (indexer_step writes, then selects from the cache). Forced acceptance: all accepted."""
    opts = dict(kv_cache=kv_cache, index_cache=index_cache, block_size=16, kernel_block_size=8)
    batch = prompts(torch.Generator().manual_seed(2), [30, 7])  # 30 > index_topk (24) of the "fp8" config
    model_and_graph("fp8")
    with RowInvariant():
        plain, ps, script = plain_run("fp8", batch, **opts)
        r1, s1 = spec_run("fp8", batch, 3, Rejecting(script, 1), **opts)
        r2, s2 = spec_run("fp8", batch, 3, Rejecting(script, 5), **opts)
    assert [s.output for s in s1] == [s.output for s in s2] == [s.output for s in ps]
    a, b, want = live_rows(r1, s1), live_rows(r2, s2), live_rows(plain, ps)
    for name in want:
        assert all(torch.equal(x, z) and torch.equal(y, z) for x, y, z in zip(a[name], b[name], want[name])), name
    _, s3 = spec_run("fp8", batch, 3, ScriptedDrafter(script), **opts)
    assert [s.output for s in s3] == [s.output for s in ps]
    assert all(set(s.acceptance[:-1]) == {4} for s in s3)


@pytest.mark.parametrize("k,seed", [(1, 0), (2, 1), (3, 2), (4, 3)])
def test_random_drafts_give_greedy_tokens_with_prefix_reuse(k, seed):
    model, _ = model_and_graph("exact")
    gen = torch.Generator().manual_seed(20 + seed)
    first = prompts(gen, LENGTHS)
    second = [first[1][:17] + [3, 4, 5], first[2][:9] + [7]]  # full blocks shared with the first batch
    plain = runner("exact", block_size=4)
    want = [s.output for s in plain.run(first, NEW)] + [s.output for s in plain.run(second, NEW)]
    script = {tuple(p): o for p, o in zip(first + second, want)}
    r = runner("exact", block_size=4, speculative=SpeculativeConfig(num_tokens=k), drafter=Random(script, seed))
    seqs = r.run(first, NEW) + r.run(second, NEW)
    assert [s.prefix_reused for s in seqs[3:]] == [16, 8]
    check_exact(model, seqs)
    assert [s.output for s in seqs] == want
    assert all(len(s.output) == NEW for s in seqs)
    assert 1 < r.acceptance.mean_length < k + 1  # some drafts accepted, some not


def test_max_new_tokens_one_runs_no_verify_step():
    batch = prompts(torch.Generator().manual_seed(3), [6, 9])
    plain = runner("exact", block_size=4).run(batch, 1)
    script = {tuple(p): s.output for p, s in zip(batch, plain)}
    r = runner("exact", block_size=4, speculative=SpeculativeConfig(num_tokens=4), drafter=ScriptedDrafter(script))
    assert [s.output for s in r.run(batch, 1)] == [s.output for s in plain] and r.acceptance.steps == 0


def test_cache_full_as_decode_does():
    """A cache too small for every request: a request that cannot grow by one token gets CacheFullError and
    leaves (its blocks go to the others), as in decode; drafts only take room no request's next token needs.
    Which request runs out first depends on how far each got (a verify step moves up to k+1 tokens), so the
    check is: every output is a prefix of plain greedy's on a large cache, complete where no error came."""
    batch = prompts(torch.Generator().manual_seed(4), [7, 6, 5])
    want = [s.output for s in runner("exact", block_size=4).run(batch, 10)]
    script = {tuple(p): o for p, o in zip(batch, want)}
    for k in (1, 4):
        r = runner("exact", block_size=4, num_blocks=9, speculative=SpeculativeConfig(num_tokens=k),
                   drafter=ScriptedDrafter(script))
        seqs = r.run(batch, 10)
        assert any(isinstance(s.error, CacheFullError) for s in seqs) and any(s.error is None for s in seqs)
        for s, w in zip(seqs, want):
            assert s.output == (w if s.error is None else w[:len(s.output)])
        assert r.blocks.num_free == 8  # every block back


@pytest.mark.parametrize("k", [1, 3])
def test_static_buffer_verify_steps_give_the_same_tokens(k):
    """decode_graphs=True on a CPU: verify steps of k+1 tokens per request run from the padded static buffers
    (what the CUDA graphs replay), batch 3 in bucket 4."""
    model, _ = model_and_graph("exact")
    batch = prompts(torch.Generator().manual_seed(30 + k), LENGTHS)
    _, plain, script = plain_run("exact", batch, block_size=4)
    r = runner("exact", block_size=4, decode_graphs=True, max_decode_batch=4,
               speculative=SpeculativeConfig(num_tokens=k), drafter=Random(script, k))
    seqs = r.run(batch, NEW)
    check_exact(model, seqs)
    assert [s.output for s in seqs] == [s.output for s in plain]
    assert r.decode_graphs.steps > 0
