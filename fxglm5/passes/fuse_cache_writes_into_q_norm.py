"""fuse_cache_writes_into_q_norm: a layer's query-latent RMSNorm and its two cache writes -> one
``fxglm5::rms_norm_write_caches``, its attention ops then told that their rows are ``written``.

Why: at decode the first GEMM of a GLM-5 attention layer (q_a | kv_a | the indexer's wk, one GEMM after
``fuse_shared_input_gemms``) is read by three small kernels that read nothing else: ``q_a_layernorm`` on the q_a
columns, the latent-cache write (kv_c's RMSNorm, k_pe's RoPE, FP8 rows) inside rtp_*mla and the index-cache write
(the key's LayerNorm and RoPE, FP8 rows) inside rtp_indexer. Each is one program per token of a few microseconds, and
the two writes sat in the middle of the chain, after the q_b GEMM. One op writes both caches where the norm was,
and its Triton kernel is one launch whose programs split into the three roles (``paged_cache.rms_norm_write_caches``:
the standalone kernels' row helpers, so the bits are theirs). Order: the attention ops' queries are computed from
the normed latent (q_b / wq_b), so the new op, which returns it, runs before both ops read their caches.

Matched, per rtp_sparse_mla / rtp_mla node not yet ``written``: its q_nope is a view / slice of a GEMM
(``fp8_linear`` or ``linear``) of an ``fxglm5::rms_norm`` (the query latent's norm). The layer's own indexer is the
rtp_indexer whose top-k the op reads, if that indexer's query is computed from the same norm: its write joins the op
when it writes to the same slots (the same forward-context nodes) and turns its key by the same RoPE tables. A layer
without its own indexer (GLM-5's "shared" layers reuse the previous layer's top-k) fuses its norm and latent write
(the kernel's index role is compiled out), so the count is one per attention layer.

Left alone: a query that is not projected from an RMSNorm; a layer whose own indexer cannot join (other RoPE tables,
other slots: its write would stay a launch of its own, for a partial fusion); a cache another op also reads or writes
(moving its write earlier could reorder them); an input of the writes computed from the normed latent (the op would
have to run before its own input). Other readers of the un-normed q_a rows or of the raw kv_c / k_pe / k rows do not
stop it: the op only reads them, so they keep what they read (the attention ops themselves still take them).

Why in the fuse_kernels stage, after ``fuse_shared_input_gemms``: the cache stage's folds must have made the raw rows
the cached ops' inputs (``fuse_norm_rope_into_cache_writes``, ``fuse_rope_into_indexer_query``); and the op reads
slices of the stacked GEMM as the ops did, so which GEMMs are stacked does not matter here.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from fxglm5.passes.graph_utils import aten, is_op, op_args, set_op_args, through
from fxglm5.passes.manager import PassOutcome
from fxglm5.passes.registry import register_pass

# ops that take a piece of a GEMM's output without computing: what lies between q_b's GEMM and the attention's q_nope
_PIECES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.slice.Tensor,
           aten.split_with_sizes.default, aten.split.Tensor, aten.squeeze.dim, aten.unsqueeze.default)
_CONTEXT = ("slot_mapping", "block_table", "req_idx", "positions", "max_positions")


def expected_fusions(ctx) -> int | None:
    """One per attention layer of a paged graph (every GLM-5 layer normalizes its query latent; ``index_writes`` in
    the details counts those with their own indexer), none in a graph without the cache stage (no cache writes).
    None where the context does not say whether the graph is paged."""
    paged = ctx.extras.get("paged")
    if paged is None:
        return None
    return ctx.config.num_hidden_layers if paged else 0


def _projected_from(node):
    """The input of the GEMM (``fp8_linear`` / ``linear``) of which ``node`` is a view or a slice, or None."""
    while isinstance(node, fx.Node):
        if node.op == "call_function" and node.target is operator.getitem:
            node = node.args[0]
        elif is_op(node, *_PIECES):
            node = op_args(node)["self"]
        else:
            break
    if is_op(node, torch.ops.fxglm5.fp8_linear.default):
        return through(op_args(node)["x"])
    if is_op(node, aten.linear.default):
        return through(op_args(node)["input"])
    return None


def reads(node, source: fx.Node, order: dict) -> bool:
    """Whether ``node``'s value is computed from ``source``'s (nodes before ``source`` cannot be)."""
    seen, todo = set(), [node]
    while todo:
        current = todo.pop()
        if current is source:
            return True
        if not isinstance(current, fx.Node) or current in seen or order[current] < order[source]:
            continue
        seen.add(current)
        todo += current.all_input_nodes
    return False


def _own_indexer(attention: fx.Node, norm: fx.Node, order: dict):
    """The rtp_indexer that selects for ``attention`` if its query is computed from ``norm`` (the layer's own), else
    None (no indexer, or an earlier layer's)."""
    selection = op_args(attention).get("topk_pos")
    if is_op(selection, torch.ops.fxglm5.rtp_indexer.default) and reads(op_args(selection)["q"], norm, order):
        return selection
    return None


def _sole_reader(cache, node: fx.Node) -> bool:
    return isinstance(cache, fx.Node) and set(cache.users) == {node}


def _fuse(gm: fx.GraphModule, attention: fx.Node, order: dict) -> int | None:
    """Rewrite one layer; returns the number of index writes it took (0 or 1), None where it is left alone."""
    args = op_args(attention)
    norm = _projected_from(args["q_nope"])
    if args["written"] or not is_op(norm, torch.ops.fxglm5.rms_norm.default):
        return None
    indexer = _own_indexer(attention, norm, order)
    if not _sole_reader(args["kv_cache"], attention):
        return None
    index = {"k": None, "index_cache": None}
    if indexer is not None:
        idx = op_args(indexer)
        same = all(idx[name] == args[name] for name in (*_CONTEXT, "rope_cos", "rope_sin"))
        if idx["written"] or not same or not _sole_reader(idx["index_cache"], indexer):
            return None
        index = {name: idx[name] for name in ("k", "index_cache", "k_norm_weight", "k_norm_bias", "k_norm_eps")}
    normed = op_args(norm)
    call = dict(x=normed["x"], weight=normed["weight"], eps=normed["eps"], kv_c=args["kv_c"], k_pe=args["k_pe"],
                kv_cache=args["kv_cache"], **index, **{name: args[name] for name in _CONTEXT},
                rope_cos=args["rope_cos"], rope_sin=args["rope_sin"], kv_norm_weight=args["kv_norm_weight"],
                kv_norm_eps=args["kv_norm_eps"])
    inputs = [value for value in call.values() if isinstance(value, fx.Node)]
    if any(reads(value, norm, order) for value in inputs):
        return None
    insert_fused(gm, norm, [norm], inputs, order, call)
    gm.graph.erase_node(norm)
    set_op_args(attention, written=True)
    if indexer is not None:
        set_op_args(indexer, written=True)
    return int(indexer is not None)


def insert_fused(gm: fx.GraphModule, at: fx.Node, outputs: list, inputs: list, order: dict, call: dict) -> fx.Node:
    """``rms_norm_write_caches(**call)`` and a getitem of each of its outputs that stands for a node of ``outputs``
    (the normed latent, then the head weights where the call computes them: their metadata, their readers), placed
    at ``at`` or, where an input comes later, right after its last input; the readers of ``outputs`` that came before
    that place move right after the getitems, in their order (none is an input: the caller checked). Returns the
    call; ``outputs`` are left unread."""
    last = max(inputs, key=order.__getitem__)
    anchor = at if order[last] < order[at] else last.next
    with gm.graph.inserting_before(anchor):
        fused = gm.graph.call_function(torch.ops.fxglm5.rms_norm_write_caches.default, (), call)
        items = [gm.graph.call_function(operator.getitem, (fused, i)) for i in range(len(outputs))]
    fused.meta.update(outputs[0].meta)  # the module the query latent's norm belonged to
    normed = outputs[0].meta.get("val")
    if normed is not None:  # the op's (normed, weights), [..., 0] without the weights
        fused.meta["val"] = (normed, outputs[1].meta.get("val") if len(outputs) > 1 else
                             normed.new_empty(*normed.shape[:-1], 0, dtype=torch.float32))
    set_op_args(fused)  # every argument by position, as the other rewritten nodes pass them
    cursor = items[-1]
    if anchor is not at:
        for node in [n for n in gm.graph.nodes if order.get(n, -1) > order[at] and order[n] <= order[last]]:
            if any(reads(node, output, order) for output in outputs):
                cursor.append(node)
                cursor = node
    for item, output in zip(items, outputs):
        item.meta.update(output.meta)
        output.replace_all_uses_with(item)
    return fused


@register_pass("fuse_kernels", expected=expected_fusions)
def fuse_cache_writes_into_q_norm(gm: fx.GraphModule, ctx) -> PassOutcome:
    ops = torch.ops.fxglm5
    fused = []
    for attention in list(gm.graph.find_nodes(op="call_function", target=ops.rtp_sparse_mla.default)) + \
            list(gm.graph.find_nodes(op="call_function", target=ops.rtp_mla.default)):
        order = {node: i for i, node in enumerate(gm.graph.nodes)}
        took = _fuse(gm, attention, order)
        if took is not None:
            fused.append(took)
    return PassOutcome(len(fused), {"index_writes": sum(fused)})
