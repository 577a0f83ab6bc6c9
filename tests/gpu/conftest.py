"""Every GPU test leaves CUDA usable for the next: a capture that failed and was not undone (see
fxglm5.runtime.decode_graphs.undo_failed_capture) would make every later CUDA random op of the run fail, far from
its cause; this names the test that did it."""

import pytest
import torch


@pytest.fixture(autouse=True)
def cuda_left_usable(request):
    yield
    if not torch.cuda.is_available():
        return
    try:
        torch.empty(4, device="cuda").normal_()
        torch.cuda.synchronize()
    except RuntimeError as err:
        pytest.fail(f"{request.node.nodeid} left CUDA unusable: {err}")
    assert torch.cuda.current_stream() == torch.cuda.default_stream(), f"{request.node.nodeid} left a side stream current"
