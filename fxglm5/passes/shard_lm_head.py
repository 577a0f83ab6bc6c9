"""shard_lm_head: the rank's rows of the vocabulary projection, then ``fxglm5::all_gather`` of the logits along
the vocabulary (last) dim, so every rank returns the whole logits (the Runner samples from them).

Only a graph whose first output is the lm_head's linear matches: head "logits", and the heads whose logits come
first beside a hidden output (:data:`LOGITS_HEADS`: "logits+hidden", speculative decoding's target, and the MTP
layer's (logits, hidden_out), whose head is the model's lm_head or the layer's own). A hidden-state graph (head
"hidden", the RTP plugin's) has no lm_head: the engine applies its own vocabulary shard. The all_gather works
row by row, so select_sampled_rows (cache stage) still moves the sampled-row selection above it and the lm_head.

A vocabulary that tp does not divide is padded (as vLLM and SGLang pad theirs): each rank holds ceil(V / tp) rows,
the last ranks' past V are zeros (``fxglm5.parallel.Mapping.vocab_part``), and the gathered logits are cut back to
V columns, so the padded logits never reach the sampler.
"""

from __future__ import annotations

import functools

from torch import fx

from fxglm5.capture.export import MTP_HEAD
from fxglm5.passes.graph_utils import aten, get_attr_tensor
from fxglm5.passes.manager import PassOutcome
from fxglm5.passes.registry import register_pass
from fxglm5.passes.sharding import gather_after, insert_after, linear, shard_each, shard_linear


# heads whose (first) output is the vocabulary projection; MTP_HEAD: the MTP layer's graph (compiler.compile_mtp)
LOGITS_HEADS = ("logits", "logits+hidden", MTP_HEAD)


def expected_lm_head(ctx):
    if ctx.mapping.world == 1:
        return 0
    head = ctx.extras.get("head")
    return None if head is None else int(head in LOGITS_HEADS)


def _shard_one(gm: fx.GraphModule, node: fx.Node, mapping, head: str | None = None) -> bool:
    """The graph's one output, when it is a linear (the lm_head); with a ``head`` of :data:`LOGITS_HEADS`, its first
    output (the logits beside a hidden output)."""
    if node.op != "output":
        return False
    outputs = node.args[0] if isinstance(node.args[0], (tuple, list)) else (node.args[0],)
    if head in LOGITS_HEADS and len(outputs) > 1:
        first = outputs[0]
    elif len(node.all_input_nodes) == 1:
        first = node.all_input_nodes[0]
    else:
        return False
    lin = linear(first) if isinstance(first, fx.Node) else None
    if lin is None or len(lin.node.users) != 1:
        return False
    vocab = get_attr_tensor(gm, lin.weight).shape[0]
    start, stop = mapping.vocab_part(vocab)
    shard_linear(gm, lin, 0, start, stop, padded=stop > vocab)
    gathered = gather_after(gm, lin.node, -1, mapping, "shard_lm_head")
    if (stop - start) * mapping.world != vocab:  # the padded columns are dropped before anything reads the logits
        cut = insert_after(gm, gathered, aten.slice.Tensor, (gathered, -1, 0, vocab))
        gathered.replace_all_uses_with(cut, delete_user_cb=lambda user: user is not cut)
    return True


@register_pass("shard", expected=expected_lm_head)
def shard_lm_head(gm: fx.GraphModule, ctx) -> PassOutcome:
    return PassOutcome(shard_each(gm, ctx, functools.partial(_shard_one, head=ctx.extras.get("head"))))
