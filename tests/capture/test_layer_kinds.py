"""The layer-kind proof (fxglm5.capture.layer_kinds) on its own, on meta models and plain key lists: what makes two
layers different kinds, what makes a layer unprovable, and where the kind plan's prefix ends (issue 40).

capture.by_kind copies one captured layer's graph to every layer of its kind, so a key that misses a difference
runs a layer on a graph traced for another, and a prefix that ends before the model's last kinds are covered
exports the wrong layers before the final norm."""

import itertools

import pytest
import torch
from torch import nn

from fxglm5.capture.layer_kinds import Unprovable, layer_key, model_plan, plan_kinds
from fxglm5.model.config import Glm5Config
from fxglm5.model.modeling import Glm5ForCausalLM


def _model(layers: int = 6) -> Glm5ForCausalLM:
    """Dense layers 0-1 then MoE; indexers full, shared, full, full, shared, full: layers 3 and 5 are one kind."""
    cfg = Glm5Config.preset("tiny").replace(
        num_hidden_layers=layers, first_k_dense_replace=2, mlp_layer_types=None,
        indexer_types=(["full", "shared", "full"] * layers)[:layers])
    return Glm5ForCausalLM(cfg, device="meta")


def test_the_two_layers_compared_below_are_one_kind():
    layers = _model().model.layers
    assert layer_key(layers[3], "model.layers.3") == layer_key(layers[5], "model.layers.5")


def test_parameters_that_differ_only_in_dtype_are_other_kinds():
    model = _model()
    norm = model.model.layers[5].post_attention_layernorm
    other = torch.float16 if norm.weight.dtype != torch.float16 else torch.bfloat16
    norm.weight = nn.Parameter(torch.empty(norm.weight.shape, dtype=other, device="meta"), requires_grad=False)
    layers = model.model.layers
    assert layer_key(layers[3], "model.layers.3") != layer_key(layers[5], "model.layers.5")
    plan = model_plan(model)
    assert plan.kinds[5] != plan.kinds[3] and plan.source[5] == 5


def test_buffers_that_differ_only_in_dtype_are_other_kinds():
    model = _model()
    layers = model.model.layers
    layers[3].self_attn.register_buffer("table", torch.empty(4, dtype=torch.float32, device="meta"))
    layers[5].self_attn.register_buffer("table", torch.empty(4, dtype=torch.float64, device="meta"))
    assert layer_key(layers[3], "a") != layer_key(layers[5], "b")


@pytest.mark.parametrize("module, attr, value", [
    ("input_layernorm", "eps", (1e-5, 1e-6)),      # an RMSNorm eps: 1e-5 against 1e-6
    ("self_attn.kv_a_layernorm", "eps", (1e-5, 1e-6)),
    ("self_attn", "scale", None),                  # the softmax scale, halved
    ("self_attn.indexer", "topk", None),           # an int: one more
])
def test_layers_of_one_model_that_differ_in_one_plain_value_are_other_kinds(module, attr, value):
    """Two layers of ONE model (every shared object the very same), differing in one plain value of one type."""
    model = _model()
    layers = model.model.layers
    target = layers[5].get_submodule(module)
    old = getattr(target, attr)
    if value is not None:
        new = value[1] if old == value[0] else value[0]
    else:
        new = old * 0.5 if isinstance(old, float) else old + 1
    assert type(new) is type(old) and new != old
    setattr(target, attr, new)
    assert layer_key(layers[3], "model.layers.3") != layer_key(layers[5], "model.layers.5")
    plan = model_plan(model)
    assert plan.kinds[5] != plan.kinds[3] and plan.source[5] == 5
    setattr(target, attr, old)
    assert layer_key(layers[3], "model.layers.3") == layer_key(layers[5], "model.layers.5")


class _Config:
    """An object that is not plain data (a config): layers may share it, by identity only."""


class _IndexedLayer(nn.Module):
    def __init__(self, idx: int, shared=None, where: str = "self"):
        super().__init__()
        self.proj = nn.Linear(4, 4, device="meta")
        self.child = nn.Module()
        holder = self if where == "self" else self.child
        self.layer_idx = idx
        if shared is not None:
            holder.cfg = shared


def test_a_layer_index_alone_is_not_part_of_the_kind():
    assert layer_key(_IndexedLayer(0), "a") == layer_key(_IndexedLayer(7), "b")


@pytest.mark.parametrize("where", ["self", "child"])
@pytest.mark.parametrize("wrap", [lambda c: c, lambda c: (c, 1), lambda c: [1, [c]]], ids=["bare", "tuple", "list"])
def test_a_layer_index_next_to_a_shared_object_is_unprovable(where, wrap):
    """layer_idx + a shared config: the forward could read config.something[self.layer_idx], so two layers that
    hold the same objects may still run different graphs. The plan must not treat them as one kind."""
    cfg = _Config()
    layer = _IndexedLayer(3, wrap(cfg), where)
    with pytest.raises(Unprovable, match=r"model\.layers\.3\.layer_idx is a layer index and the layer holds a "
                                         r"shared _Config"):
        layer_key(layer, "model.layers.3")
    stack = nn.Module()
    stack.model = nn.Module()
    stack.model.layers = nn.ModuleList([_IndexedLayer(i, wrap(cfg), where) for i in range(3)])
    with pytest.raises(Unprovable, match="layer index"):
        model_plan(stack)


def test_a_shared_object_without_a_layer_index_is_provable():
    """The same object, by identity, is one kind; another object of the same class is not."""
    cfg = _Config()
    a, b, c = _IndexedLayer(0, cfg), _IndexedLayer(1, cfg), _IndexedLayer(2, _Config())
    for layer in (a, b, c):
        del layer.layer_idx
    assert layer_key(a, "a") == layer_key(b, "b")
    assert layer_key(a, "a") != layer_key(c, "c")


# ---- the kind plan ----------------------------------------------------------------------------------------------

def _reference_prefix(kinds: tuple, depth: int) -> int:
    """The shortest leading run that holds every context of the model and ends with its last ``depth`` kinds."""
    total = len(kinds)

    def context(i):
        return tuple(kinds[i - e] if i - e >= 0 else None for e in range(depth, -1, -1))

    needed = {context(i) for i in range(total)}
    for n in range(1, total + 1):
        ends = all((kinds[n - e] if n - e >= 0 else None) == (kinds[total - e] if total - e >= 0 else None)
                   for e in range(1, depth + 1))
        if {context(i) for i in range(n)} == needed and ends:
            return n
    raise AssertionError("unreachable: the whole model qualifies")


def _check_plan(keys: list, depth: int):
    plan = plan_kinds(keys, depth)
    kinds, total = plan.kinds, len(keys)

    def kind(i):
        return kinds[i] if i >= 0 else None

    def context(i):
        return tuple(kind(i - e) for e in range(depth, -1, -1))

    assert plan.prefix == _reference_prefix(kinds, depth), (keys, depth, plan)
    # the prefix ends with the model's last kinds (the final norm reads what the last layer wrote)
    assert [kind(plan.prefix - e) for e in range(1, depth + 1)] == [kind(total - e) for e in range(1, depth + 1)]
    assert all(0 <= plan.source[i] < plan.prefix and context(plan.source[i]) == context(i) for i in range(total))


def test_the_prefix_ends_where_the_last_kinds_are_covered():
    # a b a b: every context ((-, a), (a, b), (b, a)) is seen after 3 layers, but the model ends with b
    plan = plan_kinds(list("abab"))
    assert plan.prefix == 4 and plan.source == (0, 1, 2, 1)
    # a a b b a a a: contexts all seen after 5 layers (a a b b a), and the model's last kind is a: 5, no later
    plan = plan_kinds(list("aabbaaa"))
    assert plan.prefix == 5 and plan.source == (0, 1, 2, 3, 4, 1, 1)
    # depth 2: every context is seen after 5 layers (a a b a a), but the model ends with (b, a): all 7
    plan = plan_kinds(list("aabaaba"), depth=2)
    assert plan.prefix == 7 and plan.kinds[5:7] == plan.kinds[-2:]


@pytest.mark.parametrize("depth", [1, 2])
def test_every_plan_of_up_to_six_layers_and_three_kinds(depth):
    """Every sequence of up to 6 layers over 3 kinds: the plan's prefix is the shortest that covers every context
    and ends with the model's last kinds, and each layer copies a prefix position of its own context."""
    for total in range(1, 7):
        for keys in itertools.product("abc", repeat=total):
            _check_plan(list(keys), depth)
