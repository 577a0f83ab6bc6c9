"""select_sampled_rows: the final norm and the lm_head run on the rows logits_indices keeps only
(tests/passes/template.py's checks, with the kept rows' values and the selection's new place)."""

import copy

import torch

from fxglm5.passes.graph_utils import aten, op_args
from tests.passes.modules import CanonicalMLA, canonical_graph, canonical_mla, paged_reexport, seqs
from tests.passes.template import PassTemplate, paged_args, pipeline, requests


class TokenMixingHead(CanonicalMLA):
    """Near miss: the logits of each token summed over the tokens before it (a cumulative sum on the token axis):
    row r depends on rows 0..r, so the kept rows may not be selected before it."""

    def forward(self, input_ids, position_ids):
        return super().forward(input_ids, position_ids).cumsum(1)


class TestSelectSampledRows(PassTemplate):
    name = "select_sampled_rows"
    matches = {"fp8": 1, "shared": 1, "bf16": 1}  # the one output
    ops = {"fp8": {}, "shared": {}}  # the index_select moves up, nothing else changes
    near_misses = ("token_mixing",)

    def near_miss(self, case):
        gm = canonical_graph(self.name, canonical_mla(TokenMixingHead, head=True))
        reference = copy.deepcopy(gm)
        return gm, reference, paged_args(gm, seqs([6, 3]), torch.float32, rows=torch.tensor([5, 8])), None

    def reexport(self):
        return paged_reexport(self.name, canonical_mla(head=True))


def test_selection_moves_above_the_final_norm_and_the_lm_head():
    run = pipeline("fp8")
    assert run.results["select_sampled_rows"].details == {"ops_moved": 2}
    gm = run.after["select_sampled_rows"]
    (select,) = [n for n in gm.graph.nodes if n.target is aten.index_select.default]
    (norm,) = select.users
    assert norm.target is torch.ops.fxglm5.rms_norm.default and op_args(norm)["x"] is select
    (head,) = norm.users
    assert head.target is aten.linear.default and [n.op for n in head.users] == ["output"]


def test_kept_rows_equal_the_same_rows_of_every_token():
    """Each request's last token (the step again: the same cache rows) gives 3 logits rows, those of every token."""
    run = pipeline("fp8")
    gm = run.after["select_sampled_rows"]
    seqs = requests(run.config)
    every = run.outputs(gm)
    last = torch.tensor([10, 14, 21])
    kept = gm(*paged_args(gm, seqs, torch.float32, rows=last))
    assert kept.shape == (1, 3, run.config.vocab_size)
    torch.testing.assert_close(kept[0], every[last], rtol=1e-5, atol=1e-5 * every.abs().max().item())
