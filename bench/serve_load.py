"""Load on ``fxglm5 serve`` over loopback: requests per second, time to first token, inter-token latency and
tokens per second under a bounded number of concurrent streaming clients.

The server is the real one (FastAPI + uvicorn, fxglm5.serve.app.serving) on 127.0.0.1 and an ephemeral port, in
this process; the load comes from a second process (so client parsing does not share the server's interpreter):
``--clients`` threads, each sending streaming /v1/completions requests one after another until ``--requests`` have
been sent in all, each a prompt of ``--prompt-tokens`` random token ids and ``--max-tokens`` new tokens, greedy.
Every request is bounded (``--timeout`` seconds), and the run stops by itself. A chunk's arrival time is each of its
tokens' time: TTFT is the first token's time after the request was sent, ITL the gaps between a request's
tokens. Tokens per second: every output token over the wall time of the whole load.

    python bench/serve_load.py --tiny            # CPU smoke run: the tiny random checkpoint (a minute or two)
    python bench/serve_load.py --device cuda     # GLM-5 widths, 2 layers (1 dense + 1 MoE), random FP8 weights,
                                                 # bf16, FP8 caches, decode CUDA graphs (the GPU run)

The result is saved (bench.harness) as ``serve_load_<tiny|glm5x2>_<device>_<commit>.json`` under bench/results
(or $OUT).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.harness import git_commit, save_run  # noqa: E402


def percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    ordered = sorted(values)

    def at(q):
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "mean": statistics.fmean(ordered), "n": len(ordered)}


def one_request(url: str, body: dict, timeout: float) -> dict:
    """Send one streaming request; the arrival time of each of its tokens."""
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    sent, times, finish = time.perf_counter(), [], None
    with urllib.request.urlopen(request, timeout=timeout) as response:
        for line in response:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            now = time.perf_counter()
            choice = chunk["choices"][0]
            times += [now] * len(choice.get("token_ids", []))
            finish = choice.get("finish_reason") or finish
            if time.perf_counter() - sent > timeout:
                raise TimeoutError(f"request ran past {timeout} s")
    return {"sent": sent, "times": times, "finish": finish}


def load(url: str, model: str, args: dict) -> dict:
    """The client side (its own process): ``clients`` threads sharing ``requests`` requests."""
    rng = random.Random(0)
    bodies = [dict(model=model, prompt=[rng.randrange(8, args["vocab"]) for _ in range(args["prompt_tokens"])],
                   max_tokens=args["max_tokens"], temperature=0, stream=True, return_token_ids=True)
              for _ in range(args["requests"])]
    results, errors, lock = [], [], threading.Lock()

    def worker():
        while True:
            with lock:
                if not bodies:
                    return
                body = bodies.pop()
            try:
                result = one_request(url, body, args["timeout"])
                with lock:
                    results.append(result)
            except Exception as err:  # noqa: BLE001 - counted and reported
                with lock:
                    errors.append(f"{type(err).__name__}: {err}")

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(args["clients"])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"wall": time.perf_counter() - start, "results": results, "errors": errors}


def _client_process(url, model, args, out):
    out.put(load(url, model, args))


def build(args):
    """The engine and a label of what it serves."""
    from fxglm5.runtime.options import RunnerOptions
    from fxglm5.serve.build import build_engine

    if args.tiny:
        from fxglm5.model.tiny import make_tiny_checkpoint

        directory = make_tiny_checkpoint(os.path.join(tempfile.mkdtemp(prefix="serve-load-"), "tiny"))
        options = RunnerOptions(block_size=16, max_cache_tokens=args.cache_tokens, device=args.device)
        return build_engine(directory, options), "tiny"
    from bench.decode_step import random_model, two_layer_config
    from bench.serving import GLM5_SERVING

    model = random_model(two_layer_config(False), args.device)
    return build_engine(model, GLM5_SERVING.replace(max_cache_tokens=args.cache_tokens, device=args.device)), "glm5x2"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="the tiny random checkpoint (else GLM-5 widths, 2 layers)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--clients", type=int, default=8, help="concurrent streaming clients (default: %(default)s)")
    p.add_argument("--requests", type=int, default=32, help="requests in all (default: %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=32, help="prompt length (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=16, help="new tokens per request (default: %(default)s)")
    p.add_argument("--cache-tokens", type=int, default=8192, help="the server's KV cache (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a request may take (default: %(default)s)")
    args = p.parse_args()
    from fxglm5.serve.app import ServeSettings, serving

    built = time.perf_counter()
    engine, label = build(args)
    built = time.perf_counter() - built
    vocab = engine.runner.config.vocab_size
    settings = dict(clients=args.clients, requests=args.requests, prompt_tokens=args.prompt_tokens,
                    max_tokens=args.max_tokens, timeout=args.timeout, vocab=vocab)
    with serving(engine, ServeSettings(port=0, name=label, max_queue=max(args.requests, 1))) as (url, _):
        warm = load(url, label, dict(settings, requests=2, clients=1))  # compiles and autotunes before the timing
        if warm["errors"]:
            raise SystemExit(f"warm-up failed: {warm['errors']}")
        context = multiprocessing.get_context("spawn")
        out = context.Queue()
        client = context.Process(target=_client_process, args=(url, label, settings, out))
        client.start()
        run = out.get(timeout=args.timeout * (args.requests + 1))
        client.join(timeout=60)
    results = run["results"]
    tokens = sum(len(r["times"]) for r in results)
    ttft = [(r["times"][0] - r["sent"]) * 1e3 for r in results if r["times"]]
    itl = [(b - a) * 1e3 for r in results for a, b in zip(r["times"], r["times"][1:])]
    commit = git_commit().replace("+", "-")
    save_run(f"serve_load_{label}_{args.device}_{commit}.json", model=label, build_seconds=round(built, 2),
             settings={k: v for k, v in settings.items() if k != "vocab"}, completed=len(results),
             errors=run["errors"], wall_seconds=run["wall"], requests_per_second=len(results) / run["wall"],
             output_tokens=tokens, output_tokens_per_second=tokens / run["wall"], ttft_ms=percentiles(ttft),
             itl_ms=percentiles(itl), finish_reasons={f: sum(r["finish"] == f for r in results)
                                                     for f in {r["finish"] for r in results}})
    if run["errors"]:
        raise SystemExit(f"{len(run['errors'])} requests failed: {run['errors'][:3]}")


if __name__ == "__main__":
    main()
