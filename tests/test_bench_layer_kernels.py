"""bench/layer_kernels.split_layers: one decoder layer of each kind, in order, out of a step's kernel sequence."""

import random

from bench.layer_kernels import split_layers

ATTENTION = ["add_rms_norm", "fp8_gemm_qkv", "norm_rope_write", "fp8_gemm_qb", "indexer_logits", "topk", "mla",
             "fp8_gemm_o"]
DENSE = ATTENTION + ["add_rms_norm", "fp8_gemm_gate_up", "silu_mul_down"]
MOE = ATTENTION + ["add_rms_norm", "f32_linear", "moe_route", "moe_align", "moe_gemm", "moe_gemm", "combine",
                   "fp8_gemm_shared"]


def step(prologue, dense, moe, epilogue, noise=0.0, seed=0):
    rng = random.Random(seed)
    names = prologue + DENSE * dense + MOE * moe + epilogue
    return [(n, 10.0 + i % 7 + rng.uniform(-noise, noise)) for i, n in enumerate(names)]


def test_each_kind_is_one_window_from_where_the_first_layer_begins():
    s = step(["embedding", "fill"], 3, 5, ["rms_norm", "fp8_gemm_lm_head", "argmax"])
    out = split_layers(s, 3, 5)
    assert out["prologue"] == 2 and out["epilogue"] == 3
    assert [k["kernel"] for k in out["dense"]] == DENSE
    assert [k["kernel"] for k in out["moe"]] == MOE
    first = 2 + 3 * len(DENSE)
    for j, k in enumerate(out["moe"]):  # each kernel's time is its mean over the kind's layers
        assert abs(k["us"] - sum(s[first + i * len(MOE) + j][1] for i in range(5)) / 5) < 0.01


def test_an_epilogue_that_begins_like_a_layer_does_not_shift_the_windows():
    out = split_layers(step(["embedding"], 3, 6, ["add_rms_norm", "fp8_gemm_lm_head"]), 3, 6)
    assert [k["kernel"] for k in out["moe"]] == MOE and out["epilogue"] == 2


def test_moe_only_and_no_structure():
    assert [k["kernel"] for k in split_layers(step([], 0, 4, ["lm_head"]), 0, 4)["moe"]] == MOE
    broken = step(["embedding"], 3, 5, ["lm_head"])
    broken[40] = ("an_extra_kernel", 1.0)  # one MoE layer launches something the others do not
    assert split_layers(broken, 3, 5) is None
