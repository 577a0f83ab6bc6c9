"""A long mixed workload through the Runner at GLM-5's widths (issue 37, item 6, the GPU run): throughput, and
nothing lost.

The model is bench/decode_step.py's (bf16, GLM-5's widths, 1 dense + 1 MoE layer, random FP8 weights) with its MTP
layer; Triton kernels, decode CUDA graphs, bf16 caches. The workload (tests/long_workload.py) has prompts of 1 to
``--short`` tokens, every 10th one past index_topk (2048), a third behind three shared 256-token prefixes, a cache
too small for a wave (requests wait and resume; cached prefixes are evicted), chunked prefill, stop tokens met
mid-batch (the plain run's), and the same workload with MTP speculative decoding (k = 2, no stop tokens).

Checked on every run, and the result file says so (``ok``):
- every block comes back, and no block ever serves two requests unless it is a committed prefix block;
- each committed block's latent and index rows are those a fresh runner writes for its prefix, each row within 2 %
  of it (relative: bf16 and FP8 rounding by batch; a wrong or stale row is 100 % away);
- every token, against the eager model in float32 run over the request's prompt and the runtime's own tokens (one
  forward a request, ``TokenCheck``): the chosen token is the float32 argmax or within the row's disagreement of it
  (a near tie, counted), and the runtime's logits are no further from float32 than ``--max-ratio`` times the bf16
  eager model's. bf16 kernels round a row by its batch, so exact token equality with a recompute is the float32
  CPU test's job (tests/runtime/test_long_workload.py).

Tokens per second count the time inside ``Runner.run`` (prefill and decode), not the checks.

    python bench/long_workload.py [--tiny] [--mode plain|mtp|both] [--requests N] [--wave N] [--short N] [--blocks N]
"""

from __future__ import annotations

import argparse
import collections
import copy
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.decode_step import random_model, two_layer_config  # noqa: E402
from bench.harness import save_run  # noqa: E402
from fxglm5.runtime.options import RunnerOptions  # noqa: E402
from fxglm5.serve.build import build_runner  # noqa: E402
from fxglm5.runtime.speculative import SpeculativeConfig  # noqa: E402
from tests.long_workload import (Workload, all_blocks_back, checked_blocks,  # noqa: E402
                                 committed_rows_match_their_prefix, serve)


class TokenCheck:
    """Each wave's tokens against the eager model in float32 (``exact``: the reference math at full precision, the
    FP8 weights shared), run over the request's prompt and the runtime's own tokens, beside the same eager model in
    the runtime's bf16 (``model``), whose own distance from float32 is the yardstick.

    Why float32 and not the bf16 eager model alone: at GLM-5's widths bf16 rounding that differs by batch and kernel
    moves an activation across an FP8 rounding step now and then, and a near tie in the router's top-8 or the
    indexer's top-k then picks another expert or key; two bf16 computations of the same math differ by that much
    even when both are right (issue 49's first GPU run: 12 % of the rows more than 5 % apart). Against float32 both
    carry that error, so a runtime that is as close to the math as the bf16 eager model passes and one with a real
    fault (a wrong row, a wrong key, a stale block) does not.

    The bf16 eager model runs on every ``yardstick_every``-th request only (its distances are a sample of the same
    rows; the float32 check of the runtime covers every token), which keeps the checks inside one device call.

    A token fails when it is not the float32 argmax and lies further below it than twice the largest difference
    between the runtime's row and the float32 row (then no rounding explains the choice). The rows fail the run when
    the runtime's relative distance from float32 exceeds ``max_ratio`` times the bf16 eager model's at the median or
    the 99th percentile."""

    def __init__(self, model, exact, max_ratio: float, yardstick_every: int = 4):
        self.model, self.exact, self.max_ratio, self.yardstick_every = model, exact, max_ratio, yardstick_every
        self.argmax = self.near_ties = self.eager_argmax = self.waves = self.requests = 0
        self.seconds = 0.0
        self.errs: list[float] = []  # the runtime's row against float32, relative
        self.eager_errs: list[float] = []  # the bf16 eager row against float32, relative
        self.failures: list[str] = []

    @torch.no_grad()
    def __call__(self, prompts, seqs) -> None:
        start = time.perf_counter()
        self.each(prompts, seqs)
        self.seconds += time.perf_counter() - start
        self.waves += 1
        progress(f"wave {self.waves}: {len(self.errs)} tokens checked, {self.seconds:.1f} s in the checks")

    def each(self, prompts, seqs) -> None:
        for prompt, seq in zip(prompts, seqs):
            if not seq.output:
                continue
            ids = torch.tensor([prompt + seq.output[:-1]], device=seq.logits[0].device)
            exact = self.exact(ids)[0, len(prompt) - 1:].float()
            sampled = self.requests % self.yardstick_every == 0
            self.requests += 1
            eager = self.model(ids)[0, len(prompt) - 1:].float() if sampled else [None] * len(exact)
            for j, (token, row) in enumerate(zip(seq.output, seq.logits)):
                self.check(f"request {seq.id} token {j}", token, row.float(), eager[j], exact[j])
            seq.logits.clear()

    def check(self, where: str, token: int, row: torch.Tensor, eager: torch.Tensor | None, exact: torch.Tensor) -> None:
        norm = exact.norm()
        self.errs.append(((row - exact).norm() / norm).item())
        if eager is not None:
            self.eager_errs.append(((eager - exact).norm() / norm).item())
            self.eager_argmax += int(eager.argmax()) == int(exact.argmax())
        gap = (row - exact).abs().max().item()
        best = exact.max().item()
        if int(exact.argmax()) == token:
            self.argmax += 1
        elif exact[token].item() >= best - 2 * gap:
            self.near_ties += 1
        else:
            self.failures.append(f"{where}: token {token} is {best - exact[token].item():.4f} below the float32 "
                                 f"argmax, more than twice the row's difference {gap:.4f}")

    def summary(self) -> dict:
        errs, eager = torch.tensor(self.errs or [0.0]), torch.tensor(self.eager_errs or [0.0])
        failures = list(self.failures)
        stats = {}
        for q, label in ((0.5, "p50"), (0.99, "p99")):
            ours, theirs = errs.quantile(q).item(), eager.quantile(q).item()
            ratio = ours / theirs if theirs > 0 else (1.0 if ours == 0 else math.inf)
            stats.update({f"rel_err_{label}": round(ours, 5), f"eager_bf16_rel_err_{label}": round(theirs, 5),
                          f"ratio_{label}": round(ratio, 3)})
            if ratio > self.max_ratio:
                failures.append(f"the runtime's logits are {ratio:.2f}x as far from float32 as the bf16 eager "
                                f"model's at the {label} ({ours:.4f} against {theirs:.4f})")
        return dict(tokens_checked=len(self.errs), float32_argmax=self.argmax, near_ties=self.near_ties,
                    eager_bf16_tokens=len(self.eager_errs), eager_bf16_float32_argmax=self.eager_argmax, **stats,
                    rel_err_max=round(errs.max().item(), 5), eager_bf16_rel_err_max=round(eager.max().item(), 5),
                    rows_over_5pct=int((errs > 0.05).sum()), eager_bf16_rows_over_5pct=int((eager > 0.05).sum()),
                    failures=failures[:20], failure_count=len(failures))


def float32_twin(model):
    """The eager model in float32, sharing the FP8 weights, their scales and the float32 tensors with ``model``
    (only the bf16 ones are copied, as float32): the reference math at full precision, for a few GB more."""
    shared = {id(p): p for p in model.parameters() if p.dtype != torch.bfloat16}
    twin = copy.deepcopy(model, shared)
    for module in twin.modules():
        for name, p in module._parameters.items():
            if p is not None and p.dtype == torch.bfloat16:
                module._parameters[name] = torch.nn.Parameter(p.float(), requires_grad=False)
    twin.dtype = torch.float32
    return twin


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


def run_one(model, exact, requests, a, dev, *, speculative: bool, stop: frozenset | None) -> tuple[dict, frozenset]:
    options = RunnerOptions(block_size=a.block, dtype=model.dtype, device=dev, kv_cache="bf16", index_cache="bf16",
                            backend=None if dev == "cuda" else "reference")
    t0 = time.time()
    runner = build_runner(model, options.replace(num_blocks=a.blocks, max_step_tokens=a.step_tokens, keep_logits=True,
                                                 speculative=SpeculativeConfig("mtp", 2) if speculative else None))
    compile_s = time.time() - t0
    progress(f"{'mtp' if speculative else 'plain'}: runner built in {compile_s:.1f} s")
    seen = stop_tokens(runner, requests, a.wave)
    progress("warm-up wave done")  # every run's untimed warm-up wave; the plain run's stop tokens
    stop = seen if stop is None else stop
    checks = checked_blocks(runner)
    tokens = TokenCheck(model, exact, a.max_ratio)
    served = serve(runner, requests, frozenset() if speculative else stop, a.wave, on_wave=tokens)
    failures = []
    if sorted(served.tokens) != list(range(len(requests))):
        failures.append("not every request finished")
    try:
        all_blocks_back(runner, a.blocks)
    except AssertionError as e:
        failures.append(str(e))

    def fresh(num_blocks):
        return build_runner(model, options.replace(num_blocks=num_blocks, decode_graphs=False), program=runner.program)

    progress(f"served {len(served.tokens)} requests, {served.seconds:.1f} s in Runner.run")
    try:
        compared = committed_rows_match_their_prefix(runner, fresh, requests, a.block, row_rel_err=2e-2,
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
    p.add_argument("--max-ratio", type=float, default=1.5,
                   help="the most the runtime's logits may be further from float32 than the bf16 eager model's "
                        "(at the median and the 99th percentile)")
    p.add_argument("--mode", choices=("plain", "mtp", "both"), default="both",
                   help="plain decoding, MTP speculative decoding (k = 2), or both (mtp uses the plain run's warm-up)")
    a = p.parse_args()
    dev = "cpu" if a.tiny else "cuda"
    a.block = a.block or (4 if a.tiny else 64)
    a.blocks = a.blocks or (48 if a.tiny else 400)  # a wave needs up to 553 at GLM-5's widths
    a.step_tokens = a.step_tokens or (24 if a.tiny else 2048)
    a.wave = a.wave or (12 if a.tiny else 64)
    cfg = two_layer_config(a.tiny, mtp=True)
    topk = cfg.index_topk
    workload = Workload(requests=a.requests or (24 if a.tiny else 1200), wave=a.wave,
                        short=a.short or (40 if a.tiny else 512), prefix=3 * a.block if a.tiny else 4 * a.block,
                        max_new=8 if a.tiny else 16, long=(topk + 1, topk + 3 * a.block), long_every=10)
    model = random_model(cfg, dev, mtp=True)
    exact = float32_twin(model)
    progress("model built, and its float32 twin")
    requests = workload.draw(cfg.vocab_size)
    stop, ok = None, True
    for mode in ("plain", "mtp") if a.mode == "both" else (a.mode,):
        # each mode's record is saved as soon as it ends, so a run cut off in the second keeps the first's
        run, stop = run_one(model, exact, requests, a, dev, speculative=mode == "mtp",
                            stop=stop if mode == "plain" else stop or frozenset())
        path = save_run(f"long_workload_{mode}{'_tiny' if a.tiny else ''}.json",
                        layers="tiny" if a.tiny else "1 dense + 1 MoE + MTP (GLM-5 widths), bf16, bf16 caches",
                        workload=dict(vars(workload), long=list(workload.long)), blocks=a.blocks, block=a.block,
                        step_tokens=a.step_tokens, stop_tokens=sorted(stop or ()), runs=[run], ok=run["ok"])
        print("saved", path)
        ok = ok and run["ok"]
    sys.exit(0 if ok else 1)

if __name__ == "__main__":
    main()
