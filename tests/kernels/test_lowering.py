"""The lower stage: backend order per device, FXGLM5_BACKEND override, the run-time capability fallback
(logged once), aiter picked where importable, and lowered tiny graphs agreeing with the eager model."""

import logging
import sys
import types

import pytest
import torch

from fxglm5.capture import capture
from fxglm5.lowering import backend_choice, implementations
from fxglm5.model.config import Glm5Config
from fxglm5.passes import PassContext, run_pipeline
from tests.helpers import random_model, rel_err


def _lowered(cfg, backend):
    model = random_model(cfg)
    gm = capture(model)
    results = run_pipeline(gm, PassContext(config=cfg, backend=backend), stages=("match", "fuse", "lower"))
    return model, gm, results[-1]


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_lowered_tiny_matches_eager(backend):
    cfg = Glm5Config.preset("tiny")
    model, gm, lowered = _lowered(cfg, backend)
    assert lowered.num_matches == sum(lowered.ops_before.get(f"fxglm5.{op}", 0) for op in
                                      ("fp8_linear", "moe_route", "moe_fp8", "indexer_topk", "sparse_mla", "rms_norm",
                                       "rope_interleaved"))
    assert lowered.details["backends"].startswith(backend)
    assert not any(str(n.target).startswith("fxglm5.") for n in gm.graph.nodes if n.op == "call_function")
    ids, pos = torch.randint(0, cfg.vocab_size, (1, 9)), torch.arange(9)[None]
    assert rel_err(gm(ids, pos), model(ids, pos)) < 1e-4


def test_backend_order_and_override(monkeypatch):
    monkeypatch.delenv("FXGLM5_BACKEND", raising=False)
    monkeypatch.setattr(implementations, "aiter_available", lambda: False)
    assert backend_choice.backend_order("cuda") == ["triton", "reference"]
    assert backend_choice.backend_order("cpu") == ["reference"]
    monkeypatch.setenv("FXGLM5_BACKEND", "triton")
    assert backend_choice.backend_order("cpu") == ["triton", "reference"]
    monkeypatch.setenv("FXGLM5_BACKEND", "cutlass")
    with pytest.raises(ValueError, match="FXGLM5_BACKEND must be one of"):
        backend_choice.backend_order("cuda")


def test_unsupported_call_falls_back_and_logs_once(caplog, monkeypatch):
    """The run-time Dispatch (left only for nodes without metadata) takes the same choice per call."""
    monkeypatch.setattr(backend_choice, "_warned", set())
    dispatch = backend_choice.Dispatch("moe_fp8", ["triton", "reference"], "cpu")
    x, ids, w = torch.randn(3, 128), torch.zeros(3, 2, dtype=torch.int32), torch.rand(3, 2)
    w13, w2 = torch.randn(2, 256, 128) * 0.05, torch.randn(2, 128, 128) * 0.05
    args = (x, ids, w, w13, None, w2, None, False)
    assert backend_choice.choose("moe_fp8", ["triton", "reference"], "cpu", args).backend == "reference"
    with caplog.at_level(logging.WARNING, logger="fxglm5.lowering.backend_choice"):
        first = dispatch(*args)
        second = dispatch(*args)
    torch.testing.assert_close(first, second)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "unquantized expert weights" in messages[0]


def test_aiter_is_selected_where_importable(monkeypatch):
    calls = []
    fake = types.ModuleType("aiter.ops.triton.gemm_a8w8_blockscale")

    def gemm_a8w8_blockscale(xq, w, xs, ws, dtype):
        calls.append((xq.dtype, w.dtype, tuple(xs.shape), tuple(ws.shape)))
        return torch.zeros(xq.shape[0], w.shape[0], dtype=dtype, device=xq.device)

    fake.gemm_a8w8_blockscale = gemm_a8w8_blockscale
    for name in ("aiter", "aiter.ops", "aiter.ops.triton"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "aiter.ops.triton.gemm_a8w8_blockscale", fake)
    monkeypatch.setattr(implementations, "aiter_available", lambda: True)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # CPU hosts run the Triton quantizer interpreted
    order = backend_choice.backend_order("cuda")
    assert order[0] == "aiter"
    x = torch.randn(2, 5, 256, device=device)
    w, s = (torch.randn(128, 256, device=device) * 0.1).to(torch.float8_e4m3fn), torch.ones(1, 2, device=device)
    choice = backend_choice.choose("fp8_linear", order, "cuda", (x, w, s, None, True))
    assert choice.backend == "aiter"
    assert choice.impl.fn(x, w, s, None, True).shape == (2, 5, 128)
    assert calls == [(torch.float8_e4m3fn, torch.float8_e4m3fn, (10, 2), (1, 2))]
    bias = torch.zeros(128, device=device)
    assert backend_choice.choose("fp8_linear", order, "cuda", (x, w, s, bias, True)).backend == "triton"  # aiter refuses a bias


def test_rocm_gpus_get_no_nvidia_capability(monkeypatch):
    """ROCm reports an MI300 as a "cuda" device of capability (9, 4): that must not select the sm_90 kernels."""
    from fxglm5.lowering.triton import device

    monkeypatch.setattr(device, "_cuda_capability", lambda index: (9, 4))
    monkeypatch.setattr(torch.version, "hip", "6.3.0", raising=False)
    assert device.capability(torch.device("cuda", 0)) is None
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert device.capability(torch.device("cuda", 0)) == (9, 4)
    assert device.capability(torch.device("cpu")) is None
