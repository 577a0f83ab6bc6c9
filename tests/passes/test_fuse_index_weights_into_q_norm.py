"""fuse_index_weights_into_q_norm: each indexed layer's head weights (``f32_linear``) as the second output of its
fxglm5::rms_norm_write_caches (tests/passes/template.py's checks; near misses on a small module with GLM-5's query
path: an f32_linear read by the output too, weights of an aten linear, weights computed from the normed query
latent)."""

import copy

import torch
import torch.nn.functional as F
from torch import nn

from fxglm5.passes import REGISTRY, PassContext, PassManager
from fxglm5.passes.graph_utils import op_args
from tests.passes.modules import canonical_graph, canonical_mla, paged_reexport, seqs
from tests.passes.template import PassTemplate, paged_args, pipeline, run_one
from tests.passes.test_fuse_rope_into_indexer_query import IndexedMLA

NAME = "fuse_index_weights_into_q_norm"


def _changed(n):
    """Per tiny model: n indexed layers' f32_linear gone, a getitem of each fused op's weights in its place."""
    return {"fxglm5.f32_linear": -n, "getitem": n}


class QNormIndexedMLA(IndexedMLA):
    """IndexedMLA on GLM-5's query path: the attention's and the indexer's queries projected from an RMS-normed query
    latent, the head weights ``linear(x.float(), W) * hi ** -0.5 * 0.125`` of a float32 W (fuse_f32_linear's
    pattern). Near misses (``weights``): "biased", a linear with a bias (an aten linear, no f32_linear); "cycle", the
    weights' GEMV reads the normed query latent."""

    def __init__(self, weights=None, **options):
        super().__init__(q_norm=True, **options)
        hi, di = self.indexer_shape
        width = self.emb.embedding_dim
        self.q_i = nn.Linear(width, hi * di)
        self.w_f32 = nn.Parameter(torch.randn(hi, width) * 0.3)
        self.w_bias = nn.Parameter(torch.randn(hi) * 0.1) if weights == "biased" else None
        self.weights = weights

    def forward(self, input_ids, position_ids):
        b, s = input_ids.shape
        h, dn, dr = self.shape
        hi, di = self.indexer_shape
        x = self.emb(input_ids) + 0.1 * position_ids[..., None].float()
        angles = position_ids[..., None].float() * torch.linspace(1.0, 0.01, dr // 2)
        cos, sin = angles.cos(), angles.sin()
        rope = torch.ops.fxglm5.rope_interleaved
        q_latent = torch.ops.fxglm5.rms_norm(self.q_a(x), self.q_a_norm, 1e-6)
        q_nope, q_pe = self.q_b(q_latent).view(b, s, h, dn + dr).split([dn, dr], dim=-1)
        q_pe = rope(q_pe, cos, sin)
        k_pe = rope(self.k_pe(x).view(b, s, 1, dr), cos, sin).squeeze(2)
        kv_c = torch.ops.fxglm5.rms_norm(self.kv_c(x), self.kv_norm, 1e-6)
        q_i = rope(self.q_i(q_latent).view(b, s, hi, di), cos, sin)
        k_i = rope(self.k_norm(self.k_i(x)).view(b, s, 1, di), cos, sin).view(b, s, di)
        source = q_latent if self.weights == "cycle" else x
        weights = F.linear(source.float(), self.w_f32, self.w_bias) * hi ** -0.5 * 0.125
        top = torch.ops.fxglm5.indexer_topk(q_i, k_i, weights, 3)
        return torch.ops.fxglm5.sparse_mla(q_nope, q_pe, kv_c, k_pe, self.w_uk, self.w_uv, top, 0.3).reshape(b, s, -1)


def _read_twice(gm):
    """The graph's f32_linear of the head weights also read by the output (their row sums added to it): fuse_f32_linear
    leaves weights with another reader an aten linear, so the second reader is added to its f32_linear afterwards."""
    linear = next(n for n in gm.graph.nodes if n.target is torch.ops.fxglm5.f32_linear.default)
    selected = gm.graph.output_node().args[0]  # the kept rows of the attention's output
    out = selected.args[0]
    with gm.graph.inserting_before(selected):
        total = gm.graph.call_function(torch.ops.aten.sum.dim_IntList, (linear, [-1], True))
        both = gm.graph.call_function(torch.ops.aten.add.Tensor, (out, total))
    selected.args = (both, *selected.args[1:])
    gm.recompile()
    return gm


class TestFuseIndexWeightsIntoQNorm(PassTemplate):
    name = NAME
    matches = {"fp8": 4, "shared": 2, "bf16": 4, "bf16ckpt": 4}  # the layers with an indexer of their own
    ops = {"fp8": _changed(4), "shared": _changed(2), "bf16": _changed(4), "bf16ckpt": _changed(4)}
    near_misses = ("read_twice", "biased", "cycle")

    def near_miss(self, case):
        """The variants of :class:`QNormIndexedMLA`, and "read_twice": its plain graph's head weights also read by
        the output."""
        if case == "read_twice":
            gm = _read_twice(canonical_graph(self.name, canonical_mla(QNormIndexedMLA)))
        else:
            gm = canonical_graph(self.name, canonical_mla(QNormIndexedMLA, weights=case))
        return gm, copy.deepcopy(gm), paged_args(gm, seqs([6, 3]), torch.float32), None

    def reexport(self):
        return paged_reexport(self.name, canonical_mla(QNormIndexedMLA))


def _fused(gm):
    return [n for n in gm.graph.nodes if n.target is torch.ops.fxglm5.rms_norm_write_caches.default]


def test_the_small_module_fuses_its_weights():
    """The near misses differ from a module whose one indexer's weights fold only by what makes them near misses (the
    small module's norm and cache writes are one op before this pass in each of them)."""
    gm = canonical_graph(NAME, canonical_mla(QNormIndexedMLA))
    assert len(_fused(gm)) == 1 and run_one(gm, NAME).num_matches == 1
    for case in ("biased", "cycle"):
        assert len(_fused(canonical_graph(NAME, canonical_mla(QNormIndexedMLA, weights=case)))) == 1


def test_each_indexed_layer_takes_its_weights():
    """The ops of the layers with their own indexer (all 4 of the fp8 model's, layers 0 and 2 of the shared model's)
    compute the weights that indexer reads, from the GEMV's input, weight and scales; no f32_linear is left (the
    routers' are in moe_router); each op runs before every reader of its outputs."""
    for name, indexed in (("fp8", [True] * 4), ("shared", [True, False, True, False])):
        run = pipeline(name)
        before, gm = run.before[NAME], run.after[NAME]
        gemvs = [op_args(n) for n in before.graph.nodes if n.target is torch.ops.fxglm5.f32_linear.default]
        fused = _fused(gm)
        assert [op_args(n)["weights_proj"] is not None for n in fused] == indexed
        taken = [op_args(n) for n in fused if op_args(n)["weights_proj"] is not None]
        assert [(a["weights_x"].name, a["weights_proj"].name, a["weights_scales"]) for a in taken] == \
            [(g["x"].name, g["weight"].name, g["scales"]) for g in gemvs]
        assert not any(n.target is torch.ops.fxglm5.f32_linear.default for n in gm.graph.nodes)
        indexers = [n for n in gm.graph.nodes if n.target is torch.ops.fxglm5.rtp_indexer.default]
        assert [op_args(n)["weights"].args for n in indexers] == [(n, 1) for n in fused if op_args(n)["weights_proj"]
                                                                  is not None]
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        for node in fused:
            readers = [r for item in node.users for r in item.users]
            assert order[node] < min(order[item] for item in node.users) < min(order[r] for r in readers)


def test_an_input_after_the_op_moves_it_before_its_readers():
    """Layer 0's GEMV reads a copy of its input placed after the layer's op (and before the readers of its normed
    latent): the op is placed after that copy and the normed latent's readers in between move after it, in their
    order, so the graph stays valid and computes what it did; the other layers fuse in place."""
    run = pipeline("fp8")
    gm = copy.deepcopy(run.before[NAME])
    first = _fused(gm)[0]
    gemv = next(n for n in gm.graph.nodes if n.target is torch.ops.fxglm5.f32_linear.default)
    normed = next(iter(first.users))
    reader = next(iter(normed.users))  # the q_b GEMM
    with gm.graph.inserting_before(reader):
        late = gm.graph.call_function(torch.ops.aten.clone.default, (gemv.args[0],))
    late.meta["val"] = gemv.args[0].meta.get("val")
    gemv.args = (late, *gemv.args[1:])
    late.append(gemv)  # the GEMV after its input
    gm.graph.lint()
    gm.recompile()
    reference = copy.deepcopy(gm)
    ctx = PassContext(config=run.config, extras={"paged": True})
    result = PassManager(ctx, stages=("fuse_kernels",)).run_one(gm, REGISTRY[NAME])
    assert (result.num_matches, result.expected) == (4, 4)
    gm.graph.lint()
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    moved = _fused(gm)[0]
    assert op_args(moved)["weights_x"] is late and order[late] < order[moved]
    assert order[moved] < min(order[r] for item in moved.users for r in item.users)
    assert torch.equal(run.outputs(gm), run.outputs(reference))


def test_not_paged_expects_none():
    """Without the cache stage there is no fused op to take the weights: the pass expects 0 (and None where the
    context does not say)."""
    cfg = pipeline("fp8").config
    assert REGISTRY[NAME].expected(PassContext(config=cfg, extras={"paged": False})) == 0
    assert REGISTRY[NAME].expected(PassContext(config=cfg)) is None
