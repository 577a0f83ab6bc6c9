"""The one compile door: capture a model and run the declared pass stages on it, for every caller.

The Runner and the RTP-LLM plugin compile the whole pipeline (:func:`compile_model`); an exported artifact
stores the device-independent half (match + fuse) and runs the rest, the cache and lower stages, when it is
loaded (:func:`lower_for_device`); the torch.compile backend runs the stages on the graph it exported itself
and ``fxglm5 inspect`` reports what the match and fuse stages did (:func:`compile_graph`). One place builds the
:class:`~fxglm5.passes.PassContext` from the options, so a pass sees the same context whoever compiles.

A compile that runs the cache stage returns the graph as a :class:`~fxglm5.program.PagedProgram` too
(``Compiled.program``): the one way to call it. ``inputs_validated`` says that the program's caller validates each
step's forward context itself (the Runner, the RTP plugin), so the lower stage binds the cached ops without their own
checks; the choice is made here, at compile time, not by a switch at run time.

The front doors reach the passes only through this module: the stage names (:class:`Stage`), the pass names
(:data:`PASS_NAMES`), their source hashes (:func:`pass_source_hashes`), the compile report (:func:`report`) and
what a compiled graph's FP8 GEMMs are (:func:`act_quant_ops`: W8A8 or W8A16, counted per op).
:func:`place_loaded_graph` readies a graph whose weights were filled after capture (a rank's slices, an artifact's
tensors) for its device.

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
from fxglm5.passes.graph_utils import act_quant_ops  # noqa: F401 - re-exported for the front doors
from fxglm5.passes.graph_utils import drop_unread_attributes, on_device
from fxglm5.passes.pipeline import DECLARED, STAGES, Stage, stages_of
from fxglm5.passes.registry import passes_for
from fxglm5.passes.report import pipeline_report
from fxglm5.passes.shard_check import check_sharded
from fxglm5.program import PagedProgram

PASS_NAMES = tuple(DECLARED)  # every declared pass, in pipeline order

MAX_STEP_TOKENS = 1 << 20  # flat tokens of one step when nothing bounds them (RTP's batches, artifacts)
# the flat tokens one prefill forward runs at most (the Runner's default chunk, the RTP plugin's): GLM-5's
# [tokens, 64 heads, 576] attention tensors stay inside the kernels' int32 offsets
PREFILL_STEP_TOKENS = 16384
DEVICE_STAGES = (Stage.CACHE, Stage.FUSE_KERNELS, Stage.LOWER)  # what a graph still needs for its device
KIND_STAGES = (Stage.MATCH, Stage.FUSE, Stage.SHARD)  # what runs once per decoder-layer kind (on the captured prefix)


class Compiled(NamedTuple):
    graph: fx.GraphModule
    results: list[PassResult]
    capture_seconds: float = 0.0
    program: PagedProgram | None = None  # the graph's call, where the cache stage ran


def _compiled(graph: fx.GraphModule, results: list[PassResult], seconds: float, inputs_validated: bool) -> Compiled:
    paged = "paged_cache" in graph.meta
    return Compiled(graph, results, seconds, PagedProgram(graph, inputs_validated=inputs_validated) if paged else None)


def pass_source_hashes(stages) -> dict[str, str]:
    """Each pass of ``stages``: the hash of its module's source (what an artifact records it was made with)."""
    return {spec.name: spec.source_hash for spec in passes_for(stages)}


def report(compiled: Compiled, lowered: PassResult | None = None, device: str | None = None) -> str:
    """What the compile did, pass by pass (``fxglm5 inspect``)."""
    return pipeline_report(compiled.graph, compiled.results, compiled.capture_seconds, lowered=lowered, device=device)


def place_loaded_graph(graph: fx.GraphModule, device) -> fx.GraphModule:
    """A graph whose weights were filled after capture made ready for ``device``: the attributes no node reads are
    dropped (an absorbed ``kv_b_proj``: nothing to load or store), and the device arguments the capture recorded
    (``torch.arange(..., device=meta)``) name ``device``."""
    drop_unread_attributes(graph)
    on_device(graph, torch.device(device))
    return graph


def compile_model(model, *, stages=STAGES, head: str = "logits", max_tokens: int | None = None, device=None,
                  backend: str | None = None, strict: bool = False, act_quant: bool = False,
                  disabled_passes=(), dump_dir: str | Path | None = None, mapping: Mapping = Mapping(),
                  inputs_validated: bool = False) -> Compiled:
    """Capture ``model`` (a Glm5ForCausalLM; steps of up to ``max_tokens`` flat tokens, default its
    max_position_embeddings; ``head``: "logits", "hidden" for the hidden states after the final norm, or
    "logits+hidden" for both, (logits, hidden), the target of speculative decoding whose hidden feeds
    :func:`compile_mtp`'s graph) and run
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
                             mapping=mapping, head=head, inputs_validated=inputs_validated)
    return _compiled(graph, results, seconds, inputs_validated)


def compile_mtp(model, *, stages=STAGES, max_tokens: int | None = None, device=None, backend: str | None = None,
                strict: bool = False, act_quant: bool = False, disabled_passes=(), dump_dir: str | Path | None = None,
                mapping: Mapping = Mapping(), inputs_validated: bool = False) -> Compiled:
    """The MTP layer's graph (``model.mtp``, a Glm5MTP; options as :func:`compile_model`'s): the decoder layer
    through the same passes as the target's layers (sparse_mla, its fp8_linears, moe: strict counts for one
    indexed MoE layer), the rest (enorm, hnorm, eh_proj, the concat, shared_head.norm, the head) plain graph ops
    (eh_proj an fp8_linear where the checkpoint stores it in FP8). Paged, it is called as

        graph(input_ids [1, T], position_ids [1, T], hidden [1, T, H], slot_mapping, block_table, req_idx,
              logits_indices [R], kv_cache_0, index_cache_0) -> (logits [1, R, V], hidden_out [1, R, H])

    with its own ``graph.meta["paged_cache"]`` (one indexed layer): a second PagedCache, beside the target's.

    ``mapping``: the rank's part, by the target's shard passes (the layer's heads, its expert group's experts split
    along their intermediate dim over the group's ranks, its shared expert, the head's vocabulary rows with the logits all-gathered; the
    embedding, enorm / hnorm, eh_proj and the indexer stay whole). Compile ``model`` on the meta device then and
    fill the graph with ``runtime.shard_loader.load_sharded`` (as the target's ranks do)."""
    if getattr(model, "mtp", None) is None:
        raise InputError("compile_mtp: the model has no MTP layer (load it with from_pretrained(..., mtp=True))")
    mapping.check(mtp_graph_config(model.config))  # before the capture
    from fxglm5.capture.export import MTP_HEAD, capture_mtp

    start = time.perf_counter()
    graph = capture_mtp(model, max_seq=max_tokens)
    seconds = time.perf_counter() - start
    results = compile_graph(graph, mtp_graph_config(model.config), stages=stages, device=device, backend=backend,
                            strict=strict, act_quant=act_quant, disabled_passes=disabled_passes, dump_dir=dump_dir,
                            mapping=mapping, head=MTP_HEAD, extras={"eh_proj_fp8": model.mtp.eh_proj.fp8},
                            inputs_validated=inputs_validated)
    return _compiled(graph, results, seconds, inputs_validated)


def mtp_graph_config(config):
    """``config`` as the passes see the MTP graph: a model of one decoder layer, MoE with its own indexer."""
    return config.replace(num_hidden_layers=1, first_k_dense_replace=0, mlp_layer_types=["sparse"],
                          indexer_types=["full"])


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
                  head: str | None = None, extras: dict | None = None,
                  inputs_validated: bool = False) -> list[PassResult]:
    """Run ``stages`` (in pipeline order) on ``graph`` in place. ``config``: the Glm5Config (expected scales and
    match counts; None for an arbitrary module). ``device``: where the lowered graph runs (default: where its
    weights are); ``backend``: the kernel backend the lower stage puts first. ``strict``: a pass with another
    match count than the model needs is a PassError (else a logged warning). ``act_quant``: W8A8 FP8 GEMMs.
    ``disabled_passes``: pass names to skip. ``dump_dir``: write each pass's graph before and after there.
    ``mapping``: the rank's place for the shard stage; ``head``: the graph's output ("logits" / "hidden", None:
    unknown), for the shard stage's expected counts; ``extras``: more of the passes' context (``PassContext.extras``).
    A graph that ran the cache stage must have come out paged."""
    stages = stages_of(stages)
    extras = dict(extras or {})
    if device is not None:
        extras["device"] = torch.device(device).type
    if head is not None:
        extras["head"] = head
    extras["inputs_validated"] = bool(inputs_validated)
    extras.setdefault("paged", Stage.CACHE in stages or "paged_cache" in graph.meta)  # rows selected before the head
    ctx = PassContext(config=config, act_quant=act_quant, strict=strict, backend=backend, disabled=tuple(disabled_passes),
                      mapping=mapping, extras=extras)
    if Stage.SHARD in stages and config is not None:
        mapping.check(config)
    # the sharded graph is checked as the shard stage leaves it (the stages after it rewrite the ops it counts)
    split = stages.index(Stage.SHARD) + 1 if Stage.SHARD in stages and mapping.world > 1 else len(stages)
    results = run_pipeline(graph, ctx, stages[:split], dump_dir)
    if Stage.SHARD in stages:
        check_sharded(graph, config, mapping, head, strict)
    if stages[split:]:
        results += run_pipeline(graph, ctx, stages[split:], dump_dir)
    if Stage.CACHE in stages and "paged_cache" not in graph.meta:
        raise InputError("model: insert_paged_cache found no attention to put on the paged cache")
    return results


def lower_for_device(graph: fx.GraphModule, config, *, device="cpu", inputs_validated: bool = False,
                     **options) -> Compiled:
    """The device-specific half on a matched and fused graph (in place, placed on ``device`` first): the cache,
    fuse_kernels and lower stages, which an exported artifact (``fxglm5.artifact``) still needs when it is loaded.
    Options as :func:`compile_graph`'s."""
    place_loaded_graph(graph, device)
    results = compile_graph(graph, config, stages=DEVICE_STAGES, device=device, inputs_validated=inputs_validated,
                            **options)
    return _compiled(graph, results, 0.0, inputs_validated)
