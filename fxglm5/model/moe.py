"""GLM-5's MoE block: sigmoid router with correction bias, normalized and scaled top-k, routed experts
stored stacked (as the compiler wants them), plus the shared expert.

The routed experts are captured densely over all experts, weighted by a [tokens, experts] routing
matrix that is zero outside each token's top-k: no data-dependent shapes, so torch.export captures it,
and fuse_fp8_moe rewrites the whole thing into one ``fxglm5::moe_fp8`` over the selected experts only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fxglm5.model.config import Glm5Config
from fxglm5.model.layers import FP8_DTYPE, MLP, dequantize_gate_up, dequantize_weight
from fxglm5.contracts import scale_shape


def route(logits: torch.Tensor, bias: torch.Tensor, cfg: Glm5Config) -> tuple[torch.Tensor, torch.Tensor]:
    """noaux_tc routing: (weights [T, k] float32, expert ids [T, k])."""
    scores = logits.sigmoid()
    choice = scores + bias
    if cfg.n_group > 1:
        per_group = choice.view(-1, cfg.n_group, cfg.n_routed_experts // cfg.n_group)
        group_scores = per_group.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores).scatter(1, group_scores.topk(cfg.topk_group, dim=-1).indices, 1.0)
        keep = keep[:, :, None].expand_as(per_group).reshape(choice.shape)
        choice = choice.masked_fill(keep == 0, float("-inf"))
    ids = choice.topk(cfg.num_experts_per_tok, dim=-1).indices
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids


class StackedExperts(nn.Module):
    """Routed experts as stacked tensors: gate_up_proj [E, 2I, H], down_proj [E, H, I] (+ block scales;
    gate_up_proj's are the per-expert gate_proj then up_proj scales, each half blocked on its own)."""

    def __init__(self, cfg: Glm5Config, dtype: torch.dtype, device=None):
        super().__init__()
        e, h, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.fp8, self.inter = cfg.is_fp8, i
        wdtype = FP8_DTYPE if self.fp8 else dtype
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h, dtype=wdtype, device=device), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(e, h, i, dtype=wdtype, device=device), requires_grad=False)
        if self.fp8:
            self.gate_up_proj_scale_inv = nn.Parameter(
                torch.empty(scale_shape((e, 2 * i, h), halves=True), dtype=torch.float32, device=device),
                requires_grad=False,
            )
            self.down_proj_scale_inv = nn.Parameter(
                torch.empty(scale_shape((e, h, i)), dtype=torch.float32, device=device), requires_grad=False
            )

    def weights(self, dtype: torch.dtype, expert: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate|up [.., 2I, H], down [.., H, I]) in ``dtype``: every expert's stacked, or one ``expert``'s."""
        pick = (lambda t: t) if expert is None else (lambda t: t[expert])
        if self.fp8:
            return (
                dequantize_gate_up(pick(self.gate_up_proj), pick(self.gate_up_proj_scale_inv), dtype),
                dequantize_weight(pick(self.down_proj), pick(self.down_proj_scale_inv), dtype),
            )
        return pick(self.gate_up_proj).to(dtype), pick(self.down_proj).to(dtype)

    def forward(self, x: torch.Tensor, routing: torch.Tensor) -> torch.Tensor:
        """x [T, H], routing [T, E] (top-k weights, zero elsewhere) -> [T, H].

        Captured (torch.export, torch.compile) as the dense form the passes match; run eagerly expert by expert,
        since the dense form's temporaries (every expert's dequantized weights, a [T, E, 2I] activation) reach
        tens of GB at GLM-5's widths."""
        if torch.compiler.is_compiling():
            return self.dense(x, routing)
        return self.by_expert(x, routing)

    def dense(self, x: torch.Tensor, routing: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, weighted by ``routing``: no data-dependent shapes, so it traces;
        fuse_fp8_moe rewrites it into one ``fxglm5::moe_fp8`` over the selected experts only."""
        w13, w2 = self.weights(x.dtype)
        gate_up = torch.einsum("th,eih->tei", x, w13)
        gate, up = gate_up.split([self.inter, self.inter], dim=-1)
        expert_out = torch.einsum("tei,ehi->teh", F.silu(gate) * up, w2)
        return (expert_out.float() * routing[..., None]).sum(dim=1).to(x.dtype)

    def by_expert(self, x: torch.Tensor, routing: torch.Tensor) -> torch.Tensor:
        """The dense form's math over the (token, expert) pairs with a nonzero weight, one expert's weights at a
        time: the largest temporary is one expert's float32 dequantization (or the [T, H] float32 sum).
        Each selected expert's output is the dense form's row for it (same GEMMs, same float32 weighting); only
        the float32 sum's order over the selected experts may differ."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        tokens, experts = routing.nonzero(as_tuple=True)
        for expert in experts.unique().tolist():
            rows = tokens[experts == expert]
            w13, w2 = self.weights(x.dtype, expert)
            gate, up = F.linear(x[rows], w13).split([self.inter, self.inter], dim=-1)
            expert_out = F.linear(F.silu(gate) * up, w2)
            out.index_add_(0, rows, expert_out.float() * routing[rows, expert, None])
        return out.to(x.dtype)


class MoE(nn.Module):
    def __init__(self, cfg: Glm5Config, dtype: torch.dtype, device=None):
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(
            torch.empty(cfg.n_routed_experts, cfg.hidden_size, dtype=torch.float32, device=device), requires_grad=False
        )
        self.gate.e_score_correction_bias = nn.Parameter(
            torch.zeros(cfg.n_routed_experts, dtype=torch.float32, device=device), requires_grad=False
        )
        self.experts = StackedExperts(cfg, dtype, device)
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, cfg.is_fp8, dtype, device)
            if cfg.n_shared_experts
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        logits = F.linear(flat.float(), self.gate.weight.float())
        weights, ids = route(logits, self.gate.e_score_correction_bias, self.cfg)
        routing = torch.zeros_like(logits).scatter(1, ids, weights)
        out = self.experts(flat, routing)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.view(shape)
