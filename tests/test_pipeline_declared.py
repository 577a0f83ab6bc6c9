"""The declared pipeline (fxglm5.passes.pipeline) against the registry: every pass declared once and registered
under its stage, the run order independent of the registration order, a short match count warned about on the
serving path, pass source hashes that cover the helpers a pass imports, and disabling passes as an argument."""

import logging
import random

import pytest
import torch
from torch import fx

import fxglm5.passes  # noqa: F401  (registers every pass)
from fxglm5.cli import main
from fxglm5.compiler import compile_model
from fxglm5.errors import PassError
from fxglm5.model.config import Glm5Config
from fxglm5.passes import registry
from fxglm5.passes.manager import PassContext, PassManager
from fxglm5.passes.pipeline import DECLARED, PIPELINE, STAGES, Stage
from tests.helpers import random_model


def test_registry_and_declaration_agree():
    declared = [name for names in PIPELINE.values() for name in names]
    assert len(declared) == len(set(declared)) == len(DECLARED)  # each pass declared once
    assert set(registry.REGISTRY) == set(declared)  # declared <=> registered
    assert all(registry.REGISTRY[name].stage is DECLARED[name] for name in declared)
    assert list(PIPELINE) == list(STAGES) == [Stage.MATCH, Stage.FUSE, Stage.CACHE, Stage.LOWER]
    assert [spec.name for spec in registry.passes_for(("lower", "match"))] == [*PIPELINE[Stage.MATCH], *PIPELINE[Stage.LOWER]]


def test_registration_outside_the_declaration_is_refused(monkeypatch):
    monkeypatch.setattr(registry, "REGISTRY", {})

    def undeclared(gm, ctx):
        return 0

    def match_rope(gm, ctx):
        return 0

    with pytest.raises(ValueError, match="'undeclared' registered in stage 'match'; .* declares it in no stage"):
        registry.register_pass("match")(undeclared)
    with pytest.raises(ValueError, match="'match_rope' registered in stage 'fuse'; .* declares it under stage 'match'"):
        registry.register_pass("fuse")(match_rope)
    with pytest.raises(PassError, match="declares .*'match_rope'.*, which no module registered"):
        registry.passes_for(("match",))


def test_shuffled_registration_runs_the_same_pipeline(monkeypatch):
    """The registration order (the imports of fxglm5.passes) shuffled: the same passes run in the same order and,
    in strict mode, every one of the four stages finds all its matches (with an order taken from the imports,
    sorting them left fuse_norm_rope_into_cache_writes with 0 of its 8)."""
    specs = list(registry.REGISTRY.values())
    random.Random(5).shuffle(specs)
    assert [s.name for s in specs] != list(DECLARED)
    monkeypatch.setattr(registry, "REGISTRY", {})
    for spec in specs:
        registry.register_pass(spec.stage, spec.expected)(spec.fn)
    assert [s.name for s in registry.passes_for(STAGES)] == list(DECLARED)
    cfg = Glm5Config.preset("tiny")
    graph, results, _ = compile_model(random_model(cfg), max_tokens=64, strict=True)
    assert [r.name for r in results] == list(DECLARED)
    folds = next(r for r in results if r.name == "fuse_norm_rope_into_cache_writes")
    assert folds.num_matches == folds.expected == 8


def _traced_norm_free_graph() -> fx.GraphModule:
    return fx.symbolic_trace(torch.nn.Linear(4, 4))


def test_short_match_count_is_a_warning_on_the_serving_path_and_an_error_in_strict_mode(caplog):
    cfg = Glm5Config.preset("tiny")
    spec = registry.REGISTRY["match_rms_norm"]
    with caplog.at_level(logging.WARNING, logger="fxglm5.passes.manager"):
        result = PassManager(PassContext(config=cfg), stages=("match",)).run_one(_traced_norm_free_graph(), spec)
    assert result.num_matches == 0 and result.expected == 17
    assert [r.getMessage() for r in caplog.records] == [
        "fxglm5 pass match_rms_norm: found 0 matches, the model needs 17; the graph goes on without the rest"]
    with pytest.raises(PassError, match="pass match_rms_norm: found 0 matches, the model needs 17 .strict mode."):
        PassManager(PassContext(config=cfg, strict=True), stages=("match",)).run_one(_traced_norm_free_graph(), spec)


@pytest.mark.parametrize("helper, importers", [
    ("fxglm5.passes.mla_pattern", {"match_mla", "match_sparse_mla"}),
    ("fxglm5.passes.dequant", {"match_mla", "match_sparse_mla", "fuse_fp8_linear", "fuse_fp8_moe"}),
    ("fxglm5.ops.cached", {"insert_paged_cache"}),
])
def test_source_hash_covers_the_helpers_a_pass_imports(monkeypatch, helper, importers):
    """Editing a helper module changes the hash of exactly the passes that import it (directly: match_mla imports
    mla_pattern; or through another helper: mla_pattern imports dequant)."""
    before = {name: spec.source_hash for name, spec in registry.REGISTRY.items()}
    read = registry.module_source
    monkeypatch.setattr(registry, "module_source", lambda name: read(name) + ("\n# edited\n" if name == helper else ""))
    after = {name: spec.source_hash for name, spec in registry.REGISTRY.items()}
    assert {name for name in before if after[name] != before[name]} == importers


def test_inspect_disables_passes_and_dumps_by_argument(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FXGLM5_DISABLE_PASSES", "match_mla")  # not read: disabling is the argument's
    assert main(["inspect", "--preset", "tiny", "--disable-passes", "match_rope,match_rms_norm",
                 "--dump-dir", str(tmp_path)]) == 0
    passes = [line.split()[1] for line in capsys.readouterr().out.splitlines() if line.startswith(("match ", "fuse "))]
    assert passes == ["match_sparse_mla", "match_mla", "fuse_fp8_linear", "fuse_fp8_moe"]
    assert [line.split()[1] for line in (tmp_path / "summary.txt").read_text().splitlines()] == passes
    assert main(["inspect", "--preset", "tiny", "--disable-passes", "match_ropes"]) == 2
    assert "--disable-passes: no pass named 'match_ropes'" in capsys.readouterr().err


def test_backend_dump_dir_option(tmp_path):
    torch._dynamo.reset()
    module = torch.nn.Linear(4, 4)
    compiled = torch.compile(module, backend="fxglm5", dynamic=False, options={"dump_dir": str(tmp_path)})
    x = torch.ones(2, 4)
    assert torch.allclose(compiled(x), module(x))
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert [line.split()[1] for line in summary] == [*PIPELINE[Stage.MATCH], *PIPELINE[Stage.FUSE], *PIPELINE[Stage.LOWER]]
