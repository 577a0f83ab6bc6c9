"""What the Triton launch heuristics need to know about the device they launch on."""

from __future__ import annotations

import functools

import torch


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
    """(major, minor) compute capability of a CUDA device (looked up once per device, not per launch); None
    elsewhere."""
    return _cuda_capability(_index(device)) if device.type == "cuda" else None
