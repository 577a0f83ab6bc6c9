"""W8A8 (``act_quant``: the FP8 GEMMs quantize their activations 1x128 to e4m3 on the fly) is one explicit choice at
every front door, W8A16 the default:

- the Runner (``RunnerOptions.act_quant``) compiles every FP8 GEMM and MoE of the tiny FP8 model with it (counted
  in the graph, op by op) and serves the logits of the reference W8A8 math (the eager model with each FP8 linear
  and the routed experts computed by ``fxglm5.lowering.reference.fp8`` with ``act_quant=True``), which the default
  W8A16 program does not;
- the CLI's ``--act-quant`` reaches the options of ``generate`` (one process and ``--tp``), ``serve``, ``export``
  and ``inspect``; ``--backend reference`` (the model code, W8A16) refuses it;
- an artifact records it, checked against its program's ops; a W8A8 file serves W8A8 (the CLI's default for it)
  and refuses W8A16 options, a W8A16 file refuses ``--act-quant``;
- the test run's export cache tells a W8A16 fused graph from a W8A8 one (its key reads the graph's code).
"""

import functools
import json

import pytest
import torch
from torch import fx, nn

from fxglm5.artifact import RECORD, export_artifact, load_artifact
from fxglm5.cli import build_parser, main
from fxglm5.compiler import Stage, act_quant_ops, compile_model
from fxglm5.errors import CheckpointError, InputError
from fxglm5.lowering.reference import fp8 as ref_fp8
from fxglm5.model.config import Glm5Config
from fxglm5.model.layers import Linear
from fxglm5.model.moe import StackedExperts
from fxglm5.runtime.options import RunnerOptions
from fxglm5.runtime.runner import Runner
from tests import export_cache
from tests.frontdoors.test_artifact import rewrite
from tests.paged_helpers import reference_logits

PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46], [7, 1, 8]]
SERVE = dict(kv_cache="bf16", block_size=16, max_cache_tokens=512, keep_logits=True)
NEW = 4
# the tiny model's 4 layers (1 dense, 3 MoE) after the passes: per layer the stacked q_a | kv_a | indexer wk GEMM, the
# stacked q_b | indexer wq_b with the latent query and the indexer, o_proj and the dense MLP's stacked gate | up, the
# 4 of them that read a residual add's norm with that add and norm (layers 1-3's q_a | kv_a | wk, layer 0's gate |
# up); its down projection fused with its SiLU-mul; the routed experts with the shared expert's two GEMMs, its add,
# the router and the residual add and norm before them
GEMMS = {"fp8_linear": 5, "fp8_linear_latent_query_indexer": 4, "add_rms_norm_fp8_linear": 4, "silu_mul_fp8_linear": 1,
         "add_rms_norm_moe_router_fp8_shared": 3}


def gemms(act_quant: bool) -> dict:
    return {(op, act_quant): n for op, n in GEMMS.items()}


@pytest.fixture(scope="module")
def w8a8(model):
    runner = Runner(model, **SERVE, act_quant=True)
    return runner, runner.run([list(p) for p in PROMPTS], NEW)


def w8a8_reference(model, monkeypatch) -> None:
    """The eager model computing the W8A8 recipe with the reference ops: every FP8 linear but kv_b_proj (which the
    compiled graph absorbs into the attention, no GEMM of its own) and the routed experts quantize their inputs."""
    def linear(layer, x):
        return ref_fp8.fp8_linear(x, layer.weight, layer.weight_scale_inv, None, act_quant=True)

    def experts(module, x, routing):
        weights, ids = routing.topk(model.config.num_experts_per_tok, dim=-1)
        return ref_fp8.moe_fp8(x, ids, weights, module.gate_up_proj, module.gate_up_proj_scale_inv, module.down_proj,
                               module.down_proj_scale_inv, act_quant=True)

    for name, module in model.named_modules():
        if isinstance(module, Linear) and module.fp8 and not name.endswith("kv_b_proj"):
            monkeypatch.setattr(module, "forward", functools.partial(linear, module))
        elif isinstance(module, StackedExperts):
            monkeypatch.setattr(module, "forward", functools.partial(experts, module))


def test_the_runner_compiles_w8a8_gemms_and_serves_the_reference_w8a8_logits(model, w8a8, monkeypatch):
    runner, seqs = w8a8
    assert act_quant_ops(runner.program.graph) == gemms(True)
    w8a16 = Runner(model, **SERVE)  # the default
    assert w8a16.options.act_quant is False
    assert act_quant_ops(w8a16.program.graph) == gemms(False)
    plain = w8a16.run([list(p) for p in PROMPTS], NEW)
    w8a8_reference(model, monkeypatch)
    apart, rows = 0.0, []
    for seq, other in zip(seqs, plain):
        ref = reference_logits(model, seq)
        assert seq.output == ref.argmax(dim=1).tolist()
        scale = ref.abs().max().item()
        rows += [((got - want).abs().max() / scale).item() for got, want in zip(seq.logits, ref)]
        apart = max(apart, (other.logits[0] - ref[0]).abs().max().item() / scale)  # the same prompt's prefill
    assert apart > 100 * 1e-4  # W8A16 is another computation: the option reached the compile
    # The W8A8 math, row by row, but for at most one near tie: the fused ops' references sum in another order than
    # the eager model (the add + RMSNorm of fuse_add_rms_norm_into_gemm), and where the float32 results differ by an
    # ulp an activation can land on either side of an FP8 rounding step. Which rows do is the CPU's BLAS's choice:
    # none on an Intel Xeon, one step of eight 0.0053 of the logits' scale apart on an AMD EPYC. A tie moves one
    # row, still well inside W8A16's distance; a wrong recipe moves every row by that much.
    assert sum(d > 1e-4 for d in rows) <= 1, rows
    assert max(rows) < apart / 2, (rows, apart)


def test_runner_options_take_act_quant_as_a_bool_only():
    assert RunnerOptions().act_quant is False and RunnerOptions(act_quant=True).act_quant is True
    with pytest.raises(InputError, match=r"act_quant: expected True \(W8A8\) or False \(W8A16\), got 'yes'"):
        RunnerOptions(act_quant="yes")


# ---- the CLI -----------------------------------------------------------------------------------------------------
class Captured(Exception):
    """Raised by a stand-in where the CLI hands its options over: the test reads them from it."""

    def __init__(self, value):
        super().__init__()
        self.value = value


def captured(monkeypatch, module, name: str, pick):
    def stand_in(*args, **kwargs):
        raise Captured(pick(*args, **kwargs))

    monkeypatch.setattr(module, name, stand_in)


@pytest.mark.parametrize("command", ["generate", "serve", "export", "inspect"])
def test_every_compiling_subcommand_takes_act_quant_off_by_default(command):
    required = {"generate": ["--model", "m", "--prompt-ids", "1", "--max-new-tokens", "1"],
                "serve": ["--model", "m"], "export": ["--model", "m", "--out", "o"], "inspect": ["--preset", "tiny"]}
    parser = build_parser()
    assert parser.parse_args([command, *required[command]]).act_quant is False
    assert parser.parse_args([command, *required[command], "--act-quant"]).act_quant is True


@pytest.mark.parametrize("flag", [[], ["--act-quant"]])
@pytest.mark.parametrize("tp", [1, 2])
def test_generate_passes_act_quant_to_the_runner_options(ckpt, tmp_path, monkeypatch, flag, tp):
    """In one process to the Runner's options; at --tp 2 to the options every rank builds with (the ranks are not
    started: a config.json of the tiny-tp widths is all the CLI reads before)."""
    import fxglm5.serve.build

    if tp == 1:
        captured(monkeypatch, fxglm5.serve.build, "build_runner", lambda source, options: options)
    else:
        (tmp_path / "config.json").write_text(json.dumps(Glm5Config.preset("tiny-tp").to_dict()))
        ckpt = tmp_path
        captured(monkeypatch, fxglm5.serve.build, "on_ranks", lambda entry, source, options, *rest: options)
    with pytest.raises(Captured) as got:
        main(["generate", "--model", str(ckpt), "--prompt-ids", "1,2", "--max-new-tokens", "2", "--tp", str(tp), *flag])
    assert got.value.value.act_quant is bool(flag) and got.value.value.tp == tp


@pytest.mark.parametrize("flag", [[], ["--act-quant"]])
def test_serve_passes_act_quant_to_the_engine_options(ckpt, monkeypatch, flag):
    import fxglm5.serve.build

    captured(monkeypatch, fxglm5.serve.build, "build_engine", lambda source, options: options)
    with pytest.raises(Captured) as got:
        main(["serve", "--model", str(ckpt), "--port", "0", *flag])
    assert got.value.value.act_quant is bool(flag)


def test_export_and_inspect_pass_act_quant_to_the_compile(ckpt, monkeypatch):
    import fxglm5.artifact
    import fxglm5.compiler

    captured(monkeypatch, fxglm5.artifact, "export_artifact", lambda model, out, **options: options["act_quant"])
    with pytest.raises(Captured) as got:
        main(["export", "--model", str(ckpt), "--out", str(ckpt.parent / "tiny.pt2"), "--act-quant"])
    assert got.value.value is True
    captured(monkeypatch, fxglm5.compiler, "compile_model", lambda model, **options: options["act_quant"])
    with pytest.raises(Captured) as got:
        main(["inspect", "--preset", "tiny", "--act-quant"])
    assert got.value.value is True


def test_the_reference_backend_refuses_act_quant(ckpt, capsys):
    assert main(["generate", "--model", str(ckpt), "--prompt-ids", "1,2", "--max-new-tokens", "2", "--backend",
                 "reference", "--act-quant"]) == 2
    assert "--act-quant: --backend reference recomputes with the model code" in capsys.readouterr().err


# ---- the artifact ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def w8a8_artifact(model, tmp_path_factory):
    return export_artifact(model, tmp_path_factory.mktemp("art") / "w8a8.pt2", act_quant=True)


def flip(doc) -> None:
    """The program's ``act_quant`` arguments set to false (a W8A16 export's program)."""
    for node in doc["graph_module"]["graph"]["nodes"]:
        for arg in node["inputs"]:
            if arg["name"] == "act_quant":
                arg["arg"] = {"as_bool": False}


def test_a_w8a8_artifact_records_it_and_serves_the_w8a8_runners_tokens(w8a8_artifact, w8a8):
    art = load_artifact(w8a8_artifact)
    assert art.act_quant is True and art.record["act_quant"] is True
    with pytest.raises(InputError, match=r"act_quant=False: this artifact was exported with act_quant=True \(W8A8 "
                                         r"FP8 GEMMs, fixed in its program\)"):
        art.runner(**SERVE)
    runner = art.runner(**SERVE, act_quant=True)
    assert act_quant_ops(runner.program.graph) == gemms(True)
    assert [seq.output for seq in runner.run([list(p) for p in PROMPTS], NEW)] == [seq.output for seq in w8a8[1]]


@pytest.mark.parametrize("edit, message", [
    (dict(record=lambda r: r.update(act_quant=False)), "says act_quant False; its program has True"),
    (dict(record=lambda r: r.pop("act_quant")), "says act_quant False; its program has True"),  # an older file's
    (dict(record=lambda r: r.update(act_quant="yes")), "act_quant 'yes' is not true or false"),
    (dict(program=flip), "says act_quant True; its program has False"),
])
def test_a_record_that_contradicts_its_programs_gemms_is_refused(w8a8_artifact, tmp_path, edit, message):
    with pytest.raises(CheckpointError, match=f"{RECORD}.*{message}"):
        load_artifact(rewrite(w8a8_artifact, tmp_path / "edited.pt2", **edit))


def test_the_cli_serves_an_artifact_with_its_own_gemms(w8a8_artifact, tmp_path, capsys, monkeypatch):
    import fxglm5.serve.build

    w8a16 = rewrite(w8a8_artifact, tmp_path / "w8a16.pt2", record=lambda r: r.update(act_quant=False), program=flip)
    assert load_artifact(w8a16).act_quant is False
    generate = ["generate", "--prompt-ids", "1,2", "--max-new-tokens", "2"]
    assert main([*generate, "--model", str(w8a16), "--act-quant"]) == 2
    assert f"--act-quant: {w8a16} was exported without --act-quant" in capsys.readouterr().err
    captured(monkeypatch, fxglm5.serve.build, "build_runner", lambda source, options: options)
    with pytest.raises(Captured) as got:
        main([*generate, "--model", str(w8a8_artifact)])  # no flag: the file's own W8A8
    assert got.value.value.act_quant is True
    assert "with W8A8 FP8 GEMMs (exported with --act-quant)" in capsys.readouterr().err


# ---- the export cache --------------------------------------------------------------------------------------------
def fused(act_quant: bool) -> fx.GraphModule:
    """A fused graph as the artifact exports it: its GEMM's ``act_quant`` lives only in the graph's code."""
    root = nn.Module()
    root.register_buffer("weight", torch.zeros(128, 128, dtype=torch.float8_e4m3fn))
    root.register_buffer("scale", torch.ones(1, 1))
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.ops.fxglm5.fp8_linear.default,
                                     (x, graph.get_attr("weight"), graph.get_attr("scale"), None, act_quant)))
    return fx.GraphModule(root, graph)


def test_the_export_cache_never_gives_a_w8a16_program_for_a_w8a8_graph(model):
    """A fused graph (the artifact's export) is never served a program of the other mode: its key, if it has one,
    differs (today a GraphModule is not cached at all: its class is made inside ``GraphModule.__new__``). The
    capture, which the cache does serve, precedes the fuse stage: a hit is fused in the mode asked for."""
    x = (torch.randn(4, 128),)
    keys = {quant: export_cache.cache_key(fused(quant), x, None, None, {"strict": False}) for quant in (False, True)}
    assert keys[False] is None or keys[False] != keys[True]
    export_cache.cached_export(fused(False), x, strict=False)
    program = export_cache.cached_export(fused(True), x, strict=False)
    (node,) = [n for n in program.graph.nodes if n.target is torch.ops.fxglm5.fp8_linear.default]
    assert node.args[-1] is True
    graphs = {}
    for quant in (False, True):
        hits = export_cache.stats["hits"]
        graphs[quant] = compile_model(model, stages=(Stage.MATCH, Stage.FUSE), act_quant=quant).graph
    assert export_cache.stats["hits"] > hits  # the second capture of the model: the first one's program
    for quant, graph in graphs.items():  # before fuse_kernels: per layer q_a, q_b, kv_a, o_proj, the indexer's wq_b
        # and wk, and the dense MLP's or the shared expert's 3 (4 x 6 + 4 x 3); the routed experts of 3 MoE layers
        assert act_quant_ops(graph) == {("fp8_linear", quant): 36, ("moe_fp8", quant): 3}
