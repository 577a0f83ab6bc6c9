"""Front door: GLM-5 as one exported file (``torch.export`` .pt2), loaded and served without the model code's
checkpoint loading, capture or matching.

What the file holds is the device-independent half of the compile: the model captured and rewritten by the
match and fuse stages into fxglm5's canonical ops (``fxglm5::sparse_mla``, ``fp8_linear``, ``moe_fp8`` ...),
with its weights as they were loaded (block-FP8 stays FP8), re-exported with dynamic [batch, seq], plus a
``fxglm5.json`` record (format, config, compute dtype, head, the passes run with their match counts and
source hashes, versions). Loading runs the device-specific half, the cache and lower stages, for the device
it serves on. The caches are not in the file: the paged graph takes them as inputs (``insert_paged_cache``).
The cache stage is not exported because its ops write the caches in place, which ``torch.export`` would
functionalize into a copy of every cache per step.

    fxglm5 export --model CKPT_DIR --out glm5.pt2
    fxglm5 generate --model glm5.pt2 --prompt-ids 1,2,3 --max-new-tokens 16
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from torch import fx

import fxglm5
from fxglm5.errors import CheckpointError
from fxglm5.model.config import Glm5Config
from fxglm5.runtime.compile import MAX_STEP_TOKENS, lower_paged

FORMAT = "fxglm5-artifact/1"
RECORD = "fxglm5.json"


@dataclasses.dataclass
class Artifact:
    """A loaded artifact: the canonical program and what the runtime needs beside it (``config``, ``dtype``:
    a :class:`~fxglm5.runtime.runner.Runner` takes an Artifact where it takes a model)."""

    program: torch.export.ExportedProgram
    config: Glm5Config
    dtype: torch.dtype
    head: str
    record: dict

    def paged_graph(self, device="cpu", backend: str | None = None) -> tuple[fx.GraphModule, list]:
        """A fresh paged graph for ``device``: the canonical program with the cache and lower stages run."""

        graph = _on_device(self.program.module(), torch.device(device))
        return graph, lower_paged(graph, self.config, device=device, backend=backend)

    def runner(self, *, device="cpu", backend: str | None = None, **runner_options):
        """A :class:`~fxglm5.runtime.runner.Runner` serving this artifact (options as the Runner's)."""
        from fxglm5.runtime.runner import Runner

        graph, results = self.paged_graph(device, backend)
        runner = Runner(self, graph=graph, device=device, backend=backend, **runner_options)
        runner.pass_results = results
        return runner


def _on_device(gm: fx.GraphModule, device: torch.device) -> fx.GraphModule:
    """The program's weights, constants and the device arguments export recorded (``torch.arange(...,
    device=cpu)`` where it was exported) moved to ``device``."""
    gm.to(device)
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            owner, _, name = node.target.rpartition(".")
            module = gm.get_submodule(owner) if owner else gm
            value = getattr(module, name)
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter) and value.device != device:
                setattr(module, name, value.to(device))
        elif isinstance(node.kwargs.get("device"), torch.device):
            node.update_kwarg("device", device)
    gm.recompile()
    return gm


def export_artifact(model, path: str | Path, *, head: str = "logits") -> Path:
    """Capture ``model`` (a Glm5ForCausalLM with its weights), run the match and fuse stages and save the
    result to ``path`` (.pt2). ``head``: "logits", or "hidden" (final-norm hidden states, for engines that
    apply the lm_head themselves)."""
    from fxglm5.capture import capture
    from fxglm5.capture.export import token_inputs
    from fxglm5.passes import PassContext, run_pipeline
    from fxglm5.passes.registry import passes_for

    graph = capture(model, max_seq=MAX_STEP_TOKENS, head=head)
    results = run_pipeline(graph, PassContext(config=model.config, strict=True), stages=("match", "fuse"))
    example, dims = token_inputs(next(model.parameters()).device, 1024, MAX_STEP_TOKENS)
    with torch.no_grad():
        program = torch.export.export(graph, example, dynamic_shapes=(dims, dims), strict=False)
    hashes = {spec.name: spec.source_hash for spec in passes_for(("match", "fuse"))}
    record = dict(format=FORMAT, config=model.config.to_dict(), dtype=str(model.dtype).removeprefix("torch."),
                  head=head, passes={r.name: dict(matches=r.num_matches, source_hash=hashes.get(r.name))
                                     for r in results},
                  versions=dict(fxglm5=fxglm5.__version__, torch=torch.__version__))
    path = Path(path)
    torch.export.save(program, path, extra_files={RECORD: json.dumps(record, indent=1)})
    return path


def load_artifact(path: str | Path) -> Artifact:
    """Read an artifact written by :func:`export_artifact`; CheckpointError naming the file if it is not one."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such artifact file")
    extra = {RECORD: ""}
    try:
        program = torch.export.load(path, extra_files=extra)
    except Exception as err:  # noqa: BLE001 - any unreadable file is reported as this file's problem
        raise CheckpointError(f"{path}: not a torch.export archive ({type(err).__name__}: {str(err)[:200]})") from None
    try:
        record = json.loads(extra[RECORD] or "null")
    except json.JSONDecodeError:
        record = None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        found = record.get("format") if isinstance(record, dict) else None
        raise CheckpointError(f"{path}: not an fxglm5 artifact ({RECORD}: format {found!r}, expected {FORMAT!r})")
    config = Glm5Config.from_dict(record["config"], source=f"{path}:{RECORD}")
    dtype = getattr(torch, str(record.get("dtype")), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"{path}: {RECORD} dtype {record.get('dtype')!r} is not a torch dtype")
    return Artifact(program, config, dtype, record.get("head", "logits"), record)
