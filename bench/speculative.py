"""Speculative decoding's costs in the paged runtime: the wall time of a (k+1)-token verify step against a 1-token
decode step at B = 1, 8, 64 (decode CUDA graphs on a GPU: both shapes replay their own bucket's graph), and
tokens per second with the forced-acceptance draft (the target's own greedy tokens: every draft accepted, the
upper bound of any drafter, without the drafter's own cost) and with every draft accepted by fiat
(``SpeculativeConfig.accept_all``) against plain decoding, all in one run.

The model is bench/decode_step.py's: bf16, GLM-5's widths, 2 layers (1 dense, 1 MoE), random FP8 weights, FP8
caches, Triton kernels; ``--tiny``: the tiny preset on the CPU (a check that the script runs, not a figure).
A verify step is timed with drafts that are always rejected, so that every step scores k+1 tokens and moves one.
Tokens per second count the decode phase only (after the prefill, which all paths share): plain decode steps,
and verify steps fed the forced-acceptance drafts, or any drafts accepted whole; ``bound_tokens_per_s`` is
B x (k+1) over the median verify step (derived from the measured step, not run). Every timed phase first runs
once untimed on the same prompts, so that the graph captures, compiles and autotunes it meets (a new width
bucket, a verify key, an eager step of uneven drafts) happen there: one inside a timed phase once made the forced
drafts' B=1 figure 7.2 tokens/s against plain decoding's 623. On random bf16 weights the top-2 logits are often a
bf16 step or two apart, so a verify step (prefill-shaped kernels) and a decode step can pick different greedy
tokens: ``plain_rerun_equal`` shows the same sensitivity without speculation (the timed plain run, behind the
cached prompt, against the untimed one whose tokens are the forced drafts), ``mean_acceptance_length`` what it
costs the forced drafts; ``accept_all`` takes that sensitivity out of the throughput (its tokens are not greedy
decoding's, and its acceptance length is k+1 except where a draft would pass the last token).

    python bench/speculative.py [--tiny] [--k K] [--ctx N] [--new N] [--batches 1,8,64]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.decode_step import random_model, two_layer_config  # noqa: E402
from bench.harness import save_run  # noqa: E402
from bench.serving import GLM5_SERVING  # noqa: E402
from fxglm5.runtime.options import RunnerOptions  # noqa: E402
from fxglm5.serve.build import build_runner  # noqa: E402
from fxglm5.runtime.speculative import ScriptedDrafter, SpeculativeConfig  # noqa: E402


class Rejected(ScriptedDrafter):
    """Drafts that differ from the target's next token: every verify step scores k+1 tokens and emits one."""

    def __init__(self, continuations, vocab: int):
        super().__init__(continuations)
        self.vocab = vocab

    def propose(self, seqs, counts):
        good = super().propose(seqs, counts)
        return [[(t + 1) % self.vocab for t in d] for d in good]


def timed(fn, sync) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def decode_phase(runner, prompts, step, sync) -> tuple[float, list, list]:
    """Run the decode phase of ``prompts`` twice, each behind an untimed prefill: once untimed (the graph captures,
    compiles and autotunes of every step shape the phase meets happen there), then timed, the same steps again;
    returns (the timed run's seconds, the untimed run's requests, the timed run's), their blocks released."""
    runs, seconds = [], 0.0
    for _ in range(2):
        seqs = runner.prefill(prompts)
        sync()
        t0 = time.perf_counter()
        step(runner)
        sync()
        seconds = time.perf_counter() - t0
        for seq in seqs:
            runner.release(seq)
        runs.append(seqs)
    return seconds, runs[0], runs[1]


def plain_steps(new):
    def run(runner):
        for _ in range(new - 1):
            runner.decode()
    return run


def verify_steps(new):
    def run(runner):
        while runner.active:
            runner.speculate(new)
    return run


def measure(model, program, prompts, k, new, dev, sync) -> dict:
    B, ctx = len(prompts), len(prompts[0])
    opts = GLM5_SERVING.replace(dtype=model.dtype, device=dev, max_cache_tokens=2 * B * (ctx + new + 2 * 64),
                                max_decode_batch=max(64, B), backend=None if dev == "cuda" else "reference")
    plain = build_runner(model, opts, program=program)
    t0 = time.perf_counter()
    warmed = plain.warm_up(max_batch=B, max_tokens=ctx + new + k + 1)  # every decode graph the phases replay
    warm_plain_s = time.perf_counter() - t0
    plain.prefill(prompts)
    for _ in range(3):  # warm-up: compiles, autotunes and captures at the decode shape
        plain.decode()
    decode_us = [timed(plain.decode, sync) * 1e6 for _ in range(5)]
    for seq in list(plain.active):
        plain.release(seq)
    t_plain, first, plain_seqs = decode_phase(plain, prompts, plain_steps(new), sync)
    script = {tuple(s.prompt): s.output for s in first}
    # The timed run's prompt blocks were a cached prefix, the untimed one's partly not: their numerics differ
    # (prefill behind cached rows); in bf16 on random weights, whose top-2 logits are often one or two bf16 steps
    # apart, that alone can change greedy tokens.
    rerun_equal = [s.output for s in plain_seqs] == list(script.values())

    spec = build_runner(model, opts.replace(speculative=SpeculativeConfig(num_tokens=k)), program=program,
                        drafter=Rejected(script, model.config.vocab_size))
    t0 = time.perf_counter()
    warmed += spec.warm_up(max_batch=B, max_tokens=ctx + new + k + 1)  # every decode and verify graph
    warm_spec_s = time.perf_counter() - t0
    spec.prefill(prompts)
    limit = new + 8  # drafts of up to k tokens stay inside max_new_tokens
    for _ in range(3):
        spec.speculate(limit)
    verify_us = [timed(lambda: spec.speculate(limit), sync) * 1e6 for _ in range(5)]
    for seq in list(spec.active):
        spec.release(seq)
    spec.drafter = ScriptedDrafter(script)
    t_spec, _, spec_seqs = decode_phase(spec, prompts, verify_steps(new), sync)
    steps = [a for s in spec_seqs for a in s.acceptance]
    every = build_runner(model, opts.replace(speculative=dataclasses.replace(spec.speculative, accept_all=True)),
                         program=program, drafter=ScriptedDrafter(script))
    t0 = time.perf_counter()
    warmed += every.warm_up(max_batch=B, max_tokens=ctx + new + k + 1)
    warm_spec_s += time.perf_counter() - t0
    t_all, _, all_seqs = decode_phase(every, prompts, verify_steps(new), sync)
    all_steps = [a for s in all_seqs for a in s.acceptance]
    graphs = spec.decode_graphs
    verify_median = sorted(verify_us)[2]
    return dict(B=B, decode_step_us=[round(x, 1) for x in decode_us], verify_step_us=[round(x, 1) for x in verify_us],
                verify_over_decode=round(verify_median / sorted(decode_us)[2], 3),
                plain_tokens_per_s=round(B * (new - 1) / t_plain, 1),
                forced_acceptance_tokens_per_s=round(B * (new - 1) / t_spec, 1),
                mean_acceptance_length=round(sum(steps) / len(steps), 3),
                accept_all_tokens_per_s=round(B * (new - 1) / t_all, 1),
                accept_all_mean_acceptance_length=round(sum(all_steps) / len(all_steps), 3),
                warm_up_graphs=warmed, warm_up_s=round(warm_plain_s + warm_spec_s, 2),
                bound_tokens_per_s=round(B * (k + 1) / verify_median * 1e6, 1),
                tokens_equal=[s.output for s in spec_seqs] == list(script.values()), plain_rerun_equal=rerun_equal,
                verify_graphs_replayed=graphs is not None and graphs.capture and graphs.disabled is None
                and any(key[2] == k + 1 for key in graphs.graphs))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--ctx", type=int)
    p.add_argument("--new", type=int)
    p.add_argument("--batches")
    a = p.parse_args()
    dev = "cpu" if a.tiny else "cuda"
    ctx, new = a.ctx or (24 if a.tiny else 2048), a.new or (9 if a.tiny else 64)
    batches = [int(b) for b in (a.batches or ("1,2" if a.tiny else "1,8,64")).split(",")]
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    cfg = two_layer_config(a.tiny)
    model = random_model(cfg, dev)
    t0 = time.time()
    program = build_runner(model, RunnerOptions(block_size=64, dtype=model.dtype, device=dev, decode_graphs=False,
                                                max_cache_tokens=max(batches) * (ctx + new + 128),
                                                backend=None if dev == "cuda" else "reference")).program
    print(f"compiled in {time.time() - t0:.1f} s", flush=True)
    gen = torch.Generator().manual_seed(1)
    runs = []
    for B in batches:
        prompts = torch.randint(0, cfg.vocab_size, (B, ctx), generator=gen).tolist()
        runs.append(measure(model, program, prompts, a.k, new, dev, sync))
        print(runs[-1], flush=True)  # saved after every batch: a run cut short keeps what it measured
        path = save_run(f"speculative_k{a.k}_ctx{ctx}{'_tiny' if a.tiny else ''}.json", k=a.k, ctx=ctx,
                        new_tokens=new, layers="tiny" if a.tiny else "1 dense + 1 MoE (GLM-5 widths)", runs=runs)
    print("saved", path)


if __name__ == "__main__":
    main()
