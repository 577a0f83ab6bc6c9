"""The RTP-LLM plugin on the GPU, through the stand-in's RTP lifecycle (tests/rtp_standin): with the block-FP8
checkpoint the stand-in really captures RTP's decode CUDA graphs around the plugin's forward (RTP's sequence:
max-batch warm-up forward, then per size slices of the max-batch buffers, two forwards, capture, replay) and
replays them with RTP's refresh (device table zeroed, host rows stale). Four requests fill bucket 4, then two
replay it with two stale padding rows: both batches give fxglm5's own tokens on the Triton kernels, and the first
batch's cached blocks keep every byte. A bf16 checkpoint (fp32 compute) is refused CUDA graphs by name and
decodes eagerly with the runtime's tokens."""

import pytest
import torch

from fxglm5.errors import ConfigError
from fxglm5.model.tiny import make_tiny_checkpoint
from tests.frontdoors.test_rtpllm_plugin import RTP_TINY, _prompts, assert_runtime_tokens, engine, rtp, runner  # noqa: F401 (rtp: fixture)

pytestmark = pytest.mark.gpu


def _runner(ckpt, kv, dtype):
    return runner(ckpt, kv, 32, dtype, block_size=64, device="cuda", decode_graphs=None)


@pytest.mark.parametrize("kv", ["fp8", "bf16"])
def test_rtp_decode_cuda_graphs_give_the_runtime_tokens(rtp, tmp_path, kv):  # noqa: F811
    ckpt = make_tiny_checkpoint(tmp_path, fp8=True, config=RTP_TINY)
    eng = engine(rtp, ckpt, device="cuda", fp8_kv_cache=kv == "fp8", seq_size_per_block=64,
                 kernel_seq_size_per_block=32, max_seq_len=256, enable_cuda_graph=True,
                 decode_capture_batch_sizes=(1, 4))
    g = eng.graph_runner
    assert g.captured_sizes == [4, 1] and all(inst.graph is not None for inst in g.instances.values())
    first, second = _prompts([70, 130, 65, 100], seed=1), _prompts([5, 40], seed=2)
    ref = _runner(ckpt, kv, torch.bfloat16)
    assert_runtime_tokens(eng.generate(first, 8), ref, first, 8)
    kept = sorted(eng.block_manager.cached.values())
    before = [pool[:, kept].clone() for pool in eng.kv_pools]
    assert_runtime_tokens(eng.generate(second, 8), ref, second, 8)
    assert all(torch.equal(p[:, kept].view(torch.uint8), b.view(torch.uint8)) for p, b in zip(eng.kv_pools, before))
    assert g.replays_by_size == {4: 14} and eng.eager_decode_steps == 0


def test_a_bf16_checkpoint_is_refused_graphs_and_decodes_eagerly(rtp, tmp_path):  # noqa: F811
    ckpt = make_tiny_checkpoint(tmp_path, fp8=False, config=RTP_TINY)
    kw = dict(device="cuda", act_type="FP32", seq_size_per_block=64, kernel_seq_size_per_block=32, max_seq_len=256)
    with pytest.raises(ConfigError, match="ENABLE_CUDA_GRAPH=1"):
        engine(rtp, ckpt, enable_cuda_graph=True, **kw)
    batch = _prompts([5, 20, 70])
    assert_runtime_tokens(engine(rtp, ckpt, **kw).generate(batch, 8), _runner(ckpt, "bf16", torch.float32), batch, 8)


def test_mtp_draft_decode_graphs_replay_on_the_gpu(rtp, tmp_path):  # noqa: F811
    """RTP's MTP cycle on the GPU, k = 3, block-FP8 checkpoint: the target's verify graphs and the draft's decode
    graphs are really captured (no host sync inside the compiled MTP layer) and replayed, with the eager engine's
    tokens and proposals."""
    from rtp_llm import standin_speculative as spec

    from tests.frontdoors.test_rtpllm_plugin import PLUGIN

    ckpt = make_tiny_checkpoint(tmp_path, fp8=True, config=RTP_TINY)
    kw = dict(sp_model_type="glm_5-mtp", sp_checkpoint_path=ckpt, gen_num_per_cycle=3, external_model_packages=[PLUGIN],
              device="cuda", act_type="FP32", seq_size_per_block=64, kernel_seq_size_per_block=32, max_seq_len=256)
    prompts = _prompts((5, 70, 12), seed=3)
    eager = spec.MtpEngine(ckpt, **kw)
    graphs = spec.MtpEngine(ckpt, enable_cuda_graph=True, decode_capture_batch_sizes=(1, 4), **kw)
    assert graphs.generate(prompts, 8) == eager.generate(prompts, 8)
    assert graphs.proposals == eager.proposals
    assert graphs.draft_graph_replays == 2 * graphs.verify_steps > 0
    assert graphs.draft_graph.replays_by_size[4] >= 2 and graphs.target.graph_runner.replays_by_size


def _mtp_ckpt_and_drafts(rtp, tmp_path, prompts):  # noqa: F811
    """The TP-splittable block-FP8 checkpoint (tests/frontdoors/test_rtpllm_plugin_speculative_tp.py) and forced drafts
    that make the accepted counts differ per request: request 0 verifies its plain continuation, request 2 one with
    every third token wrong, request 1 the draft model's own proposals."""
    from tests.frontdoors.test_rtpllm_plugin_speculative_tp import RTP_TINY_TP, forced

    ckpt = str(make_tiny_checkpoint(tmp_path, config=RTP_TINY_TP, seed=1))
    plain = engine(rtp, ckpt, **MTP_GPU).generate(prompts, 8)
    return ckpt, forced(prompts, plain)


MTP_GPU = dict(device="cuda", seq_size_per_block=64, kernel_seq_size_per_block=32, max_seq_len=256)


def _same_proposals(got, want):
    """The graphs' draft proposals against the eager draft's: the same steps, and the same drafts at nine in ten of
    them at least (RTP computes block-FP8 checkpoints in bf16, where a padded graph row's reduction order can flip a
    near-tie of the tiny random MTP head; the tokens, which the target verifies, are compared exactly)."""
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    same = sum(a == b for (_, a), (_, b) in zip(got, want))
    assert 10 * same >= 9 * len(want), f"{same} of {len(want)} proposals equal"


def test_mtp_draft_prefill_and_decode_graphs_replay_beside_the_verify_graphs(rtp, tmp_path):  # noqa: F811
    """RTP's MTP cycle on the GPU with every graph RTP captures at ENABLE_CUDA_GRAPH=1, k = 2, block-FP8: the target's
    verify graphs, the draft's decode graphs and its draft-prefill graphs (sp_prefill_draft_model_, keys 3..12 over 4
    request rows) really captured and replayed, the extends packing per-request accepted counts that differ inside
    one replay (padding tokens and padding requests); the tokens are the eager engine's."""
    from rtp_llm import standin_speculative as spec

    from tests.frontdoors.test_rtpllm_plugin import PLUGIN

    prompts = _prompts((5, 70, 12), seed=3)
    ckpt, forced = _mtp_ckpt_and_drafts(rtp, tmp_path, prompts)
    kw = dict(sp_model_type="glm_5-mtp", sp_checkpoint_path=ckpt, gen_num_per_cycle=2, external_model_packages=[PLUGIN],
              forced_drafts=forced, **MTP_GPU)
    eager = spec.MtpEngine(ckpt, **kw)
    graphs = spec.MtpEngine(ckpt, enable_cuda_graph=True, decode_capture_batch_sizes=(1, 4), **kw)
    prefill = graphs.draft_prefill_graph
    assert prefill.captured_sizes == [12, 9, 6, 3]
    for runner in (prefill, graphs.draft_graph, graphs.target.graph_runner):
        assert runner.instances and all(inst.graph is not None for inst in runner.instances.values())
    assert graphs.generate(prompts, 8) == eager.generate(prompts, 8)
    _same_proposals(graphs.proposals, eager.proposals)
    assert graphs.draft_prefill_replays == graphs.verify_steps == sum(prefill.replays_by_size.values()) > 0
    assert graphs.draft_graph_replays == graphs.verify_steps and graphs.target.graph_runner.replays_by_size
    assert any(len(set(n)) > 1 for n in graphs.extend_lengths) and graphs.accepted > 0
    assert eager.draft_prefill_graph is None and graphs.alias_names == ("embedding", "lm_head")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (nvidia-h200-x2)")
def test_tp2_mtp_graphs_on_two_gpus_over_nccl(rtp, tmp_path):  # noqa: F811
    """TP2 / EP2 on two GPUs over NCCL (RTP's backend; the collectives of the target's and the draft's shards inside
    captured graphs): each rank's tokens with every graph on are the eager launch's and the other rank's, and every
    rank captured and replayed its draft-prefill and draft decode graphs."""
    from rtp_llm import standin_speculative as spec

    from tests.frontdoors.test_rtpllm_plugin import PLUGIN

    prompts = _prompts((5, 70, 12), seed=3)
    ckpt, forced = _mtp_ckpt_and_drafts(rtp, tmp_path, prompts)
    sp = dict(sp_model_type="glm_5-mtp", sp_checkpoint_path=ckpt, gen_num_per_cycle=2, forced_drafts=forced)
    base = dict(external_model_packages=[PLUGIN], **MTP_GPU)
    runs = [dict(engine=base, sp=sp, prompts=prompts, new=8),
            dict(engine=dict(base, enable_cuda_graph=True, decode_capture_batch_sizes=(1, 4)), sp=sp, prompts=prompts,
                 new=8)]
    ranks = rtp.multi_rank_start(2, 1, spec.mtp_generate_on_rank, ckpt, runs, backend="nccl", timeout=1200)
    for rank, (eager, graphs) in enumerate(ranks):
        assert graphs["tokens"] == eager["tokens"] == ranks[0][0]["tokens"], f"rank {rank}"
        assert graphs["proposals"] == ranks[0][1]["proposals"], f"rank {rank}: the ranks drafted alike"
        _same_proposals(graphs["proposals"], eager["proposals"])
        assert graphs["graphs"]["prefill"]["captured"] == [12, 9, 6, 3]
        assert graphs["prefill_replays"] == graphs["verify_steps"] > 0 and graphs["draft_replays"] > 0
        assert graphs["lm_head"].shape[0] == RTP_TINY.vocab_size // 2
        assert graphs["alias_names"] == ("embedding", "lm_head")
