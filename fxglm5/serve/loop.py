"""The server's engine thread, and at ``--tp N`` the followers that step with it.

The HTTP handlers run on an asyncio event loop; the engine runs in one thread of its own (:class:`EngineLoop`), so a
step never blocks the server. A handler submits its prompts (a 429 :class:`~fxglm5.serve.protocol.ApiError` where
the engine already holds ``max_queue`` unfinished requests) and receives each step's Outputs on an asyncio queue;
an abort (a client that went away) is a command too. The thread takes every command that came since the last step,
applies them at the step boundary (so the requests that arrive together are admitted together and batched), then
runs a step; idle, it waits for the next command.

At ``--tp N`` rank 0 runs this loop and the other ranks run :func:`follow`: before each step rank 0 broadcasts the
commands it applies (``torch.distributed.broadcast_object_list`` over the "tp" group), and every rank applies the
same commands to its engine in the same order and steps, so the ranks run each step together and sample alike (a
sampled request without a seed gets one drawn on rank 0 before it is broadcast). An idle rank 0 broadcasts an
empty batch every ``HEARTBEAT`` seconds, so a waiting follower never reaches the process group's timeout; on
shutdown it broadcasts ``STOP``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import random
import threading
import traceback

from fxglm5.serve.protocol import ApiError

log = logging.getLogger(__name__)
HEARTBEAT = 1.0  # seconds between the idle leader's broadcasts
STOP = "stop"


class Commands:
    """Applies broadcast commands to an engine: ("add", key, prompt, params) and ("abort", key); keys are the
    leader's, mapped to the engine's ids (the same on every rank: the same adds in the same order)."""

    def __init__(self, engine):
        self.engine, self.ids, self.keys = engine, {}, {}

    def apply(self, commands: list) -> list:
        """Apply ``commands`` in order; returns (key, error) for each add the engine refused."""
        refused = []
        for command in commands:
            if command[0] == "add":
                _, key, prompt, params = command
                try:
                    rid = self.engine.add(prompt, params)
                except Exception as err:  # noqa: BLE001 - reported to the request's client
                    refused.append((key, err))
                    continue
                self.ids[key], self.keys[rid] = rid, key
            elif command[0] == "abort" and command[1] in self.ids:
                self.engine.abort(self.ids[command[1]])
        return refused

    def finished(self, rid: int):
        key = self.keys.pop(rid)
        del self.ids[key]
        return key


def _broadcast(commands, engine):
    """Rank 0's ``commands`` on every rank of the "tp" group."""
    import torch
    import torch.distributed as dist

    from fxglm5.parallel import resolve_group

    box = [commands]
    device = engine.runner.device
    dist.broadcast_object_list(box, src=0, group=resolve_group("tp"),
                               device=torch.device(device) if torch.device(device).type == "cuda" else None)
    return box[0]


def follow(engine) -> None:
    """A rank > 0 of ``serve --tp``: apply rank 0's commands and step, until it broadcasts STOP."""
    commands = Commands(engine)
    while True:
        batch = _broadcast(None, engine)
        if batch == STOP:
            return
        commands.apply(batch)
        if engine.has_work():
            for out in engine.step():
                if out.finished:
                    commands.finished(out.id)


class EngineLoop:
    def __init__(self, engine, *, max_queue: int = 256, tp: int = 1):
        self.engine, self.max_queue, self.tp = engine, max_queue, tp
        self.commands = Commands(engine)
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[int, tuple] = {}  # key -> (event loop, asyncio queue, choice index)
        self._keys = itertools.count()
        self._lock = threading.Lock()
        self._unfinished = 0
        self._seeds = random.Random()
        self.error: str | None = None  # set when a step failed: the server answers 503 from then on
        self._thread = threading.Thread(target=self._run, name="fxglm5-engine", daemon=True)

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._inbox.put(STOP)
        self._thread.join(timeout=30)

    def submit(self, prompts: list[list[int]], params) -> tuple[list[int], asyncio.Queue]:
        """Queue one request per prompt (one asyncio queue for them all: items are (choice index, Output) or
        (choice index, exception)); ApiError 429 when the engine holds ``max_queue`` unfinished requests."""
        with self._lock:
            if self._unfinished + len(prompts) > self.max_queue:
                raise ApiError(f"the server is busy: {self._unfinished} requests unfinished, at most {self.max_queue}",
                               status=429, code="rate_limit_exceeded", kind="rate_limit_error")
            self._unfinished += len(prompts)
        if not params.greedy and params.seed is None:  # drawn here, so that every rank samples alike
            params = params.replace(seed=self._seeds.getrandbits(63))
        loop, inbox, keys = asyncio.get_running_loop(), asyncio.Queue(), []
        for index, prompt in enumerate(prompts):
            key = next(self._keys)
            self._streams[key] = (loop, inbox, index)
            self._inbox.put(("add", key, prompt, params))
            keys.append(key)
        return keys, inbox

    def abort(self, keys: list[int]) -> None:
        for key in keys:
            if key in self._streams:
                self._inbox.put(("abort", key))

    def stats(self) -> dict:
        blocks = self.engine.runner.blocks
        return {"free_blocks": self.engine.num_free_blocks, "total_blocks": blocks.num_blocks - 1,
                "running": self.engine.num_running, "waiting": self.engine.num_waiting, "unfinished": self._unfinished}

    def _deliver(self, key: int, item, finished: bool) -> None:
        stream = self._streams.pop(key, None) if finished else self._streams.get(key)
        if finished:
            with self._lock:
                self._unfinished -= 1
        if stream is not None:
            loop, inbox, index = stream
            loop.call_soon_threadsafe(inbox.put_nowait, (index, item))

    def _take(self) -> list:
        """The commands that came since the last step; waits for one while the engine is idle."""
        batch = []
        try:
            if not self.engine.has_work():
                batch.append(self._inbox.get(timeout=HEARTBEAT))
            while True:
                batch.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        return batch

    def _run(self) -> None:
        while True:
            batch = self._take()
            stopping = STOP in batch
            batch = [c for c in batch if c != STOP]
            if self.tp > 1:
                _broadcast(STOP if stopping else batch, self.engine)
            if stopping:
                return
            for key, err in self.commands.apply(batch):
                self._deliver(key, err, finished=True)
            if not self.engine.has_work():
                continue
            try:
                outputs = self.engine.step()
            except Exception:  # noqa: BLE001 - every waiting client hears of it; the server then answers 503
                self.error = traceback.format_exc()
                log.error("fxglm5 serve: a step failed:\n%s", self.error)
                for key in list(self._streams):
                    self._deliver(key, RuntimeError("the engine failed; see the server's log"), finished=True)
                if self.tp > 1:
                    _broadcast(STOP, self.engine)
                return
            for out in outputs:
                key = self.commands.finished(out.id) if out.finished else self.commands.keys[out.id]
                self._deliver(key, out, out.finished)
