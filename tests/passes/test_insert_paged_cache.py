"""insert_paged_cache: every canonical attention op becomes its cached RTP op, the caches and the forward context
become graph inputs in the documented order, and the rewritten graph computes what the canonical graph computes
(flat tokens of several requests against the paged cache vs. each request alone): tests/passes/template.py's
checks, with the signature, the shared-indexer layers and a dense MLA."""

import copy

import torch

from fxglm5.passes import PassContext, op_histogram, run_pipeline
from fxglm5.program import PagedSignature
from tests.passes.modules import CanonicalMLA, canonical_graph, canonical_mla, seqs
from tests.passes.template import (
    PassTemplate, assert_same_output, export_small, paged_args, paged_dims, pipeline, run_one,
)

CANONICAL_ATTENTION = ("fxglm5.sparse_mla", "fxglm5.mla", "fxglm5.indexer_topk")


def _paged_ops(layers: int, indexers: int) -> dict[str, int]:
    """Each attention op and each indexer swapped for its cached op, one reshape of the positions to the flat
    tokens and one index_select of the kept rows at the output."""
    return {"aten.index_select": 1, "aten.reshape": 1, "fxglm5.indexer_topk": -indexers,
            "fxglm5.rtp_indexer": indexers, "fxglm5.rtp_sparse_mla": layers, "fxglm5.sparse_mla": -layers}


def placeholders(gm):
    return [n.name for n in gm.graph.nodes if n.op == "placeholder"]


class ExtraInput(CanonicalMLA):
    """Near miss: canonical attention in a graph whose inputs are not the model's (input_ids, position_ids): a third
    input scales the output. The paged signature would drop it, so the graph must stay as it is."""

    def forward(self, input_ids, position_ids, gain):
        return super().forward(input_ids, position_ids) * gain


class TestInsertPagedCache(PassTemplate):
    name = "insert_paged_cache"
    matches = {"fp8": 4, "shared": 4, "bf16": 4}
    ops = {"fp8": _paged_ops(4, 4), "shared": _paged_ops(4, 2)}
    near_misses = ("extra_input",)

    def near_miss(self, case):
        module = canonical_mla(ExtraInput)
        ids = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(0))
        args = (ids, torch.arange(5)[None].expand(2, 5), torch.rand(2, 5, 1))
        return export_small(module, args), module, args, None

    def reexport(self):
        gm = canonical_graph("insert_paged_cache")
        graph_after = copy.deepcopy(gm)
        run_one(graph_after, self.name)
        example, other = paged_args(graph_after, seqs([6, 3]), torch.float32), \
            paged_args(graph_after, seqs([5, 4, 2], 1), torch.float32, rows=torch.tensor([4, 8, 10]))
        return gm, example, paged_dims(graph_after), other, None


def test_tiny_model_details_signature_and_what_is_left():
    run = pipeline("fp8")
    assert run.results["insert_paged_cache"].details == {"indexers": 4}
    gm = run.after["insert_paged_cache"]
    caches = [f"{kind}_cache_{i}" for i in range(4) for kind in ("kv", "index")]
    assert placeholders(gm) == ["input_ids", "position_ids", "slot_mapping", "block_table", "req_idx",
                                "logits_indices", *caches]
    assert gm.meta["paged_cache"].cache_names == caches
    # the whole cache stage: 4 norms per layer + the final one, less the 4 folded kv norms; no RoPE left
    ops = op_histogram(run.after["fuse_rope_into_indexer_query"])
    assert not any(op in ops for op in CANONICAL_ATTENTION)
    assert ops["fxglm5.rtp_sparse_mla"] == 4 and ops["fxglm5.rtp_indexer"] == 4 and "fxglm5.rtp_mla" not in ops
    assert ops["fxglm5.rms_norm"] == 13 and "fxglm5.rope_interleaved" not in ops and "aten.layer_norm" not in ops
    again = copy.deepcopy(run.after["fuse_rope_into_indexer_query"])
    assert run_pipeline(again, PassContext(config=run.config), stages=("cache",))[0].num_matches == 0  # nothing left


def test_shared_indexer_layers_get_no_index_cache():
    gm = pipeline("shared").after["insert_paged_cache"]  # indexer_types full, shared, full, shared
    assert gm.meta["paged_cache"] == PagedSignature((("kv_cache_0", "index_cache_0"), ("kv_cache_1", None),
                                                     ("kv_cache_2", "index_cache_2"), ("kv_cache_3", None)))
    ops = op_histogram(gm)
    assert ops["fxglm5.rtp_sparse_mla"] == 4 and ops["fxglm5.rtp_indexer"] == 2
    assert not any(op in ops for op in CANONICAL_ATTENTION)


def test_dense_mla_becomes_rtp_mla():
    model = canonical_mla()
    gm = canonical_graph("insert_paged_cache", model)
    result, selected, folded, query = run_pipeline(gm, PassContext(), stages=("cache",))
    assert selected.num_matches == 0  # the module ends in a reshape, not a row-wise op: selected at the output
    assert result.num_matches == 1 and result.details == {"indexers": 0}
    assert folded.num_matches == 1 and folded.details == {"norms": 1, "ropes": 2}
    assert query.num_matches == 0  # no indexer
    ops = op_histogram(gm)
    assert ops.get("fxglm5.rtp_mla") == 1 and "fxglm5.mla" not in ops
    assert "fxglm5.rms_norm" not in ops and "fxglm5.rope_interleaved" not in ops
    assert placeholders(gm)[-1] == "kv_cache_0"
    requests = seqs([6, 3], 1)
    out = gm(*paged_args(gm, requests, torch.float32))[0]
    ref = torch.cat([model(seq[None], torch.arange(len(seq))[None])[0] for seq in requests])
    assert_same_output(out, ref, 1e-5)
