"""insert_paged_cache: canonical attention -> cached RTP ops, with the caches and the forward context as
explicit graph inputs.

Every ``fxglm5::sparse_mla`` / ``fxglm5::mla`` becomes ``fxglm5::rtp_sparse_mla`` / ``fxglm5::rtp_mla``
and every ``fxglm5::indexer_topk`` becomes ``fxglm5::rtp_indexer`` (see ``fxglm5.ops.cached``; a top-k split over the
ranks by ``shard_indexer`` stays split: its ``group`` / ``world`` carry over). Caches are
placeholders, not buffers, so one compiled graph serves any cache allocation (the runtime's, RTP's), an
exported artifact carries no cache, and CUDA-graph capture sees fixed input addresses.

The rewritten module is called positionally (plain FX codegen; the exported pytree signature is gone)::

    forward(input_ids [1, T], position_ids [1, T], slot_mapping [T], block_table [B, max_blocks],
            req_idx [T], logits_indices [R], kv_cache_0, index_cache_0, kv_cache_1, ...) -> logits [1, R, vocab]

The MTP layer's graph (``capture_mtp``, ``extras["head"] == "mtp"``) has a third input, ``hidden`` [1, T, H], before
the context inputs; a
graph of several outputs ((logits, hidden) of head "logits+hidden", the MTP's (logits, hidden_out)) keeps the
``logits_indices`` rows of each.

T tokens of B requests, flat (RTP style); ``position_ids[0]`` doubles as the ops' ``positions``; the block
table is at kernel granularity (its block size is the caches' dim 1). ``logits_indices`` lists the tokens
whose logits the step needs (a request's last token; ``torch.arange(T)`` for all of them): the output keeps
only those rows, and ``select_sampled_rows`` then computes only them. Caches come per attention layer in
layer order: ``kv_cache_{l}`` always, ``index_cache_{l}`` only for a layer that runs its own indexer (a
"shared" layer reuses an earlier layer's top-k). ``gm.meta["paged_cache"]`` (a :class:`PagedSignature`)
lists them, so a runtime allocates exactly what the graph takes.
"""

from __future__ import annotations

import torch
from torch import fx

import fxglm5.ops.cached  # noqa: F401  (registers the cached ops)
from fxglm5.capture.export import MTP_HEAD
from fxglm5.passes.graph_utils import aten, fake_call, fake_index, is_op, op_args, set_op_args
from fxglm5.passes.manager import PassOutcome
from fxglm5.passes.registry import register_pass
from fxglm5.program import CONTEXT_INPUTS, PagedSignature

_UNBOUNDED = 2**62
HEAD_OUTPUTS = {"logits": ("logits",), "hidden": ("hidden",), "logits+hidden": ("logits", "hidden"),
                MTP_HEAD: ("logits", "hidden")}


def expected_attention_layers(ctx) -> int:
    return ctx.config.num_hidden_layers


def _drop_pytree_signature(gm: fx.GraphModule, output: fx.Node) -> None:
    """Plain positional codegen; the export-time input-constraint hook would reject the new inputs."""
    gm.graph._codegen = fx.graph.CodeGen()
    for hooks in (gm._forward_pre_hooks,):
        for key, hook in list(hooks.items()):
            if getattr(hook, "__name__", "") == "_check_input_constraints_pre_hook":
                del hooks[key]
                gm._forward_pre_hooks_with_kwargs.pop(key, None)
    result = output.args[0]
    if isinstance(result, (tuple, list)) and len(result) == 1:
        output.args = (result[0],)


@register_pass("cache", expected=expected_attention_layers)
def insert_paged_cache(gm: fx.GraphModule, ctx) -> PassOutcome:
    ops = torch.ops.fxglm5
    attention = [n for n in gm.graph.nodes if is_op(n, ops.sparse_mla.default, ops.mla.default)]
    indexers = [n for n in gm.graph.nodes if is_op(n, ops.indexer_topk.default)]
    if not attention and not indexers:
        return PassOutcome(0, {"indexers": 0})
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    mtp = getattr(ctx, "extras", {}).get("head") == MTP_HEAD
    if len(placeholders) != 2 + mtp:
        wanted = "(input_ids, position_ids, hidden)" if mtp else "(input_ids, position_ids)"
        return PassOutcome(0, {"skipped": f"expected {wanted}, found {len(placeholders)} inputs"})
    config = getattr(ctx, "config", None)
    max_pos = int(config.max_position_embeddings) if config is not None else _UNBOUNDED

    # the indexer a layer owns: the first attention op that reads its top-k
    owner = {}
    for layer, node in enumerate(attention):
        if is_op(node, ops.sparse_mla.default) and op_args(node)["topk_indices"] in indexers:
            owner.setdefault(op_args(node)["topk_indices"], layer)
    if len(owner) != len(indexers):
        return PassOutcome(0, {"skipped": "an indexer_topk feeds no attention op"})

    results = _results(gm)
    head = getattr(ctx, "extras", {}).get("head")
    outputs = HEAD_OUTPUTS.get(head) or ("logits", "hidden")[:len(results)]
    if len(outputs) != len(results):
        return PassOutcome(0, {"skipped": f"head {head!r} names {len(outputs)} outputs, the graph has {len(results)}"})
    signature = PagedSignature.for_layers([layer in owner.values() for layer in range(len(attention))], outputs, mtp)
    names = signature.layers
    last = placeholders[-1]
    inputs = {}
    for name in [*CONTEXT_INPUTS, *[n for pair in names for n in pair if n is not None]]:
        with gm.graph.inserting_after(last):
            last = inputs[name] = gm.graph.placeholder(name)
    with gm.graph.inserting_after(last):
        positions = gm.graph.call_function(aten.reshape.default, (placeholders[1], [-1]))
    context = (inputs["slot_mapping"], inputs["block_table"], inputs["req_idx"], positions)

    for node, layer in owner.items():  # the attention ops' top-k argument now reads the new node
        args = op_args(node)
        q, k, weights, topk, group, world = (args[name] for name in ("q", "k", "weights", "topk", "group", "world"))
        cached = _replace(gm, node, ops.rtp_indexer.default, (q, k, weights, topk, inputs[names[layer][1]], *context,
                                                              max_pos))
        if world > 1:  # split over the ranks by shard_indexer
            set_op_args(cached, group=group, world=world)
    for layer, node in enumerate(attention):
        attn = op_args(node)
        latent = tuple(attn[name] for name in ("q_nope", "q_pe", "kv_c", "k_pe", "w_uk", "w_uv"))
        cache = inputs[names[layer][0]]
        if is_op(node, ops.sparse_mla.default):
            args = (*latent, attn["topk_indices"], attn["scale"], cache, *context, max_pos)
            _replace(gm, node, ops.rtp_sparse_mla.default, args)
        else:
            args = (*latent, attn["scale"], cache, *context, max_pos)
            _replace(gm, node, ops.rtp_mla.default, args)

    output = next(n for n in gm.graph.nodes if n.op == "output")
    _drop_pytree_signature(gm, output)
    results = _results(gm)
    index = fake_index(results[0])
    if index is not None:  # the rows kept are known at run time only; their dtype and width are known now
        inputs["logits_indices"].meta["val"] = index
    kept = []
    for result in results:
        with gm.graph.inserting_before(output):
            rows = gm.graph.call_function(aten.index_select.default, (result, 1, inputs["logits_indices"]))
        if index is not None:
            rows.meta["val"] = fake_call(aten.index_select.default, result, 1, inputs["logits_indices"])
        kept.append(rows)
    output.args = (kept[0] if len(kept) == 1 else tuple(kept),)
    gm.meta["paged_cache"] = signature
    return PassOutcome(len(attention), {"indexers": len(indexers)})


def _results(gm: fx.GraphModule) -> tuple:
    output = next(n for n in gm.graph.nodes if n.op == "output")
    return output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)


def _replace(gm: fx.GraphModule, node: fx.Node, target, args: tuple) -> fx.Node:
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(target, args)
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    return new
