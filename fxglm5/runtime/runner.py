"""Runner: prefill / decode / greedy generate over the compiled program and the paged cache.

Built once from a checkpoint directory or a ``Glm5ForCausalLM``: capture, then the match, fuse and cache
stages (``insert_paged_cache`` makes the caches and the forward context graph inputs), into a
:class:`~fxglm5.program.PagedProgram`. Each step builds an RTP-shaped :class:`ForwardContext`, validates it (nothing
runs on a bad one), and runs the program on the flat tokens of the whole batch. The program is compiled with
``inputs_validated``: the ops' own checks would repeat that validation, and could not run inside a CUDA graph. On a
CUDA device decode steps replay CUDA graphs captured per batch bucket (:mod:`fxglm5.runtime.decode_graphs`); prefill
runs the program eagerly.

Requests are admitted one by one: one that does not fit the cache (at prefill or when a decode step
needs a new block) gets a :class:`CacheFullError` in ``Sequence.error`` and its blocks are released; the
other requests go on unchanged. Prefill runs the admitted prompts in steps of at most ``max_step_tokens`` flat
tokens (chunked prefill): a prompt longer than a step's room goes on in the next step behind its cached rows.

With ``speculative`` (:mod:`fxglm5.runtime.speculative`) a drafter proposes up to k tokens per request and each
step verifies them in one forward (``speculate``); the tokens are plain greedy decoding's. Verify steps are
synchronous: the next step's drafts and room depend on this step's acceptance, read on the host.

Decode overlaps the host with the device (``decode_steps``, the default of ``run``; SGLang's overlap scheduler,
vLLM's async scheduling): the sampled tokens stay on the device and are the next step's input ids; the host builds
step n+1 (room, context, staging: none of it needs the tokens) and launches it before it reads step n's tokens,
which come back through a pinned non-blocking copy and an event, one step late. What the late read decides is
applied then, and exactly as the step-by-step loop does: the prefix hashes of the rows before the read token are
committed at the read (``BlockManager.commit``; the rows are on the device, stream-ordered before any reader), and
a request that emitted a stop token leaves with the output it has: the step already launched for it computes one
wasted row (its token is dropped, its row lies past the request's length in a block that was never committed, and
the room taken for it goes back through ``BlockManager.truncate``). Room is taken ahead only where it takes no
block that holds a cached prefix (``BlockManager.fits_unevicted``); otherwise the loop first reads the step in
flight and grows the requests in the step-by-step order (so which request gets a CacheFullError, and which
prefixes are evicted, are the same).
"""

from __future__ import annotations

import collections.abc
import dataclasses
import itertools
from pathlib import Path

import torch

from fxglm5.errors import CacheFullError, InputError
from fxglm5.compiler import PREFILL_STEP_TOKENS, compile_model
from fxglm5.lowering.backend_choice import preferred_backend
from fxglm5.program import CacheSpec, PagedProgram
from fxglm5.runtime.block_manager import BlockManager
from fxglm5.runtime.cache import PagedCache, check_cache_size, check_options
from fxglm5.runtime.decode_graphs import DecodeGraphs
from fxglm5.runtime.distributed import agree, digest
from fxglm5.runtime.forward_context import ForwardContext
from fxglm5.runtime.shard_loader import load_rank, sharded_model
from fxglm5.runtime.speculative import Acceptance, SpeculativeConfig, accepted_length, check_drafts, verify_rows


def check_lengths(prompts: list[list[int]], max_new_tokens: int, limit: int) -> None:
    """Every prompt plus ``max_new_tokens`` must fit ``limit`` (max_position_embeddings): checked before a cache
    is sized from them, so that the cache for a batch is bounded by batch x limit tokens."""
    for i, p in enumerate(prompts):
        if len(p) + max_new_tokens > limit:
            raise InputError(f"prompt {i}: {len(p)} tokens + max_new_tokens {max_new_tokens} exceed "
                             f"max_position_embeddings ({limit})")


def check_sizes(config, num_blocks: int, block_size: int, spec: CacheSpec, device) -> None:
    """Refuse (InputError) a cache of blocks longer than any sequence, or larger than the memory available on
    ``device`` (fxglm5.runtime.cache.check_cache_size), before the slow capture and before any allocation."""
    if block_size > config.max_position_embeddings:
        raise InputError(f"block_size: {block_size} exceeds max_position_embeddings ({config.max_position_embeddings}): "
                         "a block longer than the longest sequence is never filled")
    check_cache_size(num_blocks, block_size, spec, device)


class Tokens(collections.abc.Sequence):
    """``head + tail`` without copying either: a decode step reads a request's length, last token and newly
    filled blocks, and concatenating prompt and output for that cost O(context) per request per step."""

    __slots__ = ("_head", "_tail")

    def __init__(self, head: list[int], tail: list[int]):
        self._head, self._tail = head, tail

    def __len__(self) -> int:
        return len(self._head) + len(self._tail)

    def __getitem__(self, index):
        n = len(self._head)
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return list(self)[index]
            return self._head[start:min(stop, n)] + self._tail[max(start - n, 0):max(stop - n, 0)]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"token index {index} out of range")
        return self._head[index] if index < n else self._tail[index - n]


@dataclasses.dataclass
class Sequence:
    id: int
    prompt: list[int]
    output: list[int] = dataclasses.field(default_factory=list)
    error: CacheFullError | None = None
    logits: list[torch.Tensor] = dataclasses.field(default_factory=list)  # per generated token, if kept
    cached: int = 0  # tokens whose KV rows are in the cache
    prefix_reused: int = 0  # prompt tokens taken from an earlier request's blocks
    acceptance: list[int] = dataclasses.field(default_factory=list)  # tokens emitted per verify step (speculative)
    stopped: bool = False  # emitted one of the run's stop tokens (its last token) and left

    @property
    def tokens(self) -> Tokens:
        return Tokens(self.prompt, self.output)


class Runner:
    def __init__(self, model, *, kv_cache: str = "bf16", index_cache: str | None = None, block_size: int = 64,
                 kernel_block_size: int | None = None, dtype: torch.dtype = torch.float32,
                 num_blocks: int | None = None, max_cache_tokens: int = 8192, device="cpu", keep_logits=False,
                 program: PagedProgram | None = None, backend: str | None = None, decode_graphs: bool | None = None,
                 max_decode_batch: int = 64, disabled_passes=(), tp: int = 1, ep: int | None = None,
                 speculative: SpeculativeConfig | None = None, drafter=None, mtp_program: PagedProgram | None = None,
                 max_step_tokens: int = PREFILL_STEP_TOKENS, overlap: bool = True):
        """``model``: a Glm5ForCausalLM or a checkpoint directory (loaded in ``dtype``); with ``program``, anything
        with the model's ``config`` and compute ``dtype`` (an exported artifact: ``fxglm5.artifact``). ``kv_cache``: "bf16"
        (latent rows in the compute dtype) or "fp8" (656-byte ds_mla rows); ``index_cache`` defaults to the
        same kind (see fxglm5.runtime.cache). The cache holds ``num_blocks`` blocks of ``block_size`` tokens
        (default: enough for ``max_cache_tokens``). ``program``: the compiled program of another Runner over the
        same model (``runner.program``), reused (it holds no cache) to skip capture. ``backend``: the kernels the ``lower`` stage
        prefers ("triton", "aiter", "reference"; default: the best for ``device``, FXGLM5_BACKEND overrides).
        ``decode_graphs``: replay decode steps of up to ``max_decode_batch`` requests from CUDA graphs (default:
        on a CUDA device unless ``backend`` is "reference", whose ops sync with the host; on a CPU, True runs the
        same padded static-buffer steps without capture). ``disabled_passes``: pass names the compile skips.
        ``tp`` > 1: this process is one of ``tp`` ranks of the process group registered as "tp"
        (``fxglm5.runtime.distributed``); ``model`` must then be a checkpoint directory, of which this rank reads
        only its slices (``load_report``), with its experts split over ``ep`` ranks (default ``tp``; 1: every
        expert split along its intermediate dim), or a reader with CheckpointReader's ``config``, ``param`` and
        ``bytes_read`` (``fxglm5.model.random_reader.RandomReader``: random weights drawn on the device, to measure
        one rank without the checkpoint). Every rank gets the same logits and so the same tokens.
        ``speculative``: a SpeculativeConfig; its drafts come from ``drafter`` (any
        ``fxglm5.runtime.speculative.Drafter``), by default the model's MTP layer (InputError without one);
        ``acceptance`` then holds the last ``run``'s verify statistics. The MTP drafter needs the target's hidden
        states, so the target graph is then compiled with head "logits+hidden" (a given ``program`` must be one) and
        the MTP layer's own program (``mtp_program``: another such Runner's ``drafter.program``, reused) with a second
        paged cache (fxglm5.runtime.mtp_drafter); at ``tp`` > 1 both are sharded, the MTP layer as the target's layers
        (its rank reads only its slices of the MTP layer too), and every rank drafts and accepts the same tokens. ``max_step_tokens``: the most flat tokens one prefill step
        computes (chunked prefill, see ``_prefill``): the activations of a step grow with its tokens, and the
        FP8 GEMMs' int32 offsets overflow at 2^31 elements (131072 tokens x 16384 columns). ``overlap``: ``run``
        decodes with the overlapped loop (``decode_steps``; the same tokens); False: one ``decode`` at a time."""
        if isinstance(max_step_tokens, bool) or not isinstance(max_step_tokens, int) or max_step_tokens < 1:
            raise InputError(f"max_step_tokens: must be a positive integer, got {max_step_tokens!r}")
        self.max_step_tokens, self.overlap = max_step_tokens, bool(overlap)
        index_kind, _ = check_options(block_size, kernel_block_size, kv_cache, index_cache)  # before the slow part
        if speculative is not None and not isinstance(speculative, SpeculativeConfig):
            raise InputError(f"speculative: expected a SpeculativeConfig or None, got {type(speculative).__name__}")

        preferred_backend(backend)
        if not isinstance(max_cache_tokens, int) or max_cache_tokens < 1:
            raise InputError(f"max_cache_tokens: must be a positive integer, got {max_cache_tokens!r}")
        self.mapping, self.load_report, reader = None, None, None
        if tp != 1:
            model, reader, self.mapping = sharded_model(model, tp, ep, dtype,
                                                        mtp=speculative is not None and drafter is None)
        elif ep not in (None, 1):
            raise InputError(f"ep={ep}: experts are split over the tp ranks; give tp={ep} too")
        elif isinstance(model, (str, Path)):
            from fxglm5.model.modeling import Glm5ForCausalLM

            model = Glm5ForCausalLM.from_pretrained(model, dtype=dtype, device=device, progress=False,
                                                    mtp=speculative is not None and drafter is None)
        if speculative is not None and drafter is None and getattr(model, "mtp", None) is None:
            raise InputError(f"speculative method {speculative.method!r}: the model has no MTP layer (its config has "
                             "num_nextn_predict_layers = 0, or it was loaded without mtp=True)")
        self.config, self.device, self.keep_logits = model.config, device, keep_logits
        num_blocks = num_blocks or -(-max_cache_tokens // block_size) + 1
        spec = CacheSpec.for_config(self.config, kv_cache, index_kind, model.dtype)
        check_sizes(self.config, num_blocks, block_size, spec, device)  # before compiling
        self.program, self.pass_results = program, []
        self.with_hidden = speculative is not None and drafter is None  # the MTP drafter reads the target's hidden
        max_tokens = max(self.config.max_position_embeddings, num_blocks * block_size)
        if program is None:  # a step's flat token count is bounded by the cache, not by one sequence's length
            compiled = compile_model(
                model, head="logits+hidden" if self.with_hidden else "logits", max_tokens=max_tokens, device=device,
                backend=backend, disabled_passes=disabled_passes, inputs_validated=True,
                **({} if self.mapping is None else {"mapping": self.mapping}))
            self.program, self.pass_results = compiled.program, compiled.results
        if not isinstance(self.program, PagedProgram):
            raise InputError(f"program: expected a PagedProgram (a paged compile's, runner.program), got "
                             f"{type(self.program).__name__}")
        if self.mapping is not None:
            self.load_report = load_rank(self.program.graph, self.mapping, reader, model, device)
        self.cache = PagedCache(self.program.cache_spec(kv_cache, index_kind, model.dtype), num_blocks, block_size,
                                kernel_block_size, device)
        self.blocks = BlockManager(num_blocks, block_size)
        on_cuda = torch.device(device).type == "cuda"
        if decode_graphs is None:
            decode_graphs = on_cuda and backend != "reference"
        self.decode_graphs = None
        if decode_graphs:
            longest = min(-(-self.config.max_position_embeddings // block_size), num_blocks)
            self.decode_graphs = DecodeGraphs(self.program, self.cache.graph_inputs(), max_batch=max_decode_batch,
                                              table_width=longest * self.cache.ratio, device=device, capture=on_cuda,
                                              tokens_per_request=1 + (speculative.num_tokens if speculative else 0))
        self.active: list[Sequence] = []
        self._ids = itertools.count()
        self.speculative, self.drafter, self.acceptance = speculative, drafter, Acceptance()
        if self.with_hidden:
            from fxglm5.runtime.mtp_drafter import MtpDrafter

            self.drafter = MtpDrafter(self, model, mtp_program, max_tokens=max_tokens, backend=backend,
                                      disabled_passes=disabled_passes, reader=reader)
        # the last step's hidden rows [rows, H] where the graph returns them (head "logits+hidden"), else None
        self.hidden = None
        self._on_token = None  # run's streaming callback, while a run is in progress

    def warm_up(self, max_batch: int | None = None, max_tokens: int | None = None) -> int:
        """Capture before serving every decode graph (with ``speculative``, every verify graph too) that a step of up
        to ``max_batch`` requests (default: the largest batch bucket) of at most ``max_tokens`` tokens each, drafts
        included (default: the longest sequence the cache holds), can replay, so that no compile, autotune or
        capture falls inside serving (a capture of a new width bucket once cost a timed phase seconds). Returns how
        many graphs it captured (on a CPU: static-buffer steps it ran); 0 without decode graphs."""
        graphs = self.decode_graphs
        if graphs is None:
            return 0
        width = graphs.widths[-1] if max_tokens is None else self.cache.kernel_blocks(max_tokens)
        return graphs.warm(graphs.keys(max_batch or graphs.max_batch, width))

    def _agree(self, *request) -> None:
        """Ranks: the same request on every rank, checked before anything that can raise on one rank only."""
        if self.mapping is not None:
            agree(digest(*request), "the request", self.mapping.group)

    # ---- one step -----------------------------------------------------------------------------------
    def context(self, seqs: list[Sequence], lengths: list[int] | None = None, starts: list[int] | None = None,
                device=None) -> ForwardContext:
        """A prefill step of ``lengths[b]`` tokens behind ``starts[b]`` cached ones (default: each request's cached
        tokens), or, with ``lengths`` None, a decode step of one token per request."""
        c = self.cache
        return ForwardContext.build(
            lengths is not None, lengths or [], starts or [s.cached for s in seqs], [self.blocks.tables[s.id] for s in seqs],
            block_size=c.block_size, kernel_block_size=c.kernel_block_size, num_blocks=c.num_blocks,
            max_position_embeddings=self.config.max_position_embeddings, prompt_lengths=[len(s.prompt) for s in seqs],
            device=device or self.device)

    @torch.no_grad()
    def step(self, ctx: ForwardContext, input_ids: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Validate ``ctx``, run the graph on the flat ``input_ids`` [T]; logits of each request's last token [B, V]
        (or of the flat token ``rows``: a verify step asks for all of them)."""
        ctx.validate()
        if input_ids.shape != ctx.positions.shape:
            raise InputError(f"input_ids: expected {tuple(ctx.positions.shape)} tokens, got {tuple(input_ids.shape)}")
        out = self.program(ctx.step_inputs(rows), input_ids, self.cache.graph_inputs())  # default rows: the last
        if out.hidden is not None:  # head "logits+hidden" (speculative decoding with the MTP layer)
            self.hidden = out.hidden
        return out.logits.float()

    def _advance(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        next_tokens = logits.argmax(-1)  # one reduction for the batch, queued behind the step
        for seq in seqs:  # the bookkeeping that needs no new token runs while the device computes the step
            seq.cached = len(seq.tokens)
            self.blocks.commit(seq.id, seq.tokens)
        for i, (seq, token) in enumerate(zip(seqs, next_tokens.tolist())):  # the step's one device -> host read
            self._emit(seq, [token])
            if self.keep_logits:
                seq.logits.append(logits[i])

    # ---- requests -----------------------------------------------------------------------------------
    def prefill(self, prompts: list[list[int]]) -> list[Sequence]:
        """Admit and prefill a batch of prompts (each gets its first new token); returns one Sequence per prompt."""
        self._agree("prefill", prompts)
        return self._prefill(prompts)

    def _prefill(self, prompts: list[list[int]]) -> list[Sequence]:
        seqs = [Sequence(next(self._ids), self._check_prompt(p)) for p in prompts]
        admitted = []
        for seq in seqs:
            try:
                seq.cached = seq.prefix_reused = self.blocks.allocate(seq.id, seq.prompt)
                admitted.append(seq)
            except CacheFullError as err:
                seq.error = err
        for step in self._chunks(admitted):
            self._prefill_step(step)
        self.active.extend(admitted)
        return seqs

    def _chunks(self, seqs: list[Sequence]) -> list[list[tuple[Sequence, int, int]]]:
        """The prompts' uncached tokens packed in order into steps of at most ``max_step_tokens``: per step,
        (request, first position, tokens). A request longer than a step's room is split; its next chunk runs in
        the next step behind its cached rows, as a reused prefix does."""
        steps, step, room = [], [], self.max_step_tokens
        for seq in seqs:
            start = seq.cached
            while start < len(seq.prompt):
                n = min(len(seq.prompt) - start, room)
                step.append((seq, start, n))
                start, room = start + n, room - n
                if room == 0:
                    steps.append(step)
                    step, room = [], self.max_step_tokens
        return steps + [step] if step else steps

    def _prefill_step(self, step: list[tuple[Sequence, int, int]]) -> None:
        """One prefill step; the requests whose prompt it completes get their first token, the others only have
        their cached rows advanced."""
        seqs = [seq for seq, _, _ in step]
        ctx = self.context(seqs, [n for _, _, n in step], [a for _, a, _ in step])
        ids = torch.tensor([t for seq, a, n in step for t in seq.prompt[a:a + n]], device=self.device)
        ends = list(itertools.accumulate(n for _, _, n in step))
        done = [b for b, (seq, a, n) in enumerate(step) if a + n == len(seq.prompt)]
        # logits of the completed prompts' last rows; a step that completes none still asks for one row (unused),
        # so that the head never runs on zero rows
        last = torch.tensor([ends[b] - 1 for b in done] or [ends[-1] - 1], device=self.device)
        if not self.with_hidden:
            logits = self.step(ctx, ids, rows=last)
        else:  # the drafter reads the target's hidden state at every prompt row
            logits = self.step(ctx, ids, rows=torch.arange(len(ids), device=self.device))[last]
        for seq, a, n in step:  # a prompt's full blocks are committed (hashed) with its first token, in _advance
            seq.cached = a + n
        if done:
            self._advance([seqs[b] for b in done], logits)
        if self.drafter is not None:
            self.drafter.start(step, self.hidden)

    def decode(self) -> list[Sequence]:
        """One decode step for every active request (a request without room gets CacheFullError and leaves); the
        new tokens are read before it returns."""
        running = self._room_for_one()
        if running:
            self._advance(running, self._decode_step(running, torch.tensor([s.tokens[-1] for s in running])))
        return running

    def _room_for_one(self, seqs: list[Sequence] | None = None) -> list[Sequence]:
        """Grow each of ``seqs`` (default: every active request) by one token's room, in order; one that has none
        gets CacheFullError and leaves. Returns those that grew."""
        running, failed = [], set()
        for seq in self.active if seqs is None else seqs:
            try:
                self.blocks.extend(seq.id, seq.cached + 1)
                running.append(seq)
            except CacheFullError as err:
                seq.error = err
                self._leave(seq)
                failed.add(seq.id)
        self.active = [seq for seq in self.active if seq.id not in failed]
        return running

    def decode_steps(self, max_new_tokens: int, stop_tokens=()) -> None:
        """Decode the active requests until each has ``max_new_tokens`` tokens, has emitted one of ``stop_tokens``
        (it leaves: ``stopped``) or has no room; with ``overlap`` the host runs one step ahead of the device (see
        the module docstring), else one ``decode`` at a time. The tokens are the same either way."""
        stop = frozenset(stop_tokens)
        if not self.overlap:
            while any(len(s.output) < max_new_tokens for s in self.active):
                running = self._room_for_one([s for s in self.active if len(s.output) < max_new_tokens])
                if not running:
                    continue
                self._advance(running, self._decode_step(running, torch.tensor([s.tokens[-1] for s in running])))
                self._stop(running, stop)
            return
        flight = None  # the step on the device whose tokens the host has not read
        while True:
            ahead = set() if flight is None else {s.id for s in flight.seqs}
            running = [s for s in self.active if len(s.output) + (s.id in ahead) < max_new_tokens]
            if flight is not None and not (running and self.blocks.fits_unevicted(
                    [(s.id, s.cached + 1) for s in running])):
                flight = self._read(flight, stop)  # nothing left to launch, or room only as the plain loop takes it
                continue
            if not running:
                return
            running = self._room_for_one(running)
            if not running:
                continue
            logits = self._decode_step(running, self._next_ids(running, flight))
            for seq in running:  # its row is written on the device, in stream order before any reader
                seq.cached += 1
            launched = _Launched(running, logits.argmax(-1), logits if self.keep_logits else None)
            if flight is not None:
                self._read(flight, stop)
            flight = launched

    def _next_ids(self, seqs: list[Sequence], flight: "_Launched | None") -> torch.Tensor:
        """The input ids of the next step: the last tokens from the host after a read, else the step in flight's
        tokens on the device (gathered where requests left it)."""
        if flight is None:
            return torch.tensor([s.tokens[-1] for s in seqs])
        if len(seqs) == len(flight.seqs):  # seqs is a subsequence of flight.seqs, so the same requests
            return flight.tokens
        row = {s.id: i for i, s in enumerate(flight.seqs)}
        index = torch.tensor([row[s.id] for s in seqs])
        if flight.tokens.is_cuda:
            index = index.pin_memory().to(flight.tokens.device, non_blocking=True)
        return flight.tokens[index]

    def _read(self, flight: "_Launched", stop: frozenset) -> None:
        """Wait for the step in flight's tokens (its one event) and apply them as ``_advance`` and ``_stop`` do; a
        request that stopped before this step gets nothing from it. Returns None (no step in flight)."""
        tokens = flight.wait()
        live = []
        for i, (seq, token) in enumerate(zip(flight.seqs, tokens)):
            if seq.stopped:
                continue
            self.blocks.commit(seq.id, seq.tokens)  # the rows before this token: the plain loop commits them now too
            self._emit(seq, [token])
            if self.keep_logits:
                seq.logits.append(flight.logits[i])
            live.append(seq)
        self._stop(live, stop)
        return None

    def _stop(self, seqs: list[Sequence], stop: frozenset) -> None:
        """Requests whose last token is a stop token leave; room taken for a step launched past it is given back
        first, so the blocks are those the plain loop leaves."""
        for seq in seqs:
            if seq.output[-1] in stop:
                seq.stopped = True
                if seq.cached > len(seq.tokens) - 1:
                    seq.cached = len(seq.tokens) - 1
                    self.blocks.truncate(seq.id, seq.cached)
                self.release(seq)

    def speculate(self, max_new_tokens: int) -> list[Sequence]:
        """One verify step for every active request with fewer than ``max_new_tokens`` tokens (those done leave
        ``active``); returns the requests stepped. Room is given as decode gives it (a request that cannot grow
        by one token gets CacheFullError) before any draft is given room, and drafts never take a request past
        ``max_new_tokens``: a request runs out of room only where its next token has none, as in decode (which
        request that is can differ from plain decoding's, since requests move up to k+1 tokens a step)."""
        k, bs = self.speculative.num_tokens, self.blocks.block_size
        self.active = [seq for seq in self.active if len(seq.output) < max_new_tokens]
        running = self._room_for_one()
        if not running:
            return running
        counts = []
        for seq in running:  # the drafts that fit: the free blocks go to the requests in order
            room = (len(self.blocks.tables[seq.id]) + self.blocks.num_free) * bs - seq.cached - 1
            counts.append(min(k, max_new_tokens - len(seq.output) - 1, room))
            self.blocks.extend(seq.id, seq.cached + 1 + counts[-1])
        drafts = check_drafts(self.drafter.propose(running, counts), counts, self.config.vocab_size)
        ids = [t for seq, d in zip(running, drafts) for t in (seq.tokens[-1], *d)]
        logits = self._verify_step(running, counts, ids)
        accepted, start = [], 0
        for seq, d, targets in zip(running, drafts, verify_rows(logits, counts)):
            a = len(d) if self.speculative.accept_all else accepted_length(d, targets)
            self._emit(seq, d[:a])  # the accepted drafts' rows are now cached: commit them, then the target's token
            seq.cached = len(seq.tokens)
            self.blocks.commit(seq.id, seq.tokens)
            self._emit(seq, [targets[a]])
            if self.keep_logits:
                seq.logits.extend(logits[start:start + a + 1])
            start += len(d) + 1
            seq.acceptance.append(a + 1)
            self.acceptance.add(len(d), a + 1)
            accepted.append(a)
        for seq in reversed(running):  # last first: the free list gets back the order plain decoding leaves it in
            self.blocks.truncate(seq.id, seq.cached)
        self.drafter.accepted(running, counts, accepted, self.hidden)
        return running

    def _verify_step(self, seqs: list[Sequence], counts: list[int], ids: list[int]) -> torch.Tensor:
        """Logits [T, V] of every token of a verify step: from the static buffers (a CUDA graph on a GPU) when every
        request verifies k drafts, else eagerly. The step is a prefill behind each request's cached tokens."""
        q = self.speculative.num_tokens + 1
        lengths = [n + 1 for n in counts]
        if self.decode_graphs is not None and all(n == q for n in lengths):
            logits = self.decode_graphs.run(torch.tensor(ids), self.context(seqs, lengths, device="cpu").validate(),
                                            per_request=q)
            if logits is not None:
                self.hidden = self.decode_graphs.hidden
                return logits
        return self.step(self.context(seqs, lengths), torch.tensor(ids, device=self.device),
                         rows=torch.arange(len(ids), device=self.device))

    def _leave(self, seq: Sequence) -> None:
        """A request that cannot go on: its blocks (and its drafter's state) are released."""
        self.blocks.free(seq.id)
        if self.drafter is not None:
            self.drafter.release(seq)

    def _decode_step(self, seqs: list[Sequence], ids: torch.Tensor) -> torch.Tensor:
        """Logits of one decode step of token ``ids`` (on the host, or the device's sampled tokens): replayed from a
        CUDA graph where one applies, else eagerly."""
        if self.decode_graphs is not None:  # the context is built and validated on the host: no device syncs
            logits = self.decode_graphs.run(ids, self.context(seqs, device="cpu").validate())
            if logits is not None:
                return logits
        return self.step(self.context(seqs), ids.to(self.device))

    def release(self, seq: Sequence) -> None:
        """Give a request's blocks back (full prompt blocks stay reusable as a cached prefix)."""
        self._leave(seq)
        if seq in self.active:
            self.active.remove(seq)

    def _emit(self, seq: Sequence, tokens: list[int]) -> None:
        """``tokens`` join the request's output, and the ``run``'s ``on_token`` hears of each."""
        seq.output.extend(tokens)
        if self._on_token is not None:
            for token in tokens:
                self._on_token(seq, token)

    def run(self, prompts: list[list[int]], max_new_tokens: int, stop_tokens=(), on_token=None) -> list[Sequence]:
        """Greedy generation for a batch; rejected requests carry ``error`` and the rest are unaffected. A request
        that emits one of ``stop_tokens`` (e.g. the config's eos ids) ends there, the stop token its last.
        ``on_token(seq, token)`` is called for every token as the host learns it (streaming), each request's in
        order; ``seq`` is the request's Sequence, ``run``'s result in the order of ``prompts``."""
        self._agree("run", prompts, max_new_tokens, sorted(stop_tokens))
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InputError(f"max_new_tokens: must be a positive integer, got {max_new_tokens!r}")
        stop = check_stop_tokens(stop_tokens, self.config.vocab_size)
        if stop and self.speculative is not None:
            raise InputError("stop_tokens: not with speculative decoding (a verify step emits several tokens)")
        check_lengths(prompts, max_new_tokens, self.config.max_position_embeddings)
        self.acceptance = Acceptance()
        self._on_token = on_token
        try:
            seqs = self._prefill(prompts)
            if self.speculative is None:
                self._stop(list(self.active), stop)  # a first token may already be a stop token
                self.decode_steps(max_new_tokens, stop)
            else:
                while self.speculate(max_new_tokens):
                    pass
        finally:
            self._on_token = None
        for seq in seqs:
            self.release(seq)
        return seqs

    def generate(self, prompts: list[list[int]], max_new_tokens: int, stop_tokens=(),
                 on_token=None) -> list[list[int]]:
        """Greedy tokens per prompt; raises the first CacheFullError (``run`` returns partial results instead)."""
        seqs = self.run(prompts, max_new_tokens, stop_tokens, on_token)
        for seq in seqs:
            if seq.error is not None:
                raise seq.error
        return [seq.output for seq in seqs]

    def _check_prompt(self, prompt) -> list[int]:
        prompt = [int(t) for t in prompt]
        vocab = self.config.vocab_size
        if not prompt:
            raise InputError("prompt: empty")
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise InputError(f"prompt: token id {bad[0]} is out of range [0, {vocab}) (vocab_size)")
        return prompt


def check_stop_tokens(stop_tokens, vocab: int) -> frozenset:
    """The stop token ids as a set, each an int in the vocabulary (InputError)."""
    if isinstance(stop_tokens, (str, bytes)) or not isinstance(stop_tokens, collections.abc.Iterable):
        raise InputError(f"stop_tokens: expected a collection of token ids, got {type(stop_tokens).__name__}")
    stop = list(stop_tokens)
    bad = [t for t in stop if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise InputError(f"stop_tokens: {bad[0]!r} is not a token id in [0, {vocab}) (vocab_size)")
    return frozenset(stop)


class _Launched:
    """A decode step launched on the device: its requests, its sampled tokens there (the next step's input ids),
    their copy into pinned host memory and the event after it (the loop's one wait on the device)."""

    def __init__(self, seqs: list[Sequence], tokens: torch.Tensor, logits: torch.Tensor | None):
        self.seqs, self.tokens, self.logits, self.done = seqs, tokens, logits, None
        self.host = tokens
        if tokens.is_cuda:
            self.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self.host.copy_(tokens, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()

    def wait(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()
