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
