"""Decode steps through the RTP-LLM plugin (the stand-in engine of tests/rtp_standin, replaying the CUDA graphs
RTP would capture) against fxglm5's own Runner, on one checkpoint, in one process: wall time per decode step
(what TPOT is made of). The ATOM pull request this project is compared with measured its plugin path against
pure ATOM in the same way (TPOT 34.67 vs 33.53 ms).

The checkpoint has GLM-5's attention and hidden widths (64 heads, 576-value latent, 32 x 128 indexer, hidden
6144), 2 layers (1 dense, 1 MoE), block-FP8 weights, and fewer experts (16) and a 32k vocabulary so that it
is written and loaded in seconds. Both paths use the FP8 latent and indexer caches, 64-token blocks, bf16
compute. The stand-in engine's own Python (building RTP's inputs, its copies into the static buffers, its
fp32 lm_head) stands in for RTP's C++ and is counted in the plugin's figure; the plugin's own host work
(``prepare_cuda_graph``) is reported on its own.

    python bench/rtpllm_decode.py [B] [ctx] [steps] [--tiny]   # saves rtpllm_decode.json under $OUT or bench/results
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "rtp_standin"))

from bench import harness  # noqa: E402
from bench.harness import save_run  # noqa: E402
from bench.serving import GLM5_SERVING  # noqa: E402
from fxglm5.model.config import Glm5Config  # noqa: E402
from fxglm5.model.tiny import make_tiny_checkpoint  # noqa: E402
from fxglm5.serve.build import build_runner  # noqa: E402


def timed_steps(fn, sync, n):
    out = []
    for _ in range(n):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def _timed(fn, into: list):
    def wrapped(*args):
        t = time.perf_counter()
        out = fn(*args)
        into.append((time.perf_counter() - t) * 1e3)
        return out

    return wrapped


def main():
    harness.answer_help(__doc__)
    argv = sys.argv[1:]
    tiny = "--tiny" in argv
    args = [int(a) for a in argv if not a.startswith("--")]
    B, ctx, steps = (args + [None] * 3)[:3]
    B, ctx, steps = B or (2 if tiny else 64), ctx or (24 if tiny else 1024), steps or (4 if tiny else 16)
    dev = "cpu" if tiny else "cuda"
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    if tiny:
        cfg = Glm5Config.preset("tiny").replace(kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=128)
    else:
        cfg = Glm5Config.preset("glm5").replace(num_hidden_layers=2, first_k_dense_replace=1, mlp_layer_types=None,
                                                indexer_types=None, num_nextn_predict_layers=0, n_routed_experts=16,
                                                vocab_size=32768)
    prompts = torch.randint(0, cfg.vocab_size, (B, ctx), generator=torch.Generator().manual_seed(1)).tolist()
    blocks = B * (-(-(ctx + steps + 2) // 64)) + 8
    with tempfile.TemporaryDirectory(prefix="fxglm5-rtp-bench-") as tmp:
        t0 = time.time()
        ckpt = make_tiny_checkpoint(tmp, fp8=True, config=cfg)
        print(f"checkpoint written in {time.time() - t0:.0f} s", flush=True)

        from rtp_llm import standin_engine

        eng = standin_engine.Engine(ckpt, external_model_packages=["fxglm5.rtpllm.models"], act_type="BF16",
                                    fp8_kv_cache=True, seq_size_per_block=64, enable_cuda_graph=dev == "cuda",
                                    decode_capture_batch_sizes=(B,), num_blocks=blocks,
                                    max_seq_len=64 * -(-(ctx + steps + 2) // 64), device=dev)
        decode_ms = []
        original = eng._decode

        def timed_decode(reqs):
            sync()
            t = time.perf_counter()
            out = original(reqs)
            decode_ms.append((time.perf_counter() - t) * 1e3)
            return out

        eng._decode = timed_decode
        prepare_ms = []
        for inst in (eng.graph_runner.instances.values() if eng.graph_runner else ()):  # the plugin's host work
            inst.impl.prepare_cuda_graph = _timed(inst.impl.prepare_cuda_graph, prepare_ms)  # before each replay
        rtp_tokens = eng.generate(prompts, steps + 1)
        plugin = dict(decode_step_ms=[round(x, 2) for x in decode_ms], replays=eng.graph_replays,
                      prepare_cuda_graph_median_ms=round(statistics.median(prepare_ms), 3) if prepare_ms else None)
        del eng

        runner = build_runner(ckpt, GLM5_SERVING.replace(num_blocks=blocks, device=dev))
        chunk = max(1, 16384 // ctx)
        for i in range(0, B, chunk):
            runner.prefill(prompts[i:i + chunk])
        runner_ms = timed_steps(runner.decode, sync, steps)
        runner_tokens = [s.output[:steps + 1] for s in runner.active]
    same = sum(a == b for a, b in zip(rtp_tokens, runner_tokens))

    def summary(ms):  # the first step of each path captures / compiles; steady state is the rest
        return dict(median_ms=round(statistics.median(ms[1:] or ms), 3), min_ms=round(min(ms[1:] or ms), 3))

    save_run("rtpllm_decode.json", B=B, ctx=ctx, steps=steps,
             model="tiny" if tiny else "GLM-5 widths, 2 layers, 16 experts, vocab 32768, block-FP8",
             plugin_through_standin_rtp=dict(plugin, **summary(decode_ms)),
             fxglm5_runner=dict(decode_step_ms=[round(x, 2) for x in runner_ms], **summary(runner_ms)),
             requests_with_identical_tokens=f"{same} of {B}")


if __name__ == "__main__":
    main()
