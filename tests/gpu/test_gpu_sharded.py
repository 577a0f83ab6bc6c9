"""A sharded program compiled and run on the GPU: rank 0 of TP8 / EP8 (and of the mixed TP8 / ep 2) in one process
(torch's fake process group at world 8, whose collectives return without communicating), GLM-5's widths at 4 layers (3
dense, 1 MoE with its 32 local experts), random FP8 weights drawn on the GPU (RandomReader), bf16, FP8 caches.

What it guards: the sharded compile on the GPU machine's torch (2.11's C++ matmul once failed the shard stage's
shape refresh: commit 03379ab), the load of a rank's slices, and the sharded step captured in decode CUDA graphs
(the collectives inside the capture) -- the path bench/rank_at_depth.py measures. The replayed steps' logits equal
those of an eager runner over the same graph, fed the same tokens (teacher-forced, so that a near-tie in one bf16
argmax cannot make the two runs diverge)."""

import operator

import pytest
import torch

from fxglm5.model.config import Glm5Config
from fxglm5.model.random_reader import RandomReader
from fxglm5.runtime.runner import Runner
from tests.helpers import fake_process_group

pytestmark = pytest.mark.gpu
CONFIG = Glm5Config.preset("glm5").replace(num_hidden_layers=4, mlp_layer_types=None, indexer_types=None,
                                           num_nextn_predict_layers=0)
PROMPTS = [[3, 14, 15, 92, 65], list(range(100, 170))]  # the second spans two 64-token blocks
FORCED = [[11, 12, 13, 14, 15, 16], [21, 22, 23, 24, 25, 26]]  # each request's tokens fed to the decode steps
OPTIONS = dict(tp=8, ep=8, device="cuda", dtype=torch.bfloat16, kv_cache="fp8", index_cache="fp8", block_size=64,
               max_cache_tokens=1024, keep_logits=True)


@pytest.fixture(scope="module")
def fake_group():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.cuda.set_device(0)
    with fake_process_group(0, 8):
        yield


def teacher_forced(runner):
    """Prefill PROMPTS, then decode with FORCED's tokens as the inputs; the logits [requests, steps, vocab]."""
    seqs = runner.prefill(PROMPTS)
    for step in range(len(FORCED[0])):
        for seq, tokens in zip(seqs, FORCED):
            seq.output[-1] = tokens[step]
        runner.decode()
    logits = torch.stack([torch.stack(seq.logits) for seq in seqs])
    for seq in seqs:
        runner.release(seq)
    return seqs, logits


@pytest.mark.parametrize("ep", [8, 2])
def test_sharded_program_compiles_loads_and_replays_decode_graphs(fake_group, ep):
    """At EP8 and at the mixed ep 2 (rank 0 in group 0: experts 0-127, 512 of each one's 2048 rows)."""
    options = dict(OPTIONS, ep=ep)
    runner = Runner(RandomReader(CONFIG, seed=0), **options)
    assert runner.mapping.tp == 8 and runner.load_report.bytes_read > 10**9
    down = operator.attrgetter("model.layers.3.mlp.experts.down_proj")(runner.program.graph)
    assert tuple(down.shape) == ((32, 6144, 2048) if ep == 8 else (128, 6144, 512))
    seqs, replayed = teacher_forced(runner)
    graphs = runner.decode_graphs
    assert graphs.disabled is None and graphs.graphs and graphs.steps == len(FORCED[0])
    assert torch.isfinite(replayed).all()
    assert all(0 <= t < CONFIG.vocab_size for seq in seqs for t in seq.output)

    eager = Runner(RandomReader(CONFIG, seed=0), program=runner.program, decode_graphs=False, **options)
    _, expected = teacher_forced(eager)
    assert eager.decode_graphs is None
    torch.testing.assert_close(replayed, expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())

    tokens = runner.generate(PROMPTS, 8)  # the runner's own loop (overlapped decode) after the forced steps
    assert [len(t) for t in tokens] == [8, 8] and all(0 <= t < CONFIG.vocab_size for ts in tokens for t in ts)
