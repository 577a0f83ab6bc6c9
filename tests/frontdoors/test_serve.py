"""``fxglm5 serve`` through the official ``openai`` client on 127.0.0.1 with the tiny checkpoint (issue 46, item 5):
completions and chat, streamed and not, at temperature 0 give exactly ``fxglm5 generate``'s tokens; a seeded sampled
request repeats itself; 32 concurrent streaming clients all finish, batched, each with the tokens it gets alone; a
client closed mid-stream gives its blocks back; every bad request gets its status code and OpenAI error body, and
the server serves on; a full queue is a 429; ``--tp 2`` (gloo, through the CLI) serves the tokens of one rank."""

import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from fxglm5.cli import main
from fxglm5.model.config import Glm5Config
from fxglm5.model.tokenizer import Tokenizer
from fxglm5.model.tiny import make_tiny_checkpoint
from fxglm5.runtime.options import RunnerOptions
from fxglm5.serve.app import ServeSettings, serving
from fxglm5.serve.build import build_engine

TEXT = "The capital of France is"
OPTIONS = RunnerOptions(block_size=16, max_cache_tokens=2048)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("serve") / "tiny")


@pytest.fixture(scope="module")
def program(ckpt):
    return build_engine(ckpt, OPTIONS).runner.program  # compiled once, every server's engine reuses it


@pytest.fixture(scope="module")
def server(ckpt, program):
    engine = build_engine(ckpt, OPTIONS, program=program)
    with serving(engine, ServeSettings(port=0, name="tiny", max_queue=64)) as (url, loop):
        yield url, loop, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


def generate_ids(capsys, ckpt, *flags) -> list[int]:
    assert main(["generate", "--model", str(ckpt), "--block-size", "16", "--ids", *flags]) == 0
    return [int(t) for t in capsys.readouterr().out.split()]


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    health = json.load(urllib.request.urlopen(server[0] + "/health"))
    assert health["status"] == "ok" and health["free_blocks"] == health["total_blocks"] == 2048 // 16


def test_temperature_zero_gives_generate_s_tokens(client, ckpt, capsys):
    want = generate_ids(capsys, ckpt, "--prompt", TEXT, "--max-new-tokens", "8")
    done = client.completions.create(model="tiny", prompt=TEXT, max_tokens=8, temperature=0,
                                     extra_body={"return_token_ids": True})
    choice = done.choices[0]
    assert choice.token_ids == want and done.usage.completion_tokens == len(want)
    streamed = list(client.completions.create(model="tiny", prompt=TEXT, max_tokens=8, temperature=0, stream=True,
                                              extra_body={"return_token_ids": True}))
    assert [t for c in streamed for t in c.choices[0].token_ids] == want
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    assert streamed[-1].choices[0].finish_reason == choice.finish_reason == ("length" if len(want) == 8 else "stop")


def test_stop_strings_and_the_checkpoint_eos(client, server, ckpt):
    """A stop string ends the text before it (finish_reason "stop"), streamed or not, and never shows part of it;
    every request also stops at the checkpoint's EOS ids (generation_config.json)."""
    whole = client.completions.create(model="tiny", prompt=TEXT, max_tokens=16, temperature=0).choices[0].text
    stop = whole[5:8]
    cut = whole[:whole.index(stop)]
    done = client.completions.create(model="tiny", prompt=TEXT, max_tokens=16, temperature=0, stop=[stop, "@@@@"])
    assert done.choices[0].text == cut and done.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model="tiny", prompt=TEXT, max_tokens=16, temperature=0, stop=stop,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == cut and chunks[-1].choices[0].finish_reason == "stop"
    engine, seen = server[2], []
    add = engine.add
    engine.add = lambda prompt, params: seen.append(params) or add(prompt, params)
    try:
        client.completions.create(model="tiny", prompt=TEXT, max_tokens=2)
    finally:
        del engine.add
    tokenizer = Tokenizer.from_checkpoint(ckpt, Glm5Config.from_json(ckpt / "config.json"))
    assert seen[0].stop_token_ids == tokenizer.eos_ids == {1, 4}


def test_chat_uses_the_checkpoint_template(client, ckpt, capsys):
    want = generate_ids(capsys, ckpt, "--prompt", "Hello", "--chat", "--max-new-tokens", "6")
    messages = [{"role": "user", "content": "Hello"}]
    done = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                          extra_body={"return_token_ids": True})
    assert done.choices[0].token_ids == want and done.choices[0].message.role == "assistant"
    tokenizer = Tokenizer.from_checkpoint(ckpt, Glm5Config.from_json(ckpt / "config.json"))
    assert done.usage.prompt_tokens == len(tokenizer.chat("Hello"))
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == done.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == len(want) and chunks[-1].usage.prompt_tokens == done.usage.prompt_tokens


def test_a_seeded_sampled_request_repeats_itself(client):
    def ask(seed, **extra):
        return client.completions.create(model="tiny", prompt=TEXT, max_tokens=12, temperature=1.0, seed=seed,
                                         logprobs=2, extra_body={"return_token_ids": True, **extra}).choices[0]

    first, again, other = ask(5), ask(5), ask(6)
    assert first.token_ids == again.token_ids and first.text == again.text
    assert other.token_ids != first.token_ids
    assert len(first.logprobs.token_logprobs) == len(first.token_ids)
    assert all(len(top) == 2 for top in first.logprobs.top_logprobs)
    narrow = ask(5, top_k=1)  # top_k as an extra: 1 is greedy
    assert narrow.token_ids == client.completions.create(model="tiny", prompt=TEXT, max_tokens=12, temperature=0,
                                                         extra_body={"return_token_ids": True}).choices[0].token_ids


def test_32_concurrent_streaming_clients_are_batched_and_get_their_own_tokens(client, server):
    engine = server[2]
    widest, step = [0], engine.step

    def spy():
        widest[0] = max(widest[0], len(engine.runner.active))
        return step()

    engine.step = spy
    texts = [f"{TEXT} {i} " * (1 + i % 3) for i in range(32)]

    def stream(text):
        chunks = list(client.completions.create(model="tiny", prompt=text, max_tokens=6, temperature=0, stream=True,
                                                extra_body={"return_token_ids": True}))
        assert chunks[-1].choices[0].finish_reason is not None
        return [t for c in chunks for t in c.choices[0].token_ids]

    try:
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            together = list(pool.map(stream, texts))
    finally:
        del engine.step
    assert widest[0] > 1  # requests shared steps
    alone = [stream(text) for text in texts]
    assert together == alone and all(together)


def test_a_client_closed_mid_stream_gives_its_blocks_back(client, server):
    url, loop, engine = server
    start = engine.num_free_blocks
    aborted, abort = [], engine.abort
    engine.abort = lambda rid: aborted.append(rid) or abort(rid)
    try:
        stream = client.completions.create(model="tiny", prompt=TEXT * 20, max_tokens=1000, temperature=0,
                                           stream=True)
        got = [next(iter(stream)) for _ in range(3)]
        assert engine.num_free_blocks < start and got
        stream.close()
        deadline = time.monotonic() + 20
        while loop.stats()["unfinished"] and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        del engine.abort
    assert len(aborted) == 1 and loop.stats()["unfinished"] == 0
    assert engine.num_free_blocks == start


def raw(url: str, path: str, data: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


BAD = [  # (request fields, param, code, message fragment)
    (dict(model="gpt-4"), "model", "model_not_found", "does not exist"),
    (dict(max_tokens=-1), "max_tokens", None, "integer >= 1"),
    (dict(max_tokens=10**9), "max_tokens", "context_length_exceeded", "maximum context length"),
    (dict(max_tokens=3000), "max_tokens", "context_length_exceeded", "KV cache"),
    (dict(prompt=[5] * 5000), "prompt", "context_length_exceeded", "maximum context length"),
    (dict(n=2), "n", "unsupported_parameter", "not supported"),
    (dict(presence_penalty=0.5), "presence_penalty", "unsupported_parameter", "not supported"),
    (dict(temperature=3.5), "temperature", None, "temperature"),
    (dict(prompt=[1, 99999]), "prompt", None, "token ids"),
    (dict(stop=["a", "b", "c", "d", "e"]), "stop", None, "stop"),
    (dict(frobnicate=1), "frobnicate", None, "Unrecognized request argument"),
]


@pytest.mark.parametrize("fields, param, code, fragment", BAD)
def test_bad_requests_get_400_and_the_server_serves_on(server, fields, param, code, fragment):
    url = server[0]
    body = dict(dict(model="tiny", prompt=TEXT, max_tokens=4), **fields)
    status, reply = raw(url, "/v1/completions", json.dumps(body).encode())
    assert status == 400, reply
    error = reply["error"]
    assert error["param"] == param and error["code"] == code and error["type"] == "invalid_request_error"
    assert fragment in error["message"]
    status, ok = raw(url, "/v1/completions", json.dumps(dict(model="tiny", prompt=TEXT, max_tokens=2)).encode())
    assert status == 200 and ok["choices"][0]["finish_reason"] in ("length", "stop")


def test_malformed_json_and_bad_chat_messages_through_the_client(server, client):
    status, reply = raw(server[0], "/v1/chat/completions", b'{"model": "tiny", "messages": [')
    assert status == 400 and "not valid JSON" in reply["error"]["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=[{"role": "robot", "content": "hi"}], max_tokens=2)
    assert caught.value.status_code == 400 and caught.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="nope", prompt=TEXT, max_tokens=2)
    assert caught.value.code == "model_not_found"
    assert client.completions.create(model="tiny", prompt=TEXT, max_tokens=2).choices[0].text is not None


def test_a_full_queue_is_429(ckpt, program):
    engine = build_engine(ckpt, OPTIONS, program=program)
    with serving(engine, ServeSettings(port=0, name="tiny", max_queue=1)) as (url, loop):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        stream = client.completions.create(model="tiny", prompt=TEXT, max_tokens=500, temperature=0, stream=True)
        next(iter(stream))
        with pytest.raises(openai.RateLimitError) as caught:
            client.completions.create(model="tiny", prompt=TEXT, max_tokens=2)
        assert caught.value.status_code == 429 and caught.value.code == "rate_limit_exceeded"
        stream.close()
        deadline = time.monotonic() + 20
        while loop.stats()["unfinished"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.completions.create(model="tiny", prompt=TEXT, max_tokens=2).usage.completion_tokens >= 1


def test_tp2_serves_the_tokens_of_one_rank(tmp_path):
    """``fxglm5 serve --tp 2`` (two gloo ranks started by the CLI; rank 0 serves) against ``--tp 1``, both through
    the command line, greedy completions and a seeded sampled chat."""
    ckpt = make_tiny_checkpoint(tmp_path / "tiny-tp", config=Glm5Config.preset("tiny-tp"))
    replies = []
    for tp in (1, 2):
        proc = subprocess.Popen([sys.executable, "-m", "fxglm5", "serve", "--model", str(ckpt), "--port", "0",
                                 "--tp", str(tp), "--block-size", "16", "--max-cache-tokens", "1024",
                                 "--served-model-name", "tiny-tp"],
                                stderr=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        try:
            url = _wait_for_url(proc)
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
            greedy = client.completions.create(model="tiny-tp", prompt=TEXT, max_tokens=8, temperature=0,
                                               extra_body={"return_token_ids": True}).choices[0].token_ids
            sampled = client.chat.completions.create(model="tiny-tp", messages=[{"role": "user", "content": "Hi"}],
                                                     max_tokens=8, seed=3, extra_body={"return_token_ids": True})
            replies.append((greedy, sampled.choices[0].token_ids))
        finally:
            proc.send_signal(signal.SIGINT)  # uvicorn shuts down; at tp 2 rank 0 tells rank 1 to stop
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert replies[0] == replies[1] and len(replies[0][0]) >= 1


def _wait_for_url(proc, timeout=600) -> str:
    """The URL ``fxglm5 serve --port 0`` prints once it listens (its stderr read on a thread)."""
    found, lines = [], []

    def read():
        for line in proc.stderr:
            lines.append(line)
            match = re.search(r"on (http://\S+) ", line)
            if match:
                found.append(match.group(1))

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not found and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert found, "".join(lines)[-3000:]
    return found[0]
