"""Mapping.check refuses, by config field, every layout that does not give each rank whole heads / experts /
vocabulary rows and whole 128-blocks of every FP8 weight it splits, before anything is captured or read; the
expert layouts (ep groups of tp/ep ranks, ep == 1 and ep == tp their extremes); Slice and the group registry."""

import pytest
import torch

import fxglm5.compiler
from fxglm5.capture.by_kind import truncated_config
from fxglm5.compiler import compile_model
from fxglm5.errors import InputError
from fxglm5.model.config import Glm5Config
from fxglm5.model.modeling import Glm5ForCausalLM
from fxglm5.parallel import Mapping, Slice, nested, register_group, resolve_group

GLM5 = Glm5Config.preset("glm5")


@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16])
def test_glm5_splits_over_one_host_and_two(tp):
    """TP16 also aligns: 4 heads per rank give kv_b_proj 4 x 448 = 1792 rows = 14 blocks (a head's 448 rows are
    3.5 blocks, so only a single head per rank, TP64, misaligns)."""
    for rank in {0, tp - 1}:
        Mapping(tp=tp, rank=rank, ep=tp).check(GLM5)
        Mapping(tp=tp, rank=rank, ep=1).check(GLM5)


@pytest.mark.parametrize("mapping, config, named", [
    (Mapping(tp=3), GLM5, ["num_attention_heads = 64 is not divisible by tp=3",
                           "moe_intermediate_size x n_shared_experts"]),
    (Mapping(tp=3, ep=3), GLM5, ["n_routed_experts = 256 is not divisible by ep=3"]),
    (Mapping(tp=64, ep=64), GLM5, ["kv_b_proj rows: x qk_nope_head_dim + v_head_dim) = 64 gives each rank 448",
                                   "intermediate_size = 12288 gives each rank 192",
                                   "(the shared expert) = 2048 gives each rank 32"]),
    (Mapping(tp=32, ep=1), GLM5, ["moe_intermediate_size (each expert split along it over its group's tp/ep ranks, "
                                  "ep=1) = 2048 gives each rank 64"]),
    (Mapping(tp=8, ep=2), GLM5.replace(moe_intermediate_size=1280, n_shared_experts=2),
     ["(each expert split along it over its group's tp/ep ranks, ep=2) = 1280 gives each rank 320"]),
    (Mapping(tp=8, ep=2), GLM5.replace(moe_intermediate_size=2050, n_shared_experts=4),
     ["(each expert split along it over its group's tp/ep ranks, ep=2) = 2050 is not divisible by tp/ep=4"]),
    (Mapping(tp=8, ep=2), GLM5.replace(n_routed_experts=255), ["n_routed_experts = 255 is not divisible by ep=2"]),
    (Mapping(tp=2), Glm5Config.preset("tiny"), ["q_b_proj rows: x qk_nope_head_dim + qk_rope_head_dim) = 4 gives "
                                                "each rank 192"]),
    (Mapping(tp=8, ep=8), Glm5Config.preset("tiny-tp"), ["kv_b_proj rows", "each rank 192"]),
    (Mapping(tp=2), GLM5.replace(n_group=8, topk_group=4), ["n_group = 8: group-limited routing"]),
])
def test_misfits_are_refused_by_field(mapping, config, named):
    with pytest.raises(InputError, match="does not split over") as err:
        mapping.check(config)
    for text in named:
        assert text in str(err.value)


@pytest.mark.parametrize("mapping, named", [
    (Mapping(tp=8, ep=3), r"ep must divide tp=8 \(ep groups of tp/ep ranks.*got ep=3"),
    (Mapping(tp=4, ep=8), r"ep must divide tp=4 .*got ep=8"),
    (Mapping(tp=4, ep=0), r"ep must divide tp=4 .*got ep=0"),
    (Mapping(tp=8, rank=8, ep=8), r"rank must be in \[0, tp=8\), got 8"),
    (Mapping(tp=0), "tp must be >= 1"),
    (Mapping(tp=2, group=""), "group must be a process group's name"),
])
def test_bad_mappings_are_refused(mapping, named):
    with pytest.raises(InputError, match=named):
        mapping.check(GLM5)


def test_tiny_tp_preset_splits_over_two_and_four():
    for tp in (2, 4):
        for ep in (1, tp):
            Mapping(tp=tp, rank=tp - 1, ep=ep).check(Glm5Config.preset("tiny-tp"))


@pytest.mark.parametrize("ep", [1, 2, 4, 8])
def test_expert_groups_hold_consecutive_experts_split_over_their_ranks(ep):
    """TP8: group g = rank // (8/ep) holds experts [g 256/ep, (g+1) 256/ep), each split 8/ep ways in rank order; the
    ranks' parts cover every (expert, row) once. ep=8: 32 whole experts a rank; ep=1: 1/8 of every expert."""
    Mapping(tp=8, ep=ep).check(GLM5)
    held = torch.zeros(256, 2048, dtype=torch.int32)
    for rank in range(8):
        m = Mapping(tp=8, rank=rank, ep=ep)
        (e0, e1), (i0, i1) = m.expert_part(256), m.expert_inner_part(2048)
        group, place = divmod(rank, 8 // ep)
        assert (e0, e1) == (group * 256 // ep, (group + 1) * 256 // ep), rank
        assert (i0, i1) == (place * 2048 * ep // 8, (place + 1) * 2048 * ep // 8), rank
        held[e0:e1, i0:i1] += 1
    assert (held == 1).all()
    if ep == 1:
        assert [Mapping(tp=8, rank=r, ep=1).expert_inner_part(2048) for r in range(8)] == \
            [Mapping(tp=8, rank=r).part(2048) for r in range(8)]


def test_compile_refuses_before_capturing(monkeypatch):
    def capture(*args, **kwargs):
        raise AssertionError("captured")

    monkeypatch.setattr(fxglm5.compiler, "_capture", capture)
    with pytest.raises(InputError, match="num_attention_heads = 64 is not divisible by tp=3"):
        compile_model(Glm5ForCausalLM(truncated_config(GLM5, 4), device="meta"), mapping=Mapping(tp=3))


def test_slice_narrows_and_halves_narrow_each_half():
    full = torch.arange(2 * 8 * 3).reshape(2, 8, 3)
    assert torch.equal(Slice(1, 2, 4).apply(full), full[:, 2:4])
    gate, up = full[:, :4], full[:, 4:]
    assert torch.equal(Slice(1, 1, 3, halves=True).apply(full), torch.cat([gate[:, 1:3], up[:, 1:3]], 1))
    assert Slice(0, 0, 1).apply(torch.empty(4, 2, device="meta")).shape == (1, 2)


def test_a_nested_slice_narrows_experts_then_each_expert_rows():
    """The mixed layout's part: experts [1, 2) of 2, then rows 1..2 of each half (gate, up) of each of them."""
    full = torch.arange(2 * 8 * 3).reshape(2, 8, 3)
    part = nested(Slice(0, 1, 2), None, Slice(1, 1, 3, halves=True))
    assert part == Slice(0, 1, 2, inner=Slice(1, 1, 3, halves=True))
    assert part.levels() == (Slice(0, 1, 2), Slice(1, 1, 3, halves=True))
    assert torch.equal(part.apply(full), torch.cat([full[1:2, 1:3], full[1:2, 5:7]], 1))
    assert nested(None, Slice(2, 0, 1)) == Slice(2, 0, 1) and nested(None) is None
    assert repr(Slice(0, 1, 2)) == "Slice(dim=0, start=1, stop=2, halves=False, padded=False)"  # as before inner
    assert repr(part).endswith(", inner=Slice(dim=1, start=1, stop=3, halves=True, padded=False))")


def test_groups_resolve_by_name():
    assert resolve_group("tp") is None  # no torch.distributed in this process: a single rank
    marker = object()
    register_group("rtp_tp", marker)
    try:
        assert resolve_group("rtp_tp") is marker
    finally:
        register_group("rtp_tp", None)
    assert resolve_group("rtp_tp") is None


def test_a_vocabulary_tp_does_not_divide_is_padded():
    """510 tokens over 4 ranks: 128 rows each, the last rank's 126 real rows and 2 of zeros (cut after the gather)."""
    Mapping(tp=4, ep=4).check(Glm5Config.preset("tiny-tp").replace(vocab_size=510))
    parts = [Mapping(tp=4, rank=r).vocab_part(510) for r in range(4)]
    assert parts == [(0, 128), (128, 256), (256, 384), (384, 512)]
    full = torch.arange(510.0)[:, None]
    last = Slice(0, 384, 512, padded=True).apply(full)
    assert last.shape == (128, 1) and torch.equal(last[:126, 0], torch.arange(384.0, 510.0)) and not last[126:].any()
