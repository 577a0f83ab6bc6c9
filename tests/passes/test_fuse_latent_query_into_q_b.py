"""fuse_latent_query_into_q_b: each layer's q_b | wq_b GEMM and the latent query of its heads as one
fxglm5::fp8_linear_latent_query, the attention op taking that query (tests/passes/template.py's checks; near misses:
q_nope read elsewhere too, q_pe of another GEMM, the rope part first in each head, a query computed from the GEMM, a
q_b that is torch's GEMM), the op's reference against the chain it replaces, and the attention op's ``q_latent``
against the latent query it made (the Triton op against the separate launches: tests/kernels/test_kernels_fused.py)."""

import copy

import pytest
import torch

from fxglm5.errors import InputError
from fxglm5.lowering.reference import fused as ref_fused
from fxglm5.lowering.reference import paged
from fxglm5.passes import REGISTRY, PassContext, PassManager
from fxglm5.passes.graph_utils import op_args
from tests.passes.modules import CanonicalMLA, canonical_graph, canonical_mla, paged_reexport, seqs
from tests.passes.template import PassTemplate, paged_args, pipeline, run_one

ops = torch.ops.fxglm5
# per tiny model: each of the 4 layers' q_b (| wq_b) fp8_linear becomes the fused op, with a getitem of each output
FOUR = {"fxglm5.fp8_linear": -4, "fxglm5.fp8_linear_latent_query": 4, "getitem": 8}
NEAR_MISSES = ("read_twice", "other_gemm", "rope_first", "computed", "torch_gemm")


class Fp8QueryMLA(CanonicalMLA):
    """CanonicalMLA with GLM-5's query: q_b a block-FP8 GEMM (fxglm5::fp8_linear) of the RMS-normed query latent whose
    query heads come first and 40 more columns after them (the stacked wq_b's part; the output reads them), its heads
    sliced, viewed and split [q_nope | q_pe]; "offset": the 40 other columns first, the heads after them. Another
    ``variant`` makes a near miss: q_nope also added to the output ("read_twice"), q_pe from another GEMM (of x,
    "other_gemm"), each head [q_pe | q_nope] ("rope_first"), q_nope computed (scaled, "computed")."""

    def __init__(self, variant=None):
        super().__init__(q_norm=True)
        heads, dn, dr = self.shape
        self.variant, n = variant, heads * (dn + dr) + 40
        gen = torch.Generator().manual_seed(3)
        self.register_buffer("qb_weight", torch.randn(n, 32, generator=gen).to(torch.float8_e4m3fn))
        self.register_buffer("qb_scale", torch.rand(-(-n // 128), 1, generator=gen) / 8 + 0.05)

    def forward(self, input_ids, position_ids):
        b, s = input_ids.shape
        h, dn, dr = self.shape
        x = self.emb(input_ids) + 0.1 * position_ids[..., None].float()
        angles = position_ids[..., None].float() * torch.linspace(1.0, 0.01, dr // 2)
        cos, sin = angles.cos(), angles.sin()
        q_latent = ops.rms_norm(self.q_a(x), self.q_a_norm, 1e-6)
        q_all = ops.fp8_linear(q_latent, self.qb_weight, self.qb_scale, None, False)
        start = 40 if self.variant == "offset" else 0
        others = q_all[..., :40] if start else q_all[..., h * (dn + dr):]
        q = q_all[..., start:start + h * (dn + dr)].view(b, s, h, dn + dr)
        if self.variant == "rope_first":
            q_pe, q_nope = q.split([dr, dn], dim=-1)
        else:
            q_nope, q_pe = q.split([dn, dr], dim=-1)
        if self.variant == "other_gemm":
            other = ops.fp8_linear(x, self.qb_weight, self.qb_scale, None, False)
            q_pe = other[..., :h * (dn + dr)].view(b, s, h, dn + dr).split([dn, dr], dim=-1)[1]
        if self.variant == "computed":
            q_nope = q_nope * 1.5
        q_pe = ops.rope_interleaved(q_pe, cos, sin)
        k_pe = ops.rope_interleaved(self.k_pe(x).view(b, s, 1, dr), cos, sin).squeeze(2)
        kv_c = ops.rms_norm(self.kv_c(x), self.kv_norm, 1e-6)
        out = ops.mla(q_nope, q_pe, kv_c, k_pe, self.w_uk, self.w_uv, 0.3).reshape(b, s, -1)
        out = out + others[..., :out.shape[-1]]
        if self.variant == "read_twice":
            out = out + q_nope.reshape(b, s, -1)[..., :out.shape[-1]]
        return out


class TestFuseLatentQueryIntoQB(PassTemplate):
    name = "fuse_latent_query_into_q_b"
    matches = {"fp8": 4, "shared": 4, "bf16": 4, "bf16ckpt": 0}
    ops = {"fp8": FOUR, "shared": FOUR, "bf16": FOUR, "bf16ckpt": {}}
    near_misses = NEAR_MISSES

    def near_miss(self, case):
        module = canonical_mla(q_norm=True) if case == "torch_gemm" else canonical_mla(Fp8QueryMLA, variant=case)
        gm = canonical_graph(self.name, module)
        targets = {n.target for n in gm.graph.nodes}  # the near pattern: a cached attention op, an FP8 q_b but one
        assert ops.rtp_mla.default in targets and (ops.fp8_linear.default in targets) == (case != "torch_gemm")
        return gm, copy.deepcopy(gm), paged_args(gm, seqs([6, 3]), torch.float32), None

    def reexport(self):
        return paged_reexport(self.name, canonical_mla(Fp8QueryMLA))


def _fused(gm):
    return [n for n in gm.graph.nodes if n.target is ops.fp8_linear_latent_query.default]


def test_what_each_layer_takes():
    """Every layer's attention op takes its query from the fused op, which takes the stacked q_b | wq_b GEMM of an
    indexed layer (its query heads at column 0, the indexer's query after them: item 0 of the op, still read by the
    indexer) and q_b alone in a shared layer (layers 1 and 3 of the shared model), q_pe's RoPE tables included; no
    fp8_linear reads the normed query latent any more."""
    cfg = pipeline("fp8").config
    heads = cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    for name, indexed in (("fp8", [True] * 4), ("shared", [True, False, True, False])):
        gm = pipeline(name).after["fuse_latent_query_into_q_b"]
        fused = _fused(gm)
        widths = [op_args(n)["weight"].meta["val"].shape[0] for n in fused]
        assert widths == [heads + cfg.index_n_heads * cfg.index_head_dim if i else heads for i in indexed]
        assert all((op_args(n)["q_start"], op_args(n)["rope_dim"]) == (0, cfg.qk_rope_head_dim) for n in fused)
        attention = [n for n in gm.graph.nodes if n.target is ops.rtp_sparse_mla.default]
        assert [op_args(a)["q_latent"].args for a in attention] == [(n, 1) for n in fused]
        assert all(op_args(a)["rope_cos"] is op_args(n)["rope_cos"] is not None for a, n in zip(attention, fused))
        indexers = [n for n in gm.graph.nodes if n.target is ops.rtp_indexer.default]
        assert len(indexers) == sum(indexed)


@pytest.mark.parametrize("variant, q_start", [(None, 0), ("offset", 40)])
def test_the_small_module_fuses(variant, q_start):
    """The near misses differ from a module whose one query fuses only by what makes them near misses: its stacked
    GEMM (40 more columns, read by the output, after the heads or before them) becomes the op, which takes its heads
    from their first column; the graph computes what it did, bit for bit."""
    gm = canonical_graph("fuse_latent_query_into_q_b", canonical_mla(Fp8QueryMLA, variant=variant))
    reference = copy.deepcopy(gm)
    assert run_one(gm, "fuse_latent_query_into_q_b").num_matches == 1
    (fused,) = _fused(gm)
    assert (op_args(fused)["q_start"], op_args(fused)["rope_dim"]) == (q_start, 16)
    attention = next(n for n in gm.graph.nodes if n.target is ops.rtp_mla.default)
    assert op_args(attention)["q_latent"].args == (fused, 1)
    args = paged_args(gm, seqs([6, 3]), torch.float32)
    assert torch.equal(gm(*copy.deepcopy(args))[0], reference(*copy.deepcopy(args))[0])


def test_a_constant_after_the_gemm_moves_before_it():
    """A layer whose W_UK is read (a get_attr node) only after its q_b GEMM still fuses: the constant moves before the
    GEMM, where the op reads it; a computed input after the GEMM (a copy of the RoPE tables made there) leaves the
    layer alone, and the three other layers fuse."""
    run = pipeline("fp8")
    for moved in (True, False):
        gm = copy.deepcopy(run.before["fuse_latent_query_into_q_b"])
        attention = next(n for n in gm.graph.nodes if n.target is ops.rtp_sparse_mla.default)
        gemm = op_args(attention)["q_nope"].args[0].args[0].args[0].args[0]
        assert gemm.target is ops.fp8_linear.default
        if moved:
            w_uk = op_args(attention)["w_uk"]
            gemm.append(w_uk)
        else:
            cos = op_args(attention)["rope_cos"]
            with gm.graph.inserting_after(gemm):
                late = gm.graph.call_function(torch.ops.aten.clone.default, (cos,))
            late.meta["val"] = cos.meta["val"]
            attention.args = tuple(late if a is cos else a for a in attention.args)
        gm.recompile()
        reference = copy.deepcopy(gm)
        ctx = PassContext(config=run.config, extras={"paged": True})
        result = PassManager(ctx, stages=("fuse_kernels",)).run_one(gm, REGISTRY["fuse_latent_query_into_q_b"])
        assert (result.num_matches, result.expected) == (4 if moved else 3, 4)
        assert (op_args(attention)["q_latent"] is not None) == moved
        assert torch.equal(run.outputs(gm), run.outputs(reference))


def _query_chain(dtype, tokens=5, rope=True):
    """A decode step's q_b | wq_b GEMM at small widths (4 heads of 24 + 16 columns from column 0, 96 more after
    them, 256 input features) with its W_UK [4, 24, 96] and the step's RoPE tables [1, tokens, 8]."""
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(1, tokens, 256, generator=g).to(dtype)
    weight = torch.randn(4 * 40 + 96, 256, generator=g).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 2, generator=g) / 16 + 0.01
    w_uk = (torch.randn(4, 24, 96, generator=g) / 5).to(dtype)
    angles = torch.rand(1, tokens, 8, generator=g) * 10
    return x, weight, scale, w_uk, (angles.cos(), angles.sin()) if rope else (None, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rope", [True, False])
@pytest.mark.parametrize("act_quant", [False, True])
def test_the_reference_is_the_chain_it_replaces(dtype, rope, act_quant):
    """fp8_linear_latent_query's reference: fp8_linear, then the latent query the attention op's body made of its
    query heads (a slice, a view, a split, flattened), bit for bit, both outputs."""
    x, weight, scale, w_uk, (cos, sin) = _query_chain(dtype, rope=rope)
    out, q = ops.fp8_linear_latent_query(x, weight, scale, None, act_quant, w_uk, 0, 16, cos, sin)
    gemm = ops.fp8_linear(x, weight, scale, None, act_quant)
    q_nope, q_pe = gemm[..., :160].view(1, 5, 4, 40).split([24, 16], dim=-1)
    tables = None if cos is None else (cos.reshape(5, 8), sin.reshape(5, 8))
    want = paged.latent_query(q_nope.reshape(5, 4, 24), w_uk, q_pe.reshape(5, 4, 16), tables)
    assert torch.equal(out, gemm)
    assert q.shape == (1, 5, 4, 576) and torch.equal(q, want.view(1, 5, 4, 576))


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse_mla", "mla"])
def test_the_attention_ops_attend_with_the_query_given(sparse):
    """rtp_sparse_mla / rtp_mla given ``q_latent`` (the fused op's query) give what they give making it themselves
    from q_nope, q_pe, W_UK and the RoPE tables, bit for bit, and write the same cache rows (another query gives
    another output: the one given attends); a query of another shape or dtype is refused, naming it."""
    x, weight, scale, w_uk, (cos, sin) = _query_chain(torch.float32)
    out, q = ops.fp8_linear_latent_query(x, weight, scale, None, False, w_uk, 0, 16, cos, sin)
    q_nope, q_pe = ref_fused.query_heads(out, 0, 4, 24, 16)
    g = torch.Generator().manual_seed(2)
    kv_c, k_pe = torch.randn(1, 5, 96, generator=g), torch.randn(1, 5, 16, generator=g)
    w_uv = torch.randn(4, 8, 96, generator=g) / 5
    table = torch.tensor([[1, 2], [3, 0]], dtype=torch.int32)
    req, pos = torch.tensor([0, 0, 0, 1, 1], dtype=torch.int32), torch.tensor([2, 3, 4, 0, 1], dtype=torch.int32)
    context = (paged.slots_from_positions(table, req, pos, 4), table, req, pos, 64)
    top = torch.tensor([[0, 1, 2], [3, 1, -1], [4, 0, 2], [0, -1, -1], [1, 0, -1]], dtype=torch.int32)[None]

    def attend(**given):
        cache = torch.zeros(4, 4, 576)
        head = (q_nope, q_pe, kv_c, k_pe, w_uk, w_uv)
        rest = (0.3, cache, *context, cos, sin)
        result = ops.rtp_sparse_mla(*head, top, *rest, **given) if sparse else ops.rtp_mla(*head, *rest, **given)
        return result, cache

    (made, cache), (given, given_cache) = attend(), attend(q_latent=q)
    assert torch.equal(given, made) and torch.equal(given_cache, cache)
    assert not torch.allclose(attend(q_latent=q * 2)[0], made, rtol=1e-3)  # the query given is the one attending
    for bad in (q[..., :512], q.bfloat16()):
        with pytest.raises(InputError, match="q_latent"):
            attend(q_latent=bad)


@pytest.mark.parametrize("change, message", [
    (dict(q_start=200), "q_start"), (dict(rope_dim=15), "rope_dim"), (dict(rope_cos=None), "rope_cos / rope_sin"),
    (dict(w_uk=torch.zeros(4, 24)), "w_uk"), (dict(rope_sin=torch.zeros(1, 5, 4)), "rope_sin"),
])
def test_bad_inputs_name_the_argument(change, message):
    x, weight, scale, w_uk, (cos, sin) = _query_chain(torch.float32)
    args = dict(x=x, weight=weight, weight_scale_inv=scale, bias=None, act_quant=False, w_uk=w_uk, q_start=0,
                rope_dim=16, rope_cos=cos, rope_sin=sin) | change
    with pytest.raises(InputError, match=message):
        ops.fp8_linear_latent_query(**args)
