"""The lowered collectives on NCCL (one GPU: a world of 1), captured in a CUDA graph with their wait inside it (the
way the decode graphs capture a sharded step) and replayed: the all_reduce returns its input, the all_gather along
the vocabulary returns its input, and the replay reads new inputs (nothing was baked in at capture). The in-place
all_reduce (``reduce_in_place``'s body) does the same over its input's own memory, captured and replayed."""

import datetime
import socket

import pytest
import torch
import torch.distributed as dist

from fxglm5.lowering.reference.collectives import all_gather_c10d, all_reduce_c10d, all_reduce_c10d_in_place

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def nccl():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    yield
    dist.destroy_process_group()


def test_collectives_replay_in_a_cuda_graph(nccl):
    x = torch.randn(4, 7, 256, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(all_reduce_c10d(x, "tp", 1), x) and torch.equal(all_gather_c10d(x, -1, "tp", 1), x)
    static = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the capture
        all_reduce_c10d(static, "tp", 1)
        all_gather_c10d(static, -1, "tp", 1)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        reduced = all_reduce_c10d(static, "tp", 1) * 2
        gathered = all_gather_c10d(static, -1, "tp", 1) + 1
    new = torch.randn_like(x)
    static.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(reduced, new * 2) and torch.equal(gathered, new + 1)


def test_the_in_place_all_reduce_replays_in_a_cuda_graph(nccl):
    static = torch.randn(4, 7, 256, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        assert all_reduce_c10d_in_place(static, "tp", 1).data_ptr() == static.data_ptr()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        reduced = all_reduce_c10d_in_place(static, "tp", 1) * 2
    new = torch.randn_like(static)
    static.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(reduced, new * 2) and torch.equal(static, new)
