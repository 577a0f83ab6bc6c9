"""On the GPU: sampled requests in the overlapped decode loop keep it overlapped (no sync between replays but the
one lagged token wait per step: the per-row parameters go through pinned memory, the sampling branches are decided
on the host, the draws use each request's CUDA generator), a seeded request repeats its tokens through the engine
alone and in a batch, and greedy requests beside sampled ones keep eager greedy decoding's tokens."""

import pytest
import torch

from fxglm5.model.config import Glm5Config
from fxglm5.runtime.engine import Engine
from fxglm5.runtime.runner import Runner
from fxglm5.runtime.sampling import GREEDY, SamplingParams, generator_for
from tests.helpers import random_model

pytestmark = pytest.mark.gpu
PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43], [7, 1, 8], [2, 71, 82, 81, 82, 84, 59, 4, 5, 23]]
NEW = 16
OPTIONS = dict(index_cache="fp8", block_size=16, dtype=torch.float32, max_cache_tokens=1024, device="cuda",
               backend="triton")


@pytest.fixture(scope="module")
def model():
    return random_model(Glm5Config.preset("tiny"), torch.float32).cuda()


def test_sampled_requests_keep_the_loop_overlapped(model, monkeypatch):
    r = Runner(model, decode_graphs=True, **OPTIONS)
    assert r.warm_up(max_batch=len(PROMPTS), max_tokens=max(map(len, PROMPTS)) + NEW) > 0
    seqs = r.prefill(PROMPTS)
    for i, seq in enumerate(seqs[:2]):  # two sampled requests, one greedy
        seq.params = SamplingParams(seed=i, top_k=40, top_p=0.9, temperature=0.8, logprobs=2)
        seq.generator = generator_for(seq.params, "cuda", 0)
    waits, synchronize = [], torch.cuda.Event.synchronize

    def counted(event):
        waits.append(event)
        torch.cuda.set_sync_debug_mode("default")
        try:
            synchronize(event)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(torch.cuda.Event, "synchronize", counted)
    torch.cuda.set_sync_debug_mode("error")
    try:
        r.decode_steps(NEW)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(waits) == NEW - 1
    assert all(len(s.output) == NEW for s in seqs) and len(seqs[0].token_logprobs) == NEW - 1
    greedy = Runner(model, decode_graphs=False, **OPTIONS).generate(PROMPTS[2:], NEW)
    assert seqs[2].output == greedy[0]


def test_a_seeded_request_repeats_on_the_gpu(model):
    params = SamplingParams(seed=7, top_k=50, max_tokens=NEW)

    def run(items):
        engine = Engine(Runner(model, decode_graphs=True, **OPTIONS))
        ids, seqs = [engine.add(p, q) for p, q in items], {}
        while engine.has_work():
            seqs.update((o.id, o.sequence) for o in engine.step())
        return [seqs[i].output for i in ids]

    alone = run([(PROMPTS[0], params)])[0]
    batch = run([(PROMPTS[1], GREEDY.replace(max_tokens=NEW)), (PROMPTS[0], params), (PROMPTS[2], params.replace(seed=8))])
    assert batch[1] == alone and len(alone) == NEW
    assert batch[0] == Runner(model, decode_graphs=False, **OPTIONS).generate(PROMPTS[1:2], NEW)[0]
