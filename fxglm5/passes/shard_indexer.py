"""shard_indexer: the DSA indexer's top-k split over the ranks by query token, at prefill-sized steps.

shard_attention leaves the indexer whole (its projections, its key cache and its top-k): every rank's sparse
attention reads every token's selection, and every rank's later queries score every key. So at a prefill every rank
computes the same logits and top-k (issue 47: 0.73 + 0.72 ms a layer on each H100 at an 8k prompt). This pass gives
each ``fxglm5::indexer_topk`` the mapping's ``group`` and ``world``: the op then computes the selection of its share of
the step's tokens only (tokens ``rank, rank + world, ...``: an equal share of short and long causal windows) and one
all_gather of the selected positions (``T x topk`` int32: 67 MB at 8k tokens) rebuilds ``[T, topk]`` on every rank
(``fxglm5.lowering.reference.collectives.gather_split_rows``). ``insert_paged_cache`` carries both arguments to
``rtp_indexer``, which still writes every key on every rank. A step of fewer than ``MIN_ROWS_PER_RANK`` tokens a rank
(decode, speculative verification) is not split: there the gather's latency exceeds the work it saves.

Why arguments of the op and not a rewrite into slice / top-k / all_gather / reorder nodes: whether a step splits and
how far it is padded (to a multiple of the world) depend on its token count, a symbolic size of the graph. Inside the
op they are integer decisions on the step's shape, the same on every rank (the ranks run the same step), while the
graph stays one static-shape program with the same ``[T, topk]`` output for every T; as nodes they would need a
branch on a symbolic size, data-dependent pad sizes and a second paged op for the rows of the share. The rank is read
when the op runs (``torch.distributed.get_rank`` of the group), so every rank's graph is the same code (the rank
agreement's ``plan_hash``).
"""

from __future__ import annotations

import torch
from torch import fx

from fxglm5.passes.graph_utils import is_op, op_args, set_op_args
from fxglm5.passes.manager import PassOutcome
from fxglm5.passes.registry import register_pass
from fxglm5.passes.sharding import anchor, shard_each


def expected_indexers(ctx) -> int:
    """Each layer with its own indexer (a "shared" layer reuses an earlier layer's top-k node)."""
    cfg = ctx.config
    return sum(cfg.has_indexer(i) for i in range(cfg.num_hidden_layers)) if ctx.mapping.world > 1 else 0


def _split_one(gm: fx.GraphModule, node: fx.Node, mapping) -> bool:
    if not is_op(node, torch.ops.fxglm5.indexer_topk.default) or op_args(node)["world"] != 1:
        return False  # not the indexer, or one already split
    set_op_args(node, group=mapping.group, world=mapping.world)
    anchor(node, "shard_indexer")
    return True


@register_pass("shard", expected=expected_indexers)
def shard_indexer(gm: fx.GraphModule, ctx) -> PassOutcome:
    return PassOutcome(shard_each(gm, ctx, _split_one))
