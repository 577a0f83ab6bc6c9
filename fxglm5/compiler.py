"""The one compile door: capture a model and run the declared pass stages on it, for every caller.

The Runner and the RTP-LLM plugin compile the whole pipeline (:func:`compile_model`); an exported artifact
stores the device-independent half (match + fuse) and runs the rest, the cache and lower stages, when it is
loaded (:func:`lower_for_device`); the torch.compile backend runs the stages on the graph it exported itself
and ``fxglm5 inspect`` reports what the match and fuse stages did (:func:`compile_graph`). One place builds the
:class:`~fxglm5.passes.PassContext` from the options, so a pass sees the same context whoever compiles.

``mapping`` (``fxglm5.parallel.Mapping``) makes the shard stage give this rank's part of the model; it is checked
against the config before anything is captured or read, and the sharded graph is checked once it is whole
(``fxglm5.passes.shard_check``). An artifact stores match + fuse only, so it stays rank-agnostic.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import NamedTuple

import torch
from torch import fx

from fxglm5.errors import InputError
from fxglm5.parallel import Mapping
from fxglm5.passes import PassContext, PassResult, run_pipeline
from fxglm5.passes.shard_check import check_sharded
from fxglm5.passes.pipeline import STAGES, Stage, stages_of

MAX_STEP_TOKENS = 1 << 20  # flat tokens of one step when nothing bounds them (RTP's batches, artifacts)
DEVICE_STAGES = (Stage.CACHE, Stage.LOWER)  # what a graph still needs for the device it serves on
KIND_STAGES = (Stage.MATCH, Stage.FUSE, Stage.SHARD)  # what runs once per decoder-layer kind (on the captured prefix)


class Compiled(NamedTuple):
    graph: fx.GraphModule
    results: list[PassResult]
    capture_seconds: float = 0.0


def compile_model(model, *, stages=STAGES, head: str = "logits", max_tokens: int | None = None, device=None,
                  backend: str | None = None, strict: bool = False, act_quant: bool = False,
                  disabled_passes=(), dump_dir: str | Path | None = None, mapping: Mapping = Mapping()) -> Compiled:
    """Capture ``model`` (a Glm5ForCausalLM; steps of up to ``max_tokens`` flat tokens, default its
    max_position_embeddings; ``head``: "logits", or "hidden" for the hidden states after the final norm) and run
    ``stages`` on it. The match, fuse and shard stages run once per decoder-layer kind (``fxglm5.capture.by_kind``);
    the stages after them run on the whole stitched graph. The other options are :func:`compile_graph`'s."""
    stages = stages_of(stages)
    mapping.check(model.config)
    per_kind = stages[:2] == KIND_STAGES[:2]
    kind_stages = tuple(s for s in stages if s in KIND_STAGES) if per_kind else ()
    start = time.perf_counter()
    graph, results = _capture(model, max_tokens=max_tokens, head=head, rewrite=dict(
        strict=strict, act_quant=act_quant, disabled=tuple(disabled_passes), dump_dir=dump_dir, stages=kind_stages,
        mapping=mapping) if per_kind else None)
    seconds = time.perf_counter() - start - sum(r.seconds for r in results)
    if Stage.SHARD in kind_stages:
        check_sharded(graph, model.config, mapping, head, strict)
    results += compile_graph(graph, model.config, stages=stages[len(kind_stages):], device=device, backend=backend,
                             strict=strict, act_quant=act_quant, disabled_passes=disabled_passes, dump_dir=dump_dir,
                             mapping=mapping, head=head)
    return Compiled(graph, results, seconds)


def _capture(model, *, max_tokens: int | None, head: str, rewrite: dict | None) -> tuple[fx.GraphModule, list]:
    """The model as the graph the passes rewrite (the one capture of every compile): with ``rewrite`` (the
    match / fuse options), captured once per layer kind and returned rewritten by those stages, with results
    counting the whole model; without, captured whole and not yet rewritten."""
    if rewrite is None:
        from fxglm5.capture import capture

        return capture(model, max_seq=max_tokens, head=head), []
    from fxglm5.passes.by_kind import match_and_fuse

    return match_and_fuse(model, max_seq=max_tokens, head=head, **rewrite)


def compile_graph(graph: fx.GraphModule, config, *, stages=STAGES, device=None, backend: str | None = None,
                  strict: bool = False, act_quant: bool = False, disabled_passes=(),
                  dump_dir: str | Path | None = None, mapping: Mapping = Mapping(),
                  head: str | None = None) -> list[PassResult]:
    """Run ``stages`` (in pipeline order) on ``graph`` in place. ``config``: the Glm5Config (expected scales and
    match counts; None for an arbitrary module). ``device``: where the lowered graph runs (default: where its
    weights are); ``backend``: the kernel backend the lower stage puts first. ``strict``: a pass with another
    match count than the model needs is a PassError (else a logged warning). ``act_quant``: W8A8 FP8 GEMMs.
    ``disabled_passes``: pass names to skip. ``dump_dir``: write each pass's graph before and after there.
    ``mapping``: the rank's place for the shard stage; ``head``: the graph's output ("logits" / "hidden", None:
    unknown), for the shard stage's expected counts. A graph that ran the cache stage must have come out paged."""
    stages = stages_of(stages)
    extras = {} if device is None else {"device": torch.device(device).type}
    if head is not None:
        extras["head"] = head
    ctx = PassContext(config=config, act_quant=act_quant, strict=strict, backend=backend, disabled=tuple(disabled_passes),
                      mapping=mapping, extras=extras)
    if Stage.SHARD in stages and config is not None:
        mapping.check(config)
    results = run_pipeline(graph, ctx, stages, dump_dir)
    if Stage.SHARD in stages:
        check_sharded(graph, config, mapping, head, strict)
    if Stage.CACHE in stages and "paged_cache" not in graph.meta:
        raise InputError("model: insert_paged_cache found no attention to put on the paged cache")
    return results


def lower_for_device(graph: fx.GraphModule, config, *, device="cpu", **options) -> list[PassResult]:
    """The device-specific half on a matched and fused graph (in place): the cache and lower stages, which an
    exported artifact (``fxglm5.artifact``) still needs when it is loaded. Options as :func:`compile_graph`'s."""
    return compile_graph(graph, config, stages=DEVICE_STAGES, device=device, **options)
