"""The request-level engine: requests are added and aborted at any time, and each ``step`` advances them all.

``add(prompt, params) -> id`` queues a request; ``step() -> [Output]`` runs one step of the runner and returns what
each request learned in it (its new tokens, their log-probabilities and text, and how it finished); ``abort(id)``
ends one. ``Runner.run`` / ``generate`` are a loop of ``add`` and ``step``; the server (``fxglm5.serve``) drives one
engine from its own thread; at ``tp`` > 1 every rank's engine gets the same calls in the same order, so every rank
runs the same steps.

A step:

1. **Admission.** The waiting requests are given their prompt's blocks (prefix reuse) in the order they came, and
   become one *wave*. With ``wait_for_room`` (the server's engine) a request is admitted only where the free blocks
   cover what it and every admitted request need to reach their ``max_tokens``, so no request runs out of room
   while decoding; otherwise it waits, with those behind it, for the running ones to give blocks back (alone, it
   is admitted if its prompt fits). With ``wait_for_room=False`` (``run``'s batch semantics) a request whose prompt
   does not fit fails at once with CacheFullError, and one that runs out of room while decoding fails then.
2. **Prefill beside decode.** While some wave still has prompt tokens to compute, the step takes the requests that
   decode (those of waves already done) and packs prompt chunks of the pending waves, in order, into the rest of
   the ``max_step_tokens`` budget (``Runner._mixed_step``: one forward). A wave's requests start decoding together
   once its last prompt is in the cache, so a batch added at once is prefilled exactly as a batch ever was (all
   its prefill steps, then decode). Under speculative decoding the prefill chunks and the verify step run as two
   forwards of one engine step.
3. **Decode.** Otherwise one decode step: with ``overlap`` (the Runner's default) the overlapped loop's turn
   (``Runner.overlap_round``: the host launches step n+1 before it reads step n's tokens, so the tokens a step
   returns may be those of the step launched by the call before), else a plain one; under speculation one verify
   step.

A request leaves as soon as it is done: a stop token id or a stop string (``Sequence.stopped``), its ``max_tokens``,
an abort, or a CacheFullError when a step needs a block that no request can give. Its blocks go back at once (its
committed prompt blocks stay as a cached prefix, counted free: ``num_free_blocks``).
"""

from __future__ import annotations

import collections
import dataclasses
import random

from fxglm5.errors import CacheFullError, InputError
from fxglm5.runtime.sampling import SamplingParams


@dataclasses.dataclass
class Output:
    """What one request learned in a step. ``tokens``, ``logprobs`` (where it asked: TokenLogprobs per token),
    ``text`` (with a tokenizer; held back while it could be the start of a stop string): new since its last
    Output. ``finish_reason``: None while it runs, then "stop", "length", "abort" or "error" (``error``)."""

    id: int
    tokens: list
    logprobs: list
    text: str
    finish_reason: str | None
    error: Exception | None
    sequence: object  # the runner's Sequence (prompt, output, prefix_reused, ...)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Engine:
    def __init__(self, runner, tokenizer=None, *, wait_for_room: bool = True, seed: int | None = None):
        """``runner``: a Runner (not stepped by anyone else meanwhile). ``tokenizer``: a
        ``fxglm5.model.tokenizer.Tokenizer``, for text outputs and stop strings. ``wait_for_room``: a request that
        does not fit the cache waits for others to finish (else it fails at admission). ``seed``: of the stream that
        seeds sampled requests without a seed of their own (default: random)."""
        self.runner, self.tokenizer, self.wait_for_room = runner, tokenizer, wait_for_room
        self._seeds = random.Random(seed)
        self._waiting: collections.deque = collections.deque()
        self._waves: list[list] = []
        self._live: dict[int, object] = {}  # id -> Sequence, until its finished Output is returned
        self._sent: dict[int, int] = {}  # id -> tokens returned so far
        self._flight = None  # the overlapped loop's step in flight

    # ---- requests ---------------------------------------------------------------------------------------
    def add(self, prompt, params: SamplingParams | None = None) -> int:
        """Queue a request for ``prompt`` (token ids); returns its id. InputError for a bad prompt, a stop token id
        outside the vocabulary, stop strings without a tokenizer, or a prompt that with ``max_tokens`` is longer
        than max_position_embeddings."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InputError(f"params: expected a SamplingParams, got {type(params).__name__}")
        r = self.runner
        vocab, limit = r.config.vocab_size, r.config.max_position_embeddings
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise InputError(f"stop_token_ids: {bad[0]} is not a token id in [0, {vocab}) (vocab_size)")
        if params.stop and self.tokenizer is None:
            raise InputError("stop: stop strings need the engine's tokenizer (Engine(runner, tokenizer))")
        seq = r.new_sequence(prompt, params, seed=self._seeds.getrandbits(63))
        if len(seq.prompt) + params.max_tokens > limit:
            raise InputError(f"prompt: {len(seq.prompt)} tokens + max_tokens {params.max_tokens} exceed "
                             f"max_position_embeddings ({limit})")
        if self.tokenizer is not None:
            from fxglm5.runtime.text import RequestText

            seq.text = RequestText(self.tokenizer, params.stop)
        self._waiting.append(seq)
        self._live[seq.id] = seq
        self._sent[seq.id] = 0
        return seq.id

    def request(self, request_id: int):
        """The Sequence of a request not yet returned as finished."""
        return self._live[request_id]

    def abort(self, request_id: int) -> bool:
        """End a request now (its blocks go back; its finished Output, reason "abort", comes with the next
        ``step``); False where it is unknown or already finished."""
        seq = self._live.get(request_id)
        if seq is None or seq.finish_reason is not None:
            return False
        if seq in self._waiting:
            self._waiting.remove(seq)
        else:
            self.runner.release(seq)
        seq.finish_reason = "abort"
        return True

    def has_work(self) -> bool:
        """Whether a ``step`` would do anything: requests waiting or running, a step in flight, or finished
        requests not yet returned."""
        return bool(self._live or self._flight is not None)

    @property
    def num_free_blocks(self) -> int:
        """Cache blocks no request holds (cached prefixes included: they are given up when needed)."""
        return self.runner.blocks.num_free

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self.runner.active)

    # ---- the step ---------------------------------------------------------------------------------------
    def step(self) -> list[Output]:
        """One step (module docstring); the Outputs of every request that has news, finished ones last seen."""
        r = self.runner
        self._admit()
        prefilling = [s for s in r.active if s.cached < len(s.prompt)]
        if prefilling and not self._prefill(prefilling):
            prefilling = []
        if not prefilling:
            if r.speculative is not None:
                r.verify(self._decodable())
            elif r.overlap:
                self._flight, _ = r.overlap_round(self._flight)
            else:
                r.decode_once(self._decodable())
        return self._outputs()

    def _prefill(self, prefilling: list) -> bool:
        """A step of the pending waves' prompt chunks beside the decodes; False where the decodes fill the budget."""
        r = self.runner
        decodes = [] if r.speculative is not None else self._decodable()
        room = r.max_step_tokens - len(decodes)
        if room < 1:
            return False
        if self._flight is not None:  # the decodes' last tokens are needed on the host
            self._flight = r._read(self._flight)
            decodes = self._decodable()
        decodes = r._room_for_one(decodes) if decodes else []
        chunk = r._chunks(prefilling, room)[0]
        if decodes:
            r._mixed_step(chunk, decodes)
        else:
            r._prefill_step(chunk)
        for wave in list(self._waves):  # a wave decodes once all its prompts are in the cache
            if all(s.finish_reason is not None or s.cached >= len(s.prompt) for s in wave):
                for seq in wave:
                    seq.decoding = True
                self._waves.remove(wave)
        if r.speculative is not None:
            r.verify(self._decodable())
        return True

    def _decodable(self) -> list:
        return [s for s in self.runner.active if s.decoding and len(s.output) < s.params.max_tokens]

    def _admit(self) -> None:
        r, wave = self.runner, []
        while self._waiting:
            seq = self._waiting[0]
            busy = bool(r.active) or self._flight is not None
            if self.wait_for_room and busy and self._blocks_to_finish(seq) + self._reserved() > r.blocks.num_free:
                break  # admitted, it could run the others out of room: it waits for them to give blocks back
            try:
                r.admit(seq)
            except CacheFullError as err:
                if self.wait_for_room and busy:
                    break
                seq.error, seq.finish_reason = err, "error"
            self._waiting.popleft()
            if seq.finish_reason is None:
                wave.append(seq)
        if wave:
            self._waves.append(wave)

    def _blocks_to_finish(self, seq) -> int:
        """The blocks ``seq`` holds once it has all its ``max_tokens`` (a cached prefix counted as new: an upper
        bound)."""
        return -(-(len(seq.prompt) + seq.params.max_tokens) // self.runner.blocks.block_size)

    def _reserved(self) -> int:
        """The blocks the admitted requests still need to finish."""
        tables = self.runner.blocks.tables
        return sum(max(self._blocks_to_finish(s) - len(tables.get(s.id, ())), 0) for s in self.runner.active)

    def _outputs(self) -> list[Output]:
        r, out = self.runner, []
        for seq in list(r.active):  # done by length: leaves now (never in the step in flight: none launched past it)
            if seq.output and len(seq.output) >= seq.params.max_tokens and (
                    self._flight is None or seq not in self._flight.seqs):
                seq.finish_reason = "length"
                r.release(seq)
        for rid, seq in list(self._live.items()):
            sent = self._sent[rid]
            if len(seq.output) == sent and seq.finish_reason is None:
                continue
            final = seq.finish_reason is not None
            text = seq.text.take(final) if seq.text is not None else ""
            logprobs = seq.token_logprobs[sent:] if seq.params.logprobs is not None else []
            out.append(Output(rid, seq.output[sent:], logprobs, text, seq.finish_reason, seq.error, seq))
            self._sent[rid] = len(seq.output)
            if final:
                del self._live[rid], self._sent[rid]
        return out
