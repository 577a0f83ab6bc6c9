"""The full Triton path of the paged runtime (FP8 GEMM, fused MoE, cache writes, FP8 indexer + top-k,
sparse MLA) generates the same tokens as the reference path. On CPU the kernels run interpreted, so
this is small: two layers (one dense, one MoE, both with an indexer), two prompts, three new tokens (a prefill
and two decode steps); tests/gpu/test_gpu_e2e.py runs the same comparison compiled on a GPU."""

import pytest
import torch

from fxglm5.model.config import Glm5Config
from fxglm5.runtime.runner import Runner
from tests.helpers import random_model

PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26], [7, 1, 8]]  # one longer than index_topk (8)
# a decode step's MoE layer, launch by launch: the residual add and the MLP's RMSNorm (a token row a task), then the
# router (GEMV + routing), as the first tasks of the routed experts' gate|up launch (SiLU * up folded in; the shared
# expert's gate|up as more tasks; the router's and the shared tiles wait for the norm, the routed tiles for the
# routing), then their down GEMMs likewise (the shared one's gate folded in) with the combine (+ the shared row), each
# token's output tile combined by the CTA that finishes it
DECODE_MOE = ["_router_gate_up_kernel", "_moe_gemm_kernel"]
# one decode step's attention block, from the stacked q_a | kv_a | wk GEMM (the residual add and the input norm in
# its A loads) to o_proj's: the query latent's norm with both cache writes and the indexer's head weights, the stacked
# q_b | wq_b GEMM with the latent query (W_UK, q_pe's RoPE) and then the indexer (its logits and top-k, its query's
# RoPE) as the last tasks of its launch, the latent MLA with its W_UV combine as the last tasks of its launch,
# o_proj: five launches; after the dense layer's MLP (its add and norm in its stacked gate | up GEMM, the gated down
# GEMM) and before the MoE layer's MLP (its add and norm in the MoE's first launch): no add_rms_norm launch left
DECODE_ATTENTION = ["_gemm_kernel", "_norm_write_caches_kernel", "_gemm_latent_query_indexer_kernel",
                    "_mla_project_kernel", "_gemm_kernel"]
DENSE_MLP = ["_gemm_kernel", "_gemm_kernel"]


@pytest.mark.usefixtures("all_decode_joins")  # the one-launch joins are opt-in (settings.DECODE_JOINS)
def test_triton_path_same_tokens_as_reference(monkeypatch):
    """... and no RoPE kernel is launched, prefill or decode: every RoPE runs inside the attention ops' kernels (the
    indexer query's in the indexer's programs, which the decode steps run: their windows exceed the top-k); the
    indexer's logits and top-k are the last tasks of the q_b | wq_b GEMM's launch in every step here (issue 45, item
    5: at most 16 tokens, rows of one top-k round; fuse_indexer_into_q_b), the 3-token prompt's rows (their windows
    fit in the top-k) selected without scores beside the other prompt's: no indexer launch of its own; a decode MoE
    layer launches DECODE_MOE (issue 45, item 4: the router's GEMV and its routing inside the experts' gate|up
    launch, the shared expert's GEMMs inside the routed experts' two launches, the combine in the down launch: two
    launches, no _gemm_kernel or _combine_kernel among them; items 4-5: the residual add and the MLP's RMSNorm before
    it are the first tasks of its gate|up launch, fuse_add_rms_norm_into_moe, up to 16 tokens, the prefill's 15 too).
    The query latent's RMSNorm, both cache writes and the indexer's head weights are one launch per layer and step
    (fuse_cache_writes_into_q_norm, fuse_index_weights_into_q_norm; every step here is GEMV-sized, the prefill's 15
    tokens too), and the latent query runs in the q_b | wq_b GEMM's launch (fuse_latent_query_into_q_b; up to 16
    tokens, the prefill's 15 too), with the indexer after it: a decode step's attention block is DECODE_ATTENTION, no
    standalone norm, write, GEMV, latent query or indexer kernel among them, and the MLA's W_UV combine runs in the
    MLA's launch (up to 16 tokens, chosen per call): five launches, and with DECODE_MOE a decode MoE layer is seven
    (issue 45, item 5: from eight, the indexer's launch gone). The residual adds and norms before the MoE layer's
    attention and the dense layer's MLP run inside the GEMMs that read them (fuse_add_rms_norm_into_gemm; up to 16
    rows, the prefill's 15 too), and the MoE layer's MLP norm in the MoE's first launch: no add_rms_norm launch is
    left in any step, and the dense layer's MLP, the MoE layer's attention and its MoE follow each other without one."""
    from triton.runtime.interpreter import InterpretedFunction

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU tensors: the Triton bindings need the interpreter
    cfg = Glm5Config.preset("tiny").replace(num_hidden_layers=2, mlp_layer_types=None, indexer_types=None)
    model = random_model(cfg, torch.float32)
    outputs, backends, launched, launch = {}, {}, [], InterpretedFunction.run
    for backend in ("reference", "triton"):
        runner = Runner(model, kv_cache="fp8", index_cache="fp8", block_size=16, dtype=torch.float32,
                        max_cache_tokens=128, backend=backend)
        backends[backend] = runner.pass_results[-1].details["backends"]
        if backend == "triton":
            monkeypatch.setattr(InterpretedFunction, "run", lambda self, *a, **k: launched.append(self.fn.__name__)
                                or launch(self, *a, **k))
        outputs[backend] = runner.generate(PROMPTS, 3)
    assert backends == {"reference": "reference", "triton": "triton/reference"}
    assert outputs["triton"] == outputs["reference"]
    assert "_indexer_topk_kernel" not in launched and "_rope_kernel" not in launched
    assert "_indexer_logits_kernel" not in launched and "_segment_topk_kernel" not in launched
    # every step's router (the prefill's 15 tokens and each decode step's 2, all GEMV-sized) runs in its experts'
    # gate|up launch: the GEMV's last CTA routes, no router or route kernel of its own
    assert launched.count("_router_gate_up_kernel") == 3 and "_route_kernel" not in launched
    assert "_router_kernel" not in launched
    last = len(launched) - 1 - launched[::-1].index("_router_gate_up_kernel")
    assert launched[last:last + len(DECODE_MOE)] == DECODE_MOE
    assert "_combine_kernel" not in launched  # every step's tokens fit the down launch's combine
    assert "_mla_combine_project_kernel" not in launched  # W_UV in the MLA's launch (decode), or cuBLAS's (prefill)
    assert "_write_latent_fp8_kernel" not in launched and "_write_index_kernel" not in launched
    assert "_f32_gemv_kernel" not in launched
    assert launched.count("_norm_write_caches_kernel") == 2 * 3  # both layers, the prefill and two decode steps
    assert launched.count("_gemm_latent_query_indexer_kernel") == 2 * 3 and "_latent_query_kernel" not in launched
    assert "_gemm_latent_query_kernel" not in launched  # every layer's indexer joined its GEMM's launch
    last = len(launched) - launched[::-1].index("_norm_write_caches_kernel") - 1  # the last decode step's layer 1
    at = DECODE_ATTENTION.index("_norm_write_caches_kernel") + len(DENSE_MLP)
    assert launched[last - at:last - at + len(DENSE_MLP + DECODE_ATTENTION + DECODE_MOE)] == (
        DENSE_MLP + DECODE_ATTENTION + DECODE_MOE)
    assert "_add_rms_norm_kernel" not in launched  # the MoE layer's MLP norm in its gate|up launch, all 3 steps
    assert len(DECODE_ATTENTION) == 5 and len(DECODE_ATTENTION) + len(DECODE_MOE) == 7  # a decode MoE layer's


def test_triton_path_without_the_joins_runs_the_chains(monkeypatch):
    """The default (no one-launch join: they are opt-in until a GPU run shows them faster, settings.DECODE_JOINS): the
    same tokens as the reference, and each join's op runs the launches of the chain it joins: the q_b GEMM, then
    the indexer's logits and top-k launches, then the latent query; the MLA, then its W_UV combine; the residual add
    and norm before the GEMM that reads it, then that GEMM. The MoE's own launches (its norm, router and combine in
    them) are not such joins and stay two."""
    from triton.runtime.interpreter import InterpretedFunction

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("FXGLM5_DECODE_JOINS", raising=False)
    cfg = Glm5Config.preset("tiny").replace(num_hidden_layers=2, mlp_layer_types=None, indexer_types=None)
    model = random_model(cfg, torch.float32)
    want = Runner(model, kv_cache="fp8", index_cache="fp8", block_size=16, dtype=torch.float32, max_cache_tokens=128,
                  backend="reference").generate(PROMPTS, 3)
    launched, launch = [], InterpretedFunction.run
    runner = Runner(model, kv_cache="fp8", index_cache="fp8", block_size=16, dtype=torch.float32,
                    max_cache_tokens=128, backend="triton")
    monkeypatch.setattr(InterpretedFunction, "run", lambda self, *a, **k: launched.append(self.fn.__name__)
                        or launch(self, *a, **k))
    assert runner.generate(PROMPTS, 3) == want
    joined = {"_gemm_latent_query_indexer_kernel", "_gemm_latent_query_kernel", "_indexer_topk_kernel",
              "_mla_project_kernel"}
    assert not joined & set(launched)
    for chain in ("_latent_query_kernel", "_indexer_logits_kernel", "_mla_combine_project_kernel",
                  "_add_rms_norm_kernel"):
        assert chain in launched, chain
    assert launched.count("_router_gate_up_kernel") == 3  # the MoE's norm joins its gate|up launch still


@pytest.mark.parametrize("max_step_tokens, tiles", [(None, [40, 40]), (16, [16, 16, 16, 16])],
                         ids=["one_step", "chunked"])
def test_triton_prefill_through_the_query_tile_sparse_mla(monkeypatch, max_step_tokens, tiles):
    """A 40-token prompt (16 tokens a tile at the tiny model's 4 heads, a prefix of 3 blocks of 16 within 16 top-k
    lists of 8): the prefill's sparse MLA runs the query-tile kernel, the decode steps the per-token one, and the
    tokens are the reference path's. Chunked in steps of 16 tokens (issue 47, item 4), the first two chunks take the
    tile kernel over their cached prefix, the last 8 tokens (under a tile) the per-token one, with the same tokens."""
    from fxglm5.lowering.triton import sparse_mla

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg = Glm5Config.preset("tiny").replace(num_hidden_layers=2, mlp_layer_types=None, indexer_types=None)
    model = random_model(cfg, torch.float32)
    tile_calls = []
    tile_fn = sparse_mla.sparse_mla_tile_paged
    monkeypatch.setattr(sparse_mla, "sparse_mla_tile_paged",
                        lambda q, *a, **k: tile_calls.append(q.shape[0]) or tile_fn(q, *a, **k))
    prompt = [list(torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).tolist())]
    outputs = {}
    for backend in ("reference", "triton"):
        options = dict(max_step_tokens=max_step_tokens) if backend == "triton" and max_step_tokens else {}
        runner = Runner(model, kv_cache="fp8", index_cache="fp8", block_size=16, dtype=torch.float32,
                        max_cache_tokens=128, backend=backend, **options)
        outputs[backend] = runner.generate(prompt, 3)
    assert tile_calls == tiles
    assert outputs["triton"] == outputs["reference"]
