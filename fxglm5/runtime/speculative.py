"""Speculative decoding in the paged runtime: drafts proposed by a drafter, verified by the target in one step.

A verify step scores, for each request with C tokens cached, the tokens ``[last, d1 .. dn]`` (n <= k drafts) at
positions C .. C+n in one forward of the same paged graph as prefill and decode: it is a prefill step behind a
cached prefix (``ForwardContext`` with ``prefix_lengths = C``), so the new tokens attend causally among
themselves and to the cached rows, and the DSA indexer selects per new token over the keys up to its own
position; the graph's logits_indices input asks for the logits of all n+1 rows.

Greedy acceptance: draft d_{i+1} is accepted while it equals the target's argmax at row i; the step emits the
accepted drafts and the target's token at the first mismatch (the bonus token when all n are accepted), so the
tokens are those of plain greedy decoding whatever the drafts are.

Rollback of the rejected rows touches only bookkeeping: the request's length (its next step writes from its
accepted length on), its block table (blocks past the accepted length go back to the front of the free list,
``BlockManager.truncate``), and the prefix hashes (only accepted tokens are committed). The rows the
rejected tokens wrote stay in the caches past the request's length, where no read reaches (attention and the
indexer read a request's positions up to the query's own) until the next step overwrites them; both cache kinds
store a token's row independently of the others (the FP8 indexer's block-major layout too: a token's keys
and its scale are its own bytes), so nothing else needs restoring.

Both paths read a new token's index key the same way: ``indexer_step`` (fxglm5/lowering/reference/
paged_steps.py) writes the step's keys into the index cache first and then selects from the cache, so with an
FP8 index cache a verify step's selection and a decode step's both read the new keys quantized.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from fxglm5.errors import InputError
from fxglm5.model.generate import MAX_SPECULATIVE_TOKENS as MAX_TOKENS

METHODS = ("mtp",)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """``method``: where drafts come from ("mtp": the checkpoint's MTP layer); ``num_tokens``: drafts per step, k.
    ``accept_all``: accept every draft whatever the target's argmax (the tokens are then not greedy decoding's):
    for bench/speculative.py only, whose forced-acceptance throughput must not depend on bf16 near-ties flipping
    a verify step's greedy token away from the plain run's."""

    method: str = "mtp"
    num_tokens: int = 1
    accept_all: bool = False

    def __post_init__(self):
        if self.method not in METHODS:
            raise InputError(f"speculative.method: must be one of {METHODS}, got {self.method!r}")
        if isinstance(self.num_tokens, bool) or not isinstance(self.num_tokens, int) or \
                not 1 <= self.num_tokens <= MAX_TOKENS:
            raise InputError(f"speculative.num_tokens: must be an integer in 1..{MAX_TOKENS}, got {self.num_tokens!r}")


class Drafter(Protocol):
    """Proposes draft tokens for the runner's requests. The runner calls ``start`` after each prefill step of
    newly admitted requests with the step's ``(request, first position, tokens)`` chunks (a prompt may take
    several steps: chunked prefill; its first token is in ``output`` after the step that completes it),
    ``propose`` before each verify step, ``accepted`` after it (how many of each
    request's drafts were accepted: a drafter with a cache of its own rolls it back there) and ``release``
    when a request leaves. ``hidden``: the target's hidden states of the step's logits rows [rows, H] where
    the target graph returns them (head "logits+hidden"), else None."""

    def start(self, chunks: list, hidden) -> None: ...

    def propose(self, seqs: list, counts: list[int]) -> list[list[int]]: ...

    def accepted(self, seqs: list, counts: list[int], accepted: list[int], hidden) -> None: ...

    def release(self, seq) -> None: ...


class ScriptedDrafter:
    """Proposes the continuation given for each prompt (keyed by the prompt's tokens), past what the request has
    generated: with the target's own greedy tokens (a plain run's) every draft is accepted, the forced-acceptance
    draft of the tests and of bench/speculative.py."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]]):
        self.continuations = continuations

    def start(self, chunks, hidden) -> None:
        for seq, _, _ in chunks:
            if tuple(seq.prompt) not in self.continuations:
                raise InputError(f"ScriptedDrafter: no continuation for the prompt of request {seq.id}")

    def propose(self, seqs, counts):
        out = []
        for seq, n in zip(seqs, counts):
            script, done = self.continuations[tuple(seq.prompt)], len(seq.output)
            out.append((script[done:done + n] + [0] * n)[:n])
        return out

    def accepted(self, seqs, counts, accepted, hidden) -> None:
        pass

    def release(self, seq) -> None:
        pass


def accepted_length(drafts: list[int], targets: list[int]) -> int:
    """How many leading drafts the target's argmax tokens ``targets`` (one more than ``drafts``) confirm."""
    n = 0
    while n < len(drafts) and drafts[n] == targets[n]:
        n += 1
    return n


def check_drafts(drafts, counts: list[int], vocab: int) -> list[list[int]]:
    """A drafter's proposals as int lists, ``counts[b]`` for request b, each in the vocabulary (InputError)."""
    if not isinstance(drafts, (list, tuple)) or len(drafts) != len(counts):
        raise InputError(f"drafter: expected {len(counts)} draft lists, got {type(drafts).__name__} "
                         f"of {len(drafts) if hasattr(drafts, '__len__') else '?'}")
    out = []
    for b, (d, n) in enumerate(zip(drafts, counts)):
        d = [int(t) for t in d]
        if len(d) != n:
            raise InputError(f"drafter: request {b}: expected {n} draft tokens, got {len(d)}")
        if any(not 0 <= t < vocab for t in d):
            raise InputError(f"drafter: request {b}: a draft token is out of range [0, {vocab}) (vocab_size): {d}")
        out.append(d)
    return out


@dataclasses.dataclass
class Acceptance:
    """Verify steps of one ``Runner.run`` and the tokens they emitted (accepted drafts + one target token each)."""

    steps: int = 0
    drafted: int = 0
    emitted: int = 0

    def add(self, drafted: int, emitted: int) -> None:
        self.steps, self.drafted, self.emitted = self.steps + 1, self.drafted + drafted, self.emitted + emitted

    @property
    def mean_length(self) -> float:
        """Tokens per verify step per request (SGLang's "accept length": 1 + accepted drafts); 0 without steps."""
        return self.emitted / self.steps if self.steps else 0.0

    @property
    def rate(self) -> float:
        """Accepted drafts / proposed drafts."""
        return (self.emitted - self.steps) / self.drafted if self.drafted else 0.0


def verify_rows(logits: torch.Tensor, counts: list[int]) -> list[list[int]]:
    """The target's argmax token of each request's n+1 rows of a verify step's flat logits [T, V]."""
    flat = logits.argmax(-1).tolist()  # the step's one device -> host read
    out, start = [], 0
    for n in counts:
        out.append(flat[start:start + n + 1])
        start += n + 1
    return out
