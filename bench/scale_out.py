"""Serving figures for the tensor / expert-parallel run (issue 26 executes it on eight H200s; it runs on one GPU at
world size 1 today): TTFT and TPOT at batch 1, 8 and 64 for 2k and 32k contexts, through fxglm5's Runner and
through the RTP-LLM plugin (the stand-in engine of tests/rtp_standin; at ``--tp`` > 1 its ranks, with RTP's
process groups: NCCL on CUDA, gloo on the CPU), with beside them, from
the same run: the per-layer time (TPOT / layers) and the step's roofline, the bytes a decode step must read on
a rank (its weights, the experts its batch routes to, the cache rows the sparse attention and the indexer read)
over the copy bandwidth measured on that device.

The model has GLM-5's widths (FP8 block-scaled random weights, bf16 compute, FP8 latent and index caches,
64-token blocks) and ``--layers`` layers (the first dense, the rest MoE with all 256 experts). Each rank builds
it from the same seed: ranks > 1 (``--tp``) read their slices of a checkpoint directory (``--checkpoint``, which
``--write-checkpoint`` makes first), as ``fxglm5 generate --tp`` does.

    python bench/scale_out.py [--layers 2] [--batches 1,8,64] [--contexts 2048,32768] [--tp 1] [--ep D]
                              [--checkpoint DIR [--write-checkpoint]] [--plugin] [--tiny]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "rtp_standin"))

from bench import harness  # noqa: E402
from bench.decode_step import random_model  # noqa: E402
from bench.harness import save_run  # noqa: E402
from bench.serving import GLM5_SERVING  # noqa: E402
from fxglm5.contracts import FP8_ROW_BYTES, INDEX_ROW_BYTES  # noqa: E402
from fxglm5.model.config import Glm5Config  # noqa: E402
from fxglm5.serve.build import build_runner  # noqa: E402

STEPS = 6  # timed decode steps per point (after 2 warm-up steps that capture / autotune)


def bench_config(layers: int, tiny: bool) -> Glm5Config:
    if tiny:
        return Glm5Config.preset("tiny-tp").replace(num_hidden_layers=layers, first_k_dense_replace=1,
                                                    mlp_layer_types=None, indexer_types=None,
                                                    kv_lora_rank=512)  # RTP's cache rows: GLM-5's latent width
    return Glm5Config.preset("glm5").replace(num_hidden_layers=layers, first_k_dense_replace=1, mlp_layer_types=None,
                                             indexer_types=None, num_nextn_predict_layers=0)


def step_bytes(cfg: Glm5Config, batch: int, ctx: int, tp: int) -> int:
    """Bytes one decode step must read on a rank: its share of the weights (the routed experts only as many as
    ``batch`` tokens choose: expected distinct experts under uniform routing, 1 / tp of their bytes in every expert
    layout), the latent rows sparse attention
    gathers (top-k per token) and the index rows the indexer scores (the whole context), per layer."""
    from fxglm5.model.modeling import Glm5ForCausalLM

    meta = Glm5ForCausalLM(cfg, dtype=torch.bfloat16, device="meta")
    experts = cfg.n_routed_experts
    touched = experts * (1 - (1 - 1 / experts) ** (batch * cfg.num_experts_per_tok))
    total = 0.0
    for name, p in meta.named_parameters():
        size = p.numel() * p.element_size()
        if name.endswith("embed_tokens.weight"):
            total += size / cfg.vocab_size * batch  # a step reads its tokens' rows only
        elif ".mlp.experts." in name:  # the group's touched / ep experts, a 1 / (tp / ep) slice of each
            total += size * touched / experts / tp
        elif any(s in name for s in ("q_b_proj", "o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
                                     "shared_experts", "lm_head", "kv_b_proj")):
            total += size / tp
        else:
            total += size
    rows = cfg.num_hidden_layers * batch * (min(ctx, cfg.index_topk) * FP8_ROW_BYTES + ctx * INDEX_ROW_BYTES)
    return int(total + rows)


def runner_points(rank, model_or_dir, cfg, batches, contexts, tp, ep, device):
    """TTFT (prefill of one chunk of requests) and TPOT (median decode step) at every (batch, context)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    points, program, options = [], None, GLM5_SERVING.replace(device=device, tp=tp, ep=ep)
    for ctx in contexts:
        for batch in batches:
            prompts = torch.randint(0, cfg.vocab_size, (batch, ctx), generator=torch.Generator().manual_seed(1)).tolist()
            t0 = time.perf_counter()
            runner = build_runner(model_or_dir, options.replace(max_cache_tokens=batch * (ctx + 64 + STEPS)),
                                  program=program)
            build_s = time.perf_counter() - t0  # the first point's includes capture + passes (+ loading)
            if tp == 1:
                program = runner.program  # holds no cache: the next points reuse it
            # a throwaway runner over the same graph compiles / autotunes the prefill kernels at this length (not part
            # of a TTFT), without leaving a request in the measured runner's decode batch
            warm = build_runner(model_or_dir, options.replace(max_cache_tokens=ctx + 64), program=runner.program)
            warm.prefill(torch.randint(0, cfg.vocab_size, (1, ctx), generator=torch.Generator().manual_seed(2)).tolist())
            del warm
            ttft = []
            for prompt in prompts[:min(batch, 4)]:  # one request's prefill, alone in the step (TTFT), a few times
                sync()
                t0 = time.perf_counter()
                runner.prefill([prompt])
                sync()
                ttft.append((time.perf_counter() - t0) * 1e3)
            chunk = max(1, 16384 // ctx)
            for i in range(min(batch, 4), batch, chunk):
                runner.prefill(prompts[i:i + chunk])
            for _ in range(2):
                runner.decode()
            steps = []
            for _ in range(STEPS):
                sync()
                t0 = time.perf_counter()
                runner.decode()
                sync()
                steps.append((time.perf_counter() - t0) * 1e3)
            del runner
            points.append(dict(batch=batch, ctx=ctx, build_s=round(build_s, 1),
                               ttft_ms=round(statistics.median(ttft), 2),
                               tpot_ms=round(statistics.median(steps), 3), steps_ms=[round(s, 3) for s in steps]))
            print(points[-1], flush=True)
    return points


def _rank_run(rank, checkpoint, cfg, batches, contexts, ep):
    return runner_points(rank, checkpoint, cfg, batches, contexts, rank.world, ep, rank.device)


def _split_decode(engine, sync):
    """Wrap the stand-in engine's decode step so that each call is timed whole and in its parts (ms per step):
    ``inputs`` (the stand-in builds RTP's PyAttentionInputs in Python: C++ in RTP), ``prepare`` (the plugin's
    ``prepare_cuda_graph``: its host work before a replay), ``forward`` (the graph replay, or an eager forward
    where no graph runs: the plugin's kernels) and ``post`` (the stand-in's post-layers: fp32 lm_head, argmax,
    tokens to the host: C++ in RTP). Each part is bracketed by device syncs, so the parts add up to the step
    less the stand-in's replay bookkeeping (static-buffer copies, ``clone``)."""
    parts = {k: [] for k in ("step", "inputs", "prepare", "forward", "post")}
    active = [False]

    def timed(name, fn):
        def call(*args, **kwargs):
            if not active[0]:
                return fn(*args, **kwargs)
            sync()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            sync()
            parts[name].append((time.perf_counter() - t0) * 1e3)
            return out
        return call

    runner = engine.graph_runner
    for inst in (runner.instances.values() if runner is not None else ()):
        inst.impl.prepare_cuda_graph = timed("prepare", inst.impl.prepare_cuda_graph)  # the instance's, not the class's
    if runner is not None:
        runner._replay = timed("forward", runner._replay)
    engine._eager = timed("forward", engine._eager)
    engine._decode_inputs = timed("inputs", engine._decode_inputs)
    engine._post_layers = timed("post", engine._post_layers)
    decode = timed("step", engine._decode)

    def step(requests):
        active[0] = True
        try:
            return decode(requests)
        finally:
            active[0] = False

    engine._decode = step
    return parts


def plugin_points(checkpoint, cfg, batches, contexts, device, parallelism_config=None):
    """TTFT (one request's prefill alone, with RTP's post-layers and sampling) and TPOT (median decode step)
    through the RTP-LLM plugin driven by the stand-in engine (its decode CUDA graphs); ``parallelism_config``:
    this rank's, in a rank process of :func:`plugin_rank_points`. Beside the TPOT, the step's parts
    (:func:`_split_decode`): ``plugin_ms`` = prepare + forward is what the plugin costs a step (compare it with the
    Runner's step, which also runs its lm_head and sampling); ``standin_ms`` is the rest, the stand-in's Python
    scheduling and post-layers, which real RTP runs in C++."""
    from rtp_llm import standin_engine

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    points = []
    for ctx in contexts:
        for batch in batches:
            prompts = torch.randint(0, cfg.vocab_size, (batch, ctx), generator=torch.Generator().manual_seed(1)).tolist()
            blocks = batch * -(-(ctx + STEPS + 4) // 64) + 8
            engine = standin_engine.Engine(checkpoint, external_model_packages=["fxglm5.rtpllm.models"], act_type="BF16",
                                           fp8_kv_cache=True, seq_size_per_block=64, enable_cuda_graph=device == "cuda",
                                           decode_capture_batch_sizes=(batch,), num_blocks=blocks,
                                           max_seq_len=64 * -(-(ctx + STEPS + 4) // 64), device=device,
                                           parallelism_config=parallelism_config)
            engine.generate(prompts[:1], 1)  # compiles / autotunes the prefill kernels at this length: no TTFT
            ttft = []
            for prompt in prompts[:min(batch, 4)]:
                sync()
                t0 = time.perf_counter()
                engine.generate([prompt], 1)
                sync()
                ttft.append((time.perf_counter() - t0) * 1e3)
            parts = _split_decode(engine, sync)
            engine.generate(prompts, STEPS + 3)
            med = {k: round(statistics.median(v[2:] or v), 3) if v else 0.0 for k, v in parts.items()}
            plugin_ms = round(med["prepare"] + med["forward"], 3)
            points.append(dict(batch=batch, ctx=ctx, ttft_ms=round(statistics.median(ttft), 2), tpot_ms=med["step"],
                               plugin_ms=plugin_ms, standin_ms=round(med["step"] - plugin_ms, 3),
                               parts_ms={k: med[k] for k in ("inputs", "prepare", "forward", "post")}))
            print("plugin", points[-1], flush=True)
            del engine
    return points


def plugin_rank_points(world_rank, tp, dp, checkpoint, cfg, batches, contexts, ep, device):
    """One rank process of the stand-in RTP launch (``multi_rank_start``): :func:`plugin_points` on this rank."""
    from rtp_llm import standin_engine

    pc = standin_engine.rank_parallelism_config(world_rank, tp, dp, 0 if ep == tp else ep)
    return plugin_points(checkpoint, cfg, batches, contexts, device, pc)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--contexts", default="2048,32768")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=None,
                        help="expert groups, a divisor of --tp (default: --tp; 1: every expert split over all ranks; "
                             "the RTP plugin takes --tp or 1)")
    parser.add_argument("--checkpoint", help="checkpoint directory (needed for --tp > 1 and --plugin)")
    parser.add_argument("--write-checkpoint", action="store_true", help="write the random checkpoint there first")
    parser.add_argument("--plugin", action="store_true", help="also through the RTP-LLM plugin (at --tp ranks)")
    parser.add_argument("--tiny", action="store_true", help="the tiny-tp widths on the CPU (a smoke run)")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    ep = args.ep if args.ep is not None else args.tp
    device = "cpu" if args.tiny else "cuda"
    cfg = bench_config(args.layers, args.tiny)
    if (args.tp > 1 or args.plugin) and not args.checkpoint:
        parser.error("--tp > 1 and --plugin read a checkpoint directory: give --checkpoint DIR (--write-checkpoint)")
    if args.write_checkpoint:
        from fxglm5.model.tiny import make_tiny_checkpoint

        t0 = time.time()
        make_tiny_checkpoint(args.checkpoint, fp8=True, config=cfg)
        print(f"checkpoint written in {time.time() - t0:.0f} s", flush=True)
    copy_gbs = harness.copy_bandwidth_gbs() if device == "cuda" else None
    if args.tp == 1:
        source = args.checkpoint or random_model(cfg, device)
        points = runner_points(None, source, cfg, batches, contexts, 1, 1, torch.device(device))
    else:
        from fxglm5.runtime.distributed import launch

        _, points = launch(_rank_run, args.tp, args.checkpoint, cfg, batches, contexts, ep, device=device)
    for point in points:
        need = step_bytes(cfg, point["batch"], point["ctx"], args.tp)
        point.update(per_layer_ms=round(point["tpot_ms"] / cfg.num_hidden_layers, 3), step_bytes_per_rank=need,
                     roofline_ms=round(need / (copy_gbs * 1e9) * 1e3, 3) if copy_gbs else None,
                     tokens_per_s_per_gpu=round(point["batch"] / point["tpot_ms"] * 1e3 / args.tp, 1))
    plugin = None
    if args.plugin and args.tp == 1:
        plugin = plugin_points(args.checkpoint, cfg, batches, contexts, device)
    elif args.plugin:  # rank 0's figures (every rank runs the same steps)
        from rtp_llm import standin_engine

        plugin = standin_engine.multi_rank_start(args.tp, 1, plugin_rank_points, args.checkpoint, cfg, batches,
                                                 contexts, ep, device, backend="nccl" if device == "cuda" else "gloo",
                                                 timeout=3600)[0]
    save_run(f"scale_out_tp{args.tp}_ep{ep}.json", layers=args.layers, tp=args.tp, ep=ep, copy_gbs=copy_gbs,
             model="tiny-tp widths (CPU)" if args.tiny else
             f"GLM-5 widths, {args.layers} layers (1 dense), 256 experts, block-FP8 random weights, FP8 caches",
             runner=points, plugin=plugin)


if __name__ == "__main__":
    main()
