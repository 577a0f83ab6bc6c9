"""Greedy decoding by full recompute: the simplest correct generators, the references for faster ones.

``greedy_generate`` runs the target alone; ``speculative_greedy_generate`` drafts with the MTP layer and verifies
with the target (no cache either: the oracle of the paged runtime's speculative decoding). Their tokens agree.
"""

from __future__ import annotations

import torch

from fxglm5.errors import InputError
from fxglm5.model.decoder import check_input_ids
from fxglm5.model.modeling import Glm5ForCausalLM


@torch.no_grad()
def greedy_generate(model: Glm5ForCausalLM, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Append ``max_new_tokens`` argmax tokens to ``prompt_ids``, re-running the whole sequence each step."""
    ids = _prompt(model, prompt_ids, max_new_tokens)
    for _ in range(max_new_tokens):
        nxt = model(ids)[:, -1].float().argmax(dim=-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids[0, len(prompt_ids):].tolist()


def _prompt(model: Glm5ForCausalLM, prompt_ids: list[int], max_new_tokens: int) -> torch.Tensor:
    """The prompt as a [1, P] tensor on the model's device, checked together with ``max_new_tokens``."""
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise InputError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids)], dtype=torch.int64, device=device)
    check_input_ids(ids, model.config.vocab_size)
    limit = model.config.max_position_embeddings
    if ids.shape[1] + max_new_tokens > limit:
        raise InputError(
            f"prompt ({ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds max_position_embeddings ({limit})"
        )
    return ids


MAX_SPECULATIVE_TOKENS = 4


def mtp_drafts(model: Glm5ForCausalLM, ids: torch.Tensor, hidden: torch.Tensor, k: int) -> list[int]:
    """``k`` greedy drafts chained through the MTP layer after ``ids`` [1, n + 1] (the last token is the target's
    newest, not yet run through it), ``hidden`` [1, n, H] the target's states at the first n positions. Draft j
    runs the MTP at position n - 1 + j on the token before it and, past the target's states, the MTP's own
    ``hidden_out`` of the position before (what the runtime's chained drafter does)."""
    n = hidden.shape[1]
    tokens, states, drafts = ids[:, 1:], hidden, []
    for _ in range(k):
        positions = torch.arange(tokens.shape[1], device=ids.device)[None]
        logits, out = model.mtp(tokens, positions, states)
        drafts.append(int(logits[0, -1].float().argmax()))
        tokens = torch.cat([tokens, tokens.new_tensor([[drafts[-1]]])], dim=1)
        states = torch.cat([hidden, out[:, n - 1:]], dim=1)
    return drafts


@torch.no_grad()
def speculative_greedy_generate(model: Glm5ForCausalLM, prompt_ids: list[int], max_new_tokens: int,
                                k: int) -> tuple[list[int], list[int]]:
    """Greedy decoding with ``k`` MTP drafts per step, each step's drafts verified by one target forward over the
    k + 1 new positions (recomputing the whole sequence, as ``greedy_generate``): a draft is accepted while it is
    the target's own greedy token. Returns the tokens (``greedy_generate``'s) and each verify step's acceptance
    length (accepted drafts + the target's own next token)."""
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise InputError(f"k (speculative tokens) must be an integer in 1..{MAX_SPECULATIVE_TOKENS}, got {k!r}")
    if model.mtp is None:
        raise InputError("speculative decoding needs the model's MTP layer: load it with from_pretrained(..., mtp=True)")
    ids = _prompt(model, prompt_ids, max_new_tokens)
    if not max_new_tokens:
        return [], []
    logits, hidden = model(ids, return_hidden=True)
    ids = torch.cat([ids, logits[:, -1:].float().argmax(-1)], dim=1)
    accepted: list[int] = []
    while ids.shape[1] - len(prompt_ids) < max_new_tokens:
        n = hidden.shape[1]
        drafts = mtp_drafts(model, ids, hidden, min(k, max_new_tokens - (ids.shape[1] - len(prompt_ids)) - 1))
        logits, hidden = model(torch.cat([ids, ids.new_tensor([drafts]).view(1, -1)], dim=1), return_hidden=True)
        greedy = logits[0, n:].float().argmax(-1).tolist()  # the target's token after each of the k + 1 new ones
        a = next((j for j, d in enumerate(drafts) if d != greedy[j]), len(drafts))
        ids = torch.cat([ids, ids.new_tensor([drafts[:a] + [greedy[a]]])], dim=1)
        hidden = hidden[:, : n + 1 + a]
        accepted.append(a + 1)
    return ids[0, len(prompt_ids):].tolist(), accepted
