"""On the GPU: a decode step replayed from a CUDA graph loads its inputs through pinned host staging buffers with
asynchronous copies and does not wait on the device (the runner's one read of the next tokens comes after it);
the tokens are those of eager decoding."""

import pytest
import torch

from fxglm5.model.config import Glm5Config
from fxglm5.runtime.runner import Runner
from tests.helpers import random_model

pytestmark = pytest.mark.gpu
PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43], [7, 1, 8], [2, 71, 82, 81, 82, 84, 59, 4, 5, 23]]


def _no_sync_in_replays(graphs) -> list:
    """Wrap ``graphs.run`` so that a step of an already captured bucket runs under sync debug mode "error" (a
    synchronizing call, such as a copy from pageable memory, raises); returns the list of checked steps."""
    checked, run = [], graphs.run

    def checked_run(input_ids, ctx):
        key = (graphs._fit(graphs.buckets, ctx.batch_size), graphs._fit(graphs.widths, ctx.kernel_block_table.shape[1]))
        if key not in graphs.graphs:
            return run(input_ids, ctx)
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = run(input_ids, ctx)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        checked.append(key)
        return out

    graphs.run = checked_run
    return checked


def test_replayed_decode_steps_stage_pinned_and_do_not_sync():
    cfg = Glm5Config.preset("tiny")
    model = random_model(cfg, torch.float32).cuda()
    # the FP8 index cache: the exact one has no Triton indexer, and the reference one syncs, so it is not captured
    runners = {mode: Runner(model, index_cache="fp8", block_size=16, dtype=torch.float32, max_cache_tokens=1024,
                            device="cuda", backend="triton", decode_graphs=mode) for mode in (False, True)}
    graphs = runners[True].decode_graphs
    checked = _no_sync_in_replays(graphs)
    eager, replayed = runners[False].generate(PROMPTS, 16), runners[True].generate(PROMPTS, 16)
    assert replayed == eager
    assert graphs.disabled is None and len(checked) >= 10  # most steps replayed a captured bucket, none synced
    assert graphs._staged_inputs.is_pinned() and all(t.is_pinned() for t in graphs._staged_tables.values())
