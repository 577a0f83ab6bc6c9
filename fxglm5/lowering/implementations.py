"""Which implementation runs each fxglm5 op on each backend: the table the registry chooses from.

``reference`` is always the op's own torch implementation (the custom op's default kernel), so every op has
one. The table names ops by their name and looks the custom op up when it is asked for an op's implementations
(by then a graph holds the op, so it is registered): lowering imports no op module, which sit above it. A Triton or aiter entry may carry a ``supports`` check that names why it refuses a call. The checks read
only what the graph's metadata holds (dtypes, shapes, which optional arguments are given), so the ``lower``
pass runs them once per node on ``node.meta['val']`` at lower time; whether a device can run a backend at all
(Triton needs CUDA or the interpreter, aiter a ROCm build with aiter) is :func:`device_supports`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from typing import Callable, Optional

import torch

from fxglm5 import settings
from fxglm5.lowering.reference import paged, paged_steps
from fxglm5.lowering.reference.collectives import all_gather_c10d, all_reduce_c10d, all_reduce_c10d_in_place

BACKENDS = ("aiter", "triton", "reference")


@dataclasses.dataclass(frozen=True)
class Impl:
    fn: Optional[Callable]  # None in the table: the custom op itself (``torch.ops.fxglm5.<op>``), looked up when asked
    supports: Optional[Callable[..., Optional[str]]] = None  # returns None if supported, else a reason
    unchecked: Optional[Callable] = None  # the body without its input checks, for callers that validated them
    # the body that may overwrite its first input and return it, for a node whose first input no other node reads
    # (the reduce_in_place pass marks such nodes ``meta["fxglm5_in_place"]``; lower binds this body to them)
    in_place: Optional[Callable] = None


_IMPLS: dict[str, dict[str, Impl]] = {}


def register(op: str, backend: str, supports: Optional[Callable[..., Optional[str]]] = None,
             unchecked: Optional[Callable] = None, in_place: Optional[Callable] = None):
    """Decorator: ``fn`` implements fxglm5 op ``op`` on ``backend`` (``unchecked``: the same without its input
    checks; ``in_place``: the same over its first input's memory, see :class:`Impl`)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; backends are {BACKENDS}")

    def wrap(fn):
        _IMPLS.setdefault(op, {})[backend] = Impl(fn, supports, unchecked, in_place)
        return fn

    return wrap


def implementations(op: str) -> dict[str, Impl]:
    """Every backend's implementation of ``op``; ``reference`` is the custom op's own torch kernel."""
    impls = dict(_IMPLS.get(op, {}))
    reference = impls.get("reference")
    if (reference is None or reference.fn is None) and hasattr(torch.ops.fxglm5, op):
        impls["reference"] = dataclasses.replace(reference or Impl(None), fn=getattr(torch.ops.fxglm5, op).default)
    elif reference is not None and reference.fn is None:
        del impls["reference"]  # the op is not registered: nothing can call it
    return impls


@functools.lru_cache(maxsize=None)
def aiter_available() -> bool:
    if not getattr(torch.version, "hip", None):
        return False
    try:
        return importlib.util.find_spec("aiter") is not None
    except (ImportError, ValueError):
        return False


def device_supports(backend: str, device_type: str) -> Optional[str]:
    """None if ``backend`` can run on ``device_type`` at all, else the reason it cannot."""
    if backend == "aiter" and not aiter_available():
        return "aiter is not importable"
    if backend in ("aiter", "triton") and device_type != "cuda" and not settings.triton_interpret():
        return f"a {device_type} device without TRITON_INTERPRET=1"
    return None


# ---- Triton: block-FP8 GEMM and fused MoE -------------------------------------------------------------
def _fp8_linear_supported(x, weight, scale, bias, act_quant):
    if weight.dtype != torch.float8_e4m3fn:
        return "weight is not e4m3"
    return None


@register("fp8_linear", "triton", _fp8_linear_supported)
def _fp8_linear_triton(x, weight, scale, bias, act_quant):
    from fxglm5.lowering.triton.fp8_gemm import fp8_linear

    return fp8_linear(x, weight, scale, bias, act_quant)


@register("moe_route", "triton")
def _moe_route_triton(logits, bias, top_k, n_group, topk_group, renormalize, scaling):
    from fxglm5.lowering.triton.moe import moe_route

    return moe_route(logits, bias, top_k, n_group, topk_group, renormalize, scaling)


def _moe_supported(x, ids, weights, w13, w13_scale, w2, w2_scale, act_quant):
    if w13_scale is None or w2_scale is None:
        return "unquantized expert weights (bf16 checkpoint)"
    return None


@register("moe_fp8", "triton", _moe_supported)
def _moe_fp8_triton(x, ids, weights, w13, w13_scale, w2, w2_scale, act_quant):
    from fxglm5.lowering.triton.moe import moe_fp8

    return moe_fp8(x, ids, weights, w13, w13_scale, w2, w2_scale, act_quant)


def _moe_add_supported(x, ids, weights, w13, w13_scale, w2, w2_scale, act_quant, addend):
    if addend.dtype != x.dtype:
        return f"the addend is {addend.dtype}, the tokens {x.dtype}"
    return _moe_supported(x, ids, weights, w13, w13_scale, w2, w2_scale, act_quant)


@register("moe_fp8_add", "triton", _moe_add_supported)
def _moe_fp8_add_triton(x, ids, weights, w13, w13_scale, w2, w2_scale, act_quant, addend):
    from fxglm5.lowering.triton.moe import moe_fp8

    return moe_fp8(x, ids, weights, w13, w13_scale, w2, w2_scale, act_quant, addend=addend)


def _moe_shared_supported(x, ids, weights, w13, w13_scale, w2, w2_scale, act_quant, shared_w13, shared_w13_scale,
                          shared_w2, shared_w2_scale, up_start):
    return (_fp8_linear_supported(x, shared_w13, shared_w13_scale, None, act_quant)
            or _fp8_linear_supported(x, shared_w2, shared_w2_scale, None, act_quant)
            or _moe_supported(x, ids, weights, w13, w13_scale, w2, w2_scale, act_quant))


@register("moe_fp8_shared", "triton", _moe_shared_supported)
def _moe_fp8_shared_triton(x, ids, weights, w13, w13_scale, w2, w2_scale, act_quant, shared_w13, shared_w13_scale,
                           shared_w2, shared_w2_scale, up_start):
    from fxglm5.lowering.triton.moe import SharedExpert, moe_fp8

    shared = SharedExpert(shared_w13, shared_w13_scale, shared_w2, shared_w2_scale, act_quant, up_start)
    return moe_fp8(x, ids, weights, w13, w13_scale, w2, w2_scale, act_quant, shared=shared)


def _moe_router_shared_supported(x, router_weight, correction_bias, top_k, n_group, topk_group, renormalize, scaling,
                                 expert_offset, num_local, w13, w13_scale, w2, w2_scale, act_quant, shared_w13,
                                 shared_w13_scale, shared_w2, shared_w2_scale, up_start):
    return (_f32_linear_supported(x, router_weight, [])
            or _moe_shared_supported(x, None, None, w13, w13_scale, w2, w2_scale, act_quant, shared_w13,
                                     shared_w13_scale, shared_w2, shared_w2_scale, up_start))


@register("moe_router_fp8_shared", "triton", _moe_router_shared_supported)
def _moe_router_fp8_shared_triton(x, router_weight, correction_bias, top_k, n_group, topk_group, renormalize, scaling,
                                  expert_offset, num_local, w13, w13_scale, w2, w2_scale, act_quant, shared_w13,
                                  shared_w13_scale, shared_w2, shared_w2_scale, up_start, steered_ids=None):
    """``steered_ids``: benchmarks only (bench/routing_load.py's steered load, ``moe_router_fp8``)."""
    from fxglm5.lowering.triton.moe import Router, SharedExpert, moe_router_fp8

    router = Router(router_weight, correction_bias, top_k, n_group, topk_group, renormalize, scaling, expert_offset,
                    num_local)
    shared = SharedExpert(shared_w13, shared_w13_scale, shared_w2, shared_w2_scale, act_quant, up_start)
    return moe_router_fp8(x, router, w13, w13_scale, w2, w2_scale, act_quant, shared=shared,
                          steered_ids=steered_ids)


def _add_norm_moe_supported(x, residual, norm_weight, eps, router_weight, correction_bias, top_k, n_group,
                            topk_group, renormalize, scaling, expert_offset, num_local, w13, w13_scale, w2, w2_scale,
                            act_quant, shared_w13, shared_w13_scale, shared_w2, shared_w2_scale, up_start):
    if x.dtype != residual.dtype:
        return f"x is {x.dtype}, the residual {residual.dtype}"
    return (_norm_supported(x, norm_weight, eps)
            or _moe_router_shared_supported(x, router_weight, correction_bias, top_k,
                                            n_group, topk_group, renormalize, scaling, expert_offset, num_local, w13,
                                            w13_scale, w2, w2_scale, act_quant, shared_w13, shared_w13_scale,
                                            shared_w2, shared_w2_scale, up_start))


@register("add_rms_norm_moe_router_fp8_shared", "triton", _add_norm_moe_supported)
def _add_rms_norm_moe_router_fp8_shared_triton(x, residual, norm_weight, eps, router_weight, correction_bias, top_k,
                                               n_group, topk_group, renormalize, scaling, expert_offset, num_local,
                                               w13, w13_scale, w2, w2_scale, act_quant, shared_w13, shared_w13_scale,
                                               shared_w2, shared_w2_scale, up_start, steered_ids=None):
    """``steered_ids``: benchmarks only (bench/routing_load.py's steered load, ``moe_router_fp8``)."""
    from fxglm5.lowering.triton.moe import Router, SharedExpert, add_rms_norm_moe_router_fp8

    router = Router(router_weight, correction_bias, top_k, n_group, topk_group, renormalize, scaling, expert_offset,
                    num_local)
    shared = SharedExpert(shared_w13, shared_w13_scale, shared_w2, shared_w2_scale, act_quant, up_start)
    return add_rms_norm_moe_router_fp8(x, residual, norm_weight, eps, router, w13, w13_scale, w2, w2_scale, act_quant,
                                       shared=shared, steered_ids=steered_ids)


# ---- collectives: torch's functional collectives (gloo / NCCL) on the group the op names, on every device --------
register("all_reduce", "reference", in_place=all_reduce_c10d_in_place)(all_reduce_c10d)
register("all_gather", "reference")(all_gather_c10d)


# ---- aiter (ROCm): only where it is importable ------------------------------------------------------
def _aiter_fp8_linear_supported(x, weight, scale, bias, act_quant):
    if bias is not None or not act_quant:
        return "aiter's block-scale GEMM is W8A8 without bias"
    return None


@register("fp8_linear", "aiter", _aiter_fp8_linear_supported)
def _fp8_linear_aiter(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias, act_quant: bool) -> torch.Tensor:
    """aiter's W8A8 block-scale GEMM: activations quantized 1x128 (our kernel), weights as stored."""
    from aiter.ops.triton.gemm_a8w8_blockscale import gemm_a8w8_blockscale

    from fxglm5.lowering.triton.fp8_gemm import quantize_act_1x128

    lead, k = x.shape[:-1], x.shape[-1]
    xq, xs = quantize_act_1x128(x.reshape(-1, k))
    out = gemm_a8w8_blockscale(xq, weight, xs, scale, dtype=x.dtype)
    return out.view(*lead, weight.shape[0])


# ---- Triton: RMSNorm and RoPE -------------------------------------------------------------------------
def _norm_supported(x, weight, eps):
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"x is {x.dtype}"
    return None


@register("rms_norm", "triton", _norm_supported)
def _rms_norm_triton(x, weight, eps):
    from fxglm5.lowering.triton.norm_rope import rms_norm

    return rms_norm(x, weight, eps)


def _rope_supported(x, cos, sin):
    if x.shape[-1] % 2:
        return f"an odd feature count ({x.shape[-1]})"
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"x is {x.dtype}"
    return None


@register("rope_interleaved", "triton", _rope_supported)
def _rope_triton(x, cos, sin):
    from fxglm5.lowering.reference.norm_rope import flat_rope_args
    from fxglm5.lowering.triton.norm_rope import rope_interleaved

    return rope_interleaved(*flat_rope_args(x, cos, sin), validate=False).view(x.shape)


# ---- Triton: the cached RTP attention ops (paged caches) -------------------------------------------
class _LazyKernels:
    """A kernel module imported at its first use: Triton compiles nothing and is not imported until a call."""

    def __init__(self, module: str):
        self.module = module

    def __getattr__(self, name):
        return getattr(importlib.import_module(self.module), name)


_TRITON_PAGED = _LazyKernels("fxglm5.lowering.triton.paged_ops")


def _register_cached_op(op: str, step: Callable, supports: Optional[Callable[..., Optional[str]]] = None) -> None:
    """A cached RTP op (``fxglm5.ops.cached``, and ``fxglm5.ops.fused``'s rms_norm_write_caches, which makes those ops'
    writes) on both backends: its step body over the Triton kernels and over the torch references (the custom op
    itself), each with and without the step's own input validation."""
    register(op, "triton", supports, unchecked=functools.partial(step, _TRITON_PAGED, validate=False))(
        functools.partial(step, _TRITON_PAGED))
    _IMPLS.setdefault(op, {})["reference"] = Impl(None, unchecked=functools.partial(step, paged, validate=False))


def _norm_write_caches_supported(x, weight, eps, kv_c, k_pe, kv_cache, k, index_cache, slot_mapping, block_table,
                                 req_idx, positions, max_positions, rope_cos=None, rope_sin=None, kv_norm_weight=None,
                                 kv_norm_eps=0.0, k_norm_weight=None, k_norm_bias=None, k_norm_eps=0.0,
                                 weights_x=None, weights_proj=None, weights_scales=None):
    """The head weights it computes (given) as the Triton f32_linear takes them."""
    return None if weights_proj is None else _f32_linear_supported(weights_x, weights_proj, weights_scales or [])


_register_cached_op("rtp_indexer", paged_steps.indexer_step)
_register_cached_op("rtp_sparse_mla", paged_steps.sparse_mla_step)
_register_cached_op("rtp_mla", paged_steps.mla_step)
_register_cached_op("rms_norm_write_caches", paged_steps.norm_write_caches_step, _norm_write_caches_supported)


# ---- Triton: the fused ops of the fuse_kernels stage (fxglm5.ops.fused) ---------------------------------------
@register("add_rms_norm", "triton", lambda x, residual, weight, eps: _norm_supported(x, weight, eps)
          or _norm_supported(residual, weight, eps))
def _add_rms_norm_triton(x, residual, weight, eps):
    from fxglm5.lowering.triton.norm_rope import add_rms_norm

    return add_rms_norm(x, residual, weight, eps)


@register("add_rms_norm_fp8_linear", "triton",
          lambda x, residual, norm_weight, eps, weight, scale, bias, act_quant, keep_normed:
          _norm_supported(x, norm_weight, eps) or _norm_supported(residual, norm_weight, eps)
          or _fp8_linear_supported(x, weight, scale, bias, act_quant))
def _add_rms_norm_fp8_linear_triton(x, residual, norm_weight, eps, weight, scale, bias, act_quant, keep_normed):
    from fxglm5.lowering.triton.fp8_gemm import add_rms_norm_fp8_linear

    return add_rms_norm_fp8_linear(x, residual, norm_weight, eps, weight, scale, bias, act_quant, keep_normed)


def _f32_linear_supported(x, weight, scales):
    from fxglm5.lowering.triton.f32_linear import MAX_SCALES

    if weight.dtype != torch.float32:
        return f"weight is {weight.dtype}"
    return f"{len(scales)} scales, the kernel applies at most {MAX_SCALES}" if len(scales) > MAX_SCALES else None


@register("f32_linear", "triton", _f32_linear_supported)
def _f32_linear_triton(x, weight, scales):
    from fxglm5.lowering.triton.f32_linear import f32_linear

    return f32_linear(x, weight, scales)


@register("moe_route_local", "triton")
def _moe_route_local_triton(logits, bias, top_k, n_group, topk_group, renormalize, scaling, expert_offset, num_local):
    from fxglm5.lowering.triton.moe import moe_route

    return moe_route(logits, bias, top_k, n_group, topk_group, renormalize, scaling, expert_offset, num_local)


@register("moe_router", "triton",
          lambda x, weight, bias, top_k, n_group, topk_group, renorm, scaling, offset, num_local:
          _f32_linear_supported(x, weight, []))
def _moe_router_triton(x, weight, bias, top_k, n_group, topk_group, renormalize, scaling, expert_offset, num_local):
    from fxglm5.lowering.triton.moe import moe_router

    return moe_router(x, weight, bias, top_k, n_group, topk_group, renormalize, scaling, expert_offset, num_local)


@register("fp8_linear_latent_query", "triton",
          lambda x, weight, scale, bias, act_quant, w_uk, q_start, rope_dim, rope_cos=None, rope_sin=None:
          _fp8_linear_supported(x, weight, scale, bias, act_quant))
def _fp8_linear_latent_query_triton(x, weight, scale, bias, act_quant, w_uk, q_start, rope_dim, rope_cos=None,
                                    rope_sin=None):
    from fxglm5.lowering.reference.fused import validate_fp8_linear_latent_query

    validate_fp8_linear_latent_query(x, weight, scale, bias, w_uk, q_start, rope_dim, rope_cos, rope_sin)
    return _TRITON_PAGED.fp8_linear_latent_query(x, weight, scale, bias, act_quant, w_uk, q_start, rope_dim, rope_cos,
                                                 rope_sin)


def _latent_query_indexer_supported(x, weight, scale, bias, act_quant, *rest):
    """The GEMM as the Triton fp8_linear takes it (the indexer's Triton kernels take every index cache)."""
    return _fp8_linear_supported(x, weight, scale, bias, act_quant)


_register_cached_op("fp8_linear_latent_query_indexer", paged_steps.latent_query_indexer_step,
                    _latent_query_indexer_supported)


@register("silu_mul_fp8_linear", "triton",
          lambda gate, up, weight, scale, bias, act_quant: _fp8_linear_supported(gate, weight, scale, bias, act_quant))
def _silu_mul_fp8_linear_triton(gate, up, weight, scale, bias, act_quant):
    from fxglm5.lowering.triton.fp8_gemm import fp8_linear

    return fp8_linear(gate, weight, scale, bias, act_quant, up=up)
