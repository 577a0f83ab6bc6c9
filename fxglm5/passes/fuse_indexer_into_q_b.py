"""fuse_indexer_into_q_b: the DSA indexer (``rtp_indexer``) whose query is the wq_b part of a stacked q_b | wq_b GEMM
with its latent query (``fxglm5::fp8_linear_latent_query``) -> one ``fxglm5::fp8_linear_latent_query_indexer`` (the
GEMM's output, the latent query and the indexer's top-k).

Why: at decode a GLM-5 attention layer ran the q_b | wq_b GEMM with its latent query as one launch and then the
indexer (its logits and top-k) as a launch of its own: six launches a decode attention layer where issue 45 (item 5)
asks for at most five. Once the norm launch writes this step's index keys and the head weights
(``fuse_cache_writes_into_q_norm``, ``fuse_index_weights_into_q_norm``), the indexer reads nothing made in its own
launch's neighbourhood but its query, the wq_b columns of the GEMM's output (un-rotated: the logits kernel turns it),
so its programs become tasks of the GEMM's launch, each waiting for the tiles of those columns as the latent query's
programs wait for theirs (``lowering.triton.latent_query_indexer``); each role keeps its own launch's code, so the
bits of the two launches. Past the decode bounds (16 tokens, rows of 8192 keys, a top-k split over ranks) the op runs
the separate launches.

Matched, per ``rtp_indexer`` with its keys ``written``: its query is a view [..., HI, D] of a step-1 slice, on its
last dim, of item 0 (the GEMM's output) of an ``fp8_linear_latent_query``, the view read by the indexer only and the
slice by the view; where the indexer rotates its query (``rope_q``) its RoPE tables are the latent query's. The new op
takes the latent-query op's place, with its arguments, the query's first column, heads and width, and the indexer's
head weights, cache, forward context, top-k and tensor-parallel group; the latent-query op's items and the indexer's
result read the new op's. An indexer input after the GEMM is moved before it if it is a constant (a get_attr node),
else the layer is left alone.

Left alone: an indexer that still writes its own keys (not ``written``: its write is not in the norm launch, and the
new op writes nothing); an index query read elsewhere too (the view or the slice); a query that is not the GEMM's
columns as they are (computed, rotated before the indexer); a GEMM that is not the fused latent-query op (a plain
``fp8_linear``: its launch has no tasks to join); the query's RoPE tables other than the latent query's; an indexer
input computed after the GEMM. Exact: the op's reference is the chain it replaces (``fp8_linear_latent_query``, then
rtp_indexer's body over the index query view, ``paged_steps.latent_query_indexer_step``), so every graph gives what it
gave before.

Why after ``fuse_latent_query_into_q_b``: that pass makes the op whose launch the indexer joins, and needs the
stacked GEMM's output still read by this slice (it moves every reader of the GEMM to the op's item 0).
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxglm5.passes.fuse_shared_expert_into_moe import _columns
from fxglm5.passes.graph_utils import aten, fake_call, getitem_of, insert_call, is_op, op_args, shape_of
from fxglm5.passes.manager import PassOutcome
from fxglm5.passes.registry import register_pass

_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
_INPUTS = ("weights", "index_cache", "slot_mapping", "block_table", "req_idx", "positions")


def expected_fusions(ctx) -> int | None:
    """One per layer with its own indexer in a paged graph from an FP8 checkpoint (each one's q_b | wq_b GEMM carries
    its latent query), none in a bf16 checkpoint or a graph without the cache stage. None where the context does not
    say whether the graph is paged."""
    paged = ctx.extras.get("paged")
    if paged is None:
        return None
    cfg = ctx.config
    return sum(cfg.has_indexer(i) for i in range(cfg.num_hidden_layers)) if paged and cfg.is_fp8 else 0


def _index_query_of(indexer: fx.Node) -> tuple[fx.Node, int, int, int] | None:
    """(the fp8_linear_latent_query, the query's first column, its heads, their width) where the indexer's query is
    that op's output columns as matched (see the module doc), else None."""
    view = op_args(indexer)["q"]
    if not is_op(view, *_VIEWS) or set(view.users) != {indexer} or indexer.args.count(view) != 1:
        return None
    heads = shape_of(view)
    source = op_args(view)["self"]
    whole = op_args(source)["self"] if is_op(source, aten.slice.Tensor) else None
    fused = getitem_of(whole, 0)
    if heads is None or len(heads) != 4 or not is_op(fused, torch.ops.fxglm5.fp8_linear_latent_query.default):
        return None
    span, columns = _columns(source, whole), shape_of(source)
    if span is None or columns is None or not all(isinstance(d, int) for d in heads[2:]):
        return None
    if not all(statically_known_true(a == b) for a, b in zip(columns[:-1], heads[:2])) or \
            span[1] - span[0] != heads[2] * heads[3] or columns[-1] != heads[2] * heads[3]:
        return None
    return fused, span[0], heads[2], heads[3]


def _fuse(gm: fx.GraphModule, indexer: fx.Node) -> bool:
    args = op_args(indexer)
    found = _index_query_of(indexer) if args["written"] else None
    if found is None:
        return False
    fused, index_start, heads, dim = found
    lq = op_args(fused)
    if args["rope_q"] and (args["rope_cos"], args["rope_sin"]) != (lq["rope_cos"], lq["rope_sin"]):
        return False
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    later = [args[name] for name in _INPUTS if isinstance(args[name], fx.Node) and order[args[name]] > order[fused]]
    if any(value.op != "get_attr" for value in later):
        return False
    for value in later:  # a constant reads nothing: it moves before the GEMM as it is
        fused.prepend(value)
    target = torch.ops.fxglm5.fp8_linear_latent_query_indexer.default
    call = (*(lq[name] for name in ("x", "weight", "weight_scale_inv", "bias", "act_quant", "w_uk", "q_start",
                                    "rope_dim", "rope_cos", "rope_sin")), index_start, heads, dim,
            *(args[name] for name in ("weights", "topk", "index_cache", "slot_mapping", "block_table", "req_idx",
                                      "positions", "max_positions", "rope_q", "group", "world")))
    new = insert_call(gm, fused, target, call, fake_call(target, *call))
    for item in list(fused.users):  # the GEMM's output and the latent query: the same items of the new op
        item.args = (new, item.args[1])
    with gm.graph.inserting_before(fused):
        top = gm.graph.call_function(operator.getitem, (new, 2))
    top.meta.update(indexer.meta)
    top.meta["val"] = new.meta["val"][2]
    indexer.replace_all_uses_with(top)
    gm.graph.erase_node(indexer)
    gm.graph.erase_node(fused)
    return True


@register_pass("fuse_kernels", expected=expected_fusions)
def fuse_indexer_into_q_b(gm: fx.GraphModule, ctx) -> PassOutcome:
    indexers = list(gm.graph.find_nodes(op="call_function", target=torch.ops.fxglm5.rtp_indexer.default))
    return PassOutcome(sum(_fuse(gm, node) for node in indexers))
