"""The in-launch task primitive (fxglm5/lowering/triton/tasks.py), interpreted: dynamic task ids from the queue,
producers that signal, consumers that wait and read what the producers stored, and the counters reset by the last
CTA, so a second launch starts from zeros. Under the interpreter programs run in program-id order, so the ids
equal the program ids and a consumer's wait finds its producers done: the spin loop ends at once (the GPU's
interleavings: tests/gpu/test_gpu_fused.py, the router and gate|up launch)."""

import os

import torch

if not torch.cuda.is_available():  # CPU CI: interpret; set before triton is imported in this process
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("CPU-tensor kernel tests run interpreted (TRITON_INTERPRET=1)", allow_module_level=True)

import triton.language as tl  # noqa: E402

from fxglm5.lowering.triton import tasks  # noqa: E402


@triton.jit
def _producers_then_consumers(counters_ptr, values_ptr, out_ptr, ids_ptr, PRODUCERS: tl.constexpr,
                              BLOCK: tl.constexpr):
    """Tasks [0, PRODUCERS) store (task + 1) * 10 and signal dependency 0; the others wait for every producer, then
    sum what they stored; each CTA records the task id it took."""
    task = tasks.take(counters_ptr)
    tl.store(ids_ptr + tl.program_id(0), task)
    if task < PRODUCERS:
        tl.store(values_ptr + task, (task + 1) * 10)
        tasks.signal(counters_ptr, 0)
    else:
        tasks.wait(counters_ptr, 0, PRODUCERS)
        offs = tl.arange(0, BLOCK)
        got = tl.load(values_ptr + offs, mask=offs < PRODUCERS, other=0, cache_modifier=".cg")
        tl.store(out_ptr + task - PRODUCERS, tl.sum(got, axis=0))
    tasks.finish(counters_ptr, 1)


@pytest.mark.parametrize("producers, consumers", [(1, 1), (3, 5)])
def test_consumers_read_what_their_producers_signalled(producers, consumers):
    """Every consumer sees every producer's value (the wait returns once all have signalled); the task ids are the
    program ids under the interpreter; the queue, the dependency and the done counters are back at 0 after each of
    two launches, so the second gives the same."""
    counters = tasks.counters(torch.device("cpu"), 1)
    for _ in range(2):
        values = torch.zeros(producers, dtype=torch.int32)
        out = torch.full((consumers,), -1, dtype=torch.int32)
        ids = torch.full((producers + consumers,), -1, dtype=torch.int32)
        _producers_then_consumers[(producers + consumers,)](counters, values, out, ids, PRODUCERS=producers,
                                                            BLOCK=triton.next_power_of_2(producers))
        assert torch.equal(ids, torch.arange(producers + consumers, dtype=torch.int32))
        assert torch.equal(out, torch.full((consumers,), 10 * producers * (producers + 1) // 2, dtype=torch.int32))
        assert not counters.any()


def test_the_counters_are_one_zeroed_buffer_per_device():
    """One buffer a device, grown (zeroed) when a launch needs more dependency counters; the first one already holds
    the latent query's 64 of GLM-5's heads at TP1 (a buffer replaced after a CUDA graph captured it would be freed
    under the graph)."""
    cpu = torch.device("cpu")
    first = tasks.counters(cpu, 1)
    assert tasks.counters(cpu, 3) is first and tasks.counters(cpu, 64) is first and not first.any()
    assert tasks.counters(cpu, first.numel()).numel() >= first.numel() + tasks.DEPS.value
