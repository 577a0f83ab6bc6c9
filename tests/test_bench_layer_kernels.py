"""bench/layer_kernels.split_layers: one decoder layer of each kind, in order, out of a step's kernel sequence (the
real run's structure: the first layer's input norm without the residual add; the real sequence of the tiny model is
split in tests/multirank/test_fake_group.py)."""

import random

from bench.layer_kernels import split_layers

ATTENTION = ["fp8_gemm_qkv", "rms_norm_q", "norm_rope_write", "fp8_gemm_qb", "indexer_logits", "topk", "mla",
             "fp8_gemm_o", "add_rms_norm"]
DENSE = ["add_rms_norm"] + ATTENTION + ["fp8_gemm_gate_up", "silu_mul_down"]
MOE = ["add_rms_norm"] + ATTENTION + ["f32_linear", "moe_route", "moe_gemm", "moe_gemm", "combine_add"]


def step(prologue, dense, moe, epilogue, noise=0.0, seed=0):
    rng = random.Random(seed)
    layers = [DENSE] * dense + [MOE] * moe
    layers[0] = ["rms_norm"] + layers[0][1:]  # the first layer's input norm has no residual to add
    names = prologue + [k for layer in layers for k in layer] + epilogue
    return [(n, 10.0 + i % 7 + rng.uniform(-noise, noise)) for i, n in enumerate(names)]


def test_each_kind_is_one_window_from_its_input_norm():
    s = step(["embedding", "fill"], 3, 5, ["add_rms_norm", "fp8_gemm_lm_head", "argmax"])
    out = split_layers(s, 3, 5)
    assert out["prologue"] == 2 and out["epilogue"] == 3
    assert [k["kernel"] for k in out["dense"]] == DENSE
    assert [k["kernel"] for k in out["moe"]] == MOE
    first = 2 + 3 * len(DENSE)
    for j, k in enumerate(out["moe"]):  # each kernel's time is its mean over the kind's layers
        assert abs(k["us"] - sum(s[first + i * len(MOE) + j][1] for i in range(5)) / 5) < 0.01
    for j, k in enumerate(out["dense"]):  # the first layer left out: its norm is another kernel
        assert abs(k["us"] - sum(s[2 + i * len(DENSE) + j][1] for i in (1, 2)) / 2) < 0.01


def test_a_single_dense_layer_is_the_first_layer():
    out = split_layers(step(["embedding"], 1, 3, ["add_rms_norm", "lm_head"]), 1, 3)
    assert [k["kernel"] for k in out["dense"]] == ["rms_norm"] + DENSE[1:]
    assert [k["kernel"] for k in out["moe"]] == MOE and out["epilogue"] == 2


def test_moe_only_and_no_structure():
    assert [k["kernel"] for k in split_layers(step(["embedding"], 0, 4, ["lm_head"]), 0, 4)["moe"]] == MOE
    broken = step(["embedding"], 3, 5, ["lm_head"])
    broken[60] = ("an_extra_kernel", 1.0)  # one MoE layer launches something the others do not
    assert split_layers(broken, 3, 5) is None
    assert split_layers([("a", 1.0), ("b", 1.0)], 1, 1) is None  # no kernel once a layer


def test_input_norms_inside_the_attention_gemm():
    """With fuse_add_rms_norm_into_gemm a layer's input norm runs inside its first GEMM (no kernel of its own), and so
    does a dense layer's MLP norm; a MoE layer's MLP norm still launches. Each layer then begins with that GEMM, as far
    from its anchor as the first layer's own norm-less GEMM: the windows are the layers, not shifted to the MoE's
    norm (the last add-norm before each anchor) nor lost where a dense layer has none."""
    attention = ["fp8_gemm_qkv_normed"] + ATTENTION[1:-1]
    dense = attention + ["fp8_gemm_gate_up_normed", "silu_mul_down"]
    moe = attention + ["add_rms_norm", "f32_linear", "moe_route", "moe_gemm", "moe_gemm", "combine_add"]
    layers = [["rms_norm", "fp8_gemm_qkv"] + dense[1:]] + [dense] * 2 + [moe] * 5
    s = [(n, 1.0) for n in ["embedding", *(k for layer in layers for k in layer), "rms_norm", "lm_head"]]
    out = split_layers(s, 3, 5)
    assert [k["kernel"] for k in out["dense"]] == dense and [k["kernel"] for k in out["moe"]] == moe
    assert out["prologue"] == 1 and out["epilogue"] == 2
