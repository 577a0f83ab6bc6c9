"""match_mla: causal MLA -> fxglm5::mla with W_UK / W_UV absorbed from kv_b_proj (tests/passes/template.py's checks,
and hypothesis properties over random shapes; near misses: another softmax scale, a score bias, no causal mask)."""

import math

from hypothesis import given
from hypothesis import strategies as st

from fxglm5.model.config import Glm5Config
from tests.passes.modules import MLA_EXAMPLE, assert_leaves_dense_mla, dense_mla, exporting, mla_inputs, mla_shapes, tol
from tests.passes.template import PassTemplate, assert_same_output, export_small, run_small, small_dims


class TestMatchMla(PassTemplate):
    name = "match_mla"
    # GLM-5's attention is sparse in every layer: match_sparse_mla took it all, nothing dense is left
    matches = {"fp8": 0, "shared": 0, "bf16": 0}
    ops = {"fp8": {}, "shared": {}}
    numerics = ("fp8",)
    near_misses = ("scale", "bias", "nomask")

    def near_miss(self, case):
        module = dense_mla(MLA_EXAMPLE, case)
        return export_small(module, mla_inputs(MLA_EXAMPLE)), module, mla_inputs({**MLA_EXAMPLE, "seq": 11}, 1), None

    def reexport(self):
        example = mla_inputs(MLA_EXAMPLE)
        return export_small(dense_mla(MLA_EXAMPLE), example), example, small_dims(example), \
            mla_inputs({**MLA_EXAMPLE, "batch": 3, "seq": 11}, 1), None


@exporting
@given(mla_shapes)
def test_match_mla_property(p):
    module = dense_mla(p)
    args = mla_inputs(p)
    gm, result = run_small("match_mla", module, args)
    ops = result.ops_after
    assert result.num_matches == 1
    assert ops.get("fxglm5.mla") == 1 and "aten.softmax" not in ops and "aten.matmul" not in ops
    assert_same_output(gm(*args), module(*args), tol(p["dtype"]))


@exporting
@given(mla_shapes, st.sampled_from(["scale", "bias", "nomask"]))
def test_match_mla_leaves_near_misses(p, variant):
    assert_leaves_dense_mla("match_mla", p, variant)


def test_expected_scale_is_the_models():
    assert math.isclose(Glm5Config.preset("glm5").softmax_scale, 1 / 16)
