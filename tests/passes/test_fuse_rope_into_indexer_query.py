"""fuse_rope_into_indexer_query: the indexer query's RoPE computed inside rtp_indexer's selection
(tests/passes/template.py's checks, on the tiny models and on a small module with an indexer, and its near misses)."""

import copy

import torch
from torch import nn

from fxglm5.passes.graph_utils import op_args
from tests.passes.modules import CanonicalMLA, canonical_graph, canonical_mla, paged_reexport, seqs
from tests.passes.template import PassTemplate, paged_args, pipeline, run_one


class IndexedMLA(CanonicalMLA):
    """CanonicalMLA selecting its keys by a DSA indexer of ``hi`` heads of width ``di``, whose query and key turn their
    first dr features by the attention's tables (GLM-5's layout). Near misses: ``"read_twice"``, the rotated query
    also feeds the output; ``"other_angles"``, the query turns by other tables than the key."""

    def __init__(self, variant=None, hi=2, di=32, **options):
        super().__init__(**options)
        width, self.indexer_variant, self.indexer_shape = self.emb.embedding_dim, variant, (hi, di)
        self.q_i, self.k_i, self.w_i = nn.Linear(width, hi * di), nn.Linear(width, di), nn.Linear(width, hi)
        self.k_norm = nn.LayerNorm(di)
        self.k_norm.weight.data.uniform_(0.5, 1.5)
        self.k_norm.bias.data.normal_(0.0, 0.1)

    def forward(self, input_ids, position_ids):
        b, s = input_ids.shape
        h, dn, dr = self.shape
        hi, di = self.indexer_shape
        x = self.emb(input_ids) + 0.1 * position_ids[..., None].float()
        angles = position_ids[..., None].float() * torch.linspace(1.0, 0.01, dr // 2)
        cos, sin = angles.cos(), angles.sin()
        q_cos, q_sin = ((3 * angles).cos(), (3 * angles).sin()) if self.indexer_variant == "other_angles" else (cos, sin)
        rope = torch.ops.fxglm5.rope_interleaved
        q_pe = rope(self.q_pe(x).view(b, s, h, dr), cos, sin)
        k_pe = rope(self.k_pe(x).view(b, s, 1, dr), cos, sin).squeeze(2)
        kv_c = torch.ops.fxglm5.rms_norm(self.kv_c(x), self.kv_norm, 1e-6)
        q_i = rope(self.q_i(x).view(b, s, hi, di), q_cos, q_sin)
        k_i = rope(self.k_norm(self.k_i(x)).view(b, s, 1, di), cos, sin).view(b, s, di)
        top = torch.ops.fxglm5.indexer_topk(q_i, k_i, self.w_i(x), 3)
        out = torch.ops.fxglm5.sparse_mla(self.q_nope(x).view(b, s, h, dn), q_pe, kv_c, k_pe, self.w_uk, self.w_uv, top,
                                          0.3).reshape(b, s, -1)
        if self.indexer_variant == "read_twice":
            out = out + q_i.reshape(b, s, -1)[..., : out.shape[-1]]
        return out


class TestFuseRopeIntoIndexerQuery(PassTemplate):
    name = "fuse_rope_into_indexer_query"
    matches = {"fp8": 4, "shared": 2, "bf16": 4}  # the layers with an indexer of their own
    ops = {"fp8": {"fxglm5.rope_interleaved": -4}, "shared": {"fxglm5.rope_interleaved": -2}}
    near_misses = ("read_twice", "other_angles")

    def near_miss(self, case):
        gm = canonical_graph(self.name, canonical_mla(IndexedMLA, variant=case))
        return gm, copy.deepcopy(gm), paged_args(gm, seqs([6, 3]), torch.float32), None

    def reexport(self):
        return paged_reexport(self.name, canonical_mla(IndexedMLA))


def test_every_rope_of_the_tiny_models_is_folded():
    """After the cache stage no RoPE runs on its own: the MLA query's and key's, the indexer key's and now the indexer
    query's are inside the attention ops, every rtp_indexer rotating its query."""
    for name in ("fp8", "shared"):
        gm = pipeline(name).after["fuse_rope_into_indexer_query"]
        indexers = [n for n in gm.graph.nodes if n.target is torch.ops.fxglm5.rtp_indexer.default]
        assert indexers and all(op_args(n)["rope_q"] is True for n in indexers)
        assert not any(n.target is torch.ops.fxglm5.rope_interleaved.default for n in gm.graph.nodes)


def test_the_small_module_folds_its_indexer():
    """The near misses differ from a module whose one indexer query folds only by what makes them near misses."""
    gm = canonical_graph("fuse_rope_into_indexer_query", canonical_mla(IndexedMLA))
    assert run_one(gm, "fuse_rope_into_indexer_query").num_matches == 1
