"""Front door: GLM-5 as one exported file, loaded and served without the model code's checkpoint loading,
capture or matching.

What the file holds is the device-independent half of the compile, once per decoder-layer kind: the leading
layers that show every kind (``fxglm5.capture.by_kind``), captured and rewritten by the match and fuse stages
into fxglm5's canonical ops (``fxglm5::sparse_mla``, ``fp8_linear``, ``moe_fp8`` ...) and re-exported with
dynamic [batch, seq], the map of which of those layers each of the model's layers copies, and every layer's
weights as they were loaded (block-FP8 stays FP8) with the constants the passes derived from them; the format,
and what loading it trusts, are :mod:`fxglm5.artifact_format`'s. Loading stitches the program to the whole
model from the file's tensors (the stitcher of the compile) and runs the device-specific half, the cache,
fuse_kernels and lower stages, for the device it serves on. The caches are not in the file: the paged graph takes
them as inputs (``insert_paged_cache``). The cache stage is not exported because its ops write the caches in
place, which ``torch.export`` would functionalize into a copy of every cache per step.

    fxglm5 export --model CKPT_DIR --out glm5.pt2
    fxglm5 generate --model glm5.pt2 --prompt-ids 1,2,3 --max-new-tokens 16
"""

from __future__ import annotations

import dataclasses
import operator
from pathlib import Path

import torch
from torch import fx

import fxglm5
from fxglm5 import artifact_format
from fxglm5.artifact_format import CONSTANTS, FORMAT, MEMBERS, PROGRAM, RECORD, WEIGHTS
from fxglm5.capture.by_kind import PREFIX, context_depth, layer_copies, stitch
from fxglm5.capture.export import drop_metadata_asserts
from fxglm5.capture.layer_kinds import KindPlan, Unprovable, plan_kinds
from fxglm5.compiler import (MAX_STEP_TOKENS, Compiled, Stage, compile_model, lower_for_device, pass_source_hashes,
                             place_loaded_graph)
from fxglm5.errors import CheckpointError, InputError
from fxglm5.model.config import Glm5Config

__all__ = ["Artifact", "export_artifact", "load_artifact", "check_out_path",
           "FORMAT", "MEMBERS", "RECORD", "PROGRAM", "WEIGHTS", "CONSTANTS"]


@dataclasses.dataclass
class Artifact:
    """A loaded artifact: the canonical program of the layer-kind prefix, the ``plan`` that stitches it to the
    whole model from ``tensors`` (every stored tensor by name), and what the runtime needs beside it
    (``config``, ``dtype``: a :class:`~fxglm5.runtime.runner.Runner` takes an Artifact where it takes a model)."""

    program: torch.export.ExportedProgram
    config: Glm5Config
    dtype: torch.dtype
    head: str
    record: dict
    plan: KindPlan
    tensors: dict
    texts: dict = dataclasses.field(default_factory=dict)  # the checkpoint's tokenizer files, by name

    @property
    def act_quant(self) -> bool:
        """Whether the program's FP8 GEMMs are W8A8 (``export_artifact(act_quant=True)``): fixed at export, where
        the fuse stage wrote it into every GEMM op."""
        return self.record["act_quant"]

    def tokenizer(self, path: str | Path = "artifact"):
        """The checkpoint's tokenizer, chat template and EOS ids the file carries (``fxglm5.model.tokenizer``);
        CheckpointError naming ``path`` where it carries none (an fxglm5-artifact/3 file, or a checkpoint without a
        tokenizer.json)."""
        from fxglm5.model.tokenizer import Tokenizer

        return Tokenizer.from_texts(self.texts, self.config, str(path))

    def graph(self, path: str | Path = "artifact") -> fx.GraphModule:
        """A fresh canonical graph of the whole model: the program stitched to every layer (the program itself
        when it holds them all). CheckpointError naming ``path`` where the program cannot be stitched as the
        map says. Export's metadata asserts, which ``module()`` puts back, are dropped as at capture: they pin the
        intermediates they read (a float32 model's MoE sum behind its cast to float32 would not fuse)."""
        prefix = self.program.module()
        drop_metadata_asserts(prefix)
        if self.plan.prefix == len(self.plan.source):
            return prefix
        try:
            depth = context_depth(prefix, self.plan)
            if depth > self.plan.depth:
                raise Unprovable(f"its layers read {depth} layers back, its map's contexts are {self.plan.depth} deep")
            return stitch(prefix, self.tensors, self.plan)
        except Unprovable as why:
            raise CheckpointError(f"{path}: {PROGRAM} cannot be stitched as {RECORD} layers says ({why})") from None

    def compile(self, device="cpu", backend: str | None = None, disabled_passes=(),
                inputs_validated: bool = True) -> Compiled:
        """A fresh paged program for ``device`` (``Compiled.program``): the canonical whole-model graph with the
        cache, fuse_kernels and lower stages run (without ``disabled_passes``; the passes' ``act_quant`` the
        program's own); ``inputs_validated``: its caller validates each step's context (the Runner does)."""
        return lower_for_device(self.graph(), self.config, device=device, backend=backend, head=self.head,
                                disabled_passes=disabled_passes, act_quant=self.act_quant,
                                inputs_validated=inputs_validated)

    def runner(self, options=None, **runner_options):
        """A :class:`~fxglm5.runtime.runner.Runner` serving this artifact: ``options`` a
        :class:`~fxglm5.runtime.options.RunnerOptions`, or its fields as keywords; its parts built as every
        Runner's (``fxglm5.runtime.parts.build_parts``) around the program compiled here. Options whose
        ``act_quant`` is not the artifact's are refused (InputError): the file's GEMMs are one or the other."""
        from fxglm5.runtime.options import RunnerOptions
        from fxglm5.runtime.parts import build_parts
        from fxglm5.runtime.runner import Runner

        options = RunnerOptions.given(options, runner_options, "runner")
        if options.act_quant != self.act_quant:
            raise InputError(f"act_quant={options.act_quant}: this artifact was exported with act_quant="
                             f"{self.act_quant} ({'W8A8' if self.act_quant else 'W8A16'} FP8 GEMMs, fixed in its "
                             f"program); serve it with act_quant={self.act_quant}, or export the checkpoint again "
                             f"with act_quant={options.act_quant}")
        compiled = self.compile(options.device, options.backend, options.disabled_passes)
        return Runner(build_parts(self, options, program=compiled.program).replace(pass_results=compiled.results))


def export_artifact(model, path: str | Path, *, head: str = "logits", disabled_passes=(), act_quant: bool = False,
                    dump_dir: str | Path | None = None, tokenizer_dir: str | Path | None = None) -> Path:
    """Capture ``model`` (a Glm5ForCausalLM with its weights), run the match and fuse stages (strict, without
    ``disabled_passes``, W8A8 FP8 GEMMs with ``act_quant``, recorded; ``dump_dir`` as
    :func:`fxglm5.compiler.compile_graph`'s) and save the result to ``path``. ``head``: "logits", or "hidden"
    (final-norm hidden states, for engines that apply the lm_head themselves). ``tokenizer_dir``: the checkpoint
    directory whose tokenizer files the artifact carries (those it has). A ``path`` that cannot take the artifact
    (see :func:`check_out_path`) is refused before any of the work; the file is written beside it and put in place
    at the end (``st_files.new_output_file``)."""
    from fxglm5.capture.export import token_inputs
    from fxglm5.model.st_files import new_output_file
    from fxglm5.model.tokenizer import read_texts

    path = check_out_path(path)
    with new_output_file(path, artifact_format.is_artifact, "an fxglm5 artifact") as tmp:  # the state it replaces:
        graph, results = compile_model(model, stages=(Stage.MATCH, Stage.FUSE), head=head,  # now, before the work
                                       max_tokens=MAX_STEP_TOKENS, strict=True, disabled_passes=disabled_passes,
                                       act_quant=act_quant, dump_dir=dump_dir)[:2]
        layers = model.config.num_hidden_layers
        prefix, plan = graph.meta.get(PREFIX) or (graph, plan_kinds(list(range(layers)), 0))  # whole: identity map
        device = next(model.parameters()).device
        place_loaded_graph(prefix, device)  # absorbed kv_b_proj dropped: export would take it, the file keep it
        example, dims = token_inputs(device, 1024, MAX_STEP_TOKENS)
        with torch.no_grad():
            program = torch.export.export(prefix, example, dynamic_shapes=(dims, dims), strict=False)
        hashes = pass_source_hashes((Stage.MATCH, Stage.FUSE))
        record = dict(format=FORMAT, config=model.config.to_dict(), dtype=str(model.dtype).removeprefix("torch."),
                      head=head, act_quant=bool(act_quant), layers=artifact_format.plan_record(plan),
                      passes={r.name: dict(matches=r.num_matches, source_hash=hashes.get(r.name)) for r in results},
                      versions=dict(fxglm5=fxglm5.__version__, torch=torch.__version__))
        weights, constants = (_every_layer(stored, graph, plan) for stored in (program.state_dict, program.constants))
        texts = read_texts(tokenizer_dir) if tokenizer_dir is not None else {}
        artifact_format.write(tmp, program, record, weights, constants, texts)
    return path


def _every_layer(stored: dict, whole: fx.GraphModule, plan: KindPlan) -> dict:
    """The program's tensors ``stored`` and, for each, every copied layer's counterpart, read from the stitched
    ``whole`` graph (its own weights and derived constants)."""
    return {**stored, **{copy: operator.attrgetter(copy)(whole) for name in stored
                         for _, copy in layer_copies(name, plan)}}


def check_out_path(path: str | Path) -> Path:
    """``path`` as an artifact to write, checked before an export's minutes: its directory exists and can be
    written, and what is there already, if anything, is an artifact (an earlier export, which it replaces)."""
    from fxglm5.model.st_files import check_output_file

    return check_output_file(Path(path), artifact_format.is_artifact, "an fxglm5 artifact")


def load_artifact(path: str | Path) -> Artifact:
    """Read an artifact written by :func:`export_artifact`, running nothing from the file
    (:mod:`fxglm5.artifact_format` says what it checks); CheckpointError naming the file (and the member,
    field or tensor) if it is not one, holds anything beyond the format, or its record contradicts its program."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such artifact file")
    artifact = Artifact(*artifact_format.read(path))
    artifact.graph(path)  # the map's stitching checked now, not when serving starts
    return artifact
