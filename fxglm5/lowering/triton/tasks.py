"""Tasks inside one launch: a CTA takes a dynamic task id, a task may wait on tasks before it, and the launch
cleans up after itself. The seed of the persistent decode kernel (docs/perf/persistent_decode_layer.md: tasks,
dependencies as counters in global memory, consumers spinning on them), first used to run the MoE router and the
expert GEMMs that read its routing in one launch (``moe._router_gate_up_kernel``, whose first tasks are, at decode,
the residual add and RMSNorm of the MoE's tokens: a second dependency, one signal a row), then the q_b GEMM and the
latent query of its heads (``paged_cache._gemm_latent_query_kernel``: one dependency a head, signalled by each GEMM
tile that holds its columns), and after them, at decode, the DSA indexer over that GEMM's wq_b columns
(``latent_query_indexer._gemm_latent_query_indexer_kernel``: one more dependency after the heads', signalled by each
tile of those columns; each row's selection by a ticket on a counter of its own, which never waits).

Vocabulary:
- a **task** is one CTA's work; its id is **taken** from the launch's queue counter (:func:`take`), not read from
  ``tl.program_id``. The launch orders its tasks so that a task only ever waits on tasks with smaller ids.
- a **producer** stores its output, then **signals** a dependency counter (:func:`signal`: a barrier so that every
  thread's stores come first, then a release add); a **consumer** **waits** until that counter reaches the number
  of signals it needs (:func:`wait`: an acquire read in a loop, then a barrier), then reads the produced data from
  L2 (``cache_modifier=".cg"``: another SM's stores are coherent there, not in this SM's L1).
- every CTA **finishes** (:func:`finish`) as its last act, and the last one resets the counters.

Why it cannot deadlock, whatever the grid's size and however many CTAs are resident at once (the argument of CUB's
decoupled look-back): ids are handed out in the order CTAs reach the queue, so a CTA that holds id i knows that
every id below i was taken by a CTA that is already running, one that will not give its SM back before it ends.
A task waits only on smaller ids, so by induction on the id every awaited task runs to its end: task 0 waits on
nothing, and task i waits on tasks that all finish. Program ids give no such order: the hardware may run
program 9 before program 3 has started, and if program 9 spins on program 3 in the last free slot of the GPU,
program 3 never starts.

Why the reset is safe: a CTA's ``done`` increment is its last access to the queue and to the dependency counters
(every take, wait and signal of it came before, and the increment is acq_rel), so the CTA whose increment brings
``done`` to the grid's size is the last one touching them in this launch, and it zeroes them all. The next use
is the next launch (the next call, or the next replay of a CUDA graph), which starts after this grid has
completed (stream order; a kernel launched with programmatic dependent launch touches them only after its
``pdl_prologue`` wait). So every launch, captured or not, starts from zeros without a memset.

Under ``TRITON_INTERPRET=1`` the programs run one after another in program-id order: the queue hands out ids in
that order, so each task finds the tasks it waits on already finished, and :func:`wait`'s loop ends at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# the counters' layout: the queue, the finished CTAs, then the dependency counters
QUEUE, DONE, DEPS = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def take(counters_ptr):
    """This CTA's task id: the queue's next number (0, 1, ... in the order CTAs reach it)."""
    return tl.atomic_add(counters_ptr + QUEUE, 1, sem="relaxed", scope="gpu")


@triton.jit
def signal(counters_ptr, dep):
    """Publish this CTA's stores to the consumers of dependency ``dep``: every thread's stores before the release
    add that counts this producer."""
    tl.debug_barrier()
    tl.atomic_add(counters_ptr + DEPS + dep, 1, sem="release", scope="gpu")


@triton.jit
def wait(counters_ptr, dep, count):
    """Spin until dependency ``dep`` has ``count`` signals (acquire reads), then let every thread of the CTA go on;
    the produced data is then read with ``cache_modifier=".cg"``."""
    while tl.atomic_add(counters_ptr + DEPS + dep, 0, sem="acquire", scope="gpu") < count:
        pass
    tl.debug_barrier()


@triton.jit
def finish(counters_ptr, NUM_DEPS: tl.constexpr):
    """This CTA's last act: count it done; the last CTA of the grid resets the queue, the ``NUM_DEPS`` dependency
    counters and ``done`` for the next launch (see the module doc)."""
    tl.debug_barrier()  # every thread is past its waits and signals
    ctas = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
    if tl.atomic_add(counters_ptr + DONE, 1, sem="acq_rel", scope="gpu") == ctas - 1:
        tl.atomic_xchg(counters_ptr + QUEUE, 0, sem="relaxed", scope="gpu")
        for dep in tl.static_range(NUM_DEPS):
            tl.atomic_xchg(counters_ptr + DEPS + dep, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(counters_ptr + DONE, 0, sem="relaxed", scope="gpu")


_COUNTERS: dict = {}
# the counters a buffer holds at least: a launch that needs more replaces it, and a CUDA graph captured before that
# would replay over the freed one, so the first buffer is made large enough for every launch there is (the latent
# query's one dependency a head and the indexer's one after them: GLM-5's 64 + 1 at TP1)
MIN_COUNTERS = 1024


def counters(device: torch.device, deps: int) -> torch.Tensor:
    """Zeroed int32 task counters (queue, done, ``deps`` dependency counters), kept per device: every launch resets
    what it used (:func:`finish`), so one buffer serves every launch of a stream, graph replays included."""
    key = (device.type, device.index)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < DEPS.value + deps:
        buf = torch.zeros(max(DEPS.value + deps, MIN_COUNTERS), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf

