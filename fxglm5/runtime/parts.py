"""The one construction of what a Runner serves with: a source and a RunnerOptions in, :class:`RunnerParts` out.

The data flow runs one way, checkpoint -> model -> compile -> runtime, each step checked before the next costs
anything (:func:`build_parts`):

1. the model: a checkpoint directory loaded in ``options.dtype`` (with its MTP layer where the MTP layer drafts),
   a ``Glm5ForCausalLM`` as given, or, at ``tp`` > 1, this rank's meta model, the reader of its slices and its
   Mapping (``shard_loader.sharded_model``);
2. the cache's size, against the longest sequence and the device's memory (before the slow compile);
3. the paged program: compiled, or another Runner's (it holds no cache) reused; at ``tp`` > 1 the rank's weights
   read into it (``shard_loader.load_rank``);
4. the paged cache and its block manager;
5. the decode graphs (CUDA graphs per batch bucket on a CUDA device; :mod:`fxglm5.runtime.decode_graphs`);
6. the drafter of speculative decoding: the one given, else the model's MTP layer
   (:class:`~fxglm5.runtime.mtp_drafter.MtpDrafter`: its own program and cache over the target's block tables).

The Runner takes the parts (``Runner(parts)``); ``Runner(model, options)`` builds them here first. The builder
of every front door, :mod:`fxglm5.serve.build`, comes here too (an artifact through ``Artifact.runner``, which
compiles its own program and gives it).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from fxglm5.compiler import compile_model
from fxglm5.errors import InputError
from fxglm5.program import CacheSpec, PagedProgram
from fxglm5.runtime.block_manager import BlockManager
from fxglm5.runtime.cache import PagedCache, check_cache_size
from fxglm5.runtime.decode_graphs import DecodeGraphs
from fxglm5.runtime.options import RunnerOptions
from fxglm5.runtime.shard_loader import load_rank, sharded_model


@dataclasses.dataclass(frozen=True)
class RunnerParts:
    """What a Runner serves with. ``config``: the model's; ``program``: the compiled paged step (its compile's
    ``pass_results``, empty where it was given); ``cache`` and ``blocks``: the paged cache and who owns its blocks;
    ``decode_graphs``: the static-buffer decode steps, or None; ``drafter``: the speculative drafter, or None;
    ``with_hidden``: the program also returns the hidden states (head "logits+hidden", which the MTP drafter
    reads); ``mapping`` and ``load_report``: this rank's Mapping and what it read, at ``tp`` > 1 (else None)."""

    options: RunnerOptions
    config: object
    program: PagedProgram
    cache: PagedCache
    blocks: BlockManager
    decode_graphs: DecodeGraphs | None = None
    drafter: object = None
    with_hidden: bool = False
    mapping: object = None
    load_report: object = None
    pass_results: list = dataclasses.field(default_factory=list)

    def replace(self, **changes) -> "RunnerParts":
        return dataclasses.replace(self, **changes)


def check_sizes(config, num_blocks: int, block_size: int, spec: CacheSpec, device) -> None:
    """Refuse (InputError) a cache of blocks longer than any sequence, or larger than the memory available on
    ``device`` (fxglm5.runtime.cache.check_cache_size), before the slow capture and before any allocation."""
    if block_size > config.max_position_embeddings:
        raise InputError(f"block_size: {block_size} exceeds max_position_embeddings ({config.max_position_embeddings}): "
                         "a block longer than the longest sequence is never filled")
    check_cache_size(num_blocks, block_size, spec, device)


def load_model(source, options: RunnerOptions, mtp: bool):
    """Step 1: (the model, the reader of this rank's slices, its Mapping); the last two None at ``tp`` 1.
    ``mtp``: the model's MTP layer drafts, so it is loaded (or checked for)."""
    reader = mapping = None
    if options.tp != 1:
        source, reader, mapping = sharded_model(source, options.tp, options.ep, options.dtype, mtp=mtp)
    elif options.ep not in (None, 1):
        raise InputError(f"ep={options.ep}: experts are split over the tp ranks; give a tp that {options.ep} divides")
    elif isinstance(source, (str, Path)):
        from fxglm5.model.modeling import Glm5ForCausalLM

        source = Glm5ForCausalLM.from_pretrained(source, dtype=options.dtype, device=options.device, progress=False,
                                                 mtp=mtp)
    if mtp and getattr(source, "mtp", None) is None:
        raise InputError(f"speculative method {options.speculative.method!r}: the model has no MTP layer (its config "
                         "has num_nextn_predict_layers = 0, or it was loaded without mtp=True)")
    return source, reader, mapping


def build_parts(source, options: RunnerOptions | None = None, *, program: PagedProgram | None = None, drafter=None,
                mtp_program: PagedProgram | None = None, **fields) -> RunnerParts:
    """The parts for ``source`` (module docstring: the steps) with ``options``, or its fields as keywords.

    ``source``: a Glm5ForCausalLM or a checkpoint directory; with ``program``, anything with the model's ``config``
    and compute ``dtype`` (an exported artifact: ``fxglm5.artifact``). ``program``: the compiled program of another
    Runner over the same model (``runner.program``), reused to skip capture. At ``options.tp`` > 1 this process is
    one of ``tp`` ranks of the process group registered as "tp" (``fxglm5.runtime.distributed``); ``source`` must
    then be a checkpoint directory, of which this rank reads only its slices (``load_report``), or a reader with
    CheckpointReader's ``config``, ``param`` and ``bytes_read`` (``fxglm5.model.random_reader.RandomReader``:
    random weights drawn on the device). With ``options.speculative`` the drafts come from ``drafter`` (any
    ``fxglm5.runtime.speculative.Drafter``), by default the model's MTP layer (InputError without one): the target
    is then compiled with head "logits+hidden" (a given ``program`` must be one) and the MTP layer gets its own
    program (``mtp_program``: another such Runner's ``drafter.program``, reused) and paged cache; at ``tp`` > 1
    both are sharded, the MTP layer as the target's layers."""
    o = RunnerOptions.given(options, fields, "Runner")
    with_hidden = o.speculative is not None and drafter is None  # the MTP drafter reads the target's hidden
    model, reader, mapping = load_model(source, o, mtp=with_hidden)
    config, block_size = model.config, o.block_size
    num_blocks = o.num_blocks or -(-o.max_cache_tokens // block_size) + 1
    check_sizes(config, num_blocks, block_size, CacheSpec.for_config(config, o.kv_cache, o.index_kind, model.dtype),
                o.device)
    # a step's flat token count is bounded by the cache, not by one sequence's length
    max_tokens = max(config.max_position_embeddings, num_blocks * block_size)
    pass_results = []
    if program is None:
        compiled = compile_model(
            model, head="logits+hidden" if with_hidden else "logits", max_tokens=max_tokens, device=o.device,
            backend=o.backend, disabled_passes=o.disabled_passes, act_quant=o.act_quant, inputs_validated=True,
            **({} if mapping is None else {"mapping": mapping}))
        program, pass_results = compiled.program, compiled.results
    if not isinstance(program, PagedProgram):
        raise InputError(f"program: expected a PagedProgram (a paged compile's, runner.program), got "
                         f"{type(program).__name__}")
    load_report = None if mapping is None else load_rank(program.graph, mapping, reader, model, o.device)
    cache = PagedCache(program.cache_spec(o.kv_cache, o.index_kind, model.dtype), num_blocks, block_size,
                       o.kernel_block_size, o.device)
    blocks = BlockManager(num_blocks, block_size)
    graphs = decode_graphs(o, config, program, cache)
    if with_hidden:
        from fxglm5.runtime.mtp_drafter import MtpDrafter

        drafter = MtpDrafter(model, program, cache, blocks, config, o.device, mtp_program, max_tokens=max_tokens,
                             backend=o.backend, disabled_passes=o.disabled_passes, act_quant=o.act_quant,
                             mapping=mapping, reader=reader)
    return RunnerParts(o, config, program, cache, blocks, graphs, drafter, with_hidden, mapping, load_report,
                       pass_results)


def decode_graphs(o: RunnerOptions, config, program: PagedProgram, cache: PagedCache) -> DecodeGraphs | None:
    """Step 5: the decode graphs ``o.decode_graphs`` asks for (default: on a CUDA device, unless the backend is
    the reference), a step's table as wide as the longest sequence the cache holds; else None."""
    on_cuda = torch.device(o.device).type == "cuda"
    wanted = o.decode_graphs
    if wanted is None:
        wanted = on_cuda and o.backend != "reference"
    if not wanted:
        return None
    longest = min(-(-config.max_position_embeddings // cache.block_size), cache.num_blocks)
    return DecodeGraphs(program, cache.graph_inputs(), max_batch=o.max_decode_batch,
                        table_width=longest * cache.ratio, device=o.device, capture=on_cuda,
                        tokens_per_request=1 + (o.speculative.num_tokens if o.speculative else 0))
