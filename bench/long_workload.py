"""A long mixed workload through the Runner at GLM-5's widths (issue 37, item 6, the GPU run): throughput, and
nothing lost.

The model is bench/decode_step.py's (bf16, GLM-5's widths, 1 dense + 1 MoE layer, random FP8 weights) with its MTP
layer; Triton kernels, decode CUDA graphs, bf16 caches. The workload (tests/long_workload.py) has prompts of 1 to
``--short`` tokens, every 10th one past index_topk (2048), a third behind three shared 256-token prefixes, a cache
too small for a wave (requests wait and resume; cached prefixes are evicted), chunked prefill, stop tokens met
mid-batch (the plain run's), and the same workload with MTP speculative decoding (k = 2, no stop tokens).

Checked on every run, and the result file says so (``ok``):
- every block comes back, and no block ever serves two requests unless it is a committed prefix block;
- each committed block's latent and index rows equal (to bf16 rounding) those a fresh runner writes for its prefix;
- every token, against the eager model run over the request's prompt and the runtime's own tokens (one forward a
  request): the runtime's logits row agrees with the eager row (relative error ``--max-rel-err``), and the chosen
  token is the eager argmax or within that row's disagreement of it (a near tie at bf16, counted). bf16 kernels
  round a row by its batch, so exact token equality with a recompute is the float32 CPU test's job
  (tests/runtime/test_long_workload.py).

Tokens per second count the time inside ``Runner.run`` (prefill and decode), not the checks.

    python bench/long_workload.py [--tiny] [--mode plain|mtp|both] [--requests N] [--wave N] [--short N] [--blocks N]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.decode_step import random_model, two_layer_config  # noqa: E402
from bench.harness import save_run  # noqa: E402
from fxglm5.runtime.runner import Runner  # noqa: E402
from fxglm5.runtime.speculative import SpeculativeConfig  # noqa: E402
from tests.long_workload import (Workload, all_blocks_back, checked_blocks,  # noqa: E402
                                 committed_rows_match_their_prefix, serve)


class TokenCheck:
    """Each wave's tokens against the eager model run over the request's prompt and the runtime's own tokens.

    A token fails when it is not the eager argmax and lies further below it than twice the largest difference
    between the runtime's and the eager logits row (then no rounding explains the choice). A row whose relative
    difference passes ``max_rel_err`` is counted: where a context is past index_topk, bf16 rounding of the index
    scores can swap which keys a query attends to, so a few rows differ by more than rounding; more than 1 % of
    them fails the run."""

    def __init__(self, model, max_rel_err: float):
        self.model, self.max_rel_err = model, max_rel_err
        self.argmax = self.near_ties = self.waves = 0
        self.seconds = 0.0
        self.rel_errs: list[float] = []
        self.failures: list[str] = []

    @torch.no_grad()
    def __call__(self, prompts, seqs) -> None:
        start = time.perf_counter()
        self.each(prompts, seqs)
        self.seconds += time.perf_counter() - start
        self.waves += 1
        progress(f"wave {self.waves}: {len(self.rel_errs)} tokens checked, {self.seconds:.1f} s in the checks")

    def each(self, prompts, seqs) -> None:
        for prompt, seq in zip(prompts, seqs):
            if not seq.output:
                continue
            ids = torch.tensor([prompt + seq.output[:-1]], device=seq.logits[0].device)
            eager = self.model(ids)[0, len(prompt) - 1:].float()
            for j, (token, row) in enumerate(zip(seq.output, seq.logits)):
                self.check(f"request {seq.id} token {j}", token, row.float(), eager[j])
            seq.logits.clear()

    def check(self, where: str, token: int, row: torch.Tensor, eager: torch.Tensor) -> None:
        gap = (row - eager).abs().max().item()
        self.rel_errs.append(((row - eager).norm() / eager.norm()).item())
        best = eager.max().item()
        if int(eager.argmax()) == token:
            self.argmax += 1
        elif eager[token].item() >= best - 2 * gap:
            self.near_ties += 1
        else:
            self.failures.append(f"{where}: token {token} is {best - eager[token].item():.4f} below the eager "
                                 f"argmax, more than twice the row's difference {gap:.4f}")

    def summary(self) -> dict:
        errs = torch.tensor(self.rel_errs or [0.0])
        over = int((errs > self.max_rel_err).sum())
        failures = list(self.failures)
        if over > 0.01 * len(self.rel_errs):
            failures.append(f"{over} of {len(self.rel_errs)} logits rows differ from the eager model by more than "
                            f"{self.max_rel_err} (relative)")
        return dict(tokens_checked=len(self.rel_errs), eager_argmax=self.argmax, near_ties=self.near_ties,
                    rel_err_p50=round(errs.quantile(0.5).item(), 5), rel_err_p99=round(errs.quantile(0.99).item(), 5),
                    rel_err_max=round(errs.max().item(), 5), rows_over_max_rel_err=over, failures=failures[:20],
                    failure_count=len(failures))


_START = time.perf_counter()


def progress(message: str) -> None:
    """A timestamped line (seconds since the script started), so a run cut off by its time limit says where it was."""
    print(f"[{time.perf_counter() - _START:7.1f} s] {message}", flush=True)


def stop_tokens(runner, requests, wave: int, count: int = 4) -> frozenset:
    """The tokens most often generated before a request's last, in an untimed first wave (which also pays the
    compiles and autotuning the timed runs would otherwise meet): stop tokens met mid-batch."""
    seqs = runner.run([p for p, _ in requests[:wave]], max(n for _, n in requests[:wave]))
    seen = collections.Counter(t for s in seqs for t in s.output[:-1])
    for s in seqs:
        s.logits.clear()
    return frozenset(t for t, _ in seen.most_common(count))


def run_one(model, requests, a, dev, *, speculative: bool, stop: frozenset | None) -> tuple[dict, frozenset]:
    kw = dict(block_size=a.block, dtype=model.dtype, device=dev, kv_cache="bf16", index_cache="bf16",
              backend=None if dev == "cuda" else "reference")
    t0 = time.time()
    runner = Runner(model, num_blocks=a.blocks, max_step_tokens=a.step_tokens, keep_logits=True,
                    speculative=SpeculativeConfig("mtp", 2) if speculative else None, **kw)
    compile_s = time.time() - t0
    progress(f"{'mtp' if speculative else 'plain'}: runner built in {compile_s:.1f} s")
    seen = stop_tokens(runner, requests, a.wave)
    progress("warm-up wave done")  # every run's untimed warm-up wave; the plain run's stop tokens
    stop = seen if stop is None else stop
    checks = checked_blocks(runner)
    tokens = TokenCheck(model, a.max_rel_err)
    served = serve(runner, requests, frozenset() if speculative else stop, a.wave, on_wave=tokens)
    failures = []
    if sorted(served.tokens) != list(range(len(requests))):
        failures.append("not every request finished")
    try:
        all_blocks_back(runner, a.blocks)
    except AssertionError as e:
        failures.append(str(e))

    def fresh(num_blocks):
        return Runner(model, num_blocks=num_blocks, program=runner.program, decode_graphs=False, **kw)

    progress(f"served {len(served.tokens)} requests, {served.seconds:.1f} s in Runner.run")
    try:
        compared = committed_rows_match_their_prefix(runner, fresh, requests, a.block, rtol=2e-2, atol=2e-2,
                                                     limit=a.compare_blocks)
    except AssertionError as e:
        compared, failures = 0, failures + [str(e)[:500]]
    progress(f"{compared} committed blocks compared")
    summary = dict(tokens.summary(), check_seconds=round(tokens.seconds, 1))
    stopped = sum(1 for i, (_, n) in enumerate(requests) if len(served.tokens.get(i, ())) < n)
    result = dict(mode="mtp k=2" if speculative else "plain", compile_s=round(compile_s, 1),
                  run_seconds=round(served.seconds, 2), tokens=served.generated,
                  tokens_per_s=round(served.generated / served.seconds, 1), waits=served.waits,
                  stopped_early=stopped, block_checks=len(checks), committed_blocks_compared=compared,
                  acceptance=str(runner.acceptance) if speculative else None, **summary,
                  other_failures=failures)
    result["ok"] = not failures and not summary["failure_count"] and compared > 0 and served.waits > 0
    print(result, flush=True)
    del runner
    if dev == "cuda":
        torch.cuda.empty_cache()
    return result, stop


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="the tiny preset on the CPU (a check that the script runs)")
    p.add_argument("--requests", type=int)
    p.add_argument("--wave", type=int)
    p.add_argument("--short", type=int)
    p.add_argument("--blocks", type=int, help="cache blocks (too few for a wave, so requests wait)")
    p.add_argument("--block", type=int)
    p.add_argument("--step-tokens", type=int, help="chunked prefill: the most tokens a step")
    p.add_argument("--compare-blocks", type=int, default=64, help="committed blocks compared with a fresh runner")
    p.add_argument("--max-rel-err", type=float, default=0.05)
    p.add_argument("--mode", choices=("plain", "mtp", "both"), default="both",
                   help="plain decoding, MTP speculative decoding (k = 2), or both (mtp uses the plain run's warm-up)")
    a = p.parse_args()
    dev = "cpu" if a.tiny else "cuda"
    a.block = a.block or (4 if a.tiny else 64)
    a.blocks = a.blocks or (48 if a.tiny else 600)
    a.step_tokens = a.step_tokens or (24 if a.tiny else 2048)
    a.wave = a.wave or (12 if a.tiny else 64)
    cfg = two_layer_config(a.tiny, mtp=True)
    topk = cfg.index_topk
    workload = Workload(requests=a.requests or (24 if a.tiny else 1200), wave=a.wave,
                        short=a.short or (40 if a.tiny else 512), prefix=3 * a.block if a.tiny else 4 * a.block,
                        max_new=8 if a.tiny else 16, long=(topk + 1, topk + 3 * a.block), long_every=10)
    model = random_model(cfg, dev, mtp=True)
    progress("model built")
    requests = workload.draw(cfg.vocab_size)
    runs, stop = [], None
    if a.mode in ("plain", "both"):
        plain, stop = run_one(model, requests, a, dev, speculative=False, stop=None)
        runs.append(plain)
    if a.mode in ("mtp", "both"):
        runs.append(run_one(model, requests, a, dev, speculative=True, stop=stop or frozenset())[0])
    path = save_run(f"long_workload_{a.mode}{'_tiny' if a.tiny else ''}.json",
                    layers="tiny" if a.tiny else "1 dense + 1 MoE + MTP (GLM-5 widths), bf16, bf16 caches",
                    workload=dict(vars(workload), long=list(workload.long)), blocks=a.blocks, block=a.block,
                    step_tokens=a.step_tokens, stop_tokens=sorted(stop or ()), runs=runs,
                    ok=all(r["ok"] for r in runs))
    print("saved", path)
    sys.exit(0 if all(r["ok"] for r in runs) else 1)


if __name__ == "__main__":
    main()
