"""Sampling on the device: per request temperature, top-k, top-p and a seed, the top-N log-probabilities, and the
rejection rule that keeps speculative decoding's tokens distributed as the target model's.

Greedy requests (temperature 0, or top-k 1) take ``logits.argmax(-1)``: torch's argmax, whose tie rule (the lowest
token id among equal maxima) is the one the runtime always had, so greedy decoding is exact and unchanged. A batch
with no sampled request and no log-probabilities runs that one op and nothing else.

A sampled request draws from ``softmax(logits / temperature)`` restricted to its top-k tokens and then to the
smallest set of them whose probability reaches top-p (vLLM's and SGLang's order). The draw is the exponential race
(``argmax(p / E)``, E ~ Exp(1) per token: the argmax is token i with probability p_i), made on the device with the
request's own ``torch.Generator``, seeded from its seed: one draw of V exponentials per token, whatever else is in
the batch, so a seeded request repeats its tokens in any batch and nothing is read back to the host for it.

Speculative decoding (:func:`verify_sampled`): a drafter proposes tokens d_1..d_n deterministically (the MTP
layer's argmax: a point mass q = 1 at d_i). Speculative sampling (Leviathan et al. 2023; Chen et al. 2023) accepts
d_i with probability min(1, p_i(d_i) / q(d_i)) = p_i(d_i), with p_i the target's processed distribution at row
i; at the first rejection it draws from the residual max(p_i - q, 0), which is p_i without d_i, renormalized; when
every draft is accepted the bonus token is drawn from p_{n+1}. Each emitted token then follows the target's
distribution exactly, whatever the drafts are.

Log-probabilities (``logprobs``) are those of the model's own distribution, ``log_softmax(logits)`` before
temperature, top-k and top-p (what the OpenAI API and vLLM report): the chosen token's and the top N.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from fxglm5.errors import InputError

MAX_LOGPROBS = 20  # the most top log-probabilities a request may ask for (OpenAI's chat limit)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request chooses its tokens and when it ends. ``temperature`` 0 (or ``top_k`` 1): greedy. ``top_k``
    0: every token. ``seed``: the request's own random stream (None: one drawn by the engine). ``max_tokens``: new
    tokens at most. ``stop_token_ids``: it ends after emitting one (kept as its last token). ``stop``: strings that
    end it (the text stops before them; needs the engine's tokenizer). ``logprobs``: None, or the top-N
    log-probabilities to return with each token (0: the chosen token's only)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    max_tokens: int = 16
    stop_token_ids: frozenset = frozenset()
    stop: tuple = ()
    logprobs: Optional[int] = None

    def __post_init__(self):
        def number(name, value, low, high, low_open=False):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or \
                    value < low or value > high or (low_open and value == low):
                raise InputError(f"{name}: must be a number in {'(' if low_open else '['}{low}, {high}], got {value!r}")

        def integer(name, value, low, high=None):
            if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
                raise InputError(f"{name}: must be an integer >= {low}{'' if high is None else f' and <= {high}'}, "
                                 f"got {value!r}")

        number("temperature", self.temperature, 0.0, 1e4)
        number("top_p", self.top_p, 0.0, 1.0, low_open=True)
        integer("top_k", self.top_k, 0)
        if self.seed is not None:
            integer("seed", self.seed, -(2**63), 2**63 - 1)
        integer("max_tokens", self.max_tokens, 1)
        if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
            raise InputError(f"stop_token_ids: expected a collection of token ids, got {type(self.stop_token_ids).__name__}")
        bad = [t for t in self.stop_token_ids if isinstance(t, bool) or not isinstance(t, int) or t < 0]
        if bad:
            raise InputError(f"stop_token_ids: {bad[0]!r} is not a token id")
        object.__setattr__(self, "stop_token_ids", frozenset(self.stop_token_ids))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise InputError(f"stop: expected non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        if self.logprobs is not None:
            integer("logprobs", self.logprobs, 0, MAX_LOGPROBS)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def replace(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)


GREEDY = SamplingParams(temperature=0.0)


def generator_for(params: SamplingParams, device, seed: int) -> Optional[torch.Generator]:
    """The random stream of a sampled request (None for a greedy one): seeded from ``params.seed``, else ``seed``
    (the engine's draw)."""
    if params.greedy:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed((params.seed if params.seed is not None else seed) % 2**64)
    return gen


class TokenLogprobs(NamedTuple):
    """One emitted token's log-probability and the top N (token id, log-probability) of its row, best first."""

    logprob: float
    top: list


class Sampled(NamedTuple):
    """A step's chosen tokens [B] on the device and, where a request asked, the log-probabilities of its row."""

    tokens: Tensor
    logprobs: Optional[Tensor] = None  # float32 [B]: the chosen token's
    top_ids: Optional[Tensor] = None  # int64 [B, N]
    top_logprobs: Optional[Tensor] = None  # float32 [B, N]

    def host(self) -> list:
        """The tensors to bring to the host (tokens first)."""
        return [t for t in self if t is not None]


def unpack(host: list, params: list[SamplingParams]) -> tuple[list[int], list[Optional[TokenLogprobs]]]:
    """The host copies of :meth:`Sampled.host` as (tokens, per row its TokenLogprobs or None)."""
    tokens = host[0].tolist()
    if len(host) == 1:
        return tokens, [None] * len(tokens)
    chosen, top_ids, top_lp = (t.tolist() for t in host[1:])
    out = []
    for i, p in enumerate(params):
        out.append(None if p.logprobs is None else
                   TokenLogprobs(chosen[i], list(zip(top_ids[i][:p.logprobs], top_lp[i][:p.logprobs]))))
    return tokens, out


def _column(values: list, device, dtype=torch.float32) -> Tensor:
    """Per-row values on ``device`` without waiting for it: through pinned memory, non-blocking, on a GPU (a
    pageable copy would wait for the step in flight and undo the overlapped loop)."""
    t = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def probabilities(logits: Tensor, params: list[SamplingParams]) -> Tensor:
    """float32 [n, V]: each row's distribution after its temperature, top-k and top-p (rows of sampled requests)."""
    device, V = logits.device, logits.shape[-1]
    x = logits.float() / _column([p.temperature for p in params], device)[:, None]
    if any(0 < p.top_k < V or p.top_p < 1 for p in params):  # decided on the host: no read of the device
        k = _column([p.top_k if 0 < p.top_k < V else V for p in params], device, torch.int64)
        ordered, order = x.sort(-1, descending=True)
        keep = torch.arange(V, device=device)[None] < k[:, None]
        probs = ordered.masked_fill(~keep, -math.inf).softmax(-1)
        # the smallest prefix whose mass reaches top_p
        keep &= probs.cumsum(-1) - probs < _column([p.top_p for p in params], device)[:, None]
        x = torch.full_like(x, -math.inf).scatter(1, order, ordered.masked_fill(~keep, -math.inf))
    return x.softmax(-1)


def race(probs: Tensor, generators: list[torch.Generator]) -> Tensor:
    """One token per row drawn from ``probs`` [n, V] by the exponential race, each row with its own generator."""
    noise = torch.stack([torch.empty(probs.shape[-1], device=probs.device).exponential_(generator=g)
                         for g in generators])
    return (probs / noise.clamp_min_(torch.finfo(torch.float32).tiny)).argmax(-1)


def sample(logits: Tensor, params: list[SamplingParams], generators: list) -> Sampled:
    """The tokens of a step's logits rows [B, V], row b by ``params[b]`` (its generator ``generators[b]``)."""
    tokens = logits.argmax(-1)  # greedy rows, and the whole step where no request samples
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        index = _column(rows, logits.device, torch.int64)
        chosen = race(probabilities(logits[index], [params[i] for i in rows]), [generators[i] for i in rows])
        tokens = tokens.index_copy(0, index, chosen)
    return with_logprobs(tokens, logits, params)


def with_logprobs(tokens: Tensor, logits: Tensor, params: list[SamplingParams]) -> Sampled:
    """``tokens`` [B] with, where a request asked for them, the log-probabilities of its row of ``logits``."""
    wanted = [p.logprobs for p in params if p.logprobs is not None]
    if not wanted:
        return Sampled(tokens)
    lp = logits.float().log_softmax(-1)
    top = lp.topk(max(max(wanted), 1), dim=-1)
    return Sampled(tokens, lp.gather(1, tokens[:, None])[:, 0], top.indices, top.values)


def verify_sampled(logits: Tensor, drafts: list[int], params: SamplingParams, gen: torch.Generator) -> Tensor:
    """Speculative sampling of one request's verify rows ``logits`` [n+1, V] for its drafts d_1..d_n (module
    docstring): int64 [2] on the device, (accepted drafts a, the token emitted after them). Draws n uniforms, then
    V exponentials, from ``gen``; nothing is read to the host."""
    n = len(drafts)
    probs = probabilities(logits, [params] * (n + 1))
    d = _column(drafts + [0], logits.device, torch.int64)
    u = torch.rand(n, device=logits.device, generator=gen)
    accept = u < probs[torch.arange(n, device=logits.device), d[:n]]
    a = accept.long().cumprod(0).sum() if n else torch.zeros((), dtype=torch.long, device=logits.device)
    row = probs[a].clone()
    rejected = (a < n).to(row.dtype)
    row.scatter_(0, d[a].view(1), row.gather(0, d[a].view(1)) * (1 - rejected))  # the residual: p without d_a
    token = race((row / row.sum())[None], [gen])[0]
    return torch.stack([a, token])
