"""Capture: torch.export (non-strict) of Glm5ForCausalLM with dynamic batch and sequence sizes.

The result is an unlifted ``GraphModule`` (parameters as ``get_attr`` nodes) in pre-dispatch ATen, the
form the passes rewrite. Works with real weights and on the meta device (the full 78-layer GLM-5).

Tracing is the cost of a compile (about a second per GLM-5 layer on a 2-core CPU: every ATen op of the Python
model goes through fake-tensor shape propagation on symbolic [batch, seq]), so :func:`lean_tracing` turns off
what costs time there and changes nothing in the graph (docs/perf/compile_time.md has the profile).
"""

from __future__ import annotations

import contextlib
import sys
import warnings

import torch
from torch import fx
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.export import Dim

_METADATA_ASSERTS = {torch.ops.aten._assert_tensor_metadata.default}

# torch 2.13 deprecates ``isinstance(treespec, LeafSpec)`` inside its own pytree code, and every copy of an exported
# graph (the passes copy per layer kind) reaches it: the warning told users of every compiling command about torch's
# internals. Only that message is filtered.
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)


HEADS = ("logits", "hidden", "logits+hidden")
MTP_HEAD = "mtp"  # PassContext.extras["head"] of the MTP layer's graph (capture_mtp): (logits, hidden_out)


class _DecoderOnly(torch.nn.Module):
    """A causal LM without its lm_head, under the same parameter names (``model.layers.0...``), so every pass
    matches it as it matches the whole model."""

    def __init__(self, causal_lm: torch.nn.Module):
        super().__init__()
        self.config, self.model = causal_lm.config, causal_lm.model

    def forward(self, input_ids, position_ids):
        return self.model(input_ids, position_ids)


class _LogitsAndHidden(torch.nn.Module):
    """A causal LM returning (logits, hidden after the final norm): the target of speculative decoding, whose
    hidden states feed the MTP layer. Same parameter names as the causal LM."""

    def __init__(self, causal_lm: torch.nn.Module):
        super().__init__()
        self.config, self.model, self.lm_head = causal_lm.config, causal_lm.model, causal_lm.lm_head

    def forward(self, input_ids, position_ids):
        hidden = self.model(input_ids, position_ids)
        return self.lm_head(hidden), hidden


class _MtpOnly(torch.nn.Module):
    """The causal LM's MTP layer alone (parameters ``mtp.*``, the shared embedding and head under ``mtp.``)."""

    def __init__(self, causal_lm: torch.nn.Module):
        super().__init__()
        self.config, self.mtp = causal_lm.config, causal_lm.mtp

    def forward(self, input_ids, position_ids, hidden):
        return self.mtp(input_ids, position_ids, hidden)


def capture(model: torch.nn.Module, max_batch: int = 1024, max_seq: int | None = None,
            head: str = "logits") -> fx.GraphModule:
    """Export ``model(input_ids, position_ids)`` with dynamic [batch, seq]; returns the graph the passes
    work on. Both inputs are [batch, seq] int64; positions are explicit so the paged runtime can feed
    each token's real position (a decode step's token is not at position 0). ``head="hidden"`` exports the
    decoder alone: the output is the hidden states after the final norm, for engines that apply the lm_head
    themselves (RTP-LLM); ``head="logits+hidden"`` both, (logits, hidden), for speculative decoding's target."""
    if head not in HEADS:
        raise ValueError(f"head must be one of {HEADS}, got {head!r}")
    cfg = getattr(model, "config", None)
    max_seq = max_seq or (cfg.max_position_embeddings if cfg is not None else 4096)
    example, dims = token_inputs(next(model.parameters()).device, max_batch, max_seq)
    module = {"hidden": _DecoderOnly, "logits+hidden": _LogitsAndHidden}.get(head, lambda m: m)(model)
    return export_graph(module, example, {"input_ids": dims, "position_ids": dims})


def capture_mtp(model: torch.nn.Module, max_batch: int = 1024, max_seq: int | None = None) -> fx.GraphModule:
    """Export ``model.mtp(input_ids, position_ids, hidden [batch, seq, H]) -> (logits, hidden_out)`` with dynamic
    [batch, seq], as :func:`capture` exports the model."""
    max_seq = max_seq or model.config.max_position_embeddings
    param = next(model.mtp.parameters())
    (ids, pos), dims = token_inputs(param.device, max_batch, max_seq)
    hidden = torch.zeros(*ids.shape, model.config.hidden_size, dtype=model.dtype, device=param.device)
    return export_graph(_MtpOnly(model), (ids, pos, hidden), {"input_ids": dims, "position_ids": dims, "hidden": dims})


def token_inputs(device, max_batch: int, max_seq: int) -> tuple[tuple, dict]:
    """Example (input_ids, position_ids) and their dynamic [batch, seq] dims, for every export of the model."""
    example = torch.zeros(2, 3, dtype=torch.long, device=device)
    return (example, example.clone()), {0: Dim("batch", min=1, max=max_batch), 1: Dim("seq", min=1, max=max_seq)}


@contextlib.contextmanager
def lean_tracing():
    """torch.export without three costs that buy nothing here. The fake-tensor dispatch cache: with symbolic
    shapes half its lookups miss, and each miss builds and checks an entry (hashing every SymInt argument,
    synthesizing the output twice), which costs more than the hits save. The Python stack trace recorded for
    every node (``node.meta["stack_trace"]``, a traceback extracted and symbolized per op): no pass reads it, and
    a node keeps its ``nn_module_stack``, which names the module it came from; ``torch.fx.config.
    do_not_emit_stack_traces`` is newer than torch 2.11, and where it is missing the traces are recorded as
    before. The Python code of export's intermediate graph modules, regenerated after each of its clean-up passes
    (lazy graph modules, as torch.compile's own tracing uses, generate it only if it is called)."""
    fx_config = getattr(torch.fx, "config", None)
    had_flag = hasattr(fx_config, "do_not_emit_stack_traces")
    before = getattr(fx_config, "do_not_emit_stack_traces", None)
    try:
        if had_flag:
            fx_config.do_not_emit_stack_traces = True
        with torch._dynamo.config.patch(fake_tensor_cache_enabled=False), _use_lazy_graph_module(True):
            yield
    finally:
        if had_flag:
            fx_config.do_not_emit_stack_traces = before


def export_graph(module: torch.nn.Module, args: tuple, dynamic_shapes) -> fx.GraphModule:
    """Non-strict torch.export of any module (under :func:`lean_tracing`) -> unlifted GraphModule without
    metadata asserts."""
    with torch.no_grad(), lean_tracing():
        program = torch.export.export(module, args, dynamic_shapes=dynamic_shapes, strict=False)
    gm = program.module()
    drop_full_slices(gm)
    drop_metadata_asserts(gm)
    return gm


def drop_full_slices(gm: fx.GraphModule) -> int:
    """Remove ``slice(x, dim, 0, INT_MAX)`` views of a whole dimension. Code traced with symbolic sizes (what
    Dynamo hands ``torch.compile`` backends) keeps them for every ``x[None, :]``; a static trace drops them, and
    the passes' patterns are written without them. Returns how many were removed (the graph is recompiled by
    :func:`drop_metadata_asserts`)."""
    removed = 0
    for node in list(gm.graph.find_nodes(op="call_function", target=torch.ops.aten.slice.Tensor)):
        _, _, start, end, step = (*node.args, *(0, None, None, 1)[len(node.args) - 1:])
        if start in (None, 0) and (end is None or (isinstance(end, int) and end >= sys.maxsize)) and step == 1:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            removed += 1
    return removed


def drop_metadata_asserts(gm: fx.GraphModule) -> int:
    """Remove export's ``_assert_tensor_metadata`` checks: they pin every intermediate they inspect and
    would keep a rewritten subgraph (e.g. a dequantized weight) alive. Returns how many were removed."""
    removed = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _METADATA_ASSERTS:
            gm.graph.erase_node(node)
            removed += 1
    gm.graph.lint()
    gm.recompile()
    return removed
