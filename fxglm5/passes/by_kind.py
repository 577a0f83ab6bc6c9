"""The match and fuse stages (and the shard stage) on a model captured once per layer kind
(``fxglm5.capture.by_kind``): the passes run on the exported prefix (strict mode checks the prefix's expected counts
there, per kind), and the results are reported for the whole model, with the whole model's expected counts."""

from __future__ import annotations

import collections
import dataclasses

from torch import fx

from fxglm5.capture.by_kind import CAPTURED_OPS, capture_rewritten
from fxglm5.errors import PassError
from fxglm5.parallel import Mapping
from fxglm5.passes.manager import PassContext, _op_name, run_pipeline
from fxglm5.passes.registry import REGISTRY


def match_and_fuse(model, *, strict: bool = False, act_quant: bool = False, disabled: tuple[str, ...] = (),
                   max_batch: int = 1024, max_seq: int | None = None, head: str = "logits",
                   dump_dir=None, stages=("match", "fuse"), mapping: Mapping = Mapping()) -> tuple[fx.GraphModule, list]:
    """Capture ``model`` (see ``fxglm5.capture.capture`` for ``max_batch`` / ``max_seq`` / ``head``) and run
    ``stages`` (match, fuse and optionally shard for ``mapping``); returns the whole model's graph and results
    counting the whole model."""
    extras = {"head": head}

    def rewrite(graph: fx.GraphModule, config) -> list:
        ctx = PassContext(config=config, strict=strict, act_quant=act_quant, disabled=disabled, mapping=mapping,
                          extras=dict(extras))
        return run_pipeline(graph, ctx, stages, dump_dir)

    graph, results = capture_rewritten(model, rewrite, max_batch=max_batch, max_seq=max_seq, head=head)
    whole = PassContext(config=model.config, mapping=mapping, extras=dict(extras))
    results = [dataclasses.replace(r, expected=REGISTRY[r.name].expected(whole)) if REGISTRY[r.name].expected
               else r for r in results]
    for r in results:
        if strict and r.expected is not None and r.num_matches != r.expected:
            raise PassError(f"pass {r.name}: found {r.num_matches} matches, the model needs {r.expected} (strict mode)")
    return graph, results


def captured_histogram(graph: fx.GraphModule) -> dict[str, int]:
    """The op histogram (as ``op_histogram``) of the whole model as captured, before the passes rewrote it."""
    counts: collections.Counter = collections.Counter()
    for target, count in graph.meta[CAPTURED_OPS].items():
        counts[_op_name(target)] += count
    return dict(counts)
