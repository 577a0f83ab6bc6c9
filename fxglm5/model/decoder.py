"""One GLM-5 decoder layer (MLA attention with its DSA indexer, then a dense MLP or the MoE) and the token-id
check every entry runs: shared by the decoder stack (modeling.py) and the MTP layer (mtp.py), which is one more
such layer, so that neither imports the other's module."""

from __future__ import annotations

import torch
from torch import nn

from fxglm5.errors import InputError
from fxglm5.model.attention import MLAAttention
from fxglm5.model.config import Glm5Config
from fxglm5.model.layers import MLP, RMSNorm
from fxglm5.model.moe import MoE


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Glm5Config, layer: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = MLAAttention(cfg, layer, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = (
            MoE(cfg, dtype, device)
            if cfg.is_moe_layer(layer)
            else MLP(cfg.hidden_size, cfg.intermediate_size, cfg.is_fp8, dtype, device)
        )

    def forward(self, x, cos, sin, prev_selection):
        attn, selection = self.self_attn(self.input_layernorm(x), cos, sin, prev_selection)
        h = x + attn
        return h + self.mlp(self.post_attention_layernorm(h)), selection


def check_input_ids(input_ids: torch.Tensor, vocab_size: int) -> None:
    """Reject malformed token ids before any kernel sees them (an out-of-range id would read garbage)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise InputError(f"input_ids must be a 2-D LongTensor [batch, seq], got {getattr(input_ids, 'shape', input_ids)!r}")
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise InputError(f"input_ids must be int64 or int32, got {input_ids.dtype}")
    if input_ids.numel() == 0:
        raise InputError("input_ids is empty")
    if input_ids.device.type == "meta":
        return
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise InputError(f"input_ids: token id {bad} is out of range [0, {vocab_size}) (vocab_size)")
