"""Each of the artifact format's no-code checks (fxglm5/artifact_format.py) on a planted file that only it refuses
(issue 40): a registered but mutating op in program.json, a size expression made only of lower-case names and calls,
a stored tensor whose dtype is not the program's, a zip with a duplicated member. Each planted file passes every
other check, so the test fails if that one check is weakened; each is refused by name, with nothing executed
(tripwires: the deserializer and ExportedProgram.module() write a marker file when called, and the size
expression's payload creates one itself when evaluated)."""

import json
import warnings
import zipfile

import pytest
import torch
from safetensors.torch import load, save
from torch._export.serde import serialize as serde

from fxglm5.artifact import CONSTANTS, MEMBERS, PROGRAM, RECORD, WEIGHTS, export_artifact, load_artifact
from fxglm5.errors import CheckpointError
from fxglm5.model.modeling import Glm5ForCausalLM
from fxglm5.model.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def artifact_path(tmp_path_factory):
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-fp8"), fp8=True)
    model = Glm5ForCausalLM.from_pretrained(ckpt, dtype=torch.float32, progress=False)
    return export_artifact(model, tmp_path_factory.mktemp("art") / "tiny.pt2")


def _members(path) -> list[tuple[str, bytes]]:
    with zipfile.ZipFile(path) as archive:
        return [(name, archive.read(name)) for name in archive.namelist()]


def _write(path, members):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # zipfile warns of a duplicate name, and writes it
        with zipfile.ZipFile(path, "w") as archive:
            for name, data in members:
                archive.writestr(name, data)
    return path


def _edit(src, dst, member, edit):
    """A copy of ``src`` whose ``member`` is edited: JSON members as a dict, safetensors ones as name -> tensor."""
    members = []
    for name, data in _members(src):
        if name == member:
            if name.endswith(".json"):
                doc = json.loads(data)
                edit(doc)
                data = json.dumps(doc).encode()
            else:
                tensors = load(data)
                edit(tensors)
                data = save(tensors)
        members.append((name, data))
    return _write(dst, members)


@pytest.fixture
def tripwires(monkeypatch, tmp_path):
    """Marker files: ``deserialized`` when torch's deserializer is called, ``ran`` when the program is made a
    module (its code generated, before it could run)."""
    markers = dict(deserialized=tmp_path / "deserialized", ran=tmp_path / "ran")
    deserialize, module = serde.deserialize, torch.export.ExportedProgram.module

    def tripped_deserialize(*args, **kwargs):
        markers["deserialized"].touch()
        return deserialize(*args, **kwargs)

    def tripped_module(self, *args, **kwargs):
        markers["ran"].touch()
        return module(self, *args, **kwargs)

    monkeypatch.setattr(serde, "deserialize", tripped_deserialize)
    monkeypatch.setattr(torch.export.ExportedProgram, "module", tripped_module)
    return markers


def test_the_tripwires_see_a_good_artifact_load(artifact_path, tripwires):
    load_artifact(artifact_path).runner(kv_cache="fp8", block_size=16, max_cache_tokens=64)
    assert tripwires["deserialized"].exists() and tripwires["ran"].exists()


def _node(doc, target: str) -> dict:
    return next(n for n in doc["graph_module"]["graph"]["nodes"] if n["target"] == target)


def _as_add_(doc):
    _node(doc, "torch.ops.aten.add.Tensor")["target"] = "torch.ops.aten.add_.Tensor"  # same arguments, in place


def _as_copy_(doc):
    """add(self, other) -> copy_(self, src): the node's arguments fit copy_'s schema (it would write in place)."""
    node = _node(doc, "torch.ops.aten.add.Tensor")
    node["target"] = "torch.ops.aten.copy_.default"
    node["inputs"] = [dict(i, name="src") if i["name"] == "other" else i for i in node["inputs"] if i["name"] != "alpha"]


@pytest.mark.parametrize("plant, op", [(_as_add_, "torch.ops.aten.add_.Tensor"),
                                       (_as_copy_, "torch.ops.aten.copy_.default")], ids=["add_", "copy_"])
def test_a_registered_mutating_op_is_refused_by_name(tmp_path, artifact_path, tripwires, plant, op):
    assert torch.ops.aten.add_.Tensor._schema.is_mutable and torch.ops.aten.copy_.default._schema.is_mutable
    planted = _edit(artifact_path, tmp_path / "mutating.pt2", PROGRAM, plant)
    with pytest.raises(CheckpointError, match=f"mutating.pt2: {PROGRAM} calls '{op}', not a registered aten or "
                                              "fxglm5 op.*loading evaluates no Python"):
        load_artifact(planted)
    assert not tripwires["deserialized"].exists() and not tripwires["ran"].exists()


def test_a_size_expression_of_lower_case_names_and_calls_is_refused_unevaluated(tmp_path, artifact_path, tripwires,
                                                                               monkeypatch):
    """``open('marker', 'w')``: no upper-case sympy class, no dunder, no quote-free path; sympify would call it."""
    monkeypatch.chdir(tmp_path)  # the payload's relative path lands here
    payload = "open('marker', 'w')"

    def plant(doc):
        size = next(size["as_expr"] for meta in doc["graph_module"]["graph"]["tensor_values"].values()
                    for size in meta["sizes"] if "as_expr" in size)
        size["expr_str"] = payload

    planted = _edit(artifact_path, tmp_path / "sized.pt2", PROGRAM, plant)
    with pytest.raises(CheckpointError, match=rf"sized.pt2: {PROGRAM} size expression \"open\('marker', 'w'\)\" "
                                              "is not plain sympy"):
        load_artifact(planted)
    assert not (tmp_path / "marker").exists()
    assert not tripwires["deserialized"].exists() and not tripwires["ran"].exists()


def _copied_layer_tensor(path) -> str:
    """A weight of a layer that copies another program layer (so it is not the program's own)."""
    record = json.loads(dict(_members(path))[RECORD])
    j = next(j for j, p in enumerate(record["layers"]["source"]) if p != j)
    return f"model.layers.{j}.input_layernorm.weight"


@pytest.mark.parametrize("which", ["program's", "copied layer's", "constant"])
def test_a_stored_tensor_of_another_dtype_is_refused_by_name(tmp_path, artifact_path, tripwires, which):
    """Same shape, same values, float64 where the program takes float32: refused naming the tensor, before the
    program becomes code."""
    member, name = {"program's": (WEIGHTS, "model.norm.weight"),
                    "copied layer's": (WEIGHTS, _copied_layer_tensor(artifact_path)),
                    "constant": (CONSTANTS, "model.layers.0.self_attn.kv_b_proj.w_uk")}[which]

    def plant(tensors):
        assert tensors[name].dtype == torch.float32
        tensors[name] = tensors[name].double()

    planted = _edit(artifact_path, tmp_path / "wide.pt2", member, plant)
    with pytest.raises(CheckpointError, match=rf"wide.pt2: tensor {name} is torch.float64 \(\d+(, \d+)*,?\); "
                                              r"the program takes torch.float32"):
        load_artifact(planted)
    assert not tripwires["ran"].exists()


@pytest.mark.parametrize("member", MEMBERS)
def test_a_duplicated_member_is_refused_by_name(tmp_path, artifact_path, tripwires, member):
    """Two members of one name (zip readers disagree on which one counts), here the same bytes twice, so that
    nothing but the duplicate is wrong."""
    members = _members(artifact_path)
    planted = _write(tmp_path / "twice.pt2", members + [(member, dict(members)[member])])
    with zipfile.ZipFile(planted) as archive:
        assert archive.namelist().count(member) == 2
    with pytest.raises(CheckpointError, match=f"twice.pt2: not an fxglm5 artifact .2 members {member}, expected 1."):
        load_artifact(planted)
    assert not tripwires["deserialized"].exists() and not tripwires["ran"].exists()
