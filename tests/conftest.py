"""Shared test set-up: hypothesis profiles and the GPU marker.

Profiles: ``ci`` (derandomized, few examples: the default, what .ci/run uses) and ``local`` (random,
many examples). Pick one with ``HYPOTHESIS_PROFILE=local pytest``.
"""

import os

import pytest
import torch

# Triton kernels run under the interpreter on CPU-only machines (CI); on a GPU host they compile.
# Set here, once, before any test module imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=8,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "local",
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
