"""Glm5ForCausalLM: GLM-5 written once, in plain PyTorch, without a KV cache.

``forward(input_ids [B, S], position_ids=None) -> logits [B, S, vocab]``; ``model(...)`` (the decoder) gives
the hidden states after the final norm. The module tree and parameter
names follow the HF checkpoint (``model.layers.{i}.self_attn.q_a_proj.weight`` ...), except that routed
experts are stacked per layer (``mlp.experts.gate_up_proj`` [E, 2I, H]); the checkpoint loader stacks them.
"""

from __future__ import annotations

import torch
from torch import nn

from fxglm5.model.checkpoint import CheckpointReader, resolve_dtype
from fxglm5.model.config import Glm5Config
from fxglm5.model.decoder import DecoderLayer, check_input_ids
from fxglm5.model.layers import RMSNorm, rope_cos_sin
from fxglm5.model.layout import MtpLayout
from fxglm5.model.mtp import Glm5MTP


class Glm5Model(nn.Module):
    """The decoder without the vocabulary projection: ``forward(input_ids, position_ids) -> hidden [B, S, H]``
    after the final RMSNorm (what an engine that applies the lm_head itself, as RTP-LLM does, takes)."""

    def __init__(self, cfg: Glm5Config, dtype: torch.dtype, device=None):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.embed_tokens.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, device) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if not (torch.compiler.is_compiling() or torch.compiler.is_exporting()):
            check_input_ids(input_ids, self.config.vocab_size)
        bsz, seq = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(seq, device=input_ids.device)[None].expand(bsz, seq)
        cos, sin = rope_cos_sin(position_ids, self.config.qk_rope_head_dim, self.config.rope_theta)
        x = self.embed_tokens(input_ids)
        selection = None
        for layer in self.layers:
            x, selection = layer(x, cos, sin, selection)
        return self.norm(x)


class Glm5ForCausalLM(nn.Module):
    """GLM-5 (glm_moe_dsa) causal LM; ``dtype`` is the compute dtype (FP8 weights stay FP8)."""

    def __init__(self, config: Glm5Config, dtype: torch.dtype = torch.bfloat16, device=None,
                 mtp: bool | MtpLayout = False):
        """``mtp``: also build the MTP layer as ``self.mtp`` (a ``Glm5MTP``; an MtpLayout says how the checkpoint
        stores it, True: as GLM-5-FP8 does); else ``self.mtp`` is None and the model is as large as without it."""
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.model = Glm5Model(config, dtype, device)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype, device=device)
        self.lm_head.requires_grad_(False)
        self.mtp = None
        if mtp:

            layout = mtp if isinstance(mtp, MtpLayout) else MtpLayout()
            self.mtp = Glm5MTP(config, self.model.embed_tokens, self.lm_head, dtype, device, layout)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                return_hidden: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """logits [B, S, V]; with ``return_hidden`` (logits, hidden [B, S, H] after the final norm): what the MTP
        layer takes."""
        hidden = self.model(input_ids, position_ids)
        logits = self.lm_head(hidden)
        return (logits, hidden) if return_hidden else logits

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype | str = torch.bfloat16, device="cpu", progress: bool = True,
                        mtp: bool = False):
        """Build the model for ``path``'s config.json and load its safetensors (FP8 or bf16) into it; with
        ``mtp`` the MTP layer too (``self.mtp``; a checkpoint without one is a CheckpointError naming the missing
        tensors), else its tensors are skipped and never read.

        The checkpoint is checked from its headers first (names, shapes, dtypes, scale shapes), then each tensor's
        values as it is read. High-precision tensors are converted to ``dtype`` (the router and
        indexer.weights_proj stay float32); FP8 weights and their float32 scales are kept as stored."""
        dtype, device = resolve_dtype(dtype), torch.device(device)
        reader = CheckpointReader(path, mtp=mtp)
        model = cls(reader.config, dtype=dtype, device="meta", mtp=reader.mtp_layout or False)
        return reader.load_into(model, device, progress)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


class Glm5MtpDraft(nn.Module):
    """GLM-5's MTP layer (``self.mtp``, a Glm5MTP) with only the model's modules it uses: the embedding and, unless
    the checkpoint's layer has a head of its own, the lm_head (``lm_head`` None then). What a draft model beside a
    target that holds the decoder stack loads: the parameters are named as in Glm5ForCausalLM, so the same
    checkpoint loads into it, and it is what ``compiler.compile_mtp`` takes (``config``, ``dtype``, ``mtp``)."""

    def __init__(self, config: Glm5Config, dtype: torch.dtype = torch.bfloat16, device=None,
                 layout: MtpLayout = MtpLayout()):
        super().__init__()
        self.config, self.dtype = config, dtype
        embed = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.model = nn.ModuleDict({"embed_tokens": embed.requires_grad_(False)})
        self.lm_head = None if layout.own_head else nn.Linear(
            config.hidden_size, config.vocab_size, bias=False, dtype=dtype, device=device).requires_grad_(False)
        self.mtp = Glm5MTP(config, embed, self.lm_head, dtype, device, layout)

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype | str = torch.bfloat16, device="cpu", progress: bool = True):
        """The MTP layer of the checkpoint at ``path`` and the model tensors it shares, and nothing else: the
        decoder layers' tensors are not checked or read, and a shard holding only them is not opened
        (``CheckpointReader(mtp_only=True)``). A checkpoint without a complete MTP layer is a CheckpointError
        naming the missing tensors. Dtypes as :meth:`Glm5ForCausalLM.from_pretrained`."""
        dtype, device = resolve_dtype(dtype), torch.device(device)
        reader = CheckpointReader(path, mtp_only=True)
        return reader.load_into(cls(reader.config, dtype, "meta", reader.mtp_layout), device, progress)
