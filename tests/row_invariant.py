"""A test oracle's tool: torch's CPU math with each row computed as if it were alone.

Why: the speculative runtime must leave a request's cache rows exactly as plain decoding writes them, but the two
compute a token in steps of different shapes (a verify step holds k+1 tokens per request), and torch's CPU kernels
round a row by its neighbours: a GEMM's blocking depends on M (MKL), and a vectorized pointwise kernel computes
the tail of a tensor (and of each thread's chunk) on a scalar path whose sigmoid / silu / rsqrt differ in the last
bit. Under :class:`RowInvariant` a step's numerics no longer depend on the rows beside it, so a byte compare tests
the runtime (which rows are written, rolled back, reused) rather than the BLAS:

- ``mm`` / ``addmm`` / ``bmm``: every output row is a 1-row product (a ``bmm`` over rows against the expanded
  weight, which computes each row with the kernel of a lone row);
- float32 pointwise ops: computed in float64 and rounded back: exact for + - * / and sqrt (double has more than
  2p + 2 bits), and for transcendental functions the scalar and vector paths then differ only below float32's
  rounding, so the float32 result no longer depends on where the element sits;
- composite ops are decomposed and custom ops run their CPU kernels with the mode on, so the rules reach inside.

Only for float32 CPU tensors; slow (tiny test models only).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


def _rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[M, K] @ [K, N], each row with the kernel of a lone row."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(0).expand(a.shape[0], *b.shape)).squeeze(1)


def _batched_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    g, m, k = a.shape
    n = b.shape[2]
    return torch.bmm(a.reshape(g * m, 1, k), b.unsqueeze(1).expand(g, m, k, n).reshape(g * m, k, n)).view(g, m, n)


def _float32_only(args) -> bool:
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return bool(tensors) and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


class RowInvariant(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.mm.default and _float32_only(args):
            return _rows(*args)
        if func is aten.addmm.default and _float32_only(args):
            bias, a, b = args
            return bias * kwargs.get("beta", 1) + _rows(a, b) * kwargs.get("alpha", 1)
        if func is aten.bmm.default and _float32_only(args):
            return _batched_rows(*args)
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            with self:
                return func.decompose(*args, **kwargs)
        if func.namespace == "fxglm5":
            with self:
                return func.redispatch(_CPU, *args, **kwargs)
        if (torch.Tag.pointwise in func.tags and not func._schema.is_mutable and "out" not in kwargs
                and _float32_only(args)):
            out = func(*[a.double() if isinstance(a, torch.Tensor) else a for a in args], **kwargs)
            return out.float() if isinstance(out, torch.Tensor) and out.dtype == torch.float64 else out
        return func(*args, **kwargs)
