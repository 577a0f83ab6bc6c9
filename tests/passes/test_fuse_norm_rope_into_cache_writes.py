"""fuse_norm_rope_into_cache_writes: the kv RMSNorm, the q / k RoPE and the indexer key's LayerNorm + RoPE computed
inside the cache writes (tests/passes/template.py's checks, with what was folded)."""

import copy

import torch

from tests.passes.modules import canonical_graph, canonical_mla, paged_reexport, seqs
from tests.passes.template import PassTemplate, paged_args, pipeline


def _folded_ops(layers: int, indexers: int) -> dict[str, int]:
    """Per layer the kv norm and the q / k RoPE folded into the attention op; per indexer its key's LayerNorm and
    RoPE (between two views) into rtp_indexer."""
    return {"aten.layer_norm": -indexers, "aten.view": -2 * indexers, "fxglm5.rms_norm": -layers,
            "fxglm5.rope_interleaved": -2 * layers - indexers}


class TestFuseNormRopeIntoCacheWrites(PassTemplate):
    name = "fuse_norm_rope_into_cache_writes"
    matches = {"fp8": 8, "shared": 6, "bf16": 8}  # the 4 attention ops and the indexers
    ops = {"fp8": _folded_ops(4, 4), "shared": _folded_ops(4, 2)}
    near_misses = ("unfoldable",)

    def near_miss(self, case):
        gm = canonical_graph(self.name, canonical_mla(variant=case))
        return gm, copy.deepcopy(gm), paged_args(gm, seqs([6, 3]), torch.float32), None

    def reexport(self):
        return paged_reexport(self.name)


def test_what_is_folded():
    assert pipeline("fp8").results["fuse_norm_rope_into_cache_writes"].details == {"norms": 8, "ropes": 12}
    assert pipeline("shared").results["fuse_norm_rope_into_cache_writes"].details == {"norms": 6, "ropes": 10}
