"""The sharded graph's invariants, checked once it is whole (after the stitch when the shard stage ran per layer
kind): what the shard passes must have left, whichever of them ran, so that a rank never runs a program that
mixes sharded and whole parts.

- two ``all_reduce`` per decoder layer (after attention, after the MLP / MoE) and one ``all_gather`` for a head
  that makes logits (``shard_lm_head.LOGITS_HEADS``; none for the hidden-state head);
- every ``fp8_linear`` either in the shard plan or one of the linears that stay whole by design (q_a / kv_a and
  the DSA indexer's wq_b / wk: every rank computes the same latent and selects the same keys; the MTP layer's
  eh_proj: every rank computes the same input to its decoder layer);
- every ``moe_fp8``'s experts in the plan;
- with ``strict``, every node runs again on fake tensors of the rank-local weights (a size left at its unsharded
  value, e.g. a literal head count in a view, fails there, naming the node).

A broken invariant is a PassError with ``strict`` and a logged warning without, as the passes' match counts are.
"""

from __future__ import annotations

import logging

import torch
from torch import fx

from fxglm5.errors import PassError
from fxglm5.parallel import PLAN, Mapping
from fxglm5.passes.graph_utils import op_args
from fxglm5.passes.shard_lm_head import LOGITS_HEADS
from fxglm5.passes.sharding import check_shapes

log = logging.getLogger(__name__)

REPLICATED = ("self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight", "self_attn.indexer.wq_b.weight",
              "self_attn.indexer.wk.weight", "mtp.eh_proj.weight")


def sharding_problems(gm: fx.GraphModule, config, mapping: Mapping, head: str | None) -> list[str]:
    """What the graph lacks of a sharded program for ``mapping`` (empty: nothing)."""
    ops = torch.ops.fxglm5
    plan = gm.meta.get(PLAN, {})
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    problems = []
    counts = {op: sum(n.target is op for n in calls) for op in (ops.all_reduce.default, ops.all_gather.default)}
    if config is not None and counts[ops.all_reduce.default] != 2 * config.num_hidden_layers:
        problems.append(f"{counts[ops.all_reduce.default]} all_reduce for {config.num_hidden_layers} layers (needs 2 "
                        "per layer: after attention and after the MLP / MoE)")
    if head is not None and counts[ops.all_gather.default] != (head in LOGITS_HEADS):
        problems.append(f"{counts[ops.all_gather.default]} all_gather for the {head} head")
    for node in calls:
        if node.target is ops.fp8_linear.default:
            target = op_args(node)["weight"].target
            if target not in plan and not target.endswith(REPLICATED):
                problems.append(f"fp8_linear over {target} is neither sharded nor one that stays whole")
        elif node.target is ops.moe_fp8.default and op_args(node)["w13"].target not in plan:
            problems.append(f"moe_fp8 over {op_args(node)['w13'].target} is not sharded")
    return problems


def check_sharded(gm: fx.GraphModule, config, mapping: Mapping, head: str | None, strict: bool) -> None:
    """Check the invariants above (a no-op at world size 1)."""
    if mapping.world == 1:
        return
    problems = sharding_problems(gm, config, mapping, head)
    if problems and strict:
        raise PassError(f"shard stage (tp={mapping.tp}, ep={mapping.ep}): " + "; ".join(problems) + " (strict mode)")
    for problem in problems:
        log.warning("fxglm5 shard stage (tp=%d, ep=%d): %s", mapping.tp, mapping.ep, problem)
    if strict:
        check_shapes(gm)
