"""``fxglm5 serve``: an OpenAI-compatible HTTP server (FastAPI on uvicorn) over one request-level engine.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (the checkpoint's chat template), both streamed as
server-sent events with ``"stream": true`` (``data: {chunk}`` lines, then ``data: [DONE]``); ``GET /v1/models``;
``GET /health`` (the engine's free blocks and requests too). Requests are checked by
:mod:`fxglm5.serve.protocol` (400 with the OpenAI error body, naming the field) and queued on the engine thread
(:mod:`fxglm5.serve.loop`; 429 when full), which batches every request that arrived since its last step. A client
that goes away (its stream closed, or its connection dropped while it waited) aborts its requests: their blocks go
back to the cache at the next step boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket
import sys
import threading
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from fxglm5.serve import protocol
from fxglm5.serve.loop import EngineLoop
from fxglm5.serve.protocol import ApiError, ModelInfo


@dataclasses.dataclass(frozen=True)
class ServeSettings:
    """``host`` / ``port`` (0: any free port, printed once listening), ``name``: the model name clients give,
    ``max_queue``: unfinished requests at most (then 429), ``log_level``: uvicorn's."""

    host: str = "127.0.0.1"
    port: int = 8000
    name: str = "fxglm5"
    max_queue: int = 256
    log_level: str = "warning"


def model_info(engine, name: str) -> ModelInfo:
    r, tokenizer = engine.runner, engine.tokenizer
    eos = tokenizer.eos_ids if tokenizer is not None else frozenset(
        [] if r.config.eos_token_id is None else [r.config.eos_token_id])
    return ModelInfo(name, r.config.max_position_embeddings, (r.blocks.num_blocks - 1) * r.blocks.block_size,
                     r.config.vocab_size, tokenizer, frozenset(eos))


def create_app(loop: EngineLoop, info: ModelInfo) -> FastAPI:
    app = FastAPI(title="fxglm5", docs_url=None, redoc_url=None)

    def error(err: ApiError) -> JSONResponse:
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc):  # unknown routes and methods get the OpenAI error body too
        return error(ApiError(str(exc.detail), status=exc.status_code))

    @app.get("/health")
    async def health():
        if loop.error is not None:
            return error(ApiError("the engine failed; see the server's log", status=503, kind="server_error"))
        return dict(status="ok", **loop.stats())

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": info.name, "object": "model", "created": 0, "owned_by": "fxglm5",
                                            "max_model_len": info.context}]}

    async def handle(request: Request, kind: str):
        try:
            body = json.loads(await request.body())
        except ValueError as err:
            return error(ApiError(f"the request body is not valid JSON: {err}"))
        if loop.error is not None:
            return error(ApiError("the engine failed; see the server's log", status=503, kind="server_error"))
        try:
            parsed = protocol.parse_request(body, kind, info)
            keys, inbox = loop.submit(parsed.prompts, parsed.params)
        except ApiError as err:
            return error(err)
        reply = _Reply(parsed, info, protocol.new_id(kind))
        if parsed.stream:
            return StreamingResponse(_events(request, loop, keys, inbox, reply), media_type="text/event-stream")
        return await _complete(request, loop, keys, inbox, reply, error)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, "completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, "chat")

    return app


class _Reply:
    """The response to one request, choice by choice, as its Outputs come."""

    def __init__(self, parsed, info: ModelInfo, rid: str):
        self.parsed, self.info, self.rid = parsed, info, rid
        n = len(parsed.prompts)
        self.tokens, self.text = [[] for _ in range(n)], [""] * n
        self.logprobs, self.finish = [[] for _ in range(n)], [None] * n

    def add(self, index: int, out) -> dict:
        """Record ``out``; returns its choice as a stream chunk's choice."""
        offset = len(self.text[index])
        self.tokens[index] += out.tokens
        self.text[index] += out.text
        self.logprobs[index] += out.logprobs
        if out.finished:
            self.finish[index] = "length" if out.finish_reason == "length" else "stop"
        return self._choice(index, out.tokens, out.text, out.logprobs, offset, stream=True)

    def _choice(self, index, tokens, text, logprobs, offset, stream):
        chat, p = self.parsed.kind == "chat", self.parsed
        tokenizer = self.info.tokenizer
        choice = {"index": index, "logprobs": None, "finish_reason": self.finish[index]}
        if chat:
            choice["delta" if stream else "message"] = {"content": text} if stream else \
                {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if p.params.logprobs is not None:
            choice["logprobs"] = protocol.chat_logprobs(tokenizer, tokens, logprobs) if chat else \
                protocol.completion_logprobs(tokenizer, tokens, logprobs, offset, text)
        if p.return_token_ids:
            choice["token_ids"] = list(tokens)
        return choice

    def chunk(self, choices: list, usage: dict | None = None) -> str:
        body = protocol.envelope(self.parsed.kind, self.rid, self.info.name, stream=True)
        body["choices"] = choices
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    def usage(self) -> dict:
        return protocol.usage(sum(map(len, self.parsed.prompts)), sum(map(len, self.tokens)))

    def whole(self) -> dict:
        body = protocol.envelope(self.parsed.kind, self.rid, self.info.name, stream=False)
        body["choices"] = [self._choice(i, self.tokens[i], self.text[i], self.logprobs[i], 0, stream=False)
                           for i in range(len(self.tokens))]
        body["usage"] = self.usage()
        return body


def _failure(item) -> ApiError | None:
    """The error a delivered item carries: the engine refused or failed the request, or it ran out of cache."""
    if isinstance(item, Exception):
        return ApiError(str(item), status=500 if isinstance(item, RuntimeError) else 400,
                        kind="server_error" if isinstance(item, RuntimeError) else "invalid_request_error")
    if item.finish_reason == "error":
        return ApiError(f"the request ran out of KV cache while decoding: {item.error}", status=503,
                        kind="server_error", code="cache_full")
    return None


async def _next(request, inbox: asyncio.Queue):
    """The next (choice index, item) for this request, or None once its client is gone."""
    while True:
        try:
            return await asyncio.wait_for(inbox.get(), timeout=0.25)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                return None


async def _complete(request, loop: EngineLoop, keys, inbox, reply: _Reply, error):
    left = len(keys)
    try:
        while left:
            got = await _next(request, inbox)
            if got is None:
                return JSONResponse({}, status_code=499)  # nobody reads it; the finally aborts the requests
            index, item = got
            failure = _failure(item)
            if failure is not None:
                return error(failure)
            reply.add(index, item)
            left -= item.finished
        return reply.whole()
    finally:
        if left:
            loop.abort(keys)


async def _events(request, loop: EngineLoop, keys, inbox, reply: _Reply):
    left = len(keys)
    try:
        if reply.parsed.kind == "chat":
            yield reply.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None} for i in range(len(keys))])
        while left:
            got = await _next(request, inbox)
            if got is None:
                return
            index, item = got
            failure = _failure(item)
            if failure is not None:
                left -= 1
                yield f"data: {json.dumps(failure.body())}\n\n"
                break
            choice = reply.add(index, item)
            left -= item.finished
            if item.tokens or item.text or item.finished:
                yield reply.chunk([choice])
            if await request.is_disconnected():
                return
        if reply.parsed.include_usage:
            yield reply.chunk([], reply.usage())
        yield "data: [DONE]\n\n"
    finally:
        if left:
            loop.abort(keys)


def _listen(settings: ServeSettings) -> socket.socket:
    """The server's socket, bound and already listening: the URL is printed before uvicorn's loop starts (at --tp
    the engine's thread may hold the interpreter a while then), and a client that connects in between must wait in
    the backlog until uvicorn accepts, not be refused (uvicorn's own listen() on this socket changes nothing else)."""
    sock = socket.socket(socket.AF_INET6 if ":" in settings.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((settings.host, settings.port))
    sock.listen()
    return sock


def _server(engine, settings: ServeSettings, tp: int):
    import uvicorn

    loop = EngineLoop(engine, max_queue=settings.max_queue, tp=tp).start()
    app = create_app(loop, model_info(engine, settings.name))
    sock = _listen(settings)
    server = uvicorn.Server(uvicorn.Config(app, log_level=settings.log_level, timeout_graceful_shutdown=5))
    return loop, server, sock


def serve(engine, settings: ServeSettings, tp: int = 1) -> None:
    """Serve until interrupted (this thread runs uvicorn; the engine runs in its own)."""
    loop, server, sock = _server(engine, settings, tp)
    host, port = sock.getsockname()[:2]
    print(f"fxglm5 serve: {settings.name} on http://{host}:{port} (OpenAI API under /v1)", file=sys.stderr, flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        loop.stop()


@contextlib.contextmanager
def serving(engine, settings: ServeSettings):
    """Serve from a background thread while the block runs (the tests' and benches' way); yields the base URL
    and the EngineLoop."""
    loop, server, sock = _server(engine, settings, tp=1)
    thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    host, port = sock.getsockname()[:2]
    try:
        yield f"http://{host}:{port}", loop
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        loop.stop()
        sock.close()
