"""The exported-artifact front door: a checkpoint exported once (the matched and fused program with its
weights) and served from the file alone gives the tokens and hidden states of the model it came from; the
cache and lower stages run at load with the same matches; a file that is not an artifact is refused by name;
the CLI exports and generates from it. Loading runs nothing from the file: a planted payload (a pickle, or
Python hidden in the program) is refused before it could run, and a record that contradicts its program is
refused by field."""

import io
import json
import logging
import operator
import zipfile

import pytest
import torch

from fxglm5.artifact import CONSTANTS, FORMAT, MEMBERS, PROGRAM, RECORD, WEIGHTS, export_artifact, load_artifact
from fxglm5.cli import main
from fxglm5.errors import CheckpointError, InputError
from fxglm5.model.modeling import Glm5ForCausalLM
from fxglm5.model.tiny import deep_tiny_config, make_tiny_checkpoint
from fxglm5.runtime.options import RunnerOptions
from fxglm5.runtime.runner import Runner
from fxglm5.runtime.speculative import SpeculativeConfig
from fxglm5.serve.build import build_runner

PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46], [7, 1, 8]]  # around index_topk (8)
SERVE = dict(kv_cache="fp8", block_size=16, max_cache_tokens=512)


@pytest.fixture(scope="module")
def served(model):
    """The in-memory Runner's tokens for PROMPTS (fp8 cache, 16-token blocks): what an artifact of the checkpoint,
    captured by kind or whole, must generate."""
    return Runner(model, **SERVE).generate(PROMPTS, 6)


@pytest.fixture(scope="module")
def artifact_path(model, tmp_path_factory):
    return export_artifact(model, tmp_path_factory.mktemp("art") / "tiny.pt2")


def rewrite(src, dst, *, record=None, program=None, weights=None, constants=None, extra=()):
    """A copy of the artifact ``src`` with its record and program edited in place (``record(dict)``,
    ``program(dict)``), its tensors too (``weights(dict)``, ``constants(dict)``: name -> tensor) and ``extra``
    (name, bytes) members added."""
    from safetensors.torch import load, save

    with zipfile.ZipFile(src) as old, zipfile.ZipFile(dst, "w") as new:
        for name in old.namelist():
            data = old.read(name)
            edit = {RECORD: record, PROGRAM: program}.get(name)
            if edit is not None:
                doc = json.loads(data)
                edit(doc)
                data = json.dumps(doc)
            edit = {WEIGHTS: weights, CONSTANTS: constants}.get(name)
            if edit is not None:
                tensors = load(data)
                edit(tensors)
                data = save(tensors)
            new.writestr(name, data)
        for name, data in extra:
            new.writestr(name, data)
    return dst


class Payload:
    """Unpickling this creates the file ``marker`` (what a planted payload would do, harmlessly)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def test_an_artifact_generates_the_tokens_of_its_checkpoint(model, artifact_path, served):
    with zipfile.ZipFile(artifact_path) as archive:  # the format's four members, none of them a pickle
        assert archive.namelist() == list(MEMBERS)
        assert all(archive.read(name)[:1] != b"\x80" for name in MEMBERS)
    art = load_artifact(artifact_path)
    assert art.config == model.config and art.dtype == torch.float32 and art.head == "logits"
    assert art.record["passes"]["match_sparse_mla"]["matches"] == 4  # what ran before the export
    runner = art.runner(**SERVE)
    matches = {r.name: r.num_matches for r in runner.pass_results}
    assert matches["insert_paged_cache"] == 4 and matches["fuse_norm_rope_into_cache_writes"] == 8
    assert runner.generate(PROMPTS, 6) == served


def test_a_hidden_head_artifact_gives_the_decoder_output(model, tmp_path):
    """head="hidden" (what RTP-LLM takes): one prefill of 11 tokens over a compute-dtype cache (exact top-k)
    against ``Glm5Model`` without a cache."""
    from fxglm5.runtime.cache import PagedCache
    from fxglm5.runtime.forward_context import ForwardContext

    art = load_artifact(export_artifact(model, tmp_path / "hidden.pt2", head="hidden"))
    program = art.compile().program
    ids = torch.tensor(PROMPTS[0])
    T = ids.shape[0]
    cache = PagedCache(program.cache_spec(dtype=torch.float32), 4, 16)
    ctx = ForwardContext.build(True, [T], [0], [[1]], block_size=16, kernel_block_size=16, num_blocks=4,
                               max_position_embeddings=model.config.max_position_embeddings).validate()
    out = program(ctx.step_inputs(torch.arange(T)), ids, cache.graph_inputs())
    assert out.logits is None
    hidden = out.hidden[None]
    with torch.no_grad():
        ref = model.model(ids[None])
    assert hidden.shape == ref.shape == (1, T, model.config.hidden_size)
    assert (hidden - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_files_that_are_not_artifacts_are_refused_by_name(tmp_path, artifact_path):
    with pytest.raises(CheckpointError, match="no such artifact"):
        load_artifact(tmp_path / "missing.pt2")
    junk = tmp_path / "junk.pt2"
    junk.write_bytes(b"not a zip")
    with pytest.raises(CheckpointError, match="junk.pt2: not an fxglm5 artifact .truncated, or not a zip"):
        load_artifact(junk)
    # a genuine artifact whose fxglm5 record says another format
    other = rewrite(artifact_path, tmp_path / "other.pt2", record=lambda r: r.update(format="something-else/9"))
    with pytest.raises(CheckpointError, match=f"other.pt2: not an fxglm5 artifact.*{FORMAT}"):
        load_artifact(other)


def test_a_torch_export_pt2_with_a_pickled_payload_is_refused_unread(tmp_path, artifact_path):
    """fxglm5-artifact/1 was a torch.export .pt2: torch.export.load unpickles its sample inputs (falling back
    to weights_only=False), so a payload there ran before any check. Refused by name; the payload never runs."""
    marker = tmp_path / "marker"
    with zipfile.ZipFile(artifact_path) as archive:
        record = dict(json.loads(archive.read(RECORD)), format="fxglm5-artifact/1")
    program = torch.export.export(torch.nn.Linear(2, 2), (torch.zeros(1, 2),))
    classic = tmp_path / "classic.pt2"
    torch.export.save(program, classic, extra_files={RECORD: json.dumps(record)})
    planted = tmp_path / "planted.pt2"
    with zipfile.ZipFile(classic) as old, zipfile.ZipFile(planted, "w") as new:
        for name in old.namelist():
            payload = io.BytesIO()
            torch.save(Payload(marker), payload)
            new.writestr(name, payload.getvalue() if "sample_inputs" in name else old.read(name))
    with pytest.raises(CheckpointError, match=r"planted.pt2: member \S*sample_inputs\S* is a pickle "
                                              r"\(a torch.export .pt2, as fxglm5-artifact/1 was"):
        load_artifact(planted)
    assert not marker.exists()


def test_a_pickled_member_beside_the_format_is_refused_unread(tmp_path, artifact_path):
    import pickle

    marker = tmp_path / "marker"
    planted = rewrite(artifact_path, tmp_path / "planted.pt2", extra=[("payload.pkl", pickle.dumps(Payload(marker)))])
    with pytest.raises(CheckpointError, match=f"planted.pt2: member payload.pkl is a pickle; {FORMAT} holds only"):
        load_artifact(planted)
    assert not marker.exists()


def _first_size_expr(doc):
    return next(size["as_expr"] for meta in doc["graph_module"]["graph"]["tensor_values"].values()
                for size in meta["sizes"] if "as_expr" in size)


def _first_parameter(doc):
    return next(s["parameter"] for s in doc["graph_module"]["signature"]["input_specs"] if "parameter" in s)


def _code(marker):
    return f"__import__('pathlib').Path({str(marker)!r}).touch()"


# Places in program.json that torch's deserializer or ExportedProgram.module() evaluate as Python. The first
# ran its payload before this check existed (sympify evals size expressions); each is refused before
# deserializing.
PROGRAM_PAYLOADS = {
    "size expression": (lambda doc, m: _first_size_expr(doc).update(expr_str=_code(m)), "size expression"),
    "guards code": (lambda doc, m: doc.update(guards_code=[f"L['input_ids'].size()[0] > 0 and {_code(m)}"]),
                    "holds guards_code"),
    "op target": (lambda doc, m: doc["graph_module"]["graph"]["nodes"][0].update(target="torch.os.system"),
                  "calls 'torch.os.system', not a registered aten or fxglm5 op"),
    "parameter path": (lambda doc, m: _first_parameter(doc).update(parameter_name=f'x"), {_code(m)}, ("'),
                       "parameter_name .* is not an identifier"),
}


@pytest.mark.parametrize("where", PROGRAM_PAYLOADS)
def test_python_planted_in_the_program_is_refused_before_deserializing(tmp_path, artifact_path, where):
    plant, message = PROGRAM_PAYLOADS[where]
    marker = tmp_path / "marker"
    planted = rewrite(artifact_path, tmp_path / "planted.pt2", program=lambda doc: plant(doc, marker))
    with pytest.raises(CheckpointError, match=f"planted.pt2: {PROGRAM} {message}.*loading evaluates no Python"):
        load_artifact(planted)
    assert not marker.exists()


def _drop_last_layer(config):
    config.update(num_hidden_layers=3, mlp_layer_types=config["mlp_layer_types"][:3],
                  indexer_types=config["indexer_types"][:3])


CONTRADICTIONS = {  # field: (edit of the record, what the message says)
    "vocab_size": (lambda r: r["config"].update(vocab_size=1024), "vocab_size 1024; its program has 512"),
    "num_hidden_layers": (lambda r: _drop_last_layer(r["config"]), "num_hidden_layers 3; its program has 4"),
    "dtype": (lambda r: r.update(dtype="bfloat16"), "dtype torch.bfloat16; its program has torch.float32"),
    "index_topk": (lambda r: r["config"].update(index_topk=16), "index_topk 16; its program has 8"),
    "rms_norm_eps": (lambda r: r["config"].update(rms_norm_eps=1e-6), "rms_norm_eps 1e-06; its program has 1e-05"),
    "head": (lambda r: r.update(head="hidden"), "head hidden; its program has logits"),
}


@pytest.mark.parametrize("field", CONTRADICTIONS)
def test_a_record_that_contradicts_its_program_is_refused_by_field(tmp_path, artifact_path, field):
    edit, message = CONTRADICTIONS[field]
    with pytest.raises(CheckpointError, match=f"lying.pt2: {RECORD} says {message}"):
        load_artifact(rewrite(artifact_path, tmp_path / "lying.pt2", record=edit))


def test_a_record_without_config_is_refused_by_name(tmp_path, artifact_path):
    with pytest.raises(CheckpointError, match=f"bare.pt2: {RECORD} has no config"):
        load_artifact(rewrite(artifact_path, tmp_path / "bare.pt2", record=lambda r: r.pop("config")))


def test_a_tensor_that_does_not_fit_its_program_is_refused_by_name(tmp_path, artifact_path):
    from safetensors.torch import load, save

    with zipfile.ZipFile(artifact_path) as archive:
        weights = load(archive.read(WEIGHTS))
    weights["model.norm.weight"] = weights["model.norm.weight"][:-1].clone()
    bad = tmp_path / "bad.pt2"
    with zipfile.ZipFile(artifact_path) as old, zipfile.ZipFile(bad, "w") as new:
        for name in old.namelist():
            new.writestr(name, save(weights) if name == WEIGHTS else old.read(name))
    with pytest.raises(CheckpointError, match=r"bad.pt2: tensor model.norm.weight is torch.float32 \(255,\); "
                                              r"the program takes torch.float32 \(256,\)"):
        load_artifact(bad)


def test_a_truncated_artifact_is_one_error_line_and_no_logged_traceback(tmp_path, artifact_path, capsys, caplog):
    cut = tmp_path / "cut.pt2"
    cut.write_bytes(artifact_path.read_bytes()[: artifact_path.stat().st_size // 2])
    caplog.set_level(logging.DEBUG)
    assert main(["generate", "--model", str(cut), "--prompt-ids", "1,2", "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fxglm5: error: {cut}: not an fxglm5 artifact (truncated") and err.count("\n") == 1
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_export_into_a_missing_directory_fails_before_any_work(ckpt, model, tmp_path, monkeypatch, capsys):
    import fxglm5.capture

    def must_not_run(*args, **kwargs):
        raise AssertionError("the export started before its output directory was checked")

    monkeypatch.setattr(Glm5ForCausalLM, "from_pretrained", must_not_run)
    monkeypatch.setattr(fxglm5.capture, "capture", must_not_run)
    out = tmp_path / "missing" / "x.pt2"
    assert main(["export", "--model", str(ckpt), "--out", str(out)]) == 2
    assert f"{out}: directory {out.parent} does not exist" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match="does not exist"):
        export_artifact(model, out)


def test_tensors_are_stored_plain_whatever_their_layout():
    """safetensors stores no strides and refuses shared storage: views, transposes and aliases are stored
    as their own contiguous tensors, FP8 as FP8."""
    from pathlib import Path

    from safetensors.torch import load, save

    from fxglm5.artifact_format import _plain

    base = torch.randn(4, 6)
    tensors = dict(weight=base, alias=base, transposed=base.t(), row=base[1], fp8=base.to(torch.float8_e4m3fn))
    stored = load(save(_plain(Path("x"), tensors)))
    assert all(torch.equal(stored[k].float(), v.float()) and stored[k].dtype == v.dtype for k, v in tensors.items())
    with pytest.raises(CheckpointError, match="x: blob is object, not a plain tensor"):  # e.g. a ScriptObject
        _plain(Path("x"), dict(blob=object()))


def test_cli_exports_and_generates_from_the_artifact(ckpt, tmp_path, capsys):
    """export then generate gives what generate gives with the same flags: one default dtype (export's was
    bfloat16, generate's float32), and the artifact carries the checkpoint's tokenizer, so text prompts (and the chat
    template) work on it and end at its EOS ids."""
    from fxglm5.cli import build_parser

    parsers = build_parser()._subparsers._group_actions[0].choices
    defaults = {name: parsers[name].get_default("dtype") for name in ("export", "demo")}
    assert defaults == {"export": "float32", "demo": "float32"}  # generate's for a checkpoint directory
    out = tmp_path / "cli.pt2"
    assert main(["export", "--model", str(ckpt), "--out", str(out)]) == 0
    ids = ",".join(map(str, PROMPTS[0]))
    common = ["--max-new-tokens", "5", "--kv-cache", "fp8", "--block-size", "16"]
    capsys.readouterr()
    for given in (["--prompt-ids", ids], ["--prompt", "Hello, world!"], ["--prompt", "Tell me", "--chat", "--ids"]):
        assert main(["generate", "--model", str(out), *given, *common]) == 0
        from_artifact = capsys.readouterr().out
        assert main(["generate", "--model", str(ckpt), *given, *common]) == 0
        assert from_artifact == capsys.readouterr().out and from_artifact.strip(), given
    assert main(["generate", "--model", str(out), "--backend", "reference", "--prompt-ids", ids, *common]) == 2
    assert "not an artifact" in capsys.readouterr().err


def test_an_artifact_without_the_text_side_refuses_text_by_name(model, tmp_path, capsys):
    """An artifact exported without a tokenizer directory (or written by fxglm5-artifact/3) carries no text side:
    --prompt is refused naming the missing tokenizer.json in the file; token ids still work."""
    path = export_artifact(model, tmp_path / "bare.pt2")
    assert load_artifact(path).texts == {}
    assert main(["generate", "--model", str(path), "--prompt", "Hi", "--max-new-tokens", "2"]) == 2
    assert f"{path}/tokenizer.json: not found" in capsys.readouterr().err
    assert main(["generate", "--model", str(path), "--prompt-ids", "1,2", "--max-new-tokens", "2"]) == 0


@pytest.mark.parametrize("options, given, error", [
    (RunnerOptions(tp=2), {}, r"tp=2: each rank reads its slices of a checkpoint directory; an exported artifact "
                              r"serves on one rank"),
    (RunnerOptions(speculative=SpeculativeConfig(num_tokens=2)), {},
     "speculative: drafts from the MTP layer of a checkpoint directory, not an artifact"),
    (RunnerOptions(), {"program": None, "drafter": None},
     r"\['drafter', 'program'\]: an artifact compiles its own program and drafts from none"),
])
def test_the_builder_refuses_for_an_artifact_what_it_cannot_serve(artifact_path, options, given, error):
    """An artifact serves on one rank, without drafts, over the program it compiles: the builder says so before any
    compile, for the file and for the loaded artifact alike (a part given is refused, not silently dropped)."""
    for source in (artifact_path, load_artifact(artifact_path)):
        with pytest.raises(InputError, match=error):
            build_runner(source, options, **given)


def test_a_float32_artifact_compiles_with_every_fusion(artifact_path):
    """A float32 model's RMSNorm reads ``x.float()``, which the re-exported program keeps as a cast to float32 of
    the residual sum: fuse_add_rms_norm looks through it (it found 0 of 7 and warned on every load)."""
    art = load_artifact(artifact_path)
    assert art.dtype == torch.float32
    results = art.compile().results
    counted = {r.name: (r.num_matches, r.expected) for r in results if r.expected is not None}
    assert counted["fuse_add_rms_norm"] == (7, 7)
    assert all(found == expected for found, expected in counted.values()), counted


def test_generate_says_the_artifacts_dtype_and_refuses_another(ckpt, artifact_path, tmp_path, capsys):
    """An artifact computes in the dtype it was exported in: generate says so, and refuses a --dtype it cannot honour
    (the flag was silently ignored: a bfloat16 .pt2 gave other tokens than its float32 checkpoint)."""
    common = ["--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--block-size", "16"]
    assert main(["generate", "--model", str(artifact_path), *common]) == 0
    assert f"fxglm5: {artifact_path} runs in float32, the dtype it was exported in" in capsys.readouterr().err
    assert main(["generate", "--model", str(artifact_path), "--dtype", "float32", *common]) == 0
    capsys.readouterr()
    assert main(["generate", "--model", str(artifact_path), "--dtype", "bfloat16", *common]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fxglm5: error: --dtype bfloat16: ") and "exported in float32" in err and err.count("\n") == 1


def test_loading_for_another_device_moves_every_tensor_and_device_argument(artifact_path):
    """Export records the device it ran on (``torch.arange(..., device=cpu)``); serving elsewhere must not
    keep it (the GPU run of an unmoved program failed with a device mismatch). Checked with the meta device."""
    from fxglm5.passes.graph_utils import on_device

    gm = load_artifact(artifact_path).program.module()
    assert any(n.kwargs.get("device") == torch.device("cpu") for n in gm.graph.nodes)  # what export recorded
    gm = on_device(gm, torch.device("meta"))
    assert not any(isinstance(n.kwargs.get("device"), torch.device) and n.kwargs["device"].type != "meta"
                   for n in gm.graph.nodes)
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = gm
            for part in node.target.split("."):
                value = getattr(value, part)
            assert not isinstance(value, torch.Tensor) or value.device.type == "meta", node.target


# ---- fxglm5-artifact/3: each layer kind's program once, the layer map, every layer's tensors once ----------
def _program_layers(program) -> set[int]:
    return {int(name.split(".")[2]) for name in (*program.state_dict, *program.constants)
            if name.startswith("model.layers.")}


def test_a_deep_model_stores_its_prefix_once_and_generates_the_runners_tokens(tmp_path):
    """8 layers of GLM-5's kinds (its 5-layer prefix and 3 layers copying the prefix's last, as GLM-5's other 73
    do): the file's program holds the prefix, the record says which of them each layer copies, the file holds each
    layer's tensors once (about one copy of what the model serves with), and the stitched artifact generates the
    in-memory Runner's tokens."""
    from fxglm5.capture.layer_kinds import model_plan
    from fxglm5.compiler import compile_model
    from fxglm5.passes.pipeline import Stage

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", fp8=True, config=deep_tiny_config(8))
    model = Glm5ForCausalLM.from_pretrained(ckpt, dtype=torch.float32, progress=False)
    plan = model_plan(model)
    assert plan.prefix == 5 and plan.source[5:] == (4,) * 3
    path = export_artifact(model, tmp_path / "deep.pt2")
    art = load_artifact(path)
    assert _program_layers(art.program) == set(range(plan.prefix))
    assert art.record["layers"] == dict(kinds=list(plan.kinds), prefix=5, source=list(plan.source), depth=1)
    served = compile_model(model, stages=(Stage.MATCH, Stage.FUSE)).graph
    read = {n.target: operator.attrgetter(n.target)(served) for n in served.graph.find_nodes(op="get_attr")}
    layer_tensors = {name: t for name, t in read.items() if name.startswith("model.layers.")}
    assert {name for name in art.tensors if name.startswith("model.layers.")} == set(layer_tensors)
    assert all(torch.equal(art.tensors[name].float(), t.float()) for name, t in layer_tensors.items())
    one_copy = sum(t.numel() * t.element_size() for t in read.values())
    with zipfile.ZipFile(path) as archive:
        stored = sum(archive.getinfo(name).file_size for name in (WEIGHTS, CONSTANTS))
        program_bytes = archive.getinfo(PROGRAM).file_size
    assert one_copy <= stored <= 1.01 * one_copy and program_bytes < stored
    assert art.runner(**SERVE).generate(PROMPTS, 6) == Runner(model, **SERVE).generate(PROMPTS, 6)


def test_a_model_captured_whole_is_stored_whole_with_the_identity_map(ckpt, tmp_path, served):
    """A layer with a hook cannot be proven its kind's: the model is captured whole, and the file holds the whole
    program with each layer copying itself; it loads and generates the tokens of the checkpoint's in-memory Runner
    (captured by kind: the hook does nothing, so the tokens are the same)."""
    model = Glm5ForCausalLM.from_pretrained(ckpt, dtype=torch.float32, progress=False)
    model.model.layers[2].mlp.register_forward_hook(lambda *args: None)
    art = load_artifact(export_artifact(model, tmp_path / "whole.pt2"))
    assert art.record["layers"] == dict(kinds=[0, 1, 2, 3], prefix=4, source=[0, 1, 2, 3], depth=0)
    assert _program_layers(art.program) == {0, 1, 2, 3}
    assert art.runner(**SERVE).generate(PROMPTS, 6) == served


def _layers(**changes):
    return lambda record: record["layers"].update(changes)


def _source(edit):
    return lambda record: record["layers"].update(source=edit(record["layers"]["source"]))


def _drop(name):
    return lambda tensors: tensors.pop(name)


# The tiny artifact's map: kinds (0, 1, 1, 1), prefix 3, source (0, 1, 2, 2) (layer 3 copies layer 2), depth 1.
MALFORMED_MAPS = {  # case: (edits of the file, what the message says)
    "no map": (dict(record=lambda r: r.pop("layers")), f"{RECORD} has no layers map"),
    "position outside the prefix": (dict(record=_source(lambda s: s[:3] + [3])),
                                    rf"{RECORD} layers.source\[3\] is 3, outside the program's 3 layers"),
    "map longer than the model": (dict(record=_source(lambda s: s + [2])),
                                  f"{RECORD} layers.source has 5 entries; num_hidden_layers is 4"),
    "map shorter than the model": (dict(record=_source(lambda s: s[:3])),
                                   f"{RECORD} layers.source has 3 entries; num_hidden_layers is 4"),
    "kinds shorter than the model": (dict(record=_layers(kinds=[0, 1, 1])),
                                     f"{RECORD} layers.kinds has 3 entries; num_hidden_layers is 4"),
    "not a list of integers": (dict(record=_layers(source="0,1,2,2")), f"{RECORD} layers.source '0,1,2,2' is not a list of non-negative integers"),
    "not the plan of its kinds": (dict(record=_source(lambda s: [0, 1, 1, 2])),
                                  f"{RECORD} layers map is not the plan of its own kinds at depth 1"),
    "prefix longer than the program": (dict(record=_layers(kinds=[0, 1, 2, 3], prefix=4, source=[0, 1, 2, 3])),
                                       f"{RECORD} layers.prefix is 4; its program holds 3 layers"),
    "one kind, different graphs": (dict(record=_layers(kinds=[0, 0, 0, 0], depth=2)),
                                   f"{PROGRAM} cannot be stitched as {RECORD} layers says .layers 0 and 1 are one "
                                   "kind but their rewritten graphs differ"),
    "a copied layer's weight missing": (dict(weights=_drop("model.layers.3.mlp.gate.weight")),
                                        f"{WEIGHTS} has no model.layers.3.mlp.gate.weight .layer 3 copies the "
                                        "program's layer 2"),
    "a copied layer's derived constant missing": (
        dict(constants=_drop("model.layers.3.self_attn.kv_b_proj.w_uk")),
        f"{CONSTANTS} has no model.layers.3.self_attn.kv_b_proj.w_uk .layer 3 copies the program's layer 2"),
    "a program layer's weight missing": (dict(weights=_drop("model.layers.1.input_layernorm.weight")),
                                         f"{WEIGHTS} has no model.layers.1.input_layernorm.weight .the program takes"),
    "a tensor no layer reads": (dict(weights=lambda t: t.update({"model.layers.3.extra": torch.zeros(1)})),
                                f"{WEIGHTS} holds model.layers.3.extra, which neither the program nor a layer"),
    "a copied layer's weight of another shape": (
        dict(weights=lambda t: t.update({"model.layers.3.input_layernorm.weight": torch.ones(255)})),
        r"tensor model.layers.3.input_layernorm.weight is torch.float32 \(255,\); the program takes torch.float32 "
        r"\(256,\) \(for model.layers.2.input_layernorm.weight\)"),
    "fxglm5-artifact/2": (dict(record=lambda r: r.update(format="fxglm5-artifact/2")),
                          "an fxglm5-artifact/2 artifact; this fxglm5 reads fxglm5-artifact/3 and fxglm5-artifact/4 only .* export it again"),
}


@pytest.mark.parametrize("case", MALFORMED_MAPS)
def test_a_malformed_layer_map_is_refused_by_name(tmp_path, artifact_path, case):
    edits, message = MALFORMED_MAPS[case]
    with pytest.raises(CheckpointError, match=f"bad.pt2: {message}"):
        load_artifact(rewrite(artifact_path, tmp_path / "bad.pt2", **edits))
