"""The one compile door: capture a model and run the declared pass stages on it, for every caller.

The Runner and the RTP-LLM plugin compile the whole pipeline (:func:`compile_model`); an exported artifact
stores the device-independent half (match + fuse) and runs the rest, the cache and lower stages, when it is
loaded (:func:`lower_for_device`); the torch.compile backend runs the stages on the graph it exported itself
and ``fxglm5 inspect`` reports what the match and fuse stages did (:func:`compile_graph`). One place builds the
:class:`~fxglm5.passes.PassContext` from the options, so a pass sees the same context whoever compiles.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import NamedTuple

import torch
from torch import fx

from fxglm5.errors import InputError
from fxglm5.passes import PassContext, PassResult, run_pipeline
from fxglm5.passes.pipeline import STAGES, Stage, stages_of

MAX_STEP_TOKENS = 1 << 20  # flat tokens of one step when nothing bounds them (RTP's batches, artifacts)
DEVICE_STAGES = (Stage.CACHE, Stage.LOWER)  # what a graph still needs for the device it serves on


class Compiled(NamedTuple):
    graph: fx.GraphModule
    results: list[PassResult]
    capture_seconds: float = 0.0


def compile_model(model, *, stages=STAGES, head: str = "logits", max_tokens: int | None = None, device=None,
                  backend: str | None = None, strict: bool = False, act_quant: bool = False,
                  disabled_passes=(), dump_dir: str | Path | None = None) -> Compiled:
    """Capture ``model`` (a Glm5ForCausalLM; steps of up to ``max_tokens`` flat tokens, default its
    max_position_embeddings; ``head``: "logits", or "hidden" for the hidden states after the final norm) and run
    ``stages`` on it. The other options are :func:`compile_graph`'s."""
    start = time.perf_counter()
    graph = _capture(model, max_tokens=max_tokens, head=head)
    seconds = time.perf_counter() - start
    results = compile_graph(graph, model.config, stages=stages, device=device, backend=backend, strict=strict,
                            act_quant=act_quant, disabled_passes=disabled_passes, dump_dir=dump_dir)
    return Compiled(graph, results, seconds)


def _capture(model, *, max_tokens: int | None, head: str) -> fx.GraphModule:
    """The model as the graph the passes rewrite (the one capture of every compile)."""
    from fxglm5.capture import capture

    return capture(model, max_seq=max_tokens, head=head)


def compile_graph(graph: fx.GraphModule, config, *, stages=STAGES, device=None, backend: str | None = None,
                  strict: bool = False, act_quant: bool = False, disabled_passes=(),
                  dump_dir: str | Path | None = None) -> list[PassResult]:
    """Run ``stages`` (in pipeline order) on ``graph`` in place. ``config``: the Glm5Config (expected scales and
    match counts; None for an arbitrary module). ``device``: where the lowered graph runs (default: where its
    weights are); ``backend``: the kernel backend the lower stage puts first. ``strict``: a pass with another
    match count than the model needs is a PassError (else a logged warning). ``act_quant``: W8A8 FP8 GEMMs.
    ``disabled_passes``: pass names to skip. ``dump_dir``: write each pass's graph before and after there.
    A graph that ran the cache stage must have come out paged."""
    stages = stages_of(stages)
    ctx = PassContext(config=config, act_quant=act_quant, strict=strict, backend=backend, disabled=tuple(disabled_passes),
                      extras={} if device is None else {"device": torch.device(device).type})
    results = run_pipeline(graph, ctx, stages, dump_dir)
    if Stage.CACHE in stages and "paged_cache" not in graph.meta:
        raise InputError("model: insert_paged_cache found no attention to put on the paged cache")
    return results


def lower_for_device(graph: fx.GraphModule, config, *, device="cpu", **options) -> list[PassResult]:
    """The device-specific half on a matched and fused graph (in place): the cache and lower stages, which an
    exported artifact (``fxglm5.artifact``) still needs when it is loaded. Options as :func:`compile_graph`'s."""
    return compile_graph(graph, config, stages=DEVICE_STAGES, device=device, **options)
