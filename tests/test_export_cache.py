"""The test run's export cache (tests/export_cache.py) gives what a real export gives, and only then.

A hit must be a program over the calling module's own tensors, equal to a real export's, and a copy (a test that
rewrites its graph does not rewrite the next test's); anything that could change the trace (weights, attributes,
inputs, dynamic shapes, the FXGLM5_* environment, hooks, classes made inside a function) must miss or refuse.

At the root of tests/: it checks the test machinery itself (tests/export_cache.py).
"""

import pytest
import torch
from torch.export import Dim

from tests import export_cache
from tests.export_cache import cache_key, cached_export


class Block(torch.nn.Module):
    def __init__(self, scale: float = 2.0, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.proj, self.scale = torch.nn.Linear(8, 8), scale
        self.register_buffer("offset", torch.arange(8.0))

    def forward(self, x):
        return self.proj(x) * self.scale + self.offset


X = (torch.randn(3, 8),)
DYN = ({0: Dim("rows", min=1, max=64)},)


def export(mod, dynamic_shapes=DYN):
    return cached_export(mod, X, dynamic_shapes=dynamic_shapes, strict=False)


def test_a_hit_is_a_copy_over_the_callers_own_tensors():
    first, second = Block(), Block()
    export(first)
    hits = export_cache.stats["hits"]
    program = export(second)
    assert export_cache.stats["hits"] == hits + 1
    real = export_cache._real_export(second, X, dynamic_shapes=DYN, strict=False)
    assert str(program.graph) == str(real.graph)
    assert program.state_dict["proj.weight"] is second.proj.weight  # as a real export's state dict
    assert program.state_dict["offset"] is second.offset
    x = torch.randn(5, 8)
    torch.testing.assert_close(program.module()(x), second(x), rtol=0, atol=0)
    with torch.no_grad():
        second.proj.weight.add_(1.0)  # the program reads the module's weights, as a real export's does
    torch.testing.assert_close(program.module()(x), second(x), rtol=0, atol=0)


def test_rewriting_a_hit_leaves_the_next_hit_alone():
    export(Block())
    gm = export(Block()).module()
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten.mul.Tensor:
            node.target = torch.ops.aten.add.Tensor
    gm.recompile()
    again = export(Block()).module()
    x = torch.randn(2, 8)
    torch.testing.assert_close(again(x), Block()(x), rtol=0, atol=0)
    assert not torch.equal(gm(x), again(x))


@pytest.mark.parametrize("change", ["weights", "attribute", "dynamic", "inputs", "env"])
def test_what_could_change_the_trace_changes_the_key(change, monkeypatch):
    base = cache_key(Block(), X, None, DYN, {"strict": False})
    assert base is not None and cache_key(Block(), X, None, DYN, {"strict": False}) == base  # deterministic
    mod, args, dyn = Block(), X, DYN
    if change == "weights":
        mod = Block(seed=1)
    elif change == "attribute":
        mod = Block(scale=3.0)
    elif change == "dynamic":
        dyn = ({0: Dim("rows", min=1, max=32)},)
    elif change == "inputs":
        args = (torch.randn(4, 8),)
    else:
        monkeypatch.setenv("FXGLM5_DISABLE_PASSES", "match_rope")
    key = cache_key(mod, args, None, dyn, {"strict": False})
    assert key is not None and key != base


def test_hooks_local_classes_and_unknown_attributes_are_not_cached():
    hooked = Block()
    hooked.register_forward_hook(lambda *a: None)

    class Local(Block):
        pass

    odd = Block()
    odd.helper = object()
    for mod in (hooked, Local(), odd):
        assert cache_key(mod, X, None, DYN, {"strict": False}) is None
    uncached = export_cache.stats["uncached"]
    export(odd)
    assert export_cache.stats["uncached"] == uncached + 1
