"""The one way to build a running engine, and the per-rank entry points that build one on every rank.

Every front door that serves (``fxglm5 generate``, ``fxglm5 serve``, the benches) builds through here, from

- a checkpoint directory (its weights loaded in ``options.dtype``; at ``options.tp`` > 1 each rank reads only its
  slices), with its tokenizer where the directory has one;
- an exported artifact, a file (``fxglm5 export``) or a loaded :class:`~fxglm5.artifact.Artifact` (its head must
  be the logits; it computes in the dtype it was exported in; one rank);
- a ``Glm5ForCausalLM`` already loaded, or a reader (``fxglm5.model.random_reader.RandomReader``, at tp > 1).

The Runner it returns serves with the parts (program, cache, block manager, decode graphs, drafter) that
:func:`fxglm5.runtime.parts.build_parts` makes from the source and the options: checkpoint -> model -> compile ->
runtime, nothing of it calling back up here.

``options`` is one :class:`~fxglm5.runtime.options.RunnerOptions`. At ``tp`` > 1 a process only builds its own
rank: :func:`on_ranks` starts the ranks (or joins them under torchrun) and runs an entry point on each, which
builds its rank with the rank's device. The entry points live here (:func:`generate_on_rank`,
:func:`serve_on_rank`), importable by name by the spawned ranks, so the runtime never calls back into the CLI.
"""

from __future__ import annotations

from pathlib import Path

from fxglm5.errors import InputError
from fxglm5.runtime.engine import Engine
from fxglm5.runtime.options import RunnerOptions
from fxglm5.runtime.parts import build_parts
from fxglm5.runtime.runner import Runner


def load_source(source):
    """``source`` as the Runner takes it: a file path is loaded as an artifact (its head checked); anything else is
    returned as given (a checkpoint directory's path, a module, a reader, an Artifact)."""
    if isinstance(source, (str, Path)) and Path(source).is_file():
        from fxglm5.artifact import load_artifact

        source = load_artifact(source)
    head = getattr(source, "head", "logits")
    if head != "logits":
        raise InputError(f"model: an artifact exported with head={head!r}; serving needs head='logits'")
    return source


def build_runner(source, options: RunnerOptions | None = None, **given) -> Runner:
    """A Runner for ``source`` (module docstring) with ``options`` (default: RunnerOptions()), over the parts
    ``fxglm5.runtime.parts.build_parts`` makes (an artifact's through ``Artifact.runner``, around the program it
    compiles); ``given``: ``build_parts``'s ``program`` / ``mtp_program`` / ``drafter``, reused or given."""
    options = RunnerOptions() if options is None else options
    source = load_source(source)
    from fxglm5.artifact import Artifact

    if isinstance(source, Artifact):
        if options.tp != 1:
            raise InputError(f"tp={options.tp}: each rank reads its slices of a checkpoint directory; an exported "
                             "artifact serves on one rank")
        if options.speculative is not None:
            raise InputError("speculative: drafts from the MTP layer of a checkpoint directory, not an artifact")
        if given:
            raise InputError(f"{sorted(given)}: an artifact compiles its own program and drafts from none")
        return source.runner(options)
    return Runner(build_parts(source, options, **given))


def load_tokenizer(source, config):
    """The checkpoint's tokenizer where ``source`` is a checkpoint directory that has one, else None."""
    if not isinstance(source, (str, Path)) or not (Path(source) / "tokenizer.json").is_file():
        return None
    from fxglm5.model.tokenizer import Tokenizer

    return Tokenizer.from_checkpoint(source, config)


def build_engine(source, options: RunnerOptions | None = None, *, wait_for_room: bool = True, seed: int | None = None,
                 **given) -> Engine:
    """A request-level Engine over :func:`build_runner`'s runner, with the checkpoint's tokenizer (text outputs
    and stop strings) where it has one."""
    runner = build_runner(source, options, **given)
    return Engine(runner, load_tokenizer(source, runner.config), wait_for_room=wait_for_room, seed=seed)


def on_ranks(entry, source, options: RunnerOptions, *args, timeout: float | None = None):
    """Run ``entry(rank, source, options, *args)`` on each of ``options.tp`` ranks (started here, or this process
    one of them under torchrun; gloo on a CPU, NCCL on CUDA); returns ``(rank, value)`` as
    ``fxglm5.runtime.distributed.launch`` does. ``entry`` builds its rank with :func:`rank_options`."""
    from fxglm5.runtime.distributed import launch

    return launch(entry, options.tp, source, options, *args, device=str(options.device), timeout=timeout)


def rank_options(rank, options: RunnerOptions) -> RunnerOptions:
    """``options`` for one rank: its world size and its device."""
    return options.replace(tp=rank.world, device=rank.device)


def generate_on_rank(rank, source, options: RunnerOptions, prompts: list[list[int]], max_new_tokens: int,
                     stop_tokens=(), stream: bool = False) -> tuple[list[list[int]], tuple[float, int]]:
    """One rank of ``generate --tp``: its sharded Runner's greedy tokens, and the mean acceptance length and verify
    steps of a speculative run (every rank verifies alike). ``stream``: rank 0 prints the one prompt's text as its
    tokens come (through the checkpoint's tokenizer), as ``generate`` in one process does."""
    runner = build_runner(source, rank_options(rank, options))
    printer = None
    if stream and rank.rank == 0:
        from fxglm5.model.tokenizer import TextPrinter, Tokenizer

        printer = TextPrinter(Tokenizer.from_checkpoint(source, runner.config), frozenset(stop_tokens))
    outputs = runner.generate(prompts, max_new_tokens, stop_tokens, on_token=printer)
    if printer is not None:
        printer.finish()
    return outputs, (runner.acceptance.mean_length, runner.acceptance.steps)


def serve_on_rank(rank, source, options: RunnerOptions, settings) -> None:
    """One rank of ``serve --tp``: rank 0 serves HTTP and leads each step; the others follow it (fxglm5.serve.loop)."""
    from fxglm5.serve.app import serve
    from fxglm5.serve.loop import follow

    engine = build_engine(source, rank_options(rank, options))
    if rank.rank == 0:
        serve(engine, settings, tp=rank.world)
    else:
        follow(engine)
