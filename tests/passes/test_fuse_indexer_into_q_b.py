"""fuse_indexer_into_q_b: each indexed layer's rtp_indexer, whose query is the wq_b part of its q_b | wq_b GEMM with
the latent query, as one fxglm5::fp8_linear_latent_query_indexer (tests/passes/template.py's checks; near misses on a
small module with GLM-5's query path: the index query read twice, the keys not written by the norm op, a q_b GEMM
without its latent query, the head weights computed after the GEMM, the query turned by other tables), the op's
reference against the chain it replaces, and its bad inputs (the Triton op against the separate launches:
tests/kernels/test_kernels_latent_query_indexer.py)."""

import copy

import pytest
import torch
import torch.nn.functional as F

from fxglm5.errors import InputError
from fxglm5.lowering.reference import paged
from fxglm5.passes import REGISTRY, PassContext, PassManager
from fxglm5.passes.graph_utils import op_args, set_op_args
from tests.passes.modules import canonical_graph, canonical_mla, paged_reexport, seqs
from tests.passes.template import PassTemplate, paged_args, pipeline, run_one
from tests.passes.test_fuse_index_weights_into_q_norm import QNormIndexedMLA

NAME = "fuse_indexer_into_q_b"
ops = torch.ops.fxglm5


def _changed(n):
    """Per tiny model: n indexed layers' latent-query op and indexer (with its query's slice and view) gone, the new op
    in their place with one more getitem (its top-k)."""
    return {"aten.slice": -n, "aten.view": -n, "fxglm5.fp8_linear_latent_query": -n,
            "fxglm5.fp8_linear_latent_query_indexer": n, "fxglm5.rtp_indexer": -n, "getitem": n}


class Fp8IndexedMLA(QNormIndexedMLA):
    """QNormIndexedMLA with GLM-5's stacked query GEMM: one block-FP8 GEMM (fxglm5::fp8_linear) of the RMS-normed
    query latent whose attention heads come first and the indexer's query after them. ``variant``: "read_twice", the
    index query also feeds the output; "q_read_twice", the attention's q_nope does (so the GEMM keeps no latent query:
    a plain fp8_linear)."""

    def __init__(self, variant=None):
        super().__init__()
        (h, dn, dr), (hi, di) = self.shape, self.indexer_shape
        self.variant, n = variant, h * (dn + dr) + hi * di
        gen = torch.Generator().manual_seed(5)
        self.register_buffer("qb_weight", torch.randn(n, 32, generator=gen).to(torch.float8_e4m3fn))
        self.register_buffer("qb_scale", torch.rand(-(-n // 128), 1, generator=gen) / 8 + 0.05)

    def forward(self, input_ids, position_ids):
        b, s = input_ids.shape
        (h, dn, dr), (hi, di) = self.shape, self.indexer_shape
        x = self.emb(input_ids) + 0.1 * position_ids[..., None].float()
        angles = position_ids[..., None].float() * torch.linspace(1.0, 0.01, dr // 2)
        cos, sin = angles.cos(), angles.sin()
        rope = ops.rope_interleaved
        q_latent = ops.rms_norm(self.q_a(x), self.q_a_norm, 1e-6)
        q_all = ops.fp8_linear(q_latent, self.qb_weight, self.qb_scale, None, False)
        q_nope, q_pe = q_all[..., :h * (dn + dr)].view(b, s, h, dn + dr).split([dn, dr], dim=-1)
        q_view = q_all[..., h * (dn + dr):].view(b, s, hi, di)
        q_pe = rope(q_pe, cos, sin)
        k_pe = rope(self.k_pe(x).view(b, s, 1, dr), cos, sin).squeeze(2)
        kv_c = ops.rms_norm(self.kv_c(x), self.kv_norm, 1e-6)
        q_i = rope(q_view, cos, sin)
        k_i = rope(self.k_norm(self.k_i(x)).view(b, s, 1, di), cos, sin).view(b, s, di)
        weights = F.linear(x.float(), self.w_f32) * hi ** -0.5 * 0.125
        top = ops.indexer_topk(q_i, k_i, weights, 3)
        out = ops.sparse_mla(q_nope, q_pe, kv_c, k_pe, self.w_uk, self.w_uv, top, 0.3).reshape(b, s, -1)
        if self.variant == "read_twice":
            out = out + q_view.reshape(b, s, -1)[..., :out.shape[-1]]
        if self.variant == "q_read_twice":
            out = out + q_nope.reshape(b, s, -1)[..., :out.shape[-1]]
        return out


def _indexer(gm):
    return next(n for n in gm.graph.nodes if n.target is ops.rtp_indexer.default)


def _latent_query_op(gm):
    return next(n for n in gm.graph.nodes if n.target is ops.fp8_linear_latent_query.default)


def _unwritten(gm):
    """The indexer writes its keys again itself (the norm op's write left in place: the same rows)."""
    set_op_args(_indexer(gm), written=False)


def _late_weights(gm):
    """The indexer's head weights read through a copy made after the GEMM."""
    indexer = _indexer(gm)
    weights = op_args(indexer)["weights"]
    with gm.graph.inserting_after(_latent_query_op(gm)):
        late = gm.graph.call_function(torch.ops.aten.clone.default, (weights,))
    late.meta["val"] = weights.meta["val"]
    set_op_args(indexer, weights=late)


def _other_tables(gm):
    """The indexer's query (and key) tables: a copy of the latent query's, another node."""
    indexer = _indexer(gm)
    args = op_args(indexer)
    with gm.graph.inserting_before(_latent_query_op(gm)):
        cos, sin = (gm.graph.call_function(torch.ops.aten.clone.default, (args[name],)) for name in ("rope_cos",
                                                                                                  "rope_sin"))
    cos.meta["val"], sin.meta["val"] = args["rope_cos"].meta["val"], args["rope_sin"].meta["val"]
    set_op_args(indexer, rope_cos=cos, rope_sin=sin)


SURGERY = {"unwritten": _unwritten, "late_weights": _late_weights, "other_tables": _other_tables}


class TestFuseIndexerIntoQB(PassTemplate):
    name = NAME
    matches = {"fp8": 4, "shared": 2, "bf16": 4, "bf16ckpt": 0}  # the FP8 layers with an indexer of their own
    ops = {"fp8": _changed(4), "shared": _changed(2), "bf16": _changed(4), "bf16ckpt": {}}
    near_misses = ("read_twice", "q_read_twice", *SURGERY)

    def near_miss(self, case):
        """The variants of :class:`Fp8IndexedMLA`, or its graph changed by one of SURGERY's functions."""
        gm = canonical_graph(self.name, canonical_mla(Fp8IndexedMLA, variant=None if case in SURGERY else case))
        if case in SURGERY:
            SURGERY[case](gm)
            gm.graph.lint()
            gm.recompile()
        targets = {n.target for n in gm.graph.nodes}  # the near pattern: an indexer and the stacked GEMM
        assert ops.rtp_indexer.default in targets
        assert (ops.fp8_linear_latent_query.default in targets) == (case != "q_read_twice")
        return gm, copy.deepcopy(gm), paged_args(gm, seqs([6, 3]), torch.float32), None

    def reexport(self):
        return paged_reexport(self.name, canonical_mla(Fp8IndexedMLA))


def _fused(gm):
    return [n for n in gm.graph.nodes if n.target is ops.fp8_linear_latent_query_indexer.default]


def test_the_small_module_fuses():
    """The near misses differ from a module whose one indexer joins its GEMM only by what makes them near misses: its
    op takes the index query from the attention heads' end (2 heads of 32 columns), the indexer's weights, cache and
    context; the attention reads its top-k; the graph computes what it did, bit for bit."""
    gm = canonical_graph(NAME, canonical_mla(Fp8IndexedMLA))
    reference = copy.deepcopy(gm)
    indexer = op_args(_indexer(gm))
    assert run_one(gm, NAME).num_matches == 1
    (fused,) = _fused(gm)
    args = op_args(fused)
    assert (args["index_start"], args["index_heads"], args["index_dim"]) == (2 * (8 + 16), 2, 32)
    assert all(args[name] is indexer[name] for name in ("weights", "index_cache", "block_table", "positions"))
    assert args["rope_q"] is True and args["rope_cos"] is indexer["rope_cos"]
    attention = next(n for n in gm.graph.nodes if n.target is ops.rtp_sparse_mla.default)
    assert op_args(attention)["topk_pos"].args == (fused, 2)
    assert op_args(attention)["q_latent"].args == (fused, 1)
    args = paged_args(gm, seqs([6, 3]), torch.float32)
    assert torch.equal(gm(*copy.deepcopy(args))[0], reference(*copy.deepcopy(args))[0])


def test_what_each_layer_takes():
    """Each indexed layer's op takes its query (16 heads of 64 columns) after the attention's 4 heads of 64 + 32, its
    weights from the norm op, and the top-k it makes is read by that layer's attention and (shared model) the next
    layer's; no rtp_indexer and no fp8_linear_latent_query is left where every indexed layer fused."""
    cfg = pipeline("fp8").config
    start = cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    for name, indexed in (("fp8", [True] * 4), ("shared", [True, False, True, False])):
        gm = pipeline(name).after[NAME]
        fused = _fused(gm)
        assert len(fused) == sum(indexed)
        assert all((op_args(n)["index_start"], op_args(n)["index_heads"], op_args(n)["index_dim"]) ==
                   (start, cfg.index_n_heads, cfg.index_head_dim) for n in fused)
        norms = [n for n in gm.graph.nodes if n.target is ops.rms_norm_write_caches.default]
        assert [op_args(n)["weights"].args for n in fused] == [(m, 1) for m, i in zip(norms, indexed) if i]
        attention = [n for n in gm.graph.nodes if n.target is ops.rtp_sparse_mla.default]
        owners = [fused[sum(indexed[:layer + 1]) - 1] for layer in range(len(indexed))]
        assert [op_args(a)["topk_pos"].args for a in attention] == [(n, 2) for n in owners]
        assert not any(n.target is ops.rtp_indexer.default for n in gm.graph.nodes)
        assert sum(n.target is ops.fp8_linear_latent_query.default for n in gm.graph.nodes) == indexed.count(False)


def test_a_constant_after_the_gemm_moves_before_it():
    """A layer whose index cache is read (a get_attr node) only after its GEMM still fuses: the constant moves before
    the op; the other layers fuse as they are, the graph computes what it did."""
    run = pipeline("fp8")
    gm = copy.deepcopy(run.before[NAME])
    indexer, lq = _indexer(gm), _latent_query_op(gm)
    gm.register_buffer("late_cache", torch.zeros(0))
    with gm.graph.inserting_after(lq):
        const = gm.graph.get_attr("late_cache")
    real = op_args(indexer)["index_cache"]
    set_op_args(indexer, index_cache=const)
    ctx = PassContext(config=run.config, extras={"paged": True})
    order = lambda: {n: i for i, n in enumerate(gm.graph.nodes)}  # noqa: E731
    assert order()[const] > order()[lq]
    result = PassManager(ctx, stages=("fuse_kernels",)).run_one(gm, REGISTRY[NAME])
    assert (result.num_matches, result.expected) == (4, 4)
    fused = next(n for n in _fused(gm) if op_args(n)["index_cache"] is const)
    assert order()[const] < order()[fused]
    set_op_args(fused, index_cache=real)  # the real cache again: the graph runs
    gm.graph.lint()
    gm.recompile()
    assert torch.equal(run.outputs(gm), run.outputs(run.after[NAME]))


def test_not_paged_expects_none():
    cfg = pipeline("fp8").config
    assert REGISTRY[NAME].expected(PassContext(config=cfg, extras={"paged": True})) == 4
    assert REGISTRY[NAME].expected(PassContext(config=cfg, extras={"paged": False})) == 0
    assert REGISTRY[NAME].expected(PassContext(config=cfg)) is None


def _step(tokens=5, dim=64, exact=False):
    """A decode step at small widths: the stacked GEMM (4 attention heads of 24 + 16 columns, then 3 index heads of
    ``dim``, 256 input features), W_UK [4, 24, 96], the RoPE tables, the head weights, an index cache of 4-token
    blocks holding every request's keys (windows of 2 to 12 keys against a top-3: both paths of the selection) and
    the forward context."""
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(1, tokens, 256, generator=g)
    weight = torch.randn(4 * 40 + 3 * dim, 256, generator=g).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-(4 * 40 + 3 * dim) // 128), 2, generator=g) / 16 + 0.01
    w_uk = torch.randn(4, 24, 96, generator=g) / 5
    angles = torch.rand(1, tokens, 8, generator=g) * 10
    weights = torch.randn(1, tokens, 3, generator=g)
    table = torch.tensor([[1, 2, 3], [4, 5, 0]], dtype=torch.int32)
    req = torch.tensor([0, 1, 0, 1, 0][:tokens], dtype=torch.int32)
    pos = torch.tensor([11, 5, 3, 1, 8][:tokens], dtype=torch.int32)
    cache = torch.zeros(6, 4, 128) if exact else torch.zeros(6, 4, 132, dtype=torch.uint8)
    for r, n in ((0, 12), (1, 6)):
        p = torch.arange(n)
        slots = paged.slots_from_positions(table, torch.full_like(p, r), p, 4)
        keys = torch.randn(n, 128, generator=g)
        (paged.write_exact_index_keys if exact else paged.write_indexer_cache)(cache, keys, slots)
    context = (paged.slots_from_positions(table, req, pos, 4), table, req, pos, 64)
    return (x, weight, scale, None, False, w_uk, 0, 16, angles.cos(), angles.sin(), 160, 3, dim, weights, 3, cache,
            *context)


@pytest.mark.parametrize("dim, exact, rope_q", [(64, False, True), (128, False, False), (64, True, True)],
                         ids=["fp8_64", "fp8_128_no_rope", "exact_64"])
def test_the_reference_is_the_chain_it_replaces(dim, exact, rope_q):
    """fp8_linear_latent_query_indexer's reference: fp8_linear_latent_query, then rtp_indexer (its keys written) over
    the view of the index query's columns, bit for bit, all three outputs (the indices in the same order)."""
    args = _step(dim=dim, exact=exact)
    out, q, top = ops.fp8_linear_latent_query_indexer(*args, rope_q)
    x, weight, scale, bias, act_quant, w_uk, q_start, rope_dim, cos, sin, start, heads, _, weights, topk = args[:15]
    cache, slots, table, req, pos, max_positions = args[15:]
    want_out, want_q = ops.fp8_linear_latent_query(x, weight, scale, bias, act_quant, w_uk, q_start, rope_dim, cos,
                                                   sin)
    view = want_out[..., start:start + heads * dim].view(1, 5, heads, dim)
    want_top = ops.rtp_indexer(view, x[..., :dim], weights, topk, cache, slots, table, req, pos, max_positions, cos,
                               sin, rope_q=rope_q, written=True)
    assert torch.equal(out, want_out) and torch.equal(q, want_q) and torch.equal(top, want_top)
    assert top.shape == (1, 5, 3) and sorted(top[0, 3].tolist()) == [-1, 0, 1]  # a window of 2 keys


@pytest.mark.parametrize("change, message", [
    (dict(index_start=300), "index_start"), (dict(index_dim=130), "index_dim"), (dict(index_heads=0), "index_heads"),
    (dict(positions=torch.tensor([11, 5, 3, 1, 99], dtype=torch.int32)), "positions|slot_mapping"),
    (dict(weights=torch.zeros(1, 5, 4)), "weights"), (dict(rope_cos=None, rope_sin=None), "rope_q"),
])
def test_bad_inputs_name_the_argument(change, message):
    """The GEMM's, the index query's and the indexer's checks (rtp_indexer's own, its query a stand-in of the view's
    shape) run before anything is computed, each naming its argument."""
    names = ("x", "weight", "weight_scale_inv", "bias", "act_quant", "w_uk", "q_start", "rope_dim", "rope_cos",
             "rope_sin", "index_start", "index_heads", "index_dim", "weights", "topk", "index_cache", "slot_mapping",
             "block_table", "req_idx", "positions", "max_positions")
    args = dict(zip(names, _step()), rope_q=True) | change
    with pytest.raises(InputError, match=message):
        ops.fp8_linear_latent_query_indexer(**args)
