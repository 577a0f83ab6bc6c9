"""RTP-LLM's MTP speculative decoding through the plugin at tensor / expert parallel and with every CUDA graph RTP
captures (issue 39 items 2-4), driven by the stand-in (tests/rtp_standin: ``multi_rank_start`` ranks on gloo,
``standin_speculative.MtpEngine``, ``standin_graph.DraftPrefillGraphRunner``).

What a user relies on, on a block-FP8 checkpoint whose widths split over 2 ranks (RTP computes it in bf16):
- ``TP_SIZE=2`` (EP_SIZE unset: EP2) with ``--sp_type mtp --gen_num_per_cycle 2`` and ``ENABLE_CUDA_GRAPH=1``: the
  target's verify graphs, the draft's decode graphs and its draft-prefill graphs (``sp_prefill_draft_model_``) are
  captured and replayed on every rank, and every rank emits exactly the plain greedy tokens; the draft model's
  proposals are the eager draft's on the same ranks; each rank's draft publishes its own vocabulary rows of the
  lm_head (RTP gathers them), the target's tensor itself (RTP's weight alias).
- The same launch at TP 1 emits the same tokens as plain decoding, and its proposals are the eager draft's; the
  draft-prefill graphs replay extends whose per-request accepted counts differ inside one replay (a batch of 3 in
  4 request rows, token totals rounded up to the next multiple of k+1), and without the rows rebuilt before each
  replay the proposals change (a control).
"""

import pytest
import torch

from fxglm5.model.config import Glm5Config
from fxglm5.model.tiny import make_tiny_checkpoint
from tests.frontdoors.test_rtpllm_plugin import PLUGIN, _prompts, rtp  # noqa: F401 - fixtures

# tiny-tp at RTP's GLM-5 cache widths, 2 layers (one dense, one MoE) + the MTP layer: FP8 blocks split over 2 ranks
RTP_TINY_TP = Glm5Config.preset("tiny-tp").replace(kv_lora_rank=512, num_hidden_layers=2, mlp_layer_types=None,
                                                   indexer_types=None)
K, NEW = 2, 8
ENGINE = dict(external_model_packages=[PLUGIN], seq_size_per_block=16, num_blocks=40, max_seq_len=64)
GRAPHS = dict(enable_cuda_graph=True, decode_capture_batch_sizes=(1, 2, 4))  # max_bs 4: draft-prefill keys 3..12
TIMEOUT = 1200  # seconds before the ranks count as hung (two ranks compile on shared cores)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("rtp-tiny-tp"), config=RTP_TINY_TP, seed=1))


@pytest.fixture(scope="module")
def prompts():
    return _prompts((5, 12, 7), seed=0)  # 12 > index_topk (8): the indexers select


def forced(prompts, plain):
    """Request 0 verifies its plain continuation (all accepted), request 2 one with every third token wrong (one or
    two accepted), request 1 the draft model's own proposals: the extends' per-request lengths differ."""
    return {tuple(prompts[0]): plain[0],
            tuple(prompts[2]): [t if i % 3 != 1 else (t + 1) % RTP_TINY_TP.vocab_size for i, t in enumerate(plain[2])]}


def speculative(ckpt, forced_drafts):
    return dict(sp_model_type="glm_5-mtp", sp_checkpoint_path=ckpt, gen_num_per_cycle=K, forced_drafts=forced_drafts)


@pytest.fixture(scope="module")
def tp1(rtp, ckpt, prompts):
    from rtp_llm import standin_speculative as spec

    plain = rtp.Engine(ckpt, **GRAPHS, **ENGINE).generate(prompts, NEW)
    kw = dict(speculative(ckpt, forced(prompts, plain)), **ENGINE)
    eager = spec.MtpEngine(ckpt, **kw)
    graphs = spec.MtpEngine(ckpt, **GRAPHS, **kw)
    return plain, (eager, eager.generate(prompts, NEW)), (graphs, graphs.generate(prompts, NEW)), kw


@pytest.fixture(scope="module")
def tp2(rtp, ckpt, prompts, tp1):
    from rtp_llm import standin_speculative as spec

    plain, kw = tp1[0], speculative(ckpt, forced(prompts, tp1[0]))
    runs = [dict(engine=dict(GRAPHS, **ENGINE), prompts=prompts, new=NEW),
            dict(engine=ENGINE, sp=kw, prompts=prompts, new=NEW),
            dict(engine=dict(GRAPHS, **ENGINE), sp=kw, prompts=prompts, new=NEW)]
    return rtp.multi_rank_start(2, 1, spec.mtp_generate_on_rank, ckpt, runs, timeout=TIMEOUT)


def test_tp2_mtp_with_every_graph_gives_the_plain_greedy_tokens(tp1, tp2):
    plain = tp1[0]
    assert len({t for seq in plain for t in seq}) > 6  # tokens that can tell shards apart
    for rank, (plain2, eager, graphs) in enumerate(tp2):
        assert plain2["tokens"] == plain, f"rank {rank}: TP2 plain decoding"
        assert eager["tokens"] == graphs["tokens"] == plain, f"rank {rank}"
        assert graphs["proposals"] == eager["proposals"] == tp2[0][2]["proposals"], f"rank {rank}"
        assert graphs["accepted"] == eager["accepted"] > 0
        g = graphs["graphs"]
        assert g["verify"]["captured"] == g["decode"]["captured"] == [4, 2, 1]
        assert g["prefill"]["captured"] == [12, 9, 6, 3]
        assert graphs["prefill_replays"] == graphs["verify_steps"] == sum(g["prefill"]["replays"].values())
        assert graphs["draft_replays"] == (K - 1) * graphs["verify_steps"] and g["verify"]["replays"]
        assert eager["graphs"]["prefill"] is None and eager["prefill_replays"] == 0
        assert any(len(set(lengths)) > 1 for lengths in graphs["extend_lengths"])  # per-request counts differ


def test_tp2_draft_publishes_its_vocabulary_shard_the_targets_own(tp1, tp2):
    full = tp1[2][0].draft_lm_head  # one rank's: the whole head
    vocab = full.shape[0]
    for rank, (_, eager, graphs) in enumerate(tp2):
        for run in (eager, graphs):
            assert run["alias_names"] == ("embedding", "lm_head")  # MtpEngine checked the tensors are the target's
            assert torch.equal(run["lm_head"], full[rank * vocab // 2:(rank + 1) * vocab // 2])


def test_tp1_draft_prefill_graphs_replay_varying_accepted_counts_with_the_eager_drafts(tp1, prompts):
    plain, (eager, eager_tokens), (graphs, tokens), _ = tp1
    assert tokens == eager_tokens == plain
    assert graphs.proposals == eager.proposals and graphs.accepted == eager.accepted > 0
    g = graphs.draft_prefill_graph
    assert g.captured_sizes == [12, 9, 6, 3] and all(i.graph is None for i in g.instances.values())  # CPU: emulated
    assert graphs.draft_prefill_replays == graphs.verify_steps == sum(g.replays_by_size.values())
    assert graphs.draft_graph_replays == (K - 1) * graphs.verify_steps
    # extends of 3 requests with different accepted counts (packed totals off the keys: padding tokens), and of one
    # request (the others done: three padding request rows)
    assert any(len(set(n)) > 1 and sum(n) % (K + 1) for n in graphs.extend_lengths)
    assert 3 in g.replayed_batches and 1 in g.replayed_batches
    assert set(g.replays_by_size) >= {3, 6}
    assert graphs.alias_names == ("embedding", "lm_head")
    assert graphs.draft.weight.get_global_weight("lm_head") is graphs.target.model.weight.get_global_weight("lm_head")


def test_without_rebuilt_rows_the_draft_prefill_graph_proposes_otherwise(rtp, ckpt, prompts, tp1, monkeypatch):
    """Control: a draft-prefill step that keeps the rows of its capture (no request ids, positions or slots rebuilt
    before a replay) changes the proposals (the verify still keeps the tokens greedy's)."""
    from rtp_llm import standin_speculative as spec

    from fxglm5.rtpllm.speculative import DraftPrefillGraphStep

    plain, (eager, _), _, kw = tp1
    original = DraftPrefillGraphStep.prepare_cuda_graph

    def capture_rows_only(self, attn):  # the rows of the step's capture, kept through every replay
        if getattr(self, "prepared", False):
            self.model.mtp_hidden = self.mtp_hidden
        else:
            original(self, attn)
            self.prepared = True

    monkeypatch.setattr(DraftPrefillGraphStep, "prepare_cuda_graph", capture_rows_only)
    stale = spec.MtpEngine(ckpt, **GRAPHS, **kw)
    assert stale.generate(prompts, NEW) == plain
    assert stale.draft_prefill_replays > 0 and stale.proposals != eager.proposals
