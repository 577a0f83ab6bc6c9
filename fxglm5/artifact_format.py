"""The artifact file format (fxglm5-artifact/4), and what loading one trusts.

A zip of four members, and the checkpoint's text side where it has one, and nothing else: ``fxglm5.json`` (the
record: format, config, compute dtype, head, ``act_quant``, the layer map, the passes run with their match counts
and source hashes, versions), ``program.json`` (the exported program in torch's JSON schema, ``torch._export.serde``, without
its guards code), ``weights.safetensors`` and ``constants.safetensors``; then ``tokenizer.json``,
``tokenizer_config.json`` (with the chat template) and ``generation_config.json`` (the EOS ids) as the checkpoint
stores them, JSON each, so that text prompts work on the file. No pickle, no sample inputs, no Python source.
An fxglm5-artifact/3 file (the same without the text side) reads as before. ``act_quant`` says whether the
fuse stage made the FP8 GEMMs W8A8 (activations quantized 1x128 on the fly) or W8A16: the program's ops carry it,
so it is fixed at export; a record without it (written before the field) is False, as every such program is.

The program holds the rewritten layer-kind prefix only (``fxglm5.capture.by_kind``: 5 of GLM-5's 78 layers);
the record's ``layers`` map (the KindPlan: ``kinds``, ``prefix``, ``source``, ``depth``) says which program
layer each of the model's layers copies. The tensors are every layer's, once, in the model's naming: the
weights (parameters) in ``weights.safetensors``, the constants the passes derived (the absorbed MLA W_UK / W_UV
of every layer, stored as tensors: their recipes are Python and stay out of the file) in
``constants.safetensors``. A model that could not be captured per kind is stored whole with the identity map.
fxglm5-artifact/2 (the whole stitched model re-exported) is refused by name: re-export it.

Reading runs nothing from the file. Before anything is deserialized it refuses any other member (a torch.export
.pt2, fxglm5-artifact/1 included, holds pickles), and any part of the program that torch's deserializer or
``ExportedProgram.module()`` would evaluate as Python: guards code (exec'd), a symbolic size that is not plain
sympy (``sympify`` evals it), a node name or parameter path that is not an identifier (FX generates code
from them), an op that is not a registered, non-mutating aten or fxglm5 op (called when the graph runs),
subgraphs and script objects. Tensors are read only through safetensors. Then the record is checked against
the program (vocab, width, layers, dtype, index_topk, eps, head, act_quant: every op's ``act_quant`` argument),
the layer map against the model (one entry
per layer, positions inside the program's layers, the plan of its own kinds), and the tensors against both: the
program's and each copied layer's counterpart of them present in their member, with the shape and dtype the
program takes, and nothing else stored.
"""

from __future__ import annotations

import inspect
import json
import math
import operator
import re
import zipfile
from pathlib import Path

import safetensors.torch
import torch
from torch._export.serde import serialize as serde

import fxglm5.ops  # noqa: F401 - registers the fxglm5 ops a program names
from fxglm5.capture.by_kind import layer_copies
from fxglm5.capture.layer_kinds import KindPlan, plan_kinds
from fxglm5.errors import CheckpointError
from fxglm5.model.config import Glm5Config
from fxglm5.model.tokenizer import TEXT_FILES

FORMAT = "fxglm5-artifact/4"
READABLE = ("fxglm5-artifact/3", FORMAT)  # /3: no text side
OLD_FORMATS = ("fxglm5-artifact/1", "fxglm5-artifact/2")
RECORD, PROGRAM, WEIGHTS, CONSTANTS = "fxglm5.json", "program.json", "weights.safetensors", "constants.safetensors"
MEMBERS = (RECORD, PROGRAM, WEIGHTS, CONSTANTS)


def _serialize_program(program: torch.export.ExportedProgram) -> bytes:
    """The program as torch's JSON serde writes it. torch 2.13 can skip pickling the weights it is not asked to
    keep; torch 2.11 has no such switch (its ``serialize`` pickles them into bytes that are dropped here)."""
    if "serialize_state_dict" in inspect.signature(serde.serialize).parameters:
        return serde.serialize(program, serialize_state_dict=False, serialize_constants=False).exported_program
    return serde.serialize(program).exported_program


def plan_record(plan: KindPlan) -> dict:
    """The record's ``layers`` field for ``plan``."""
    return dict(kinds=list(plan.kinds), prefix=plan.prefix, source=list(plan.source), depth=plan.depth)


def write(path: Path, program: torch.export.ExportedProgram, record: dict, weights: dict, constants: dict,
          texts: dict[str, str] | None = None) -> None:
    """Save ``program`` (the rewritten prefix), its ``record`` (with the ``layers`` map), every layer's ``weights``
    and ``constants`` and the checkpoint's ``texts`` (:data:`TEXT_FILES` by name) as an artifact at ``path``."""
    doc = json.loads(_serialize_program(program))
    doc.pop("guards_code", None)  # Python source; without sample inputs torch makes no guards from it anyway
    members = {RECORD: json.dumps(record, indent=1), PROGRAM: json.dumps(doc),
               WEIGHTS: safetensors.torch.save(_plain(path, weights)),
               CONSTANTS: safetensors.torch.save(_plain(path, constants)),
               **{name: text for name, text in (texts or {}).items() if name in TEXT_FILES}}
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)


def is_artifact(path: Path) -> bool:
    """Whether ``path`` is an fxglm5 artifact of any format (what ``fxglm5 export`` may replace)."""
    try:
        with zipfile.ZipFile(path) as archive:
            record = json.loads(archive.read(RECORD))
    except (zipfile.BadZipFile, KeyError, OSError, ValueError, EOFError):
        return False
    return isinstance(record, dict) and str(record.get("format", "")).startswith("fxglm5-artifact/")


def _plain(path: Path, tensors: dict) -> dict[str, torch.Tensor]:
    """Plain contiguous CPU tensors, each with its own storage (what safetensors stores: no strides, no
    sharing); a constant that is not a tensor (a ``torch.ScriptObject``) cannot be stored."""
    plain, seen = {}, set()
    for name, value in tensors.items():
        if type(value) not in (torch.Tensor, torch.nn.Parameter):
            raise CheckpointError(f"{path}: {name} is {type(value).__name__}, not a plain tensor "
                                  "(all an artifact stores)")
        value = value.detach().cpu()
        storage = value.untyped_storage().data_ptr()
        shared = storage in seen and value.numel() > 0
        own = value.is_contiguous() and not shared
        plain[name] = value if own else value.clone(memory_format=torch.contiguous_format)
        seen.add(storage)
    return plain


def read(path: Path) -> tuple[torch.export.ExportedProgram, Glm5Config, torch.dtype, str, dict, KindPlan, dict, dict]:
    """The program, config, dtype, head, record, layer plan, every stored tensor by name (the program's among
    them) and the text side (:data:`TEXT_FILES` by name) of the artifact at ``path``, checked as the module says;
    CheckpointError naming the file (and the member, field or tensor) otherwise."""
    try:
        with zipfile.ZipFile(path) as archive:
            _check_members(path, archive)
            config, dtype, head, record = _read_record(path, archive.read(RECORD))
            texts = {name: _text(path, name, archive.read(name)) for name in TEXT_FILES if name in archive.namelist()}
            raw = archive.read(PROGRAM)
            doc = _json(path, PROGRAM, raw)
            _check_program(path, doc)
            weights, constants = (_read_tensors(path, archive, name) for name in (WEIGHTS, CONSTANTS))
    except (zipfile.BadZipFile, EOFError, OSError) as err:
        raise CheckpointError(f"{path}: not an fxglm5 artifact (truncated, or not a zip archive: {err})") from None
    try:
        params = _check_record(path, doc, weights, config, dtype, head, record["act_quant"])
        plan = _read_plan(path, record, config)  # after the record's own fields: a map can only be as long as they say
        copies = _check_stored(path, doc, plan, {WEIGHTS: weights, CONSTANTS: constants})
    except (KeyError, TypeError, AttributeError, StopIteration) as err:
        raise CheckpointError(f"{path}: {PROGRAM} is not an exported program ({type(err).__name__}: {err})") from None
    params |= {name for param in params for name in copies.get(param, ())}
    weights = {k: torch.nn.Parameter(v, requires_grad=False) if k in params else v for k, v in weights.items()}
    tensors = {**weights, **constants}
    try:
        program = serde.deserialize(serde.SerializedArtifact(raw, *(
            {k: v for k, v in member.items() if k in copies} for member in (weights, constants)), b""))
    except Exception as err:  # noqa: BLE001 - a program torch cannot rebuild is this file's problem
        raise CheckpointError(f"{path}: {PROGRAM} does not deserialize "
                              f"({type(err).__name__}: {str(err)[:300]})") from None
    _check_tensors(path, program, tensors, copies)
    return program, config, dtype, head, record, plan, tensors, texts


def _check_members(path: Path, archive: zipfile.ZipFile) -> None:
    """Refuse, before deserializing anything, a member the format does not have (a pickle above all: a
    torch.export .pt2, fxglm5-artifact/1 included, holds its sample inputs as one)."""
    names = archive.namelist()
    foreign = [name for name in names if name not in MEMBERS + TEXT_FILES]
    if foreign:
        pickles = [name for name in foreign if _is_pickle(archive.open(name).read(2))]
        name = (pickles or foreign)[0]
        torch_pt2 = any(n.endswith("archive_format") for n in names)
        raise CheckpointError(
            f"{path}: member {name} is {'a pickle' if pickles else 'not part of the format'}"
            + (" (a torch.export .pt2, as fxglm5-artifact/1 was: export it again)" if torch_pt2 else "")
            + f"; {FORMAT} holds only {', '.join(MEMBERS)} and {', '.join(TEXT_FILES)}, and loading refuses anything "
              "else undeserialized")
    for name in MEMBERS:
        if names.count(name) != 1:
            raise CheckpointError(f"{path}: not an fxglm5 artifact ({names.count(name)} members {name}, expected 1)")
    for name in TEXT_FILES:
        if names.count(name) > 1:
            raise CheckpointError(f"{path}: not an fxglm5 artifact ({names.count(name)} members {name}, expected 1)")


def _is_pickle(head: bytes) -> bool:
    """A pickle (protocol 2 and up) or a torch.save zip (which holds one)."""
    return head[:1] == b"\x80" or head == b"PK"


def _text(path: Path, member: str, raw: bytes) -> str:
    """A text-side member: UTF-8 JSON (the tokenizer parses it; nothing of it runs as Python)."""
    _json(path, member, raw)
    return raw.decode("utf-8")


def _json(path: Path, member: str, raw: bytes):
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: {member} is not JSON ({err})") from None


def _read_record(path: Path, raw: bytes) -> tuple[Glm5Config, torch.dtype, str, dict]:
    record = _json(path, RECORD, raw)
    found = record.get("format") if isinstance(record, dict) else None
    if found in OLD_FORMATS:
        raise CheckpointError(f"{path}: an {found} artifact; this fxglm5 reads {' and '.join(READABLE)} only (it "
                              "stores each layer kind's program once): export it again from its checkpoint "
                              "(fxglm5 export)")
    if found not in READABLE:
        raise CheckpointError(f"{path}: not an fxglm5 artifact ({RECORD}: format {found!r}, expected {FORMAT!r})")
    if not isinstance(record.get("config"), dict):
        raise CheckpointError(f"{path}: {RECORD} has no config (the model's config.json fields)")
    config = Glm5Config.from_dict(record["config"], source=f"{path}:{RECORD}")
    dtype = getattr(torch, str(record.get("dtype")), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"{path}: {RECORD} dtype {record.get('dtype')!r} is not a torch dtype")
    if record.get("head") not in ("logits", "hidden"):
        raise CheckpointError(f"{path}: {RECORD} head {record.get('head')!r} is not 'logits' or 'hidden'")
    record.setdefault("act_quant", False)  # written before the field: every such export was W8A16
    if not isinstance(record["act_quant"], bool):
        raise CheckpointError(f"{path}: {RECORD} act_quant {record['act_quant']!r} is not true or false")
    return config, dtype, record["head"], record


def _read_tensors(path: Path, archive: zipfile.ZipFile, member: str) -> dict[str, torch.Tensor]:
    try:
        return safetensors.torch.load(archive.read(member))
    except Exception as err:  # noqa: BLE001 - safetensors raises its own SafetensorError and others
        raise CheckpointError(f"{path}: {member} is not a safetensors file ({err})") from None


# What torch's deserializer and ``ExportedProgram.module()`` would evaluate as Python: sympy expressions
# (``sympify`` evals them), node names and parameter paths (FX generates and execs code with them), guards
# code (exec'd), op targets (called when the graph runs), subgraphs and script objects.
_NAME_KEYS = {"name", "as_name", "parameter_name", "buffer_name", "tensor_constant_name", "fqn", "forward_arg_names"}
_NAME_TABLES = {"tensor_values", "sym_int_values", "sym_bool_values", "sym_float_values"}
_REFUSED_KEYS = {"guards_code", "as_graph", "as_custom_obj", "custom_obj", "custom_obj_values"}
_SYMPY_NAMES = {"Symbol", "Integer", "Rational", "Float", "Add", "Mul", "Pow", "Max", "Min", "Mod", "True", "False",
                "positive", "integer", "nonnegative", "real", "finite", "oo",
                *torch.utils._sympy.functions.__all__}


def _check_program(path: Path, doc) -> None:
    """Refuse, before deserializing, anything in the program that would run as Python."""
    def refuse(what: str):
        raise CheckpointError(f"{path}: {PROGRAM} {what}; loading evaluates no Python from the file")

    stack = [("", doc)]
    while stack:
        key, value = stack.pop()
        if isinstance(value, dict):
            for k, v in value.items():
                if k in _REFUSED_KEYS and v:
                    refuse(f"holds {k} (Python source, a subgraph or a script object)")
                if key in _NAME_TABLES and not _is_name(k):
                    refuse(f"names a value {k!r}, not an identifier")
                stack.append((k, v))
        elif isinstance(value, list):
            stack.extend((key, v) for v in value)
        elif key in _NAME_KEYS and not (isinstance(value, str) and _is_name(value)):
            refuse(f"{key} {value!r} is not an identifier")
        elif key in ("target", "as_operator") and not _allowed_op(value):
            refuse(f"calls {value!r}, not a registered aten or fxglm5 op")
        elif key == "expr_str" and not _is_sympy(value):
            refuse(f"size expression {value!r} is not plain sympy")


def _is_name(text: str) -> bool:
    """An identifier, or a dotted module path such as ``model.layers.0.mlp`` (or "", the root module's)."""
    return re.fullmatch(r"((?!\d)\w+|\d+)(\.((?!\d)\w+|\d+))*|", text, re.ASCII) is not None


def _is_sympy(text) -> bool:
    return (isinstance(text, str) and re.fullmatch(r"[\w\s(),'.=+\-*/]*", text) is not None
            and all(name in _SYMPY_NAMES or re.fullmatch(r"[a-z]{1,3}\d+", name)
                    for name in re.findall(r"[A-Za-z_]\w*", text)))


def _allowed_op(target) -> bool:
    """A registered, non-mutating aten or fxglm5 op overload, getitem, or torch's symbolic-size arithmetic."""
    if not isinstance(target, str):
        return False
    root, *parts = target.split(".")
    value = {"torch": torch, "_operator": operator, "math": math}.get(root)
    for part in parts:
        value = getattr(value, part, None)
    if isinstance(value, torch._ops.OpOverload):
        return value.namespace in ("aten", "fxglm5") and not value._schema.is_mutable
    return value is operator.getitem or value in serde._SYM_OPS


def _check_record(path: Path, doc: dict, weights: dict, config: Glm5Config, dtype: torch.dtype, head: str,
                  act_quant: bool) -> set:
    """The record against its program: each field below as the program's weights and op arguments give it
    (the indexer's top-k, the eps of the norms that take ``rms_norm_eps``, the ``act_quant`` of every FP8 GEMM).
    Returns the parameters' names."""
    specs = doc["graph_module"]["signature"]["input_specs"]
    params = {spec["parameter"]["arg"]["name"]: spec["parameter"]["parameter_name"] for spec in specs
              if "parameter" in spec}

    def op_args(op: str | None) -> list[dict]:
        """The arguments of each node of fxglm5 ``op`` (None: of every fxglm5 op), by name."""
        return [{a["name"]: next(iter(a["arg"].values())) for a in node["inputs"]}
                for node in doc["graph_module"]["graph"]["nodes"]
                if node["target"] == f"torch.ops.fxglm5.{op}.default"
                or op is None and node["target"].startswith("torch.ops.fxglm5.")]

    def model_norm(args: dict) -> bool:
        weight = params.get(args["weight"]["name"], "")
        return weight == "model.norm.weight" or weight.endswith(("input_layernorm.weight",
                                                                 "post_attention_layernorm.weight"))

    embed = weights.get("model.embed_tokens.weight")
    if embed is None:
        raise CheckpointError(f"{path}: {WEIGHTS} has no model.embed_tokens.weight")
    lm_head = weights.get("lm_head.weight")
    found = dict(vocab_size={embed.shape[0]} | ({lm_head.shape[0]} if lm_head is not None else set()),
                 hidden_size={embed.shape[1]},
                 num_hidden_layers={len({k.split(".")[2] for k in weights if k.startswith("model.layers.")})},
                 index_topk={args["topk"] for args in op_args("indexer_topk")},
                 rms_norm_eps={args["eps"] for args in op_args("rms_norm") if model_norm(args)},
                 dtype={embed.dtype}, head={"hidden" if lm_head is None else "logits"},
                 act_quant={args["act_quant"] for args in op_args(None) if "act_quant" in args})
    claimed = dict(dtype=dtype, head=head, act_quant=act_quant)
    for field, values in found.items():
        claim = claimed[field] if field in claimed else getattr(config, field)
        if values and values != {claim}:
            shown = ", ".join(sorted(map(str, values)))
            raise CheckpointError(f"{path}: {RECORD} says {field} {claim}; its program has {shown}")
    return set(params.values())


_LAYER_FIELDS = ("kinds", "source")


def _read_plan(path: Path, record: dict, config: Glm5Config) -> KindPlan:
    """The record's ``layers`` map: one kind and one program position per layer of the model, positions inside
    the program's ``prefix`` layers, and the very plan ``plan_kinds`` makes of those kinds at that depth (what
    the stitcher's wiring relies on)."""
    layers = record.get("layers")
    if not isinstance(layers, dict):
        raise CheckpointError(f"{path}: {RECORD} has no layers map (which program layer each model layer copies)")
    for field in ("prefix", "depth", *_LAYER_FIELDS):
        value = layers.get(field)
        if not all(type(v) is int and v >= 0 for v in (value if field in _LAYER_FIELDS and isinstance(value, list)
                                                         else [value])):
            raise CheckpointError(f"{path}: {RECORD} layers.{field} {repr(value)[:80]} is not "
                                  + ("a list of non-negative integers" if field in _LAYER_FIELDS
                                     else "a non-negative integer"))
    total = config.num_hidden_layers
    for field in _LAYER_FIELDS:
        if len(layers[field]) != total:
            raise CheckpointError(f"{path}: {RECORD} layers.{field} has {len(layers[field])} entries; "
                                  f"num_hidden_layers is {total}")
    prefix = layers["prefix"]
    for j, p in enumerate(layers["source"]):
        if p >= prefix:
            raise CheckpointError(f"{path}: {RECORD} layers.source[{j}] is {p}, outside the program's {prefix} layers "
                                  "(layers.prefix)")
    plan = KindPlan(tuple(layers["kinds"]), prefix, tuple(layers["source"]), layers["depth"])
    if plan_kinds(list(plan.kinds), plan.depth) != plan:
        raise CheckpointError(f"{path}: {RECORD} layers map is not the plan of its own kinds at depth {plan.depth} "
                              f"(expected {plan_record(plan_kinds(list(plan.kinds), plan.depth))})")
    return plan


def _check_stored(path: Path, doc: dict, plan: KindPlan, members: dict[str, dict]) -> dict[str, list[str]]:
    """Every tensor the program takes, and each copied layer's counterpart of it, stored in the member the
    program's own is in; nothing else stored. Returns each program tensor's copies' names."""
    kinds = dict(parameter=WEIGHTS, buffer=WEIGHTS, tensor_constant=CONSTANTS)
    copies: dict[str, list[str]] = {}
    layers = set()
    for spec in doc["graph_module"]["signature"]["input_specs"]:
        kind, arg = next(iter(spec.items()))
        if kind not in kinds:
            continue
        name = arg[f"{kind}_name"]
        member = CONSTANTS if kind == "buffer" and not arg.get("persistent", True) else kinds[kind]
        if name not in members[member]:
            raise CheckpointError(f"{path}: {member} has no {name} (the program takes it)")
        copies[name] = []
        if name.startswith("model.layers."):
            layers.add(name.split(".")[2])
        for j, copy in layer_copies(name, plan):
            if copy not in members[member]:
                raise CheckpointError(f"{path}: {member} has no {copy} (layer {j} copies the program's layer "
                                      f"{plan.source[j]}, which takes {name})")
            copies[name].append(copy)
    if layers != {str(p) for p in range(plan.prefix)}:
        raise CheckpointError(f"{path}: {RECORD} layers.prefix is {plan.prefix}; its program holds "
                              f"{len(layers)} layers ({', '.join(sorted(layers, key=int))})")
    read = set(copies) | {name for names in copies.values() for name in names}
    for member, tensors in members.items():
        extra = sorted(set(tensors) - read)
        if extra:
            raise CheckpointError(f"{path}: {member} holds {extra[0]}, which neither the program nor a layer the "
                                  "map copies reads")
    return copies


def _check_tensors(path: Path, program, tensors: dict, copies: dict[str, list[str]]) -> None:
    """Each stored tensor (a program tensor and its copies in other layers) has the shape and dtype the program
    was exported with."""
    signature = program.graph_signature
    names = {**signature.inputs_to_parameters, **signature.inputs_to_buffers,
             **signature.inputs_to_lifted_tensor_constants}
    for node in program.graph.find_nodes(op="placeholder"):
        if node.name in names:
            name, meta = names[node.name], node.meta["val"]
            for stored in (name, *copies[name]):
                tensor = tensors[stored]
                if tensor.shape != meta.shape or tensor.dtype != meta.dtype:
                    raise CheckpointError(f"{path}: tensor {stored} is {tensor.dtype} {tuple(tensor.shape)}; the "
                                          f"program takes {meta.dtype} {tuple(meta.shape)}"
                                          + (f" (for {name})" if stored != name else ""))
