"""Sizes checked against the GPU's memory before anything is allocated: a cache larger than the device is
refused with InputError before capture, and the available figure follows what torch really holds."""

import pytest
import torch

from fxglm5.errors import InputError
from fxglm5.model.tiny import make_tiny_checkpoint
from fxglm5.runtime import cache
from fxglm5.runtime import parts as parts_module
from fxglm5.runtime.runner import Runner

pytestmark = pytest.mark.gpu


def test_available_memory_follows_allocations():
    torch.cuda.empty_cache()
    before = cache.available_memory("cuda")
    total = torch.cuda.get_device_properties(0).total_memory
    assert 0 < before <= total
    block = torch.empty(2**30, dtype=torch.uint8, device="cuda")  # 1 GiB, held by this test
    during = cache.available_memory("cuda")
    del block
    after = cache.available_memory("cuda")  # freed into torch's cache: still available to a new tensor
    assert abs((before - during) - 2**30) < 64 * 2**20 and abs(after - before) < 64 * 2**20


def test_cache_larger_than_the_gpu_is_refused_before_capture(tmp_path, monkeypatch):
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", fp8=True)
    monkeypatch.setattr(parts_module, "compile_model", lambda *a, **k: pytest.fail("captured before refusing"))
    free = cache.available_memory("cuda")
    tokens = free // (4 * (576 + 128) * 2) + 4096  # bf16 rows of the tiny model's 4 indexed layers, past the free bytes
    with pytest.raises(InputError, match=r"paged cache: .* GiB available on cuda"):
        Runner(ckpt, dtype=torch.bfloat16, block_size=64, max_cache_tokens=int(tokens), device="cuda")
