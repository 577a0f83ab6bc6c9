"""What Triton launches need to know about the device they launch on: its size and capability, the global
scratch allocator TMA descriptors need, and the interpreter (CPU) quirks to work around."""

from __future__ import annotations

import functools

import torch
import triton

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
