"""torch.compile(model, backend="fxglm5"): listed through the entry point, runs the passes, gives the eager logits;
symbolic shapes from Dynamo export once; lowered for the inputs' device; options checked by name."""

import logging
import re

import pytest
import torch

import fxglm5.backend
from fxglm5.model.config import Glm5Config
from tests.helpers import random_model, rel_err

TWO_LAYERS = Glm5Config.preset("tiny").replace(num_hidden_layers=2, mlp_layer_types=None, indexer_types=None)  # dense + MoE


def _tokens(cfg, batch, seq, seed=0):
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))
    return ids, torch.arange(seq)[None].expand(batch, seq)


def test_backend_is_listed():
    assert "fxglm5" in torch._dynamo.list_backends()


def test_compiled_tiny_model_matches_eager(caplog):
    cfg = Glm5Config.preset("tiny")
    model = random_model(cfg)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fxglm5", dynamic=False)
    ids, pos = _tokens(cfg, 2, 13)
    with caplog.at_level(logging.INFO, logger="fxglm5.backend"):
        out = compiled(ids, pos)
    assert rel_err(out, model(ids, pos)) < 1e-4
    summaries = [r.getMessage() for r in caplog.records]
    assert any("match_sparse_mla" in s and "matches=4" in s for s in summaries)
    assert any("fuse_fp8_moe" in s and "matches=3" in s for s in summaries)


# Dynamo compiles (2, 5) statically, then makes what changed symbolic: under dynamic=None both dims change at the
# second call, so that graph serves the third; dynamic=True starts symbolic; dynamic=False compiles every shape.
SHAPES = [(2, 5), (3, 12), (4, 10)]


@pytest.mark.parametrize("dynamic, shapes, exports", [(True, SHAPES, 1), (None, SHAPES, 2), (False, SHAPES[:2], 2)])
def test_new_shapes_match_eager_and_export_once(monkeypatch, dynamic, shapes, exports):
    model = random_model(TWO_LAYERS)
    calls = []

    def counting_export(*args):
        calls.append(args[2])
        return export_graph(*args)

    export_graph = fxglm5.backend.export_graph
    monkeypatch.setattr(fxglm5.backend, "export_graph", counting_export)
    torch._dynamo.reset()
    # strict: a dynamic graph must give every match the static one does (a pattern that misses raises)
    compiled = torch.compile(model, backend="fxglm5", dynamic=dynamic, options={"config": TWO_LAYERS, "strict": True})
    for batch, seq in shapes:
        ids, pos = _tokens(TWO_LAYERS, batch, seq)
        with torch.no_grad():
            assert rel_err(compiled(ids, pos), model(ids, pos)) < 1e-5, (batch, seq)
    assert len(calls) == exports
    assert (calls[-1] is None) == (dynamic is False)  # the last export had dynamic dims unless compiled static


def test_lowered_for_triton_with_options(monkeypatch, caplog):
    """On CPU the interpreted Triton kernels run when the backend option asks for them; disabled passes are skipped.
    The MoE runs as add_rms_norm_moe_router_fp8_shared (the shared expert's GEMMs, its add, the router and the
    residual add and norm before it fused into the MoE) through the Triton moe_fp8."""
    from fxglm5.lowering.triton import fp8_gemm, moe

    ran = []
    for module, name in [(fp8_gemm, "fp8_linear"), (moe, "moe_fp8")]:
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _k=kernel, _n=name, **kw: ran.append(_n) or _k(*a, **kw))
    model = random_model(TWO_LAYERS)
    torch._dynamo.reset()
    options = {"config": TWO_LAYERS, "backend": "triton", "disabled_passes": ["match_rope"]}
    compiled = torch.compile(model, backend="fxglm5", dynamic=False, options=options)
    ids, pos = _tokens(TWO_LAYERS, 1, 12)
    with caplog.at_level(logging.INFO, logger="fxglm5.backend"), torch.no_grad():
        assert rel_err(compiled(ids, pos), model(ids, pos)) < 1e-4
    summaries = [r.getMessage() for r in caplog.records]
    lowered = next(s for s in summaries if "lower lower " in s)  # the lower pass (fuse_shared_input_gemms runs first)
    for op in ("fp8_linear", "add_rms_norm_moe_router_fp8_shared", "rms_norm"):
        assert re.search(rf"[=,]{op}:triton x", lowered), (op, lowered)  # the op itself, not one its name ends
    assert "sparse_mla:reference" in lowered and "rope_interleaved" not in lowered
    assert not any("match_rope" in s for s in summaries)
    assert {"fp8_linear", "moe_fp8"} <= set(ran)


@pytest.mark.parametrize("options, named", [({"bogus": 1}, "'bogus'"), ({"backend": "cuda"}, "'backend'"),
                                            ({"config": {}}, "'config'"), ({"disabled_passes": "lower"}, "'disabled_passes'")])
def test_bad_options_are_named(options, named):
    torch._dynamo.reset()
    compiled = torch.compile(torch.nn.Linear(4, 4), backend="fxglm5", options=options)
    with pytest.raises(Exception, match=f"option {named}"):
        compiled(torch.ones(2, 4))


def test_regional_compilation_compiles_each_layer_kind_once_over_each_layers_weights(monkeypatch):
    """PyTorch's regional recipe: each decoder layer compiled on its own. Dynamo reuses one graph per layer kind
    (tiny: one dense layer, three MoE layers -> two compiles) and passes each layer's parameters as inputs; every
    layer must run on its own weights (a graph frozen to the first layer's weights gave logits off by 4.1), and
    its attention must become sparse_mla (with the causal mask an input of the layer it stayed generic)."""
    cfg = Glm5Config.preset("tiny")
    model = random_model(cfg)
    ids, pos = _tokens(cfg, 1, 12)
    expected = model(ids, pos)
    compiles = []
    real = fxglm5.backend.compile_graph

    def counted(*args, **kwargs):
        results = real(*args, **kwargs)
        compiles.append({r.name: r.num_matches for r in results})
        return results

    monkeypatch.setattr(fxglm5.backend, "compile_graph", counted)
    torch._dynamo.reset()
    for layer in model.model.layers:
        layer.compile(backend="fxglm5", dynamic=False)
    assert rel_err(model(ids, pos), expected) < 1e-4
    assert len(compiles) == 2
    # each layer compiled alone still shows the passes its whole attention (the layer builds its causal mask)
    assert [(c["match_sparse_mla"], c["fuse_fp8_moe"]) for c in compiles] == [(1, 0), (1, 1)]
    assert rel_err(model(ids, pos), expected) < 1e-4  # the bound graphs are reused, not rebuilt
    assert len(compiles) == 2
