"""RTP-LLM's no-cache prefill warm-up through the plugin: its time and the device memory it peaks at, which RTP
reserves as runtime memory before it sizes the KV cache (``MemoryEvaluationHelper.cc:110``, rtp-llm 4b8d39cd5),
next to a real prefill of the same length on RTP's cache.

For each length n the stand-in engine of tests/rtp_standin runs its PDFUSION warm-up (``initialize(None)``,
one prefill of ``max_seq_len - 1`` = n tokens without block tables) twice, then, on RTP's cache, a real prefill
of n tokens twice (the first of each pair includes kernel compilation). Measured per run: wall time and, on
CUDA, ``torch.cuda.memory_allocated`` before and ``max_memory_allocated`` during the step. The plugin's
warm-up scratch cache is measured (the bytes it allocated); the scratch the plugin allocated before it was made
length-independent (one block per 64 warm-up tokens plus block 0, every layer) is COMPUTED from the same
layout, for this model and for GLM-5's 78 layers.

The model has GLM-5's widths (64 heads, 576-value latent, 32 x 128 indexer, hidden 6144), ``--layers`` layers
(the first dense, the rest MoE), block-FP8 weights, 16 experts and a 32k vocabulary (a random checkpoint written
in seconds), bf16 compute, FP8 latent and indexer caches, 64-token blocks. ``--tiny`` runs the tiny model at
RTP's cache widths on the CPU, to check the script.

    python bench/rtpllm_warmup.py [--tiny] [--lengths 1024,8192] [--layers 2]
    # saves rtpllm_warmup.json (--tiny: rtpllm_warmup_tiny.json) under $OUT or bench/results
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "rtp_standin"))

from bench.harness import save_run  # noqa: E402
from fxglm5.model.config import Glm5Config  # noqa: E402
from fxglm5.model.tiny import make_tiny_checkpoint  # noqa: E402
from fxglm5.program import CacheSpec  # noqa: E402
from fxglm5.runtime.cache import check_cache_size  # noqa: E402

BLOCK, MIB = 64, 2**20


def model_config(tiny: bool, layers: int) -> Glm5Config:
    base = dict(num_hidden_layers=layers, mlp_layer_types=None, indexer_types=None)
    if tiny:
        return Glm5Config.preset("tiny").replace(kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=128, **base)
    return Glm5Config.preset("glm5").replace(first_k_dense_replace=1, num_nextn_predict_layers=0, n_routed_experts=16,
                                             vocab_size=32768, **base)


def old_scratch_bytes(cfg: Glm5Config, n: int) -> int:
    """COMPUTED: the scratch the plugin allocated for an n-token warm-up before (1 + ceil(n / 64) blocks of 64
    tokens, FP8 rows, every attention layer); the meta device allocates and checks nothing."""
    spec = CacheSpec.for_config(cfg, "fp8", "fp8", torch.bfloat16)
    return check_cache_size(1 + -(-n // BLOCK), BLOCK, spec, "meta")


def timed(device, fn) -> tuple[object, dict]:
    """fn()'s result and its wall time, with (CUDA) the bytes allocated before and the most allocated during it."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    out = fn()
    if cuda:
        torch.cuda.synchronize(device)
    row = dict(seconds=round(time.perf_counter() - t0, 3))
    if cuda:
        peak = torch.cuda.max_memory_allocated(device)
        row.update(allocated_before_mib=round(before / MIB, 1), max_allocated_mib=round(peak / MIB, 1),
                   peak_above_before_mib=round((peak - before) / MIB, 1))
    return out, row


def measure(eng, cfg: Glm5Config, n: int) -> dict:
    model, scratch = eng.py_model, []
    prepare = model.prepare_fmha_impl

    def recording(inputs, is_cuda_graph=False):  # the warm-up's scratch cache, as the plugin allocated it
        impl = prepare(inputs, is_cuda_graph)
        scratch.append(sum(c.nbytes for c in impl.caches or ()))
        return impl

    eng.max_seq_len = n + 1  # the stand-in's warm-up runs max_seq_len - 1 tokens, as RTP's does
    model.prepare_fmha_impl = recording
    try:
        warm = [timed(eng.device, lambda: eng._warm_up("PDFUSION", 0)) for _ in range(2)]
    finally:
        del model.prepare_fmha_impl
    eng._initialize(eng.kv_cache)  # a real prefill writes into RTP's cache
    prompt = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    real = [timed(eng.device, lambda: eng.generate([prompt], 1))[1] for _ in range(2)]
    return dict(tokens=n, warm_up=[row for _, row in warm], warm_up_rows_finite=all(
                    bool(torch.isfinite(h).all()) for h, _ in warm),
                real_prefill_on_rtp_cache=real, scratch_cache_mib_measured=round(max(scratch) / MIB, 3),
                old_scratch_cache_mib_computed=round(old_scratch_bytes(cfg, n) / MIB, 1),
                old_scratch_cache_mib_computed_glm5_78_layers=round(
                    old_scratch_bytes(Glm5Config.preset("glm5"), n) / MIB, 1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="the tiny model on the CPU (checks the script)")
    ap.add_argument("--lengths", help="comma-separated warm-up lengths in tokens (default 1024,8192; --tiny 64,256)")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers, the first dense (default 2)")
    args = ap.parse_args()
    lengths = [int(x) for x in (args.lengths or ("64,256" if args.tiny else "1024,8192")).split(",")]
    dev = "cpu" if args.tiny else "cuda"
    cfg = model_config(args.tiny, args.layers)
    with tempfile.TemporaryDirectory(prefix="fxglm5-rtp-warmup-") as tmp:
        t0 = time.time()
        ckpt = make_tiny_checkpoint(tmp, fp8=True, config=cfg)
        print(f"checkpoint written in {time.time() - t0:.0f} s", flush=True)
        from rtp_llm import standin_engine

        top = max(lengths) + 1
        eng = standin_engine.Engine(ckpt, external_model_packages=["fxglm5.rtpllm.models"], act_type="BF16",
                                    fp8_kv_cache=True, seq_size_per_block=BLOCK, num_blocks=-(-top // BLOCK) + 2,
                                    max_seq_len=top, warm_up=False, device=dev)
        rows = [measure(eng, cfg, n) for n in lengths]
    save_run("rtpllm_warmup_tiny.json" if args.tiny else "rtpllm_warmup.json",
             model=("tiny at RTP's cache widths" if args.tiny else "GLM-5 widths, 16 experts, vocab 32768")
             + f", {args.layers} layers, block-FP8, FP8 KV cache", rows=rows)


if __name__ == "__main__":
    main()
