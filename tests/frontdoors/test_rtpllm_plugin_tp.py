"""The RTP-LLM plugin at tensor / expert parallel, driven by the RTP stand-in's ranks (tests/rtp_standin:
``multi_rank_start`` spawns the rank processes and creates RTP's process groups on gloo, as RTP's
``BackendManager`` does with ``collective_torch``; the engine broadcasts each step's inputs from TP rank 0,
takes the least block count over the ranks and all-gathers the vocabulary-sharded logits as RTP's C++ does).

- tp=2 with ep=2 (EP_SIZE unset: whole experts per rank) and with ep=1 (every expert split along its
  intermediate dim), float32: every rank generates exactly the tokens of the single-rank plugin, over a batch
  and a second batch that reuses a cached prefix, after RTP's prefill warm-up; each rank publishes its own
  vocabulary rows of the lm_head.
- Launches the plugin cannot serve are refused by field name on every rank, before any collective (a refusal on
  one rank only would leave the other in the next run's collectives, and the job would time out): dp_size=2,
  pp_size=2, ep_size=3, and a model whose 3 heads do not split over 2 ranks. A tensor only one rank reads that
  fails its checks (a NaN in an expert of rank 1's) stops both ranks at load, the other naming rank 1.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch

from fxglm5.model.tiny import make_tiny_checkpoint
from tests.frontdoors.test_rtpllm_plugin import PLUGIN, RTP_TINY, ckpt, rtp  # noqa: F401 - fixtures

PREFIX = [7 + 3 * i for i in range(16)]  # one whole 16-token block
REQUESTS = [([PREFIX + [1, 2, 3], [5, 6, 7, 8, 9]], 5, False), ([PREFIX + [9, 8]], 5, True)]
ENGINE = dict(external_model_packages=[PLUGIN], seq_size_per_block=16, num_blocks=40, max_seq_len=64,
              act_type="FP32")
TIMEOUT = 1200  # seconds before the ranks count as hung (two ranks compile on shared cores)


@pytest.fixture(scope="module")
def odd_heads(tmp_path_factory):
    config = RTP_TINY.replace(num_attention_heads=3, num_key_value_heads=3)
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-3-heads"), fp8=False, config=config))


@pytest.fixture(scope="module")
def nan_expert(ckpt, tmp_path_factory):
    """The checkpoint with a NaN in routed expert 12 of layer 1, which only rank 1 reads at ep=2."""
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("nan-expert")
    name = "model.layers.1.mlp.experts.12.down_proj.weight"
    for f in Path(ckpt).iterdir():
        shutil.copy(f, path / f.name)
    file = path / json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = load_file(file)
    tensors[name][0, 0] = float("nan")
    save_file(tensors, file, metadata={"format": "pt"})
    return str(path)


def test_tp2_ranks_generate_the_single_rank_tokens_and_refuse_bad_launches_on_every_rank(rtp, ckpt, odd_heads,
                                                                                         nan_expert):
    single = rtp.Engine(ckpt, **ENGINE)
    expected = [single.generate(p, n, reuse_prefix=reuse) for p, n, reuse in REQUESTS]
    assert len({t for batch in expected for seq in batch for t in seq}) > 3  # tokens that can tell shards apart
    runs = [dict(fields={"pp_size": 2}), dict(fields={"ep_size": 3}), dict(ckpt="odd_heads"), dict(ckpt="nan"),
            dict(ep_size=0, engine=ENGINE, requests=REQUESTS), dict(ep_size=1, engine=ENGINE, requests=REQUESTS)]
    for run in runs[:4]:
        run["engine"] = ENGINE
    ckpts = dict(default=str(ckpt), odd_heads=odd_heads, nan=nan_expert)
    ranks = rtp.multi_rank_start(2, 1, rtp.generate_on_rank, ckpts, runs, timeout=TIMEOUT)
    refusals = ["parallelism_config.pp_size=2", "parallelism_config.ep_size=3", "num_attention_heads = 3 is not "
                "divisible by tp=2"]
    vocab = single.lm_head.shape[0]
    for rank, outcomes in enumerate(ranks):
        for (status, value), reason in zip(outcomes[:3], refusals):
            assert status == "error" and reason in value, f"rank {rank}: {value}"
        # the rank that read the bad tensor names it; the other names that rank, instead of waiting for it
        status, value = outcomes[3]
        reason = "experts.12.down_proj.weight' holds NaN" if rank == 1 else "rank 1 could not load its slices"
        assert status == "error" and value.startswith("CheckpointError") and reason in value, f"rank {rank}: {value}"
        for status, value in outcomes[4:]:
            assert status == "ok", f"rank {rank}: {value}"
            assert value["tokens"] == expected, f"rank {rank}"
            shard = single.lm_head[rank * vocab // 2:(rank + 1) * vocab // 2]
            assert torch.equal(value["lm_head"], shard.to(value["lm_head"].dtype))


def test_data_parallel_is_refused_by_name_on_every_rank(rtp, ckpt):
    ranks = rtp.multi_rank_start(1, 2, rtp.generate_on_rank, dict(default=str(ckpt)), [dict(engine=ENGINE)],
                                 timeout=TIMEOUT)
    for rank, [(status, value)] in enumerate(ranks):
        assert status == "error" and "parallelism_config.dp_size=2" in value, f"rank {rank}: {value}"
