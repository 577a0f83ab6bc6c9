"""The OpenAI API's requests and responses, as ``fxglm5 serve`` speaks them.

:func:`parse_request` checks a /v1/completions or /v1/chat/completions body field by field and turns it into
prompts (token ids: the prompt encoded, or the messages rendered with the checkpoint's chat template) and one
:class:`~fxglm5.runtime.sampling.SamplingParams`. Every refusal is an :class:`ApiError` whose body is the OpenAI
error object (``{"error": {"message", "type", "param", "code"}}``), with the field in ``param``: an unknown model,
a malformed field, a ``max_tokens`` that is not a positive integer or does not fit the context or the cache, an
unsupported parameter (``n`` > 1, penalties, ``logit_bias``, tools, ...) or an unknown one are 400s; a full
queue is a 429 (raised by the server).

Sampling fields: ``temperature`` (default 1), ``top_p``, ``seed``, ``stop`` (up to 4 strings), ``max_tokens``
(completions: default 16; chat: ``max_completion_tokens`` too, default the rest of the context), ``logprobs``
(completions: the top N; chat: ``logprobs`` + ``top_logprobs``), and as extras (the client's ``extra_body``)
``top_k`` (vLLM's; 0 or -1: off) and ``return_token_ids`` (each choice carries its generated ``token_ids``). A
request always stops at the checkpoint's end-of-sequence ids.
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid

from fxglm5.errors import Fxglm5Error
from fxglm5.runtime.sampling import MAX_LOGPROBS, SamplingParams

MAX_STOPS = 4  # the OpenAI API's limit on stop strings
COMMON = {"model", "stream", "stream_options", "temperature", "top_p", "top_k", "seed", "stop", "max_tokens",
          "logprobs", "return_token_ids", "user", "n", "frequency_penalty", "presence_penalty", "logit_bias"}
FIELDS = {
    "completions": COMMON | {"prompt", "best_of", "echo", "suffix"},
    "chat": COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                      "parallel_tool_calls", "response_format"},
}
# accepted only at the value that asks for nothing: anything else is a feature fxglm5 does not have
NEUTRAL = {"n": (None, 1), "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
           "frequency_penalty": (None, 0), "presence_penalty": (None, 0), "logit_bias": (None, {}),
           "tools": (None, []), "tool_choice": (None, "none"), "parallel_tool_calls": (None, True, False),
           "response_format": (None, {"type": "text"})}


class ApiError(Fxglm5Error):
    """A request refused with ``status`` and the OpenAI error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


@dataclasses.dataclass
class Parsed:
    kind: str  # "completions" or "chat"
    prompts: list  # token ids per choice
    params: SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool
    top_logprobs: int | None  # chat: how many alternatives per token (None: no logprobs)


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What the server serves: its name, the context, the cache's capacity in tokens, the tokenizer (None for an
    artifact: token ids in, ids out) and the end-of-sequence ids every request stops at."""

    name: str
    context: int
    capacity: int
    vocab_size: int
    tokenizer: object
    eos_ids: frozenset


def _number(body, name, default, low, high, low_open=False):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < low \
            or value > high or (low_open and value == low):
        raise ApiError(f"{name}: must be a number in {'(' if low_open else '['}{low}, {high}], got {value!r}", name)
    return value


def _integer(body, name, default, low, high=None):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        span = f">= {low}" + ("" if high is None else f" and <= {high}")
        raise ApiError(f"{name}: must be an integer {span}, got {value!r}", name)
    return value


def _flag(body, name, default=False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(f"{name}: must be true or false, got {value!r}", name)
    return value


def _check_fields(body: dict, kind: str) -> None:
    for name in body:
        if name not in FIELDS[kind]:
            raise ApiError(f"Unrecognized request argument supplied: {name}", name)
    for name, neutral in NEUTRAL.items():
        if name in body and body[name] not in neutral:
            raise ApiError(f"{name}: {body[name]!r} is not supported by fxglm5 (only {neutral[-1]!r})", name,
                           code="unsupported_parameter")


def _ids(value, info: ModelInfo, field: str) -> list[int]:
    if not value or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < info.vocab_size for t in value):
        raise ApiError(f"{field}: token ids must be integers in [0, {info.vocab_size})", field)
    return list(value)


def _encode(text: str, info: ModelInfo, field: str) -> list[int]:
    if info.tokenizer is None:
        raise ApiError(f"{field}: this model has no tokenizer (an artifact); give token ids", field)
    if not text:
        raise ApiError(f"{field}: empty", field)
    return info.tokenizer.encode(text)


def _prompts(body: dict, info: ModelInfo) -> list[list[int]]:
    """The completions ``prompt``: a string, token ids, or a list of either (one choice each)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [_encode(prompt, info, "prompt")]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [_ids(prompt, info, "prompt")]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return [_encode(p, info, "prompt") if isinstance(p, str) else _ids(p, info, "prompt") for p in prompt]
    raise ApiError("prompt: expected a string, a list of token ids, or a list of either", "prompt")


def _messages(body: dict, info: ModelInfo) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages: expected a non-empty list of {role, content} objects", "messages")
    rendered = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
            raise ApiError(f"messages[{i}]: expected an object with a role of system, developer, user or assistant",
                           "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text
            if any(not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str)
                   for p in content):
                raise ApiError(f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError(f"messages[{i}].content: expected a string", "messages")
        rendered.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    if info.tokenizer is None or not info.tokenizer.chat_template:
        raise ApiError("messages: this model has no chat template; use /v1/completions", "messages")
    return info.tokenizer.encode(info.tokenizer.render_chat(rendered))


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or any(not isinstance(s, str) or not s for s in stops):
        raise ApiError(f"stop: expected a non-empty string or a list of up to {MAX_STOPS} of them", "stop")
    return tuple(stops)


def parse_request(body, kind: str, info: ModelInfo) -> Parsed:
    """A checked request (module docstring); ApiError naming the field otherwise."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    _check_fields(body, kind)
    if body.get("model") != info.name:
        raise ApiError(f"The model `{body.get('model')}` does not exist (this server serves `{info.name}`)", "model",
                       code="model_not_found")
    prompts = _prompts(body, info) if kind == "completions" else [_messages(body, info)]
    longest = max(map(len, prompts))
    if longest >= info.context:
        field = "prompt" if kind == "completions" else "messages"
        raise ApiError(f"This model's maximum context length is {info.context} tokens; the {field} has {longest}",
                       field, code="context_length_exceeded")
    name = "max_completion_tokens" if kind == "chat" and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(body, name, 16 if kind == "completions" else None, 1)
    if max_tokens is None:
        max_tokens = min(info.context, info.capacity) - longest
    if longest + max_tokens > info.context:
        raise ApiError(f"This model's maximum context length is {info.context} tokens; {longest} in the prompt + "
                       f"{name} {max_tokens} exceed it", name, code="context_length_exceeded")
    if longest + max_tokens > info.capacity:
        raise ApiError(f"{longest} prompt tokens + {name} {max_tokens} exceed the server's KV cache "
                       f"({info.capacity} tokens)", name, code="context_length_exceeded")
    if kind == "chat":
        top_logprobs = _integer(body, "top_logprobs", None, 0, MAX_LOGPROBS)
        wants = _flag(body, "logprobs")
        if top_logprobs is not None and not wants:
            raise ApiError("top_logprobs: needs logprobs: true", "top_logprobs")
        logprobs = (top_logprobs or 0) if wants else None
    else:
        top_logprobs, logprobs = None, _integer(body, "logprobs", None, 0, MAX_LOGPROBS)
    top_k = _integer(body, "top_k", 0, -1)
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict) or
                                set(options) - {"include_usage"} or not isinstance(options.get("include_usage", False), bool)):
        raise ApiError("stream_options: only {\"include_usage\": true|false}, with stream: true", "stream_options")
    params = SamplingParams(temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                            top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True), top_k=max(top_k, 0),
                            seed=_integer(body, "seed", None, -(2**63), 2**63 - 1), max_tokens=max_tokens,
                            stop_token_ids=info.eos_ids, stop=_stop(body), logprobs=logprobs)
    return Parsed(kind, prompts, params, stream, bool((options or {}).get("include_usage")),
                  _flag(body, "return_token_ids"), logprobs if kind == "chat" else None)


# ---- responses ----------------------------------------------------------------------------------------
def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


def envelope(kind: str, rid: str, model: str, stream: bool) -> dict:
    obj = {"chat": "chat.completion", "completions": "text_completion"}[kind]
    return {"id": rid, "object": obj + (".chunk" if stream and kind == "chat" else ""), "created": int(time.time()),
            "model": model}


def token_text(tokenizer, token: int) -> str:
    return str(token) if tokenizer is None else tokenizer.decode([token])


def completion_logprobs(tokenizer, tokens: list[int], logprobs: list, offset: int, text: str) -> dict:
    """The completions API's logprobs object for ``tokens`` (their TokenLogprobs), offsets from ``offset``."""
    pieces = [token_text(tokenizer, t) for t in tokens]
    offsets, at = [], offset
    for piece in pieces:
        offsets.append(at)
        at += len(piece)
    return {"tokens": pieces, "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{token_text(tokenizer, t): v for t, v in lp.top} for lp in logprobs],
            "text_offset": offsets}


def chat_logprobs(tokenizer, tokens: list[int], logprobs: list) -> dict:
    def entry(token, value):
        piece = token_text(tokenizer, token)
        return {"token": piece, "logprob": value, "bytes": list(piece.encode())}

    return {"content": [dict(entry(t, lp.logprob), top_logprobs=[entry(i, v) for i, v in lp.top])
                        for t, lp in zip(tokens, logprobs)]}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
