"""fuse_latent_query_into_q_b: the q_b (| wq_b) GEMM whose query heads an attention op reads -> one
``fxglm5::fp8_linear_latent_query`` (the GEMM's output and the latent query of its heads); the attention op
(``rtp_sparse_mla`` / ``rtp_mla``) then takes that query as its ``q_latent`` and makes none.

Why: at decode a GLM-5 attention layer ran the stacked q_b | wq_b GEMM as one launch and then, inside the
attention op's Triton body, the latent query (per head q_nope . W_UK -> 512 columns, q_pe rotated -> 64: the
[T, H, 576] MLA query) as a launch of its own after the indexer's: eight launches a decode attention layer where
issue 45 (item 5) asks for fewer. The latent query reads nothing but the GEMM's query columns (and constants), so
the two meet in one launch with a dependency inside it: the Triton op (``lowering.triton.paged_cache
.fp8_linear_latent_query``) runs the GEMM's tiles and then the latent query's programs as tasks of one launch, each
head's programs waiting for the tiles of that head's columns (``lowering.triton.tasks``), each with its own
launch's tile function, so the bits of the two launches; one launch fewer a decode attention layer. Past 16 tokens
(prefill), and where the GEMM is not one plain launch (the GEMV, the Gluon kernel), the op runs the two launches.

Matched, per ``rtp_sparse_mla`` / ``rtp_mla`` without a ``q_latent``: its q_nope and q_pe are items 0 and 1 of one
``split_with_sizes([nope, rope], -1)`` of a view [..., H, nope + rope] of (a step-1 slice, on its last dim, of) an
``fxglm5::fp8_linear`` of the layer's normed query latent, with the op's W_UK of [H, nope, R]: the GEMM's H query
heads from the slice's start column, q_nope first in each. The two items must be read by that op only, the split by
its items, the view by the split and the slice by the view (the attention op keeps q_nope, q_pe and W_UK as the
names of what its query was made from; ``written`` is the cache writes' precedent). The new op takes the GEMM's
place (an input that comes after it is a constant, moved before it, or the layer is left alone) and its first
output every reader of the GEMM (the indexer's query slice of the stacked GEMM among them).

Left alone: q_nope or q_pe read elsewhere too; q_nope and q_pe of two GEMMs (or two splits); q_pe first in each head;
a query computed from the GEMM (not only sliced, viewed and split); a GEMM that is not ``fp8_linear`` (a bf16
checkpoint's q_b is an ``aten.linear``, cuBLAS's launch); the op's RoPE tables or W_UK computed after the GEMM.
Exact: the op's reference is the chain it replaces (``fp8_linear``, then the reference latent query of its query
columns, as the attention op's body made it), so every graph gives what it gave before.

Why in the fuse_kernels stage after ``fuse_index_weights_into_q_norm``: ``fuse_shared_input_gemms`` has stacked
q_b | wq_b (the op takes the stacked GEMM, the query heads at its start), and ``fuse_cache_writes_into_q_norm`` found
each layer's query-latent norm from q_nope as a view of this GEMM; the cache stage folded q_pe's RoPE into the
attention op (``rope_cos`` / ``rope_sin``), which the new op applies as the attention op did.
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxglm5.passes.fuse_shared_expert_into_moe import _columns
from fxglm5.passes.graph_utils import aten, fake_call, getitem_of, insert_call, is_op, op_args, set_op_args, shape_of
from fxglm5.passes.manager import PassOutcome
from fxglm5.passes.registry import register_pass

_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def expected_fusions(ctx) -> int | None:
    """One per attention layer of a paged graph from an FP8 checkpoint (every layer's q_b is an fp8_linear), none in a
    bf16 checkpoint (q_b is torch's GEMM) or a graph without the cache stage (no cached attention op). None where the
    context does not say whether the graph is paged."""
    paged = ctx.extras.get("paged")
    if paged is None:
        return None
    return ctx.config.num_hidden_layers if paged and ctx.config.is_fp8 else 0


def _same(a, b) -> bool:
    return statically_known_true(a == b)


def _query_of(attention: fx.Node) -> tuple[fx.Node, int, int] | None:
    """(the fp8_linear, its first query column, the rope width) of an attention op whose q_nope and q_pe are the
    query heads of one GEMM's output as matched (see the module doc), else None."""
    args = op_args(attention)
    q_nope, q_pe, w_uk = args["q_nope"], args["q_pe"], shape_of(args["w_uk"])
    split = getitem_of(q_nope, 0)
    if split is None or getitem_of(q_pe, 1) is not split or not is_op(split, aten.split_with_sizes.default):
        return None
    if set(q_nope.users) != {attention} or set(q_pe.users) != {attention} or set(split.users) != {q_nope, q_pe}:
        return None
    view, sizes, dim = (op_args(split)[name] for name in ("self", "split_sizes", "dim"))
    heads = shape_of(view)
    if not is_op(view, *_VIEWS) or heads is None or w_uk is None or set(view.users) != {split}:
        return None
    if dim % len(heads) != len(heads) - 1 or len(sizes) != 2 or (heads[-2], sizes[0]) != tuple(w_uk[:2]):
        return None
    source = op_args(view)["self"]
    columns = shape_of(source)
    if (columns is None or len(columns) != len(heads) - 1 or not all(map(_same, columns[:-1], heads[:-2]))
            or not _same(columns[-1], heads[-2] * heads[-1]) or not _same(heads[-1], sizes[0] + sizes[1])):
        return None
    gemm, q_start = source, 0
    if is_op(source, aten.slice.Tensor):
        gemm = op_args(source)["self"]
        span = _columns(source, gemm)
        if span is None or span[1] - span[0] != columns[-1]:
            return None
        q_start = span[0]
    return (gemm, q_start, sizes[1]) if is_op(gemm, torch.ops.fxglm5.fp8_linear.default) else None


def _fuse(gm: fx.GraphModule, attention: fx.Node) -> bool:
    args = op_args(attention)
    found = None if args["q_latent"] is not None else _query_of(attention)
    if found is None:
        return False
    gemm, q_start, rope_dim = found
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    later = [value for value in (args["w_uk"], args["rope_cos"], args["rope_sin"])
             if isinstance(value, fx.Node) and order[value] > order[gemm]]
    if any(value.op != "get_attr" for value in later):
        return False
    for value in later:  # a constant reads nothing: it moves before the GEMM as it is
        gemm.prepend(value)
    g = op_args(gemm)
    target = torch.ops.fxglm5.fp8_linear_latent_query.default
    call = (g["x"], g["weight"], g["weight_scale_inv"], g["bias"], g["act_quant"], args["w_uk"], q_start, rope_dim,
            args["rope_cos"], args["rope_sin"])
    fused = insert_call(gm, gemm, target, call, fake_call(target, *call))
    with gm.graph.inserting_before(gemm):
        out, query = (gm.graph.call_function(operator.getitem, (fused, i)) for i in range(2))
    out.meta.update(gemm.meta)
    query.meta["val"] = fused.meta["val"][1]
    gemm.replace_all_uses_with(out)
    gm.graph.erase_node(gemm)
    set_op_args(attention, q_latent=query)
    return True


@register_pass("fuse_kernels", expected=expected_fusions)
def fuse_latent_query_into_q_b(gm: fx.GraphModule, ctx) -> PassOutcome:
    ops = torch.ops.fxglm5
    attention = [*gm.graph.find_nodes(op="call_function", target=ops.rtp_sparse_mla.default),
                 *gm.graph.find_nodes(op="call_function", target=ops.rtp_mla.default)]
    return PassOutcome(sum(_fuse(gm, node) for node in attention))
