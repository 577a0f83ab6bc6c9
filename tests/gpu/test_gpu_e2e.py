"""End to end on the GPU: the tiny GLM-5 lowered to Triton generates the same tokens as the reference
backend, cache-less (the match + fuse graph) and through the paged runtime with bf16 and FP8 caches,
mixed prompt lengths and prompts longer than index_topk."""

import pytest
import torch

from fxglm5.capture import capture
from fxglm5.model.config import Glm5Config
from fxglm5.passes import PassContext, run_pipeline
from fxglm5.runtime.runner import Runner
from tests.helpers import random_model

pytestmark = pytest.mark.gpu
PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43], [7, 1, 8], [2, 71, 82, 81, 82, 84, 59, 4, 5, 23, 53, 60, 28, 74, 71]]


def _greedy(graph, prompt, steps):
    tokens = list(prompt)
    for _ in range(steps):
        ids = torch.tensor([tokens], device="cuda")
        pos = torch.arange(len(tokens), device="cuda")[None]
        tokens.append(int(graph(ids, pos)[0, -1].argmax()))
    return tokens[len(prompt):]


def test_lowered_graph_same_tokens_as_reference():
    cfg = Glm5Config.preset("tiny")
    model = random_model(cfg, torch.float32).cuda()
    outputs = {}
    for backend in ("reference", "triton"):
        gm = capture(model)
        results = run_pipeline(gm, PassContext(config=cfg, backend=backend), stages=("match", "fuse", "lower"))
        assert results[-1].details["backends"].startswith(backend)
        outputs[backend] = [_greedy(gm, p, 12) for p in PROMPTS]
    assert outputs["triton"] == outputs["reference"]


@pytest.mark.parametrize("kv_cache", ["bf16", "fp8"])
def test_paged_runtime_triton_same_tokens_as_reference(kv_cache):
    cfg = Glm5Config.preset("tiny")
    model = random_model(cfg, torch.float32).cuda()
    outputs = {}
    for backend in ("reference", "triton"):
        runner = Runner(model, kv_cache=kv_cache, index_cache="fp8", block_size=16, dtype=torch.float32,
                        max_cache_tokens=512, device="cuda", backend=backend)
        outputs[backend] = runner.generate(PROMPTS, 24)
    assert outputs["triton"] == outputs["reference"]


@pytest.mark.parametrize("kv_cache,index_cache", [("bf16", "fp8"), ("fp8", "fp8"), ("bf16", "bf16")])
def test_decode_cuda_graphs_same_tokens_as_eager(kv_cache, index_cache):
    """Decode replayed from CUDA graphs (batch 3 padded to bucket 4, then batch 5 to bucket 8) against the same
    runner decoding eagerly: the same tokens, and logits equal up to float32 rounding (the static block table
    is wider than the eager one, which may change a kernel's split of the keys). The exact-mode index cache
    (``index_cache="bf16"``) too: its write and selection are kernels with no host sync (its capture failed
    while they were the reference's host loop)."""
    cfg = Glm5Config.preset("tiny")
    model = random_model(cfg, torch.float32).cuda()
    runners = {mode: Runner(model, kv_cache=kv_cache, index_cache=index_cache, block_size=16, dtype=torch.float32,
                            max_cache_tokens=1024, device="cuda", backend="triton", keep_logits=True,
                            decode_graphs=mode) for mode in (False, True)}
    for batch in (PROMPTS, PROMPTS + [[5, 6, 7, 8, 9], [11] * 20]):
        eager, replayed = runners[False].run(batch, 16), runners[True].run(batch, 16)
        assert [s.output for s in replayed] == [s.output for s in eager]
        for a, b in zip(replayed, eager):
            expected = torch.stack(b.logits)
            torch.testing.assert_close(torch.stack(a.logits), expected, rtol=1e-3,
                                       atol=1e-3 * expected.abs().max().item())
    graphs = runners[True].decode_graphs
    assert graphs.disabled is None and {batch for batch, _, _ in graphs.graphs} == {4, 8} and graphs.steps == 2 * 15


def _teacher_forced(runner, prompts, forced):
    """Prefill ``prompts`` and decode, feeding ``forced[i][step]`` (not the runner's own argmax) as each next
    token, so two backends see the same token streams; returns the logits [prompts, steps, vocab]."""
    seqs = runner.prefill(prompts)
    for step in range(1, len(forced[0])):
        for seq, tokens in zip(seqs, forced):
            seq.output[-1] = tokens[step - 1]
        runner.decode()
    return torch.stack([torch.stack(seq.logits) for seq in seqs])


@pytest.mark.parametrize("kv_cache", ["bf16", "fp8"])
def test_paged_runtime_hopper_mla_matches_reference(kv_cache, monkeypatch):
    """bf16 compute with GLM-5's 576-wide latent rows (16 heads, a tensor-parallel shard's count) and 64-token
    blocks: the shapes the Gluon Hopper MLA kernel serves, so on Hopper every decode step's sparse MLA goes through it,
    and the prefill's through the query-tile kernel (``sparse_mla_tile_paged``, its Gluon form there).

    bf16 logits tie often (the reference's top-2 margin reaches 0 on the tiny model), so two backends' greedy
    tokens may part at a tie and differ for good after it; instead the Triton backend is fed the reference's
    greedy tokens and each step's logits are compared. The model has no discrete choice that a bf16 rounding
    could flip into an O(1) change (on the tiny preset a flipped expert or listed position moves the logits by
    a third of their range): every expert is routed to, and index_topk (64) lists every cached position, so the
    sparse kernel attends to all of them (prompts longer than index_topk are the float32 tests' job)."""
    from fxglm5.lowering.triton import mla_hopper, sparse_mla

    if not mla_hopper.supported(torch.zeros(1, 16, 576, dtype=torch.bfloat16, device="cuda"),
                                torch.zeros(2, 64, 576, dtype=torch.bfloat16, device="cuda"), sparse=True):
        pytest.skip("the Hopper MLA kernel needs sm_90")
    calls = []
    launch = mla_hopper.launch

    def counted(*args, sparse, **kwargs):
        calls.append(sparse)
        return launch(*args, sparse=sparse, **kwargs)

    monkeypatch.setattr(mla_hopper, "launch", counted)
    tiles = []
    tile = sparse_mla.sparse_mla_tile_paged

    def tile_counted(*args, **kwargs):
        tiles.append(args[0].shape[0])  # the prefill's tokens
        return tile(*args, **kwargs)

    monkeypatch.setattr(sparse_mla, "sparse_mla_tile_paged", tile_counted)
    cfg = Glm5Config.preset("tiny").replace(kv_lora_rank=512, qk_rope_head_dim=64, num_attention_heads=16,
                                            num_key_value_heads=16, n_routed_experts=4, num_experts_per_tok=4,
                                            n_group=1, topk_group=1, index_topk=64)
    model = random_model(cfg, torch.bfloat16).cuda()
    runners = {backend: Runner(model, kv_cache=kv_cache, index_cache="fp8", block_size=64, dtype=torch.bfloat16,
                               max_cache_tokens=512, device="cuda", backend=backend, keep_logits=True)
               for backend in ("reference", "triton")}
    reference = runners["reference"].run(PROMPTS, 24)
    ref_logits = torch.stack([torch.stack(seq.logits) for seq in reference])
    logits = _teacher_forced(runners["triton"], PROMPTS, [seq.output for seq in reference])
    # Python-side launches, every layer: the one prefill step (the query tile), then the Hopper MLA, all sparse, in
    # the decode bucket's (3 requests -> 4) eager warm-up and its capture; the other 22 decode steps replay them
    graphs = runners["triton"].decode_graphs
    assert graphs.disabled is None and list(graphs.graphs) == [(4, 1, 1)] and graphs.steps == 23  # one 64-token block
    assert tiles == [sum(map(len, PROMPTS))] * cfg.num_hidden_layers, tiles
    assert calls == [True] * 2 * cfg.num_hidden_layers, calls
    diff = (logits - ref_logits).abs().amax(-1)  # per prompt and step
    assert diff.max() <= 0.05 * ref_logits.abs().max(), (diff.max(), ref_logits.abs().max())
    top2 = ref_logits.topk(2, dim=-1).values
    decisive = (top2[..., 0] - top2[..., 1]) > 2 * diff
    same = logits.argmax(-1) == ref_logits.argmax(-1)
    assert same[decisive].all(), (same, decisive)
    assert decisive.float().mean() > 0.5  # the check above is not vacuous
