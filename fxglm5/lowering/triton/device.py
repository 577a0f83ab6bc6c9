"""What Triton launches need to know about the device they launch on: its size and capability, the global
scratch allocator TMA descriptors need, and the interpreter (CPU) quirks to work around."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from fxglm5 import settings


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (looked up once per device); 4 elsewhere (CPU tensors under the
    interpreter), so that the grid heuristics still split work."""
    if device.type != "cuda":
        return 4
    return _cuda_sms(_index(device))


def capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) compute capability of an NVIDIA device (looked up once per device, not per launch); None
    elsewhere. ROCm builds report AMD GPUs as "cuda" devices with a capability made of the gfx version (an MI300
    is (9, 4), an MI250 (9, 0)), which would select the sm_90 Gluon kernels there, so ROCm gets None too."""
    if device.type != "cuda" or getattr(torch.version, "hip", None):
        return None
    return _cuda_capability(_index(device))


def interpreter_compat() -> None:
    """Make Triton 3.6's interpreter work with numpy >= 2.3 (idempotent; a no-op when not interpreting).

    The interpreter holds every scalar as a 1-element array and implements ``tensor.__index__`` as
    ``int(array)``, which numpy 2.3+ refuses for 1-d arrays: any ``range()`` with a runtime bound fails. We
    wrap its tensor patcher so that ``__index__`` uses ``.item()``.
    """
    if not settings.triton_interpret():
        return
    try:
        import triton.runtime.interpreter as interp
    except Exception:  # pragma: no cover
        return
    orig = getattr(interp, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "_fxglm5_compat", False):
        return

    def _patched(tensor, scope, _orig=orig):
        _orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    _patched._fxglm5_compat = True
    interp._patch_lang_tensor = _patched


def ensure_tma_allocator() -> None:
    """TMA descriptors built in-kernel need a global scratch allocator (set once, if nobody set one)."""
    from triton.runtime import _allocation

    if _allocation._allocator.get() is _allocation._NULL_ALLOCATOR:
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """The first statement of a kernel that may be launched with programmatic dependent launch (PDL): wait until the
    kernel before it in the stream has completed and its writes are visible, then let the next kernel launch (its
    CTAs take the SMs this grid leaves free and wait in their own prologue). Nothing before it may read or write
    memory another kernel touches, and no program may return before it: a grid whose programs all left early would
    complete before its predecessor, and the kernel after it would read unfinished data."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@gluon.jit
def gluon_pdl_prologue(PDL: gl.constexpr):
    """:func:`pdl_prologue` for Gluon kernels, under the same rules: Gluon has no ``gdc_wait`` /
    ``gdc_launch_dependents``, so these are the two PTX instructions Triton's own helpers
    (``triton/language/extra/cuda/gdc.py``) emit, as side-effecting inline assembly with a dummy result."""
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)


def pdl(device: torch.device) -> dict:
    """The launch keywords of a kernel that starts with :func:`pdl_prologue` (a Gluon kernel:
    :func:`gluon_pdl_prologue`): ``PDL`` for its prologue and Triton's ``launch_pdl`` where the launch can overlap
    its predecessor's tail (CUDA on sm_90 and later, ``FXGLM5_PDL=1``; a CUDA-graph capture keeps the launch
    attribute as a programmatic edge). Gluon kernels take ``launch_pdl`` as Triton kernels do (their
    ``GluonJITFunction`` inherits ``JITFunction.run``, whose launch options are the backend's ``CUDAOptions``).
    Why: a decode step is thousands of kernels of a few microseconds, and each launch's start-up otherwise waits for
    the previous grid to drain; one kernel of the chain launched without it breaks the overlap on both its sides."""
    cap = capability(device)
    on = settings.pdl() and not settings.triton_interpret() and cap is not None and cap[0] >= 9
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
