"""The pipeline as a whole: the declaration (fxglm5.passes.pipeline) against the registry (every pass declared once
and registered under its stage, the run order independent of the registration order, source hashes that cover the
helpers a pass imports); the match + fuse stages on the tiny GLM-5 (FP8 and bf16 checkpoints: what is left in the
graph, exact counts, agreement with the eager model, re-export); strict mode and a short count warned about on the
serving path; graph dumps; disabling passes as an argument. Each pass's own checks are in its file here."""

import logging
import random

import pytest
import torch
from torch import fx

import copy

import fxglm5.passes  # noqa: F401  (registers every pass)
from fxglm5.cli import main
from fxglm5.compiler import compile_model
from fxglm5.errors import PassError
from fxglm5.model.config import Glm5Config
from fxglm5.passes import op_histogram, registry, run_pipeline
from fxglm5.passes.manager import PassContext, PassManager
from fxglm5.passes.pipeline import DECLARED, PIPELINE, STAGES, Stage
from tests.helpers import copy_to_dtype, random_model, rel_err
from tests.passes.template import pipeline

GENERIC_LEFTOVERS = ("aten.softmax", "aten._softmax", "aten.einsum", "aten.sigmoid", "aten.rsqrt", "aten.stack")
MATCH_FUSE = [*PIPELINE[Stage.MATCH], *PIPELINE[Stage.FUSE]]


def _fp8_dequant_casts(gm) -> int:
    """Casts of an e4m3 weight: a dequantization left standing outside a fused op."""
    return sum(
        1 for n in gm.graph.nodes
        if n.op == "call_function" and "to" in str(n.target) and n.args and hasattr(n.args[0], "meta")
        and getattr(n.args[0].meta.get("val"), "dtype", None) == torch.float8_e4m3fn
    )


def _inputs(cfg, batch=2, seq=19, offset=0):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
    return ids, (torch.arange(seq) + offset)[None].expand(batch, seq)


def _captured(name: str):
    """A copy of the tiny model ``name`` as captured (tests/passes/template.py's pipeline), and its config."""
    run = pipeline(name)
    return copy.deepcopy(run.before[PIPELINE[Stage.MATCH][0]]), run.config


@pytest.mark.parametrize("name", ["fp8", "bf16ckpt", "shared", "shared_bf16ckpt"])
def test_pipeline_rewrites_everything_float32(name):
    run = pipeline(name)
    cfg, gm = run.config, run.after[MATCH_FUSE[-1]]
    fp8, shared = cfg.is_fp8, name.startswith("shared")
    for pass_name in MATCH_FUSE:
        r = run.results[pass_name]
        assert r.num_matches == r.expected, r.summary()
    ops = op_histogram(gm)
    for generic in GENERIC_LEFTOVERS:
        assert generic not in ops, f"{generic} left in the graph"
    assert _fp8_dequant_casts(gm) == 0
    n_full = sum(cfg.has_indexer(i) for i in range(cfg.num_hidden_layers))
    assert ops["fxglm5.sparse_mla"] == cfg.num_hidden_layers and ops["fxglm5.indexer_topk"] == n_full
    assert ops["fxglm5.moe_fp8"] == 3 and ops.get("fxglm5.fp8_linear", 0) == ((36 - 4 * shared) if fp8 else 0)
    assert ops["fxglm5.rms_norm"] == 4 * cfg.num_hidden_layers + 1
    assert ops["fxglm5.rope_interleaved"] == 2 * cfg.num_hidden_layers + 2 * n_full
    # Prompt longer than index_topk (8) and a position offset: the selection really selects.
    ids, pos = _inputs(cfg, offset=5)
    assert rel_err(gm(ids, pos), run.model(ids, pos)) < 1e-4
    ids1, pos1 = _inputs(cfg, batch=1, seq=1)
    assert rel_err(gm(ids1, pos1), run.model(ids1, pos1)) < 1e-4


@pytest.mark.parametrize("name", ["bf16", "bf16_bf16ckpt"])
def test_pipeline_bf16_within_documented_bound(name):
    """bf16 compute: the fused ops accumulate in fp32 where the generic graph rounds weights and
    intermediates to bf16, so the two differ by bf16 rounding (and a rounding can flip a near-tie in the
    indexer's top-k or the router). Documented bound: measured against the same weights in float32, the
    rewritten bf16 graph is no further off than the generic bf16 model it replaces (relative L2 error at
    most 1.5x the generic one's, plus 1e-3)."""
    run = pipeline(name)
    assert all(run.results[p].num_matches == run.results[p].expected for p in MATCH_FUSE)  # strict
    exact = copy_to_dtype(run.model, torch.float32)
    ids, pos = _inputs(run.config)
    ref = exact(ids, pos)
    fused_err = ((run.after[MATCH_FUSE[-1]](ids, pos).float() - ref).norm() / ref.norm()).item()
    generic_err = ((run.model(ids, pos).float() - ref).norm() / ref.norm()).item()
    assert fused_err <= 1.5 * generic_err + 1e-3, (fused_err, generic_err)


def test_transformed_graph_exports_again():
    run = pipeline("fp8")
    dims = {0: torch.export.Dim("b", max=64), 1: torch.export.Dim("s", max=4096)}
    ids, pos = _inputs(run.config)
    program = torch.export.export(run.after[MATCH_FUSE[-1]], (ids, pos), dynamic_shapes=(dims, dims), strict=False)
    ids2, pos2 = _inputs(run.config, batch=3, seq=11)
    assert rel_err(program.module()(ids2, pos2), run.model(ids2, pos2)) < 1e-4


def test_strict_mode_reports_missing_match():
    gm, cfg = _captured("fp8")
    wrong = cfg.replace(num_hidden_layers=5, mlp_layer_types=None, indexer_types=None)
    with pytest.raises(PassError, match="match_sparse_mla: found 4 matches, the model needs 5"):
        run_pipeline(gm, PassContext(config=wrong, strict=True))


def test_dump_dir_writes_before_after_and_summary(tmp_path):
    gm, cfg = _captured("fp8")
    PassManager(PassContext(config=cfg), dump_dir=str(tmp_path)).run(gm)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "00_match_sparse_mla.before.py" in names and "05_fuse_fp8_moe.after.py" in names
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert [line.split()[1] for line in summary] == MATCH_FUSE
    assert "torch.ops.fxglm5.sparse_mla" in (tmp_path / "00_match_sparse_mla.after.py").read_text()


def test_registry_has_stages_and_source_hashes():
    specs = {name: spec for name, spec in registry.REGISTRY.items()}
    assert specs["match_sparse_mla"].stage == "match" and specs["fuse_fp8_moe"].stage == "fuse"
    assert len({s.source_hash for s in specs.values()}) == len(specs)


def test_disabled_passes_are_skipped_and_unknown_names_refused(monkeypatch):
    gm, cfg = _captured("fp8")
    monkeypatch.setenv("FXGLM5_DISABLE_PASSES", "match_mla")  # not read: disabling is an argument, so the environment cannot change a compile
    results = PassManager(PassContext(config=cfg, disabled=("match_rope", "match_rms_norm"))).run(gm)
    assert [r.name for r in results] == ["match_sparse_mla", "match_mla", "fuse_fp8_linear", "fuse_fp8_moe"]
    ops = op_histogram(gm)
    assert "fxglm5.rms_norm" not in ops and "fxglm5.rope_interleaved" not in ops and ops["aten.rsqrt"] == 17
    with pytest.raises(PassError, match="match_ropes"):
        PassManager(PassContext(config=cfg, disabled=("match_ropes",)))


def test_registry_and_declaration_agree():
    declared = [name for names in PIPELINE.values() for name in names]
    assert len(declared) == len(set(declared)) == len(DECLARED)  # each pass declared once
    assert set(registry.REGISTRY) == set(declared)  # declared <=> registered
    assert all(registry.REGISTRY[name].stage is DECLARED[name] for name in declared)
    assert list(PIPELINE) == list(STAGES) == [Stage.MATCH, Stage.FUSE, Stage.SHARD, Stage.CACHE, Stage.FUSE_KERNELS,
                                              Stage.LOWER]
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
    graph, results = compile_model(random_model(cfg), max_tokens=64, strict=True)[:2]
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
    ("fxglm5.passes.mla_pattern", {"match_mla", "match_sparse_mla", "shard_attention"}),
    ("fxglm5.passes.dequant", {"match_mla", "match_sparse_mla", "fuse_fp8_linear", "fuse_fp8_moe", "shard_attention",
                               "shard_indexer", "shard_mlp", "shard_moe_experts", "shard_lm_head"}),  # the shard
    # passes through sharding
    ("fxglm5.passes.sharding", {"shard_attention", "shard_indexer", "shard_mlp", "shard_moe_experts", "shard_lm_head"}),
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
    assert [line.split()[1] for line in summary] == [*PIPELINE[Stage.MATCH], *PIPELINE[Stage.FUSE],
                                                     *PIPELINE[Stage.FUSE_KERNELS], *PIPELINE[Stage.LOWER]]


def _node_loops_counting_matches(source: str) -> list[int]:
    """The lines of ``for`` loops over a graph's nodes (``.nodes`` / ``find_nodes``) whose body counts with ``+=`` or
    sums a counter: the rewrite loop that ``graph_utils.rewrite_each`` is the one copy of."""
    import ast

    found = []
    for loop in ast.walk(ast.parse(source)):
        if not isinstance(loop, ast.For):
            continue
        over = ast.unparse(loop.iter)
        if ".nodes" not in over and "find_nodes" not in over:
            continue
        counts = [n for n in ast.walk(loop) if isinstance(n, ast.AugAssign) and isinstance(n.op, ast.Add)
                  and isinstance(n.target, ast.Name)]
        counts += [n for n in ast.walk(loop) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Tuple)
                   and any(isinstance(e, ast.BinOp) for e in n.value.elts)]
        if counts:
            found.append(loop.lineno)
    return found


def test_the_passes_share_one_rewrite_loop():
    """Every pass that rewrites node by node walks the graph through ``graph_utils.rewrite_each`` (the shard passes
    through ``sharding.shard_each``, which does): no pass module keeps its own copy of the walk-match-rewrite-count
    loop, and the detector sees one."""
    import inspect
    import pathlib

    from fxglm5.passes import graph_utils

    folder = pathlib.Path(graph_utils.__file__).parent
    planted = "def p(gm):\n    matches = 0\n    for node in list(gm.graph.nodes):\n        matches += 1\n"
    assert _node_loops_counting_matches(planted) == [3]
    loops = {path.name: lines for path in sorted(folder.glob("*.py"))
             if (lines := _node_loops_counting_matches(path.read_text()))}
    assert loops == {}, f"walk the graph with graph_utils.rewrite_each: {loops}"
    users = {name for name, spec in registry.REGISTRY.items()
             if "rewrite_each(" in inspect.getsource(inspect.getmodule(spec.fn))
             or "shard_each(" in inspect.getsource(inspect.getmodule(spec.fn))}
    assert len(users) >= 16, sorted(set(registry.REGISTRY) - users)
