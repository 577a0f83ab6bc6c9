"""The model as the paged runtime runs it: captured, rewritten by every pass stage, lowered for a device.

One function for every driver of the graph (the local :class:`~fxglm5.runtime.runner.Runner` and the RTP-LLM
plugin), so both run the same rewritten graph (the contract is in ``fxglm5.passes.insert_paged_cache``).
"""

from __future__ import annotations

import torch
from torch import fx

from fxglm5.errors import InputError

MAX_STEP_TOKENS = 1 << 20  # flat tokens of one step when nothing bounds them (RTP's batches, artifacts)


def compile_paged(model, *, max_tokens: int, device="cpu", backend: str | None = None,
                  head: str = "logits") -> tuple[fx.GraphModule, list]:
    """Capture ``model`` (steps of up to ``max_tokens`` flat tokens; ``head``: "logits", or "hidden" for the
    hidden states after the final norm) and run the match, fuse, cache and lower stages for ``device``
    (``backend`` puts one kernel backend first). Returns the graph and the pass results."""
    from fxglm5.passes.by_kind import match_and_fuse

    graph, results = match_and_fuse(model, max_seq=max_tokens, head=head)
    return graph, results + lower_paged(graph, model.config, device=device, backend=backend)


def lower_paged(graph: fx.GraphModule, config, *, device="cpu", backend: str | None = None) -> list:
    """The cache and lower stages on a matched and fused graph (in place): the device-specific half, which is
    also what an exported artifact (``fxglm5.artifact``) still needs when it is loaded."""
    from fxglm5.passes import PassContext, run_pipeline

    ctx = PassContext(config=config, backend=backend, extras={"device": torch.device(device).type})
    results = run_pipeline(graph, ctx, stages=("cache", "lower"))
    if "paged_cache" not in graph.meta:
        raise InputError("model: insert_paged_cache found no attention to put on the paged cache")
    return results
