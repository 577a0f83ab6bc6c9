"""The RTP-LLM plugin on the GPU: with the block-FP8 checkpoint the stand-in engine really captures RTP's decode
CUDA graphs around the plugin's forward (padding rows in a larger bucket included) and replays them, giving
the eager engine's tokens; with a bf16 checkpoint (fp32 compute) CUDA graphs are refused by the plugin and
the eager tokens are those of fxglm5's own runtime on the Triton kernels."""

import pytest
import torch

from fxglm5.model.tiny import make_tiny_checkpoint
from fxglm5.runtime.runner import Runner
from tests.test_rtpllm_plugin import RTP_TINY, _prompts, rtp  # noqa: F401  (rtp: the stand-in fixture)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("act,fp8", [("FP32", False), ("BF16", True)])
def test_rtp_decode_cuda_graphs_give_the_eager_tokens(rtp, tmp_path, act, fp8):  # noqa: F811
    ckpt = make_tiny_checkpoint(tmp_path, fp8=fp8, config=RTP_TINY)
    batch = _prompts([5, 20, 70])
    kw = dict(act_type=act, seq_size_per_block=64, num_blocks=16, device="cuda", fp8_kv_cache=fp8)
    eager = rtp.Engine(ckpt, **kw).generate(batch, 8)
    if not fp8:  # a bf16 checkpoint's MoE is the host-syncing reference op: the plugin says no CUDA graphs
        with pytest.raises(RuntimeError, match="support_cuda_graph"):
            rtp.Engine(ckpt, enable_cuda_graph=True, **kw)
        runner = Runner(ckpt, kv_cache="bf16", index_cache="fp8", block_size=64, dtype=torch.float32, num_blocks=16,
                        device="cuda")
        assert eager == runner.generate(batch, 8)
        return
    graphs = rtp.Engine(ckpt, enable_cuda_graph=True, decode_capture_batch_sizes=(1, 4), **kw)
    assert graphs.generate(batch, 8) == eager
    assert graphs.graph_replays == 7 and graphs.eager_decode_steps == 0 and graphs.graphs[4][2] is not None
