"""On the GPU: the overlapped decode loop (Runner.decode_steps) replays CUDA graphs whose inputs come through pinned
staging buffers and the device's own sampled tokens, and between replays it never syncs with the device except the
one lagged wait per step on the event after a step's token copy; its tokens are those of eager decoding and of the
step-by-step loop."""

import pytest
import torch

from fxglm5.model.config import Glm5Config
from fxglm5.runtime.decode_graphs import DecodeGraphs
from fxglm5.runtime.runner import Runner
from tests.helpers import random_model

pytestmark = pytest.mark.gpu
PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43], [7, 1, 8], [2, 71, 82, 81, 82, 84, 59, 4, 5, 23]]
NEW = 16


def test_overlapped_decode_loop_does_not_sync_between_replays(monkeypatch):
    cfg = Glm5Config.preset("tiny")
    model = random_model(cfg, torch.float32).cuda()
    # the FP8 index cache: the exact one has no Triton indexer, and the reference one syncs, so it is not captured
    opts = dict(index_cache="fp8", block_size=16, dtype=torch.float32, max_cache_tokens=1024, device="cuda",
                backend="triton")
    eager = Runner(model, decode_graphs=False, **opts).generate(PROMPTS, NEW)
    stepwise = Runner(model, decode_graphs=True, overlap=False, **opts).generate(PROMPTS, NEW)
    r = Runner(model, decode_graphs=True, **opts)
    graphs = r.decode_graphs
    assert r.warm_up(max_batch=len(PROMPTS), max_tokens=max(map(len, PROMPTS)) + NEW) > 0  # no capture when timed
    seqs = r.prefill(PROMPTS)
    waits, synchronize = [], torch.cuda.Event.synchronize

    def counted(event):  # the lagged token read: the only wait allowed, outside sync debug's check
        waits.append(event)
        torch.cuda.set_sync_debug_mode("default")
        try:
            synchronize(event)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(torch.cuda.Event, "synchronize", counted)
    steps, captured = graphs.steps, len(graphs.graphs)
    torch.cuda.set_sync_debug_mode("error")  # any other synchronizing call (a pageable copy, .item()) raises
    try:
        r.decode_steps(NEW)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert graphs.steps - steps == NEW - 1 and len(graphs.graphs) == captured and graphs.disabled is None
    assert len(waits) == NEW - 1  # one event wait per step, none for the staging sets
    assert [s.output for s in seqs] == eager == stepwise
    assert all(st.inputs.is_pinned() and all(t.is_pinned() for t in st.tables.values()) for st in graphs._staging)


def test_a_failed_capture_decodes_eagerly_and_leaves_cuda_usable(monkeypatch):
    """A step that syncs while captured invalidates its capture: the runner decodes that bucket eagerly with the
    eager tokens, the default stream is current again, CUDA random ops work and a later capture (with a random op
    inside) replays."""
    cfg = Glm5Config.preset("tiny")
    model = random_model(cfg, torch.float32).cuda()
    opts = dict(index_cache="fp8", block_size=16, dtype=torch.float32, max_cache_tokens=1024, device="cuda",
                backend="triton")
    eager = Runner(model, decode_graphs=False, **opts).generate(PROMPTS, NEW)
    forward = DecodeGraphs._forward

    def syncing(self, *key):
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()  # not permitted while capturing: the capture is invalidated
        return forward(self, *key)

    monkeypatch.setattr(DecodeGraphs, "_forward", syncing)
    r = Runner(model, decode_graphs=True, **opts)
    assert r.generate(PROMPTS, NEW) == eager
    assert r.decode_graphs.disabled is not None and not r.decode_graphs.graphs
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    torch.manual_seed(0)
    first = torch.randn(8, device="cuda")
    torch.manual_seed(0)
    assert torch.equal(torch.randn(8, device="cuda"), first)
    static = torch.zeros(8, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static.copy_(torch.rand(8, device="cuda") + 1)
    graph.replay()
    torch.cuda.synchronize()
    assert bool(((static >= 1) & (static < 2)).all())
