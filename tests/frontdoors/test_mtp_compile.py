"""The MTP layer's paged graph (``compile_mtp``) and the target's "logits+hidden" head, driven through a PagedCache
over a prefill and decode steps, against the eager model (reference kernels, float32); the passes' counts exact."""

import pytest
import torch

from fxglm5.compiler import compile_model, compile_mtp
from fxglm5.errors import InputError
from fxglm5.model.modeling import Glm5ForCausalLM
from fxglm5.model.tiny import make_tiny_checkpoint
from fxglm5.parallel import Mapping
from fxglm5.runtime.cache import PagedCache
from fxglm5.runtime.forward_context import ForwardContext

IDS = [5, 77, 300, 2, 411, 9, 33, 480, 12, 6, 150, 91, 200]  # 10 prefill positions (> index_topk 8) + 3 decode
PREFILL, BLOCK = 10, 4
# one indexed MoE layer: 4 RMSNorms + enorm, hnorm, shared_head.norm; q_a, q_b, kv_a, o_proj, indexer wq_b / wk and
# the shared expert's 3 in FP8 (eh_proj is bf16, as GLM-5-FP8 stores it); the router and the indexer's head weights
# as f32_linear (the router's then folded into its router: moe_router), the shared expert's gate into its down GEMM,
# then its two GEMMs into the MoE, then its router, the query latent's norm with both cache writes and the indexer's
# head weights, the latent query with its q_b | wq_b GEMM and then the indexer in that op, the attention's residual
# sum into the next norm, which feeds the MoE, so it joins the MoE op and no GEMM
MTP_COUNTS = {"match_sparse_mla": 1, "match_mla": 0, "match_rms_norm": 7, "match_rope": 4, "fuse_fp8_linear": 9,
              "fuse_fp8_moe": 1, "insert_paged_cache": 1, "select_sampled_rows": 1,
              "fuse_norm_rope_into_cache_writes": 2, "fuse_rope_into_indexer_query": 1, "fuse_f32_linear": 2,
              "fuse_local_experts_into_route": 0, "fuse_f32_linear_into_route": 1, "fuse_shared_input_gemms": 3,
              "fuse_cache_writes_into_q_norm": 1, "fuse_index_weights_into_q_norm": 1, "fuse_latent_query_into_q_b": 1,
              "fuse_indexer_into_q_b": 1, "fuse_silu_mul_into_down": 1,
              "fuse_shared_expert_into_moe": 1, "fuse_router_into_moe": 1,
              "fuse_add_rms_norm": 1, "fuse_add_rms_norm_into_moe": 1, "fuse_add_rms_norm_into_gemm": 0}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("mtp") / "fp8", fp8=True)
    return Glm5ForCausalLM.from_pretrained(path, dtype=torch.float32, progress=False, mtp=True)


def run_paged(program, model, ids, extra=None):
    """The program over a prefill of PREFILL tokens, then one decode step per further token: each step's output
    rows (all of a prefill's, the decode token's), concatenated along the tokens."""
    device = ids.device
    cache = PagedCache(program.cache_spec(dtype=model.dtype), 6, BLOCK, device=device)
    table = [[1, 2, 3, 4]]
    steps = [(True, 0, PREFILL)] + [(False, p, p + 1) for p in range(PREFILL, ids.shape[1])]
    outs = []
    for prefill, lo, hi in steps:
        ctx = ForwardContext.build(prefill, [hi - lo], [lo], table, block_size=BLOCK, kernel_block_size=BLOCK,
                                   num_blocks=6, max_position_embeddings=model.config.max_position_embeddings,
                                   device=device).validate()
        rows = torch.arange(hi - lo, device=device)
        out = program(ctx.step_inputs(rows), ids[0, lo:hi], cache.graph_inputs(),
                      hidden=None if extra is None else extra[0, lo:hi])
        outs.append(tuple(t[None] for t in out if t is not None))
    return [torch.cat(parts, dim=1) for parts in zip(*outs)]


def close(a, b):
    assert a.shape == b.shape and (a - b).abs().max() <= 1e-4 * b.abs().max()


@pytest.fixture(scope="module")
def mtp_compiled(model):
    return compile_mtp(model, backend="reference", strict=True, max_tokens=64)


def test_paged_mtp_graph_equals_the_eager_mtp(model, mtp_compiled):
    compiled = mtp_compiled
    counts = {r.name: r.num_matches for r in compiled.results if r.name in MTP_COUNTS}
    assert counts == MTP_COUNTS and all(r.num_matches == r.expected for r in compiled.results if r.expected is not None)
    assert [(kv, ix) for kv, ix in compiled.graph.meta["paged_cache"].layers] == [("kv_cache_0", "index_cache_0")]
    ids = torch.tensor([IDS])
    with torch.no_grad():
        _, hidden = model(ids, return_hidden=True)
        tokens, h = ids[:, 1:], hidden[:, :-1]  # position i: t_{i+1} and the target's h_i
        ref_logits, ref_hidden = model.mtp(tokens, torch.arange(tokens.shape[1])[None], h)
        logits, out = run_paged(compiled.program, model, tokens, h)
    close(logits, ref_logits)
    close(out, ref_hidden)


@pytest.fixture(scope="module")
def target_compiled(model):
    return compile_model(model, head="logits+hidden", backend="reference", strict=True, max_tokens=64)


def test_logits_and_hidden_head(model, target_compiled):
    compiled = target_compiled
    select = next(r for r in compiled.results if r.name == "select_sampled_rows")
    # the logits' selection meets the hidden output's at the final norm's output, and both move above the norm
    assert select.num_matches == 1 and select.details["ops_moved"] == 2
    ids = torch.tensor([IDS])
    with torch.no_grad():
        ref_logits, ref_hidden = model(ids, return_hidden=True)
        logits, hidden = run_paged(compiled.program, model, ids)
    close(logits, ref_logits)
    close(hidden, ref_hidden)


def test_the_mtp_program_requires_hidden_and_the_target_program_refuses_it(model, mtp_compiled, target_compiled):
    """The program boundary's ``hidden`` rule: the MTP program takes the target's hidden states and refuses a call
    without them; a target program (here the logits+hidden head's) refuses them, each naming ``hidden``."""
    program = mtp_compiled.program
    assert program.signature.hidden_input and program.inputs[2] == "hidden"
    ctx = ForwardContext.build(True, [3], [0], [[1]], block_size=BLOCK, kernel_block_size=BLOCK, num_blocks=6,
                               max_position_embeddings=model.config.max_position_embeddings).validate()
    cache = PagedCache(program.cache_spec(dtype=model.dtype), 6, BLOCK)
    ids, hidden = torch.tensor([5, 77, 300]), torch.randn(3, model.config.hidden_size)
    with pytest.raises(InputError, match=r"hidden: the MTP program takes the target's hidden states \[T, H\]"):
        program(ctx.step_inputs(), ids, cache.graph_inputs())
    logits, out = program(ctx.step_inputs(), ids, cache.graph_inputs(), hidden=hidden)
    assert logits.shape == (1, model.config.vocab_size) and out.shape == (1, model.config.hidden_size)  # the last row
    target = target_compiled.program
    assert not target.signature.hidden_input
    target_cache = PagedCache(target.cache_spec(dtype=model.dtype), 6, BLOCK)
    with pytest.raises(InputError, match="hidden: this program takes no hidden states"):
        target(ctx.step_inputs(), ids, target_cache.graph_inputs(), hidden=hidden)


def test_compile_mtp_bad_input(model, tmp_path):
    plain = Glm5ForCausalLM(model.config, dtype=torch.float32, device="meta")
    with pytest.raises(InputError, match="no MTP layer"):
        compile_mtp(plain)
    # a mapping is checked against the MTP layer's widths before anything is captured (tiny's shared expert is
    # 128 wide: no whole FP8 block per rank at tp=2)
    with pytest.raises(InputError, match=r"does not split over tp=2, ep=1: .*moe_intermediate_size x n_shared_experts "
                                         r"\(the shared expert\) = 128 gives each rank 64"):
        compile_mtp(model, mapping=Mapping(tp=2, rank=0))
