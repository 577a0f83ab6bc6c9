"""Runner: the steps of serving (prefill, decode, verify) over the compiled program and the paged cache.

Built from its :class:`~fxglm5.runtime.parts.RunnerParts`, which :mod:`fxglm5.runtime.parts` makes once from a
checkpoint directory or a ``Glm5ForCausalLM`` and a :class:`~fxglm5.runtime.options.RunnerOptions`: capture, then the
match, fuse and cache stages (``insert_paged_cache`` makes the caches and the forward context graph inputs), into a
:class:`~fxglm5.program.PagedProgram`, with its paged cache, block manager, decode graphs and drafter. Each step
builds an RTP-shaped :class:`ForwardContext`, validates it (nothing runs on a bad one), and runs the program on the
flat tokens of the whole batch. The program is compiled with ``inputs_validated``: the ops' own checks would repeat
that validation, and could not run inside a CUDA graph. On a CUDA device decode steps replay CUDA graphs captured
per batch bucket (:mod:`fxglm5.runtime.decode_graphs`); prefill runs the program eagerly.

Requests as they come and go are the engine's (:mod:`fxglm5.runtime.engine`: ``add`` / ``step`` / ``abort``);
``run`` and ``generate`` are short loops over it. The Runner holds what a step needs: the active requests
(:class:`Sequence`: prompt, output, cached rows, :class:`~fxglm5.runtime.sampling.SamplingParams`), and the steps
themselves, which the engine and the batch methods (``prefill``, ``decode``, ``decode_steps``, ``speculate``, the
benches' way in) share. A request that does not fit the cache (at admission or when a step needs a new block)
gets a :class:`CacheFullError` in ``Sequence.error`` and its blocks are released; the other requests go on
unchanged. Prompts run in steps of at most ``max_step_tokens`` flat tokens (chunked prefill): a prompt longer than
a step's room goes on in the next step behind its cached rows; a step may carry other requests' decode tokens beside
its prompt chunks (``_mixed_step``: a decode token is a chunk of one behind its cached rows). Tokens are sampled on
the device (:mod:`fxglm5.runtime.sampling`; greedy: ``argmax``, the tie rule of old).

With ``speculative`` (:mod:`fxglm5.runtime.speculative`) a drafter proposes up to k tokens per request and each
step verifies them in one forward (``verify``); greedy requests get plain greedy decoding's tokens, sampled ones
the target's distribution (speculative sampling). Verify steps are synchronous: the next step's drafts and room
depend on this step's acceptance, read on the host.

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

import torch

from fxglm5.errors import CacheFullError, InputError
from fxglm5.runtime.distributed import agree, digest
from fxglm5.runtime.forward_context import ForwardContext
from fxglm5.runtime.options import RunnerOptions
from fxglm5.runtime.parts import RunnerParts, build_parts
from fxglm5.runtime.sampling import (GREEDY, Sampled, SamplingParams, generator_for, sample, unpack, verify_sampled,
                                     with_logprobs)
from fxglm5.runtime.speculative import Acceptance, accepted_length, check_drafts, verify_rows


def check_lengths(prompts: list[list[int]], max_new_tokens: int, limit: int) -> None:
    """Every prompt plus ``max_new_tokens`` must fit ``limit`` (max_position_embeddings): checked before a cache
    is sized from them, so that the cache for a batch is bounded by batch x limit tokens."""
    for i, p in enumerate(prompts):
        if len(p) + max_new_tokens > limit:
            raise InputError(f"prompt {i}: {len(p)} tokens + max_new_tokens {max_new_tokens} exceed "
                             f"max_position_embeddings ({limit})")


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
    stopped: bool = False  # emitted a stop (its last token; or a stop string in its text) and left
    params: SamplingParams = GREEDY  # how it samples, and its max_tokens and stops
    generator: torch.Generator | None = dataclasses.field(default=None, repr=False)  # a sampled request's stream
    token_logprobs: list = dataclasses.field(default_factory=list)  # per generated token, where params.logprobs asks
    text: object = dataclasses.field(default=None, repr=False)  # its text as it grows (fxglm5.runtime.text)
    decoding: bool = False  # its prefill (and that of the requests admitted with it) is done: it decodes
    finish_reason: str | None = None  # once it left: "stop", "length", "abort" or "error"

    @property
    def tokens(self) -> Tokens:
        return Tokens(self.prompt, self.output)

    def hit_stop(self) -> bool:
        """Whether its last token is one of its stop token ids, or its text met one of its stop strings."""
        return bool(self.output) and (self.output[-1] in self.params.stop_token_ids or
                                      (self.text is not None and self.text.stopped))


class Runner:
    def __init__(self, parts, options: RunnerOptions | None = None, **keywords):
        """``parts``: the :class:`~fxglm5.runtime.parts.RunnerParts` it serves with (``build_parts``; the builder's
        way, ``fxglm5.serve.build``). Or, a shim that builds them first, a model (a Glm5ForCausalLM, a checkpoint
        directory, a reader at ``tp`` > 1) with ``options`` (a :class:`~fxglm5.runtime.options.RunnerOptions`, or
        its fields as keywords) and ``build_parts``'s ``program`` / ``drafter`` / ``mtp_program``: ``Runner(model,
        options)`` is ``Runner(build_parts(model, options))``. Every rank of ``tp`` > 1 gets the same logits and so
        the same tokens; with ``options.speculative``, ``acceptance`` holds the last ``run``'s verify statistics."""
        if not isinstance(parts, RunnerParts):
            parts = build_parts(parts, options, **keywords)
        elif options is not None or keywords:
            raise InputError("Runner(parts): the parts carry their options and program; give nothing beside them")
        self.options = o = parts.options
        self.config, self.program, self.pass_results = parts.config, parts.program, parts.pass_results
        self.cache, self.blocks, self.decode_graphs = parts.cache, parts.blocks, parts.decode_graphs
        self.mapping, self.load_report, self.with_hidden = parts.mapping, parts.load_report, parts.with_hidden
        self.device, self.keep_logits = o.device, o.keep_logits
        self.max_step_tokens, self.overlap = o.max_step_tokens, o.overlap
        self.speculative, self.drafter, self.acceptance = o.speculative, parts.drafter, Acceptance()
        self.active: list[Sequence] = []
        self._ids = itertools.count()
        # the last step's hidden rows [rows, H] where the graph returns them (head "logits+hidden"), else None
        self.hidden = None

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

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> Sampled:
        """The tokens of a step's logits rows, one per request, each by its own SamplingParams (on the device)."""
        return sample(logits, [s.params for s in seqs], [s.generator for s in seqs])

    def _advance(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        sampled = self._sample(seqs, logits)  # queued behind the step
        for seq in seqs:  # the bookkeeping that needs no new token runs while the device computes the step
            seq.cached = len(seq.tokens)
            self.blocks.commit(seq.id, seq.tokens)
        tokens, logprobs = unpack(sampled.host(), [s.params for s in seqs])  # the step's one device -> host read
        for i, (seq, token) in enumerate(zip(seqs, tokens)):
            self._emit(seq, [token], [logprobs[i]])
            if self.keep_logits:
                seq.logits.append(logits[i])

    # ---- requests -----------------------------------------------------------------------------------
    def prefill(self, prompts: list[list[int]]) -> list[Sequence]:
        """Admit and prefill a batch of prompts (each gets its first new token); returns one Sequence per prompt."""
        self._agree("prefill", prompts)
        return self._prefill(prompts)

    def new_sequence(self, prompt, params: SamplingParams = GREEDY, seed: int = 0) -> Sequence:
        """A request for ``prompt`` (checked), not admitted yet; ``seed``: its random stream where ``params`` samples
        without a seed of its own."""
        return Sequence(next(self._ids), self._check_prompt(prompt), params=params,
                        generator=generator_for(params, self.device, seed))

    def admit(self, seq: Sequence) -> None:
        """Give ``seq`` its prompt's blocks (the cached prefix reused) and make it active; CacheFullError, with
        nothing changed, where they do not fit."""
        seq.cached = seq.prefix_reused = self.blocks.allocate(seq.id, seq.prompt)
        self.active.append(seq)

    def _prefill(self, prompts: list[list[int]]) -> list[Sequence]:
        seqs = [self.new_sequence(p) for p in prompts]
        admitted = []
        for seq in seqs:
            try:
                self.admit(seq)
                admitted.append(seq)
            except CacheFullError as err:
                seq.error, seq.finish_reason = err, "error"
        for step in self._chunks(admitted):
            self._prefill_step(step)
        for seq in admitted:
            seq.decoding = True
        return seqs

    def _chunks(self, seqs: list[Sequence], room: int | None = None) -> list[list[tuple[Sequence, int, int]]]:
        """The prompts' uncached tokens packed in order into steps of at most ``max_step_tokens`` (the first step:
        ``room``): per step, (request, first position, tokens). A request longer than a step's room is split; its
        next chunk runs in the next step behind its cached rows, as a reused prefix does."""
        steps, step, room = [], [], self.max_step_tokens if room is None else room
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
        self._mixed_step(step, [])

    def _mixed_step(self, step: list[tuple[Sequence, int, int]], decodes: list[Sequence]) -> None:
        """One step of prompt chunks (request, first position, tokens) beside one decode token of each of
        ``decodes`` (their room taken): a prefill step behind each request's cached rows, a decode token being a
        chunk of one. The decodes and the requests whose prompt it completes get a token; a request that emitted a
        stop leaves."""
        chunks = [(seq, seq.cached, 1) for seq in decodes] + step
        seqs = [seq for seq, _, _ in chunks]
        ctx = self.context(seqs, [n for _, _, n in chunks], [a for _, a, _ in chunks])
        ids = torch.tensor([seq.tokens[-1] for seq in decodes] +
                           [t for seq, a, n in step for t in seq.prompt[a:a + n]], device=self.device)
        ends = list(itertools.accumulate(n for _, _, n in chunks))
        done = list(range(len(decodes))) + [len(decodes) + b for b, (seq, a, n) in enumerate(step)
                                            if a + n == len(seq.prompt)]
        # logits of the decodes' and the completed prompts' last rows; a step that completes none still asks for one
        # row (unused), so that the head never runs on zero rows
        last = torch.tensor([ends[b] - 1 for b in done] or [ends[-1] - 1], device=self.device)
        if not self.with_hidden:
            logits = self.step(ctx, ids, rows=last)
        else:  # the drafter reads the target's hidden state at every prompt row
            logits = self.step(ctx, ids, rows=torch.arange(len(ids), device=self.device))[last]
        for seq, a, n in step:  # a prompt's full blocks are committed (hashed) with its first token, in _advance
            seq.cached = a + n
        emitting = [seqs[b] for b in done]
        if emitting:
            self._advance(emitting, logits)
        if self.drafter is not None and step:
            self.drafter.start(step, self.hidden)
        self._stop(emitting)

    def decode(self) -> list[Sequence]:
        """One decode step for every active request (a request without room gets CacheFullError and leaves); the
        new tokens are read before it returns."""
        return self.decode_once(list(self.active))

    def decode_once(self, seqs: list[Sequence]) -> list[Sequence]:
        """One decode step of ``seqs`` (each given room first, or CacheFullError), its tokens read; a request that
        emitted a stop leaves. Returns the requests stepped."""
        running = self._room_for_one(seqs)
        if running:
            self._advance(running, self._decode_step(running, torch.tensor([s.tokens[-1] for s in running])))
            self._stop(running)
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
                seq.error, seq.finish_reason = err, "error"
                self._leave(seq)
                failed.add(seq.id)
        self.active = [seq for seq in self.active if seq.id not in failed]
        return running

    def decode_steps(self, max_new_tokens: int, stop_tokens=()) -> None:
        """Decode the active requests until each has ``max_new_tokens`` tokens, has emitted one of ``stop_tokens``
        (it leaves: ``stopped``) or has no room; with ``overlap`` the host runs one step ahead of the device (see
        the module docstring), else one ``decode`` at a time. The tokens are the same either way."""
        stop = frozenset(stop_tokens)
        for seq in self.active:
            seq.params = seq.params.replace(max_tokens=max_new_tokens, stop_token_ids=stop)
        if not self.overlap:
            while True:
                wanting = [s for s in self.active if len(s.output) < s.params.max_tokens]
                if not wanting:
                    return
                self.decode_once(wanting)
        flight, more = None, True
        while more:
            flight, more = self.overlap_round(flight)

    def overlap_round(self, flight: "_Launched | None") -> tuple["_Launched | None", bool]:
        """One turn of the overlapped decode loop (module docstring): launch the next decode step of the active
        requests below their ``max_tokens`` (fed the step in flight's tokens on the device) and then read the step in
        flight, or only read it where nothing can be launched ahead. Returns (the step now in flight, whether
        anything was done)."""
        ahead = set() if flight is None else {s.id for s in flight.seqs}
        running = [s for s in self.active if s.decoding and len(s.output) + (s.id in ahead) < s.params.max_tokens]
        if flight is not None and not (running and self.blocks.fits_unevicted([(s.id, s.cached + 1) for s in running])):
            return self._read(flight), True  # nothing left to launch, or room only as the plain loop takes it
        if not running:
            return None, False
        running = self._room_for_one(running)
        if not running:
            return flight, True
        logits = self._decode_step(running, self._next_ids(running, flight))
        for seq in running:  # its row is written on the device, in stream order before any reader
            seq.cached += 1
        launched = _Launched(running, self._sample(running, logits), logits if self.keep_logits else None)
        if flight is not None:
            self._read(flight)
        return launched, True

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

    def _read(self, flight: "_Launched") -> None:
        """Wait for the step in flight's tokens (its one event) and apply them as ``_advance`` and ``_stop`` do; a
        request that left before this step (a stop, an abort) gets nothing from it. Returns None (no step in
        flight)."""
        tokens, logprobs = flight.wait()
        live = []
        for i, (seq, token) in enumerate(zip(flight.seqs, tokens)):
            if seq.finish_reason is not None:
                continue
            self.blocks.commit(seq.id, seq.tokens)  # the rows before this token: the plain loop commits them now too
            self._emit(seq, [token], [logprobs[i]])
            if self.keep_logits:
                seq.logits.append(flight.logits[i])
            live.append(seq)
        self._stop(live)
        return None

    def _stop(self, seqs: list[Sequence]) -> None:
        """Requests that emitted a stop (a stop token id, or a stop string in their text) leave; room taken for a
        step launched past it is given back first, so the blocks are those the plain loop leaves."""
        for seq in seqs:
            if seq.hit_stop():
                seq.stopped, seq.finish_reason = True, "stop"
                if seq.cached > len(seq.tokens) - 1:
                    seq.cached = len(seq.tokens) - 1
                    self.blocks.truncate(seq.id, seq.cached)
                self.release(seq)

    def speculate(self, max_new_tokens: int) -> list[Sequence]:
        """One verify step for every active request with fewer than ``max_new_tokens`` tokens (those done leave
        ``active``); returns the requests stepped. See :meth:`verify`."""
        for seq in self.active:
            seq.params = seq.params.replace(max_tokens=max_new_tokens)
        self.active = [seq for seq in self.active if len(seq.output) < max_new_tokens]
        return self.verify(list(self.active))

    def verify(self, seqs: list[Sequence]) -> list[Sequence]:
        """One verify step of ``seqs`` (each below its ``max_tokens``); returns the requests stepped. Room is given
        as decode gives it (a request that cannot grow by one token gets CacheFullError) before any draft is given
        room, and drafts never take a request past its ``max_tokens``: a request runs out of room only where its
        next token has none, as in decode (which request that is can differ from plain decoding's, since requests
        move up to k+1 tokens a step). Greedy requests accept the drafts their argmax confirms; sampled ones by
        speculative sampling (fxglm5.runtime.sampling.verify_sampled). A request whose emitted tokens meet a stop
        keeps them up to it and leaves."""
        k, bs = self.speculative.num_tokens, self.blocks.block_size
        running = self._room_for_one(seqs)
        if not running:
            return running
        counts = []
        for seq in running:  # the drafts that fit: the free blocks go to the requests in order
            room = (len(self.blocks.tables[seq.id]) + self.blocks.num_free) * bs - seq.cached - 1
            counts.append(min(k, seq.params.max_tokens - len(seq.output) - 1, room))
            self.blocks.extend(seq.id, seq.cached + 1 + counts[-1])
        drafts = check_drafts(self.drafter.propose(running, counts), counts, self.config.vocab_size)
        ids = [t for seq, d in zip(running, drafts) for t in (seq.tokens[-1], *d)]
        logits = self._verify_step(running, counts, ids)
        starts = list(itertools.accumulate((n + 1 for n in counts), initial=0))
        verdicts = self._judge(running, drafts, logits, starts)
        accepted, stopped = [], []
        for seq, d, start, (a, token, logprobs) in zip(running, drafts, starts, verdicts):
            emitted = 0
            for draft in d[:a]:  # the accepted drafts' rows are now cached: commit them, then the target's token
                self._emit(seq, [draft], logprobs[emitted:emitted + 1])
                emitted += 1
                if seq.hit_stop():
                    break
            seq.cached = len(seq.tokens)
            self.blocks.commit(seq.id, seq.tokens)
            if not seq.hit_stop():
                self._emit(seq, [token], logprobs[emitted:emitted + 1])
                emitted += 1
            if self.keep_logits:
                seq.logits.extend(logits[start:start + emitted])
            seq.acceptance.append(a + 1)
            self.acceptance.add(len(d), a + 1)
            accepted.append(a)
            stopped.append(seq.hit_stop())
        for seq in reversed(running):  # last first: the free list gets back the order plain decoding leaves it in
            self.blocks.truncate(seq.id, seq.cached)
        self._stop([seq for seq, s in zip(running, stopped) if s])
        going = [b for b, s in enumerate(stopped) if not s]
        if len(going) == len(running):
            self.drafter.accepted(running, counts, accepted, self.hidden)
        elif going:
            rows = [r for b in going for r in range(starts[b], starts[b] + counts[b] + 1)]
            hidden = None if self.hidden is None else self.hidden[torch.tensor(rows, device=self.hidden.device)]
            self.drafter.accepted([running[b] for b in going], [counts[b] for b in going],
                                  [accepted[b] for b in going], hidden)
        return running

    def _judge(self, seqs: list[Sequence], drafts: list[list[int]], logits: torch.Tensor,
               starts: list[int]) -> list[tuple[int, int, list]]:
        """Per request of a verify step: (drafts accepted a, the token after them, the log-probabilities of the a+1
        emitted tokens where it asked for them, else Nones)."""
        out: list = [None] * len(seqs)
        sampled = [b for b, seq in enumerate(seqs) if not seq.params.greedy]
        if len(sampled) < len(seqs):
            for b, targets in enumerate(verify_rows(logits, [len(d) for d in drafts])):  # one device -> host read
                if seqs[b].params.greedy:
                    d = drafts[b]
                    a = len(d) if self.speculative.accept_all else accepted_length(d, targets)
                    out[b] = (a, targets[a])
        if sampled:
            verdicts = torch.stack([verify_sampled(logits[starts[b]:starts[b + 1]], drafts[b], seqs[b].params,
                                                   seqs[b].generator) for b in sampled]).tolist()
            for b, (a, token) in zip(sampled, verdicts):
                out[b] = (a, token)
        return [(a, token, self._verify_logprobs(seq, logits[start:start + a + 1], d[:a] + [token]))
                for seq, d, start, (a, token) in zip(seqs, drafts, starts, out)]

    def _verify_logprobs(self, seq: Sequence, rows: torch.Tensor, tokens: list[int]) -> list:
        if seq.params.logprobs is None:
            return [None] * len(tokens)
        sampled = with_logprobs(torch.tensor(tokens, device=rows.device), rows, [seq.params] * len(tokens))
        return unpack(sampled.host(), [seq.params] * len(tokens))[1]

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

    @staticmethod
    def _emit(seq: Sequence, tokens: list[int], logprobs: list | None = None) -> None:
        """``tokens`` join the request's output (their log-probabilities, where it asked, its ``token_logprobs``;
        its text, where it has one, grows)."""
        seq.output.extend(tokens)
        if seq.params.logprobs is not None:
            seq.token_logprobs.extend(logprobs)
        if seq.text is not None:
            for token in tokens:
                seq.text.push(token)

    def run(self, prompts: list[list[int]], max_new_tokens: int, stop_tokens=(), on_token=None) -> list[Sequence]:
        """Greedy generation for a batch, through the request-level engine (fxglm5.runtime.engine: the prompts
        added, then steps until every request is done); rejected requests carry ``error`` and the rest are
        unaffected. A request that emits one of ``stop_tokens`` (e.g. the config's eos ids) ends there, the stop
        token its last. ``on_token(seq, token)`` is called for every token as the host learns it (streaming), each
        request's in order; ``seq`` is the request's Sequence, ``run``'s result in the order of ``prompts``."""
        from fxglm5.runtime.engine import Engine

        self._agree("run", prompts, max_new_tokens, sorted(stop_tokens))
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InputError(f"max_new_tokens: must be a positive integer, got {max_new_tokens!r}")
        stop = check_stop_tokens(stop_tokens, self.config.vocab_size)
        check_lengths(prompts, max_new_tokens, self.config.max_position_embeddings)
        self.acceptance = Acceptance()
        engine = Engine(self, wait_for_room=False)
        params = GREEDY.replace(max_tokens=max_new_tokens, stop_token_ids=stop)
        seqs = [engine.request(engine.add(prompt, params)) for prompt in prompts]
        while engine.has_work():
            for out in engine.step():
                for token in out.tokens if on_token is not None else ():
                    on_token(out.sequence, token)
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
    their copy (with any log-probabilities) into pinned host memory and the event after it (the loop's one wait on
    the device)."""

    def __init__(self, seqs: list[Sequence], sampled: Sampled, logits: torch.Tensor | None):
        self.seqs, self.tokens, self.logits, self.done = seqs, sampled.tokens, logits, None
        self.host = sampled.host()
        if self.tokens.is_cuda:
            self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                         for t in self.host]
            self.done = torch.cuda.Event()
            self.done.record()

    def wait(self) -> tuple[list[int], list]:
        if self.done is not None:
            self.done.synchronize()
        return unpack(self.host, [s.params for s in self.seqs])
