"""The mixed expert layout end to end: four gloo CPU ranks run ``Runner(ckpt, tp=4, ep=2)`` on a 2-layer tiny-tp FP8
checkpoint (8 experts of 512 intermediate rows): ranks 0-1 hold experts 0-3, ranks 2-3 experts 4-7, each expert
split 2 ways along its rows (256 rows: 2 blocks). Every rank generates the tokens of the unsharded eager model and of
the single-rank Runner (logits within 1e-5 of the latter's); each rank opens only its group's four experts and reads
exactly a quarter of the expert bytes (half the experts, half of each), and holds them at the plan's shapes."""

import operator

import pytest
import torch

from fxglm5.model.checkpoint import CheckpointReader
from fxglm5.model.config import Glm5Config
from fxglm5.model.generate import greedy_generate
from fxglm5.model.layout import is_mtp_tensor
from fxglm5.model.modeling import Glm5ForCausalLM
from fxglm5.model.tiny import make_tiny_checkpoint
from fxglm5.runtime.distributed import spawn
from fxglm5.runtime.runner import Runner

PROMPTS = [[7 + 3 * i for i in range(12)], [5, 6, 7]]
NEW = 6
OPTIONS = dict(block_size=16, max_cache_tokens=256, keep_logits=True)
MOE = "model.layers.1.mlp.experts."


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    config = Glm5Config.preset("tiny-tp").replace(num_hidden_layers=2, mlp_layer_types=None, indexer_types=None,
                                                  num_nextn_predict_layers=0)
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-tp") / "fp8", config=config, seed=2))


def serve(runner):
    seqs = runner.run(PROMPTS, NEW)
    return [s.output for s in seqs], [torch.stack(s.logits) for s in seqs]


def mixed_job(rank, ckpt):
    runner = Runner(ckpt, tp=rank.world, ep=2, **OPTIONS)
    graph = runner.program.graph
    shapes = {t: tuple(operator.attrgetter(t)(graph).shape)
              for t in (MOE + "gate_up_proj", MOE + "gate_up_proj_scale_inv", MOE + "down_proj")}
    return dict(served=serve(runner), report=runner.load_report, shapes=shapes)


@pytest.fixture(scope="module")
def tp4_ep2(ckpt):
    return spawn(mixed_job, 4, ckpt, timeout=1200)


def test_tp4_ep2_gives_the_eager_and_single_rank_tokens(ckpt, tp4_ep2):
    eager = Glm5ForCausalLM.from_pretrained(ckpt, dtype=torch.float32, progress=False)
    with torch.no_grad():
        want = [greedy_generate(eager, prompt, NEW) for prompt in PROMPTS]
    tokens, logits = serve(Runner(ckpt, **OPTIONS))
    assert tokens == want and len({t for out in want for t in out}) > 2  # not one token repeated
    for rank in tp4_ep2:
        got_tokens, got_logits = rank["served"]
        assert got_tokens == want
        for got, ref in zip(got_logits, logits):
            assert got.shape == ref.shape and (got - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_each_rank_holds_and_reads_its_groups_experts_at_half_their_rows(ckpt, tp4_ep2):
    reader = CheckpointReader(ckpt)
    experts = {n: info for n, info in reader.tensors.items()
               if ".mlp.experts." in n and not is_mtp_tensor(n, reader.config)}
    expert_bytes = sum(info.dtype.itemsize * torch.Size(info.shape).numel() for info in experts.values())
    for r, rank in enumerate(tp4_ep2):
        group = r // 2
        assert rank["shapes"] == {MOE + "gate_up_proj": (4, 512, 256), MOE + "gate_up_proj_scale_inv": (4, 4, 2),
                                  MOE + "down_proj": (4, 256, 256)}, r
        report = rank["report"]
        opened = {int(n.split(".")[5]) for n in report.tensors if n in experts}
        assert opened == set(range(4 * group, 4 * group + 4)), r
        assert sum(b for n, b in report.tensors.items() if n in experts) * 4 == expert_bytes, r
