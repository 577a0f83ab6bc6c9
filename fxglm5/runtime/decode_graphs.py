"""Decode steps replayed from CUDA graphs, one per (batch, block-table width) bucket.

Why: the runner calls the compiled program eagerly, and a decode step is then host-bound: on two GLM-5-width
layers at batch 64 it spends several times its device work in Python (the graph's interpreter, the ops'
dispatch, a few hundred launches; figures: docs/perf/runtime_decode.md), and the gap grows with every layer.
A replayed graph costs one launch.

How: the graph's inputs live in static device buffers sized for the largest batch bucket (token ids,
positions, slot mapping, request index) and a block table per width bucket (powers of two of kernel blocks, up
to the longest sequence the cache can hold). The width is bucketed too because kernels size their work by it:
the indexer's logits rows are as wide as the table, and past a few thousand keys the top-k switches to its
long-row method (one table as wide as the cache made a 2-layer step at 2k tokens slower than eager).
A step copies its validated context into the buffers, padded to its (batch, width) bucket, through pinned host
staging buffers written in place (one asynchronous copy per device buffer, no tensors made per step; two sets used
in turn, so that the runner's overlapped loop, one step ahead of its token reads, never waits for the previous
step's copies to have read a set) -- a padding token
has slot -1 (its cache write is skipped), position 0 and an all-zero block-table row (block 0 is reserved), so
it reads only block 0 and writes nothing -- replays that bucket's graph and returns the live rows' logits. Token
ids already on the device (the previous step's sampled tokens, which the overlapped loop never brings to the host
first) are copied into the static ids buffer on the device, behind the staged copy.
Verify steps of speculative decoding (:mod:`fxglm5.runtime.speculative`) run here too: ``per_request`` = k+1
tokens of each request, request b's tokens at rows b*q .. b*q+q-1, every row's logits returned; their graphs are
bucketed by (batch, width, tokens per request) alike (a step whose requests compute different numbers of tokens
runs eagerly). A bucket is captured at its first use, or ahead of serving by ``warm``: the step first runs eagerly on
the same buffers (kernel compilation and autotuning happen there, never inside capture; its result is that step's
answer, as capture itself computes nothing), then the graph is captured. ``warm`` runs a step of padding tokens
only (slot -1: nothing is written to the caches). The op-level validation is never bound (it syncs with the
host); the runner validated the context, and its program was compiled without them (``inputs_validated``).

A step larger than the largest batch bucket, a table wider than the cache's longest sequence, or a graph that
cannot be captured (an op that syncs with the host, as the exact-mode indexer cache's reference top-k does)
runs eagerly; the last case is logged once and switches capture off for the runner. Without a CUDA device
(``capture=False``) the padded static-buffer steps run without capture: the same inputs, checked on the CPU.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from fxglm5.program import PagedProgram, StepInputs
from fxglm5.runtime.forward_context import ForwardContext

log = logging.getLogger(__name__)


def request_rows(batch: int, tokens_per_request: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(request of each token, logits rows) of a step in which each of ``batch`` requests computes
    ``tokens_per_request`` tokens laid out request by request (request b's at rows b*q .. b*q+q-1): ``row // q``,
    and every row (a verify step scores each of its tokens)."""
    every = torch.arange(batch * tokens_per_request, dtype=torch.int64, device=device)
    return every // tokens_per_request, every


def pow2_buckets(limit: int) -> list[int]:
    """Powers of two up to ``limit``, and ``limit`` itself (batch sizes; block-table widths)."""
    return sorted({1 << i for i in range(limit.bit_length()) if 1 << i <= limit} | {limit})


class DecodeGraphs:
    def __init__(self, program: PagedProgram, caches: list[torch.Tensor], *, max_batch: int, table_width: int, device,
                 capture: bool = True, tokens_per_request: int = 1):
        """``tokens_per_request``: the most tokens one request computes in a step (1; k+1 with k drafts)."""
        self.program, self.caches, self.capture = program, caches, capture
        self.max_batch = max_batch
        self.buckets, self.widths = pow2_buckets(max_batch), pow2_buckets(table_width)
        self.device = device
        i64 = dict(dtype=torch.int64, device=device)
        # token ids, positions and slot mapping in one buffer (one host -> device copy a step); the graph reads views
        self.inputs = torch.zeros(3, max_batch * tokens_per_request, **i64)
        self.input_ids, self.positions, self.slot_mapping = self.inputs[0:1], self.inputs[1:2], self.inputs[2]
        self.slot_mapping.fill_(-1)
        self.req_idx = torch.arange(max_batch, **i64)  # decode: token b is request b; padding reads row b
        # per tokens-per-request q: (the request of each token, the logits rows = every token)
        self._rows = {1: (self.req_idx, self.req_idx)}
        if tokens_per_request > 1:
            self._rows[tokens_per_request] = request_rows(max_batch, tokens_per_request, device)
        self.tables: dict[int, torch.Tensor] = {}  # width bucket -> int32 [max_batch, width]
        # host staging of each device buffer, pinned on a GPU so that its copy is asynchronous (a copy from
        # pageable memory waits for the device: the copy queued behind the previous replay held the host); two
        # sets, the steps using them in turn
        self._pin = torch.device(device).type == "cuda" and torch.cuda.is_available()
        self._staging = [_Staging(max_batch * tokens_per_request, self._pin) for _ in range(2)]
        self.graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # (batch, width, q)
        self.steps = 0  # decode / verify steps run from the static buffers (replayed, or uncaptured on a CPU)
        self.hidden: Optional[torch.Tensor] = None  # the last step's hidden rows, from a (logits, hidden) graph
        self.disabled: Optional[str] = None
        self._pool = None

    @staticmethod
    def _fit(buckets: list[int], n: int) -> Optional[int]:
        return next((b for b in buckets if b >= n), None)

    def key(self, batch: int, width: int, per_request: int = 1) -> Optional[tuple[int, int, int]]:
        """The (batch bucket, width bucket, tokens per request) of a step, or None where it runs eagerly."""
        key = (self._fit(self.buckets, batch), self._fit(self.widths, width), per_request)
        return None if self.disabled is not None or None in key or per_request not in self._rows else key

    def keys(self, max_batch: int, max_width: int) -> list[tuple[int, int, int]]:
        """Every key a step of up to ``max_batch`` requests and ``max_width`` kernel blocks can take."""
        batches = self.buckets[:self.buckets.index(self._fit(self.buckets, min(max_batch, self.max_batch))) + 1]
        widths = self.widths[:self.widths.index(self._fit(self.widths, min(max_width, self.widths[-1]))) + 1]
        return [(b, w, q) for q in sorted(self._rows) for b in batches for w in widths]

    def warm(self, keys) -> int:
        """Capture (on a CPU: run) the graph of each key not captured yet, on a step of padding tokens only (slot
        -1, position 0, table row 0: the caches are not written); returns how many ran. Serving then compiles,
        autotunes and captures nothing at these keys."""
        done = 0
        for key in keys:
            if key in self.graphs or self.disabled is not None:
                continue
            bucket, width, q = key
            self._table(width)
            staging = self._next_staging()
            staging.inputs.zero_()
            staging.inputs[2].fill_(-1)
            staging.tables[width].zero_()
            self._send(staging, bucket, width)
            self.steps += 1
            if self.capture:
                self._warm_up_and_capture(key)
            else:
                self._forward(*key)
            done += 1
        return done

    def reset(self) -> None:
        """Drop every captured graph, their memory pool and a failed capture's verdict: the next step of each key
        captures anew (after a kernel setting changed; capturing into the pool of graphs already freed fails in
        torch's allocator)."""
        self.graphs.clear()
        self._pool, self.disabled = None, None

    def run(self, input_ids: torch.Tensor, ctx: ForwardContext, per_request: int = 1) -> Optional[torch.Tensor]:
        """float32 logits [B * per_request, V] of a validated ``ctx`` (host or device tensors) in which every request
        computes ``per_request`` tokens (a decode step: 1), or None: run it eagerly. ``input_ids`` on the buffers'
        device are copied there without visiting the host."""
        B = ctx.batch_size
        key = self.key(B, ctx.kernel_block_table.shape[1], per_request)
        if key is None:
            return None
        self._load(input_ids, ctx, *key)
        self.steps += 1
        T = B * per_request
        if not self.capture:
            return self._outputs(self._forward(*key), T)
        if key in self.graphs:
            graph, out = self.graphs[key]
            graph.replay()
            return self._outputs(out, T)
        return self._outputs(self._warm_up_and_capture(key), T)

    def _outputs(self, out, T: int) -> torch.Tensor:
        """float32 logits of the live rows (a copy: the static output is overwritten by the next replay); the
        hidden rows of a (logits, hidden) program (head "logits+hidden") go to ``self.hidden``, copied too."""
        if out.hidden is not None:
            self.hidden = out.hidden[:T].clone()
        return out.logits[:T].to(torch.float32, copy=True)

    def _table(self, width: int) -> None:
        if width not in self.tables:
            self.tables[width] = torch.zeros(self.max_batch, width, dtype=torch.int32, device=self.device)
            for staging in self._staging:
                staging.tables[width] = torch.zeros(self.max_batch, width, dtype=torch.int32, pin_memory=self._pin)

    def _next_staging(self) -> "_Staging":
        """The staging set of the step after the last one; its last copies are done by now (the runner has read
        the tokens of the step that used it), so the wait is a check that never blocks in the runner's loops."""
        self._staging.reverse()
        staging = self._staging[0]
        if staging.copied is not None and not staging.copied.query():
            staging.copied.synchronize()
        return staging

    def _load(self, input_ids: torch.Tensor, ctx: ForwardContext, bucket: int, width: int, q: int = 1) -> None:
        """Copy the step into the static buffers; rows B..bucket-1 become padding tokens. The step is written into
        the host staging buffers in place and each goes to the device in one non-blocking copy; device-resident
        ``input_ids`` then overwrite the ids row on the device."""
        B, used = ctx.batch_size, ctx.kernel_block_table.shape[1]
        self._table(width)
        staging = self._next_staging()
        staged, table = staging.inputs, staging.tables[width]
        on_device = input_ids.device == self.inputs.device  # on a CPU every step takes this path
        for row, values, pad in ((0, None if on_device else input_ids, 0), (1, ctx.positions, 0),
                                 (2, ctx.slot_mapping, -1)):
            if values is not None:
                staged[row, :B * q] = values
            staged[row, B * q:bucket * q] = pad
        table[:B, :used] = ctx.kernel_block_table
        table[:B, used:] = 0
        table[B:bucket] = 0
        self._send(staging, bucket, width)
        if on_device:
            self.inputs[0, :B * q].copy_(input_ids)

    def _send(self, staging: "_Staging", bucket: int, width: int) -> None:
        self.inputs.copy_(staging.inputs, non_blocking=True)
        self.tables[width][:bucket].copy_(staging.tables[width][:bucket], non_blocking=True)
        if self._pin:
            staging.copied = torch.cuda.Event()
            staging.copied.record()

    def _forward(self, bucket: int, width: int, q: int = 1) -> torch.Tensor:
        T = bucket * q
        req, rows = self._rows[q]  # q = 1: token b is request b's and its logits' row
        step = StepInputs(self.positions[0, :T], self.slot_mapping[:T], self.tables[width][:bucket], req[:T], rows[:T])
        return self.program(step, self.input_ids[0, :T], self.caches)

    def _warm_up_and_capture(self, key: tuple[int, int]) -> torch.Tensor:
        bucket = key[0]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            logits = self._forward(*key)  # this step's answer; compiles and autotunes outside capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        outer = torch.cuda.current_stream()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                out = self._forward(*key)
        except Exception as err:  # noqa: BLE001 - an op that cannot be captured: this runner decodes eagerly
            undo_failed_capture(graph, outer)
            self.disabled = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
            log.warning("decode CUDA graphs off, capture failed at batch %d (%s); decoding eagerly", bucket,
                        self.disabled)
            torch.cuda.synchronize()
            return logits
        self._pool = graph.pool()
        self.graphs[key] = (graph, out)
        return logits


def undo_failed_capture(graph: torch.cuda.CUDAGraph, outer: torch.cuda.Stream) -> None:
    """Put back what a capture that raised leaves half-done, so that the process goes on eagerly.

    ``torch.cuda.graph``'s exit ends the capture before it leaves its stream; when the capture was invalidated (an
    op that syncs, say) ``capture_end`` raises before the default generator's capture epilogue and before the
    allocator stops routing the capture stream's allocations to the graph's pool. Left so, the current stream stays
    the capture stream and every later CUDA random op of the process fails with "Offset increment outside graph
    capture encountered unexpectedly" (torch's CUDAGeneratorState::increase). Here: the stream before the capture is
    current again, the pool takes no more allocations, and the default generator gets a fresh state object with the
    same seed and offset (the stuck one stays with the dead graph)."""
    torch.cuda.set_stream(outer)
    device = outer.device.index
    try:
        torch._C._cuda_endAllocateToPool(device, graph.pool())
    except (AttributeError, RuntimeError):  # the capture ended before the error, or never began
        pass
    stuck = torch.cuda.default_generators[device]
    fresh = torch.Generator(device=outer.device)
    fresh.set_state(stuck.get_state())
    stuck.graphsafe_set_state(fresh)


class _Staging:
    """One set of host staging buffers (ids, positions, slots; a block table per width bucket) and the event after
    the last copies that read it."""

    def __init__(self, tokens: int, pin: bool):
        self.inputs = torch.zeros(3, tokens, dtype=torch.int64, pin_memory=pin)
        self.tables: dict[int, torch.Tensor] = {}
        self.copied: Optional[torch.cuda.Event] = None
