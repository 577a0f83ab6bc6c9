"""Torch reference semantics of the block-FP8 GEMM and the FP8 MoE (any device, fp32 math).

These functions define what the Triton kernels must compute; other code (ops, passes, tests) calls
them as the ground truth. Layouts follow the GLM-5-FP8 (DeepSeek-V3) checkpoint: a weight is e4m3
``[N, K]`` (or stacked ``[E, N, K]``) with float32 ``weight_scale_inv`` per 128x128 block
``[ceil(N/128), ceil(K/128)]``; activations are quantized dynamically per token in groups of 128
columns (``scale = amax / 448``). Shapes that are not multiples of 128 (kv_a's N=576) have a short last
block, of weights and of activation groups alike: its scale comes from the elements it holds, which is
what zero-padding N and K to multiples of 128 gives. The MoE's stacked gate|up weight keeps the
per-expert blocks of each half (``fxglm5.model.layout.scale_shape``, ``halves``). Everything
accumulates in float32 and is cast back to the activation dtype once at the end.
"""

from __future__ import annotations

from typing import Optional

import torch

from fxglm5.contracts import FP8_BLOCK as GROUP
from fxglm5.contracts import FP8_MAX, scale_shape
from fxglm5.errors import InputError

FP8 = torch.float8_e4m3fn


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise InputError(msg)


def _check_tensor(name: str, t, dtypes=None, ndim=None) -> None:
    _check(isinstance(t, torch.Tensor), f"{name}: expected a tensor, got {type(t).__name__}")
    if dtypes is not None:
        _check(t.dtype in dtypes, f"{name}: dtype {t.dtype} not supported, expected one of {list(dtypes)}")
    if ndim is not None:
        _check(t.dim() == ndim, f"{name}: expected {ndim} dims, got shape {tuple(t.shape)}")


ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_fp8_weight(name: str, w, scale, lead: tuple = (), halves: bool = False) -> None:
    """Validate an e4m3 weight ``[*lead, N, K]`` and its block scales ``[*lead, ceil(N/128), ceil(K/128)]``
    (``halves``: a gate|up weight [*lead, 2I, K] with ``[*lead, 2 * ceil(I/128), ceil(K/128)]``)."""
    _check_tensor(name, w, (FP8,), len(lead) + 2)
    _check_tensor(f"{name}_scale", scale, (torch.float32,), len(lead) + 2)
    want = scale_shape(tuple(w.shape), halves)
    _check(tuple(scale.shape) == want,
           f"{name}_scale: shape {tuple(scale.shape)} does not fit {name} {tuple(w.shape)}, expected {want}")
    if lead:
        _check(tuple(w.shape[:-2]) == tuple(lead),
               f"{name}: leading dims {tuple(w.shape[:-2])}, expected {tuple(lead)}")


def quantize_act_1x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-128-column dynamic e4m3 quantization: ``(x_fp8 [M, K], scale f32 [M, ceil(K/128)])``."""
    _check_tensor("x", x, ACT_DTYPES, 2)
    m, k = x.shape
    kg = _cdiv(k, GROUP)
    xf = torch.nn.functional.pad(x.float(), (0, kg * GROUP - k)).view(m, kg, GROUP)
    scale = xf.abs().amax(dim=-1).clamp_min(1e-10) / FP8_MAX
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(m, kg * GROUP)[:, :k].contiguous(), scale


def dequantize_act_1x128(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_act_1x128`, float32."""
    k = q.shape[-1]
    return q.float() * scale.repeat_interleave(GROUP, dim=-1)[..., :k]


def fake_quant_act_1x128(x: torch.Tensor) -> torch.Tensor:
    """x quantized 1x128 and dequantized again (float32): what a W8A8 GEMM actually multiplies."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    return dequantize_act_1x128(*quantize_act_1x128(x2)).view(shape)


def dequantize_block_fp8(w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """W = w * scale_inv per 128x128 block, float32, any leading batch dims (stacked experts)."""
    check_fp8_weight("w", w, scale_inv, tuple(w.shape[:-2]))
    n, k = w.shape[-2:]
    s = scale_inv.repeat_interleave(GROUP, dim=-2)[..., :n, :].repeat_interleave(GROUP, dim=-1)[..., :k]
    return w.float() * s


def dequantize_gate_up(w13: torch.Tensor, s13: torch.Tensor) -> torch.Tensor:
    """A stacked gate|up weight [.., 2I, K] with each half's own blocks: the two halves dequantized
    one by one, float32."""
    check_fp8_weight("w13", w13, s13, tuple(w13.shape[:-2]), halves=True)
    *lead, two_i, k = w13.shape
    halves = dequantize_block_fp8(w13.reshape(*lead, 2, two_i // 2, k), s13.reshape(*lead, 2, -1, s13.shape[-1]))
    return halves.reshape(w13.shape)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    act_quant: bool = True,
) -> torch.Tensor:
    """y = x_eff @ W.T (+ bias) in float32, cast to x.dtype; x_eff is x, or x 1x128-fake-quantized (W8A8)."""
    check_linear_inputs(x, weight, weight_scale_inv, bias)
    w = dequantize_block_fp8(weight, weight_scale_inv)
    xe = fake_quant_act_1x128(x) if act_quant else x.float()
    y = xe @ w.T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def check_linear_inputs(x, weight, weight_scale_inv, bias) -> None:
    _check_tensor("x", x, ACT_DTYPES)
    _check(x.dim() >= 1, "x: expected at least 1 dim")
    check_fp8_weight("weight", weight, weight_scale_inv)
    n, k = weight.shape
    _check(x.shape[-1] == k, f"x: last dim {x.shape[-1]} does not match weight K={k}")
    _check(weight.device == x.device and weight_scale_inv.device == x.device, "weight: must be on x's device")
    if bias is not None:
        _check_tensor("bias", bias, ACT_DTYPES, 1)
        _check(bias.shape[0] == n, f"bias: shape {tuple(bias.shape)}, expected ({n},)")


def check_route_inputs(router_logits, correction_bias, top_k, n_group, topk_group) -> None:
    _check_tensor("router_logits", router_logits, (torch.float32,), 2)
    e = router_logits.shape[1]
    _check_tensor("correction_bias", correction_bias, (torch.float32, torch.bfloat16), 1)
    _check(correction_bias.shape[0] == e, f"correction_bias: shape {tuple(correction_bias.shape)}, expected ({e},)")
    _check(n_group >= 1 and e % n_group == 0, f"n_group: {n_group} must divide the {e} experts")
    _check(1 <= topk_group <= n_group, f"topk_group: {topk_group} must be in [1, n_group={n_group}]")
    per_group = e // n_group
    _check(per_group >= 2 or n_group == 1, f"n_group: {n_group} leaves fewer than 2 experts per group")
    _check(1 <= top_k <= topk_group * per_group, f"top_k: {top_k} must be in [1, {topk_group * per_group}]")


def moe_route(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GlmMoeDsaTopkRouter from the logits: sigmoid, biased group-limited top-k, unbiased weights.

    Ids come out sorted by descending biased score (transformers leaves the order unspecified).
    """
    check_route_inputs(router_logits, correction_bias, top_k, n_group, topk_group)
    t, e = router_logits.shape
    scores = router_logits.sigmoid()
    choice = scores + correction_bias.float()
    if n_group > 1:
        grouped = choice.view(t, n_group, e // n_group)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
        keep = group_mask.unsqueeze(-1).expand(t, n_group, e // n_group).reshape(t, e).bool()
        choice = choice.masked_fill(~keep, float("-inf"))
    ids = choice.topk(top_k, dim=-1, sorted=True)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling_factor, ids.to(torch.int32)


def check_moe_inputs(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale,
                     ids_given: bool = True) -> tuple[int, int, int, int]:
    """Validate moe_fp8 arguments; returns (T, E, H, I). ``ids_given=False``: topk_ids is a buffer the router
    writes in the experts' own launch, so it holds no values to check yet."""
    _check_tensor("x", x, ACT_DTYPES, 2)
    t, h = x.shape
    _check_tensor("topk_ids", topk_ids, (torch.int32, torch.int64), 2)
    _check(topk_ids.shape[0] == t, f"topk_ids: {topk_ids.shape[0]} rows, x has {t} tokens")
    _check_tensor("topk_weights", topk_weights, (torch.float32,), 2)
    _check(tuple(topk_weights.shape) == tuple(topk_ids.shape),
           f"topk_weights: shape {tuple(topk_weights.shape)} differs from topk_ids {tuple(topk_ids.shape)}")
    _check_tensor("w13", w13, (FP8,), 3)
    e, two_i, h13 = w13.shape
    _check(two_i % 2 == 0, f"w13: dim 1 ({two_i}) must be 2*I (gate rows then up rows)")
    inter = two_i // 2
    _check(h13 == h, f"w13: hidden dim {h13} does not match x's {h}")
    check_fp8_weight("w13", w13, w13_scale, (e,), halves=True)
    check_fp8_weight("w2", w2, w2_scale, (e,))
    _check(tuple(w2.shape[1:]) == (h, inter), f"w2: shape {tuple(w2.shape)}, expected ({e}, {h}, {inter})")
    for name, tt in (("topk_ids", topk_ids), ("topk_weights", topk_weights), ("w13", w13), ("w2", w2)):
        _check(tt.device == x.device, f"{name}: on {tt.device}, x is on {x.device}")
    if ids_given and (topk_ids.device.type == "cpu" or not torch.cuda.is_current_stream_capturing()):
        if topk_ids.numel():
            lo, hi = int(topk_ids.min()), int(topk_ids.max())
            _check(lo >= -1 and hi < e, f"topk_ids: values must be in [-1, {e}), got min {lo} max {hi}")
    return t, e, h, inter


def moe_fp8(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    act_quant: bool = True,
) -> torch.Tensor:
    """Routed experts: out[t] = sum_j w[t,j] * W2_e (silu(G_e x_t) * U_e x_t), e = ids[t,j] (-1 skipped).

    One expert at a time (its weights dequantized on the fly, so full-size layers fit in memory);
    with ``act_quant`` both x and the SiLU*up intermediate are 1x128 fake-quantized before their GEMMs.
    """
    t, e, h, inter = check_moe_inputs(x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale)
    xe = fake_quant_act_1x128(x) if act_quant else x.float()
    out = torch.zeros(t, h, dtype=torch.float32, device=x.device)
    ids = topk_ids.long()
    for ex in torch.unique(ids[ids >= 0]).tolist():
        tok, slot = (ids == ex).nonzero(as_tuple=True)
        w_gu = dequantize_gate_up(w13[ex], w13_scale[ex])
        gu = xe[tok] @ w_gu.T
        hmid = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
        if act_quant:
            hmid = fake_quant_act_1x128(hmid)
        y = hmid @ dequantize_block_fp8(w2[ex], w2_scale[ex]).T
        out.index_add_(0, tok, y * topk_weights[tok, slot, None])
    return out.to(x.dtype)


def moe_any(x, ids, weights, w13, w13_scale, w2, w2_scale, act_quant):
    """``fxglm5::moe_fp8``'s reference: block-FP8 experts (:func:`moe_fp8`), or unquantized ones where the scales
    are None (a bf16 checkpoint's or a float32 model's: :func:`moe_plain`)."""
    if w13_scale is None or w2_scale is None:
        return moe_plain(x, ids, weights, w13, w2)
    return moe_fp8(x, ids, weights, w13, w13_scale, w2, w2_scale, act_quant)


def moe_plain(x, ids, weights, w13, w2):
    """Routed experts with unquantized stacked weights (bf16 checkpoints), fp32 math."""
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    ids = ids.long()
    for ex in torch.unique(ids[ids >= 0]).tolist():
        tok, slot = (ids == ex).nonzero(as_tuple=True)
        gu = x[tok].float() @ w13[ex].float().T
        y = (torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]) @ w2[ex].float().T
        out.index_add_(0, tok, y * weights[tok, slot, None])
    return out.to(x.dtype)
