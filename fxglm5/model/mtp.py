"""Glm5MTP: GLM-5's multi-token-prediction layer (checkpoint layer ``num_hidden_layers``), the draft model of
speculative decoding, written as vLLM / SGLang serve DeepSeek's MTP.

At position i it takes the target's hidden state h_i after the final norm and the token t_{i+1}, and predicts
t_{i+2}::

    x = eh_proj(cat([enorm(embed_tokens(t_{i+1})), hnorm(h_i)], -1));  y = layer(x, RoPE at position i)
    logits = head(shared_head_norm(y))

``y`` is what a chained draft feeds back as h for the next position. The decoder layer is the model's
``DecoderLayer`` (MoE, with a DSA indexer of its own), so the compiler's passes see the pattern they see in the
target. ``embed_tokens`` and, unless the checkpoint has a ``shared_head.head``, ``head`` are the target's modules.
"""

from __future__ import annotations

import torch
from torch import nn

from fxglm5.model.config import Glm5Config
from fxglm5.model.layers import Linear, RMSNorm, rope_cos_sin
from fxglm5.model.layout import MtpLayout, check_mtp_config
from fxglm5.model.decoder import DecoderLayer, check_input_ids


class Glm5MTP(nn.Module):
    def __init__(self, cfg: Glm5Config, embed_tokens: nn.Embedding, lm_head: nn.Module, dtype: torch.dtype,
                 device=None, layout: MtpLayout = MtpLayout()):
        super().__init__()
        check_mtp_config(cfg)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.config, self.layout = cfg, layout
        self.embed_tokens = embed_tokens
        self.enorm = RMSNorm(h, eps, dtype, device)
        self.hnorm = RMSNorm(h, eps, dtype, device)
        self.eh_proj = Linear(2 * h, h, layout.eh_proj_fp8, dtype, device)
        self.layer = DecoderLayer(cfg, cfg.num_hidden_layers, dtype, device)
        self.shared_head_norm = RMSNorm(h, eps, dtype, device)
        if layout.own_head:
            self.head = nn.Linear(h, cfg.vocab_size, bias=False, dtype=dtype, device=device)
            self.head.requires_grad_(False)
        else:
            self.head = lm_head

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [B, S] (t_{i+1}), position_ids [B, S] (i), hidden [B, S, H] (h_i) -> (logits [B, S, V],
        hidden_out [B, S, H]). Attention is causal over the S positions given (the MTP's own keys)."""
        if not (torch.compiler.is_compiling() or torch.compiler.is_exporting()):
            check_input_ids(input_ids, self.config.vocab_size)
        cos, sin = rope_cos_sin(position_ids, self.config.qk_rope_head_dim, self.config.rope_theta)
        e = self.enorm(self.embed_tokens(input_ids))
        x = self.eh_proj(torch.cat([e, self.hnorm(hidden.to(e.dtype))], dim=-1))
        y, _ = self.layer(x, cos, sin, None)
        return self.head(self.shared_head_norm(y)), y
