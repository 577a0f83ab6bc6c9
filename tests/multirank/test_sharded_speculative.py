"""Speculative decoding with the MTP layer at tensor / expert parallel (issue 39 item 2): the sharded Runner on gloo
CPU ranks against the single-rank Runner, on a 2-layer tiny-tp FP8 checkpoint with its MTP layer, float32.

- TP2 / EP2 with k = 2 MTP drafts: every rank emits the plain greedy tokens of one rank, over a batch of mixed
  prompt lengths (one past index_topk: the MTP's indexer selects), and every verify step's drafts are the
  single-rank speculative Runner's (the MTP graph is sharded as the target's layers: its heads, its experts by EP,
  its head's vocabulary rows with the logits gathered; so every rank proposes the same tokens).
- Each rank reads only its own half of the MTP layer's routed experts (its expert tensors opened, the others never)
  and not the embedding nor the lm_head a second time: the MTP graph takes the target graph's tensors.
- An MTP layer with a head of its own (``shared_head.head``, as GLM-5.x variants store it; the vocabulary of 509
  padded over the ranks): every rank's drafts are the eager MTP's with that head (``mtp_drafts``, full recompute),
  not the lm_head's, and each rank reads its own padded vocabulary rows of it, never the lm_head a second time.
"""

import pytest
import torch

from fxglm5.model.checkpoint import CheckpointReader
from fxglm5.model.config import Glm5Config
from fxglm5.model.generate import mtp_drafts
from fxglm5.model.layout import is_mtp_tensor, mtp_prefix
from fxglm5.model.modeling import Glm5ForCausalLM
from fxglm5.model.tiny import make_tiny_checkpoint
from fxglm5.runtime.distributed import spawn
from fxglm5.runtime.runner import Runner
from fxglm5.runtime.speculative import SpeculativeConfig
from tests.helpers import add_own_mtp_head

PROMPTS = [[7 + 3 * i for i in range(13)], [5, 6, 7], [300, 2, 90, 41, 8]]
NEW, K = 7, 2
OPTIONS = dict(block_size=16, max_cache_tokens=256)
TIMEOUT = 1200  # seconds before the ranks count as hung (two ranks compile on shared cores)


CONFIG = Glm5Config.preset("tiny-tp").replace(num_hidden_layers=2, mlp_layer_types=None, indexer_types=None)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-tp-mtp") / "fp8", config=CONFIG, seed=1))


@pytest.fixture(scope="module")
def own_head_ckpt(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-tp-mtp-head") / "fp8", config=CONFIG.replace(
        vocab_size=509), seed=1)
    add_own_mtp_head(path)
    return str(path)


def recorded(runner):
    """``runner.run`` of PROMPTS: the tokens, and (tokens so far, drafts) of every verify step."""
    proposals, propose = [], runner.drafter.propose

    def record(seqs, counts):
        drafts = propose(seqs, counts)
        proposals.extend((list(seq.tokens), d) for seq, d in zip(seqs, drafts))
        return drafts

    runner.drafter.propose = record
    return [s.output for s in runner.run(PROMPTS, NEW)], proposals


def speculative_job(rank, ckpt):
    runner = Runner(ckpt, tp=rank.world, speculative=SpeculativeConfig(num_tokens=K), **OPTIONS)
    tokens, proposals = recorded(runner)
    return dict(tokens=tokens, proposals=proposals, steps=runner.acceptance.steps, report=runner.drafter.load_report,
                target_report=runner.load_report)


@pytest.fixture(scope="module")
def tp2(ckpt):
    return spawn(speculative_job, 2, ckpt, timeout=TIMEOUT)


def test_tp2_speculative_gives_the_single_rank_plain_greedy_tokens_and_drafts(ckpt, tp2):
    plain = Runner(ckpt, **OPTIONS).generate(PROMPTS, NEW)
    tokens, proposals = recorded(Runner(ckpt, speculative=SpeculativeConfig(num_tokens=K), **OPTIONS))
    assert tokens == plain
    assert len({t for seq in plain for t in seq}) > 4  # tokens that can tell shards apart
    for rank in tp2:
        assert rank["tokens"] == plain
        assert rank["steps"] >= NEW // (K + 1) and rank["proposals"] == proposals


def test_tp2_mtp_rank_reads_its_experts_and_takes_the_targets_embedding_and_lm_head(ckpt, tp2):
    reader = CheckpointReader(ckpt, mtp=True)
    cfg = reader.config
    layer = f"model.layers.{cfg.num_hidden_layers}.mlp.experts."
    experts = [n for n in reader.tensors if n.startswith(layer)]
    assert experts
    for r, rank in enumerate(tp2):
        report, target = rank["report"], rank["target_report"]
        assert all(is_mtp_tensor(n, cfg) for n in report.tensors)  # the MTP graph reads its own layer only
        assert not {"model.embed_tokens.weight", "lm_head.weight"} & set(report.tensors)
        opened = {int(n[len(layer):].split(".")[0]) for n in report.tensors if n.startswith(layer)}
        half = cfg.n_routed_experts // 2
        assert opened == set(range(r * half, (r + 1) * half))
        assert not any(is_mtp_tensor(n, cfg) for n in target.tensors)  # the target graph reads none of it
        assert sum(b for n, b in report.tensors.items() if n.startswith(layer)) * 2 == sum(
            reader.tensors[n].dtype.itemsize * torch.Size(reader.tensors[n].shape).numel() for n in experts)


def eager_drafts(model, proposals):
    """For each recorded (tokens so far, drafts): what full recompute proposes (the target's hidden states of the
    tokens, the MTP layer chained as many times)."""
    out = []
    for tokens, drafts in proposals:
        with torch.no_grad():
            hidden = model(torch.tensor([tokens[:-1]]), return_hidden=True)[1]
        out.append(mtp_drafts(model, torch.tensor([tokens]), hidden, len(drafts)))
    return out


def test_tp2_mtp_with_its_own_head_drafts_with_that_head(own_head_ckpt):
    tp2 = spawn(speculative_job, 2, own_head_ckpt, timeout=TIMEOUT)
    model = Glm5ForCausalLM.from_pretrained(own_head_ckpt, dtype=torch.float32, progress=False, mtp=True)
    assert model.mtp.head is not model.lm_head
    plain = Runner(own_head_ckpt, **OPTIONS).generate(PROMPTS, NEW)
    proposals = tp2[0]["proposals"]
    want = eager_drafts(model, proposals)
    assert [d for _, d in proposals] == want
    model.mtp.head = model.lm_head  # control: the lm_head's drafts differ, so the comparison above can fail
    assert eager_drafts(model, proposals) != want
    head = mtp_prefix(model.config) + "shared_head.head.weight"
    for r, rank in enumerate(tp2):
        assert rank["tokens"] == plain and rank["proposals"] == proposals
        report = rank["report"]
        assert "lm_head.weight" not in report.tensors and "model.embed_tokens.weight" not in report.tensors
        assert report.tensors[head] == (255 if r == 0 else 254) * model.config.hidden_size * 2  # its rows, bf16
