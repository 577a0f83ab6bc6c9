"""Greedy decoding by full recompute: the simplest correct generator, the reference for faster ones."""

from __future__ import annotations

import torch

from fxglm5.errors import InputError
from fxglm5.model.modeling import Glm5ForCausalLM, check_input_ids


@torch.no_grad()
def greedy_generate(model: Glm5ForCausalLM, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Append ``max_new_tokens`` argmax tokens to ``prompt_ids``, re-running the whole sequence each step."""
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
    for _ in range(max_new_tokens):
        nxt = model(ids)[:, -1].float().argmax(dim=-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids[0, len(prompt_ids):].tolist()
