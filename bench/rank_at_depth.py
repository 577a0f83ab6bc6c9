"""One rank of a TP x EP deployment of GLM-5-FP8 at full depth (78 layers) on one GPU: TTFT and TPOT with, beside each
point, its roofline, collectives, kernels and memory (an earlier measurement's method, which patched the project
from outside, made part of it; results: bench/results/rank_at_depth/).

Why one rank on one GPU: a rank of TP8 / EP8 holds 97 GB of weights and runs every layer; what it computes per step
is what each of the eight GPUs computes, less the communication. The process group is torch's fake one
(``torch.testing._internal.distributed.fake_pg``): its collectives return at once without communicating (all_reduce
leaves its input, all_gather repeats it), eagerly and inside CUDA-graph capture, which a probe checks first. So the
figures leave out the collectives' time; beside each point are their bytes per step and that traffic priced at an
NVLink bus bandwidth (``--nvlink-gbs``, default ``NVLINK_BUS_GBS``: an assumption, see there), the bandwidth term
only. Weights are random (``fxglm5.model.random_reader.RandomReader``, drawn on the GPU at the shard plan's shapes):
uniform routing, which is optimistic for MoE.

The indexer's top-k at a prefill (``shard_indexer``): the rank selects for its share of the tokens (t = 0, 8, 16, ...:
rank 0's rows), and the fake all_gather repeats that share, so token 8 i + j attends to token 8 i's selection: a
set of at most as many positions, none past its own, in its own request as long as a step holds one prompt, which
every TTFT point's does (one prompt, no decodes beside it). So the sparse attention after it reads valid rows of
about the real count, and the rank's indexer does 1/8 of the work, as each of the 8 would. Decode steps (at most
64 tokens) stay below the split's threshold (``collectives.MIN_ROWS_PER_RANK``) and select for every token.

Points: TTFT of one prompt of 2k / 8k / 32k tokens (after one warm-up prefill of that length, which compiles and
autotunes); TPOT, the median of 8 ``Runner.decode()`` steps after 2 warm-ups (the first captures the decode CUDA
graph), at B = 1, 8, 64 with 2k context and B = 1, 8 with 32k. The decode context is synthetic: each request's
blocks hold valid random rows in every layer's latent and index caches, written by the cache-write kernels, its
state as after a prefill (no 256k tokens of prefill to measure a step). A point whose cache does not fit beside
the weights is skipped with the reason. Beside each point: the bytes the step must read over this run's copy
bandwidth (roofline), the kernels per step and their device time (torch.profiler over 3 more steps, or the one
prefill), the collectives per step and their message sizes, and the memory. One runner serves every point.

    python bench/rank_at_depth.py [--points ttft2k,tpot1x2k,...] [--layers N] [--without pass,pass] [--tiny]
                                  [--variants fixup_off,pdl,...] [--variant-points tpot1x2k,...]
                                  [--ep 1|2|8] [--load busiest|mean] [--act-quant]

``--ep``: the experts' layout over the 8 ranks (1: each expert split along its intermediate dim, so every rank reads
the same bytes; 2: two groups of 128 experts, each expert split over its group's 4 ranks; 8: 32 whole experts a
rank). ``--load busiest`` (the default): the measured rank routes as the busiest rank of a uniformly routed step, the
one every other rank waits for (``bench/routing_load.py``: a simulation of top-8 routing; with ``--ep 1`` every rank
is the average one); ``mean``: the random router's routing, an average rank. Beside each point, one decoder layer of
each kind's kernels in order with their device times (``bench/layer_kernels.py``).

``--act-quant``: the FP8 GEMMs W8A8 (activations quantized 1x128 to e4m3 on the fly: the checkpoint's recipe, which
SGLang and vLLM run, at FP8 tensor-core rate, and on Hopper the warp-specialized prefill GEMM); without it W8A16,
fxglm5's default (bf16 activations times the widened weights). The setup line and the file names say which
(``_w8a8``), and each run records its graph's FP8 GEMM ops by their ``act_quant`` (``fp8_gemms``).

``--without``: after the run, a baseline over the same points with those compiler passes disabled (a second
runner, built after the first is freed). ``--variants``: kernel settings (VARIANTS: an environment setting, or
launch configurations of the kernel modules) measured again at ``--variant-points`` on the same runner, its decode
graphs captured anew under each, so that a setting is judged by the whole step beside the default in one run.
``--tiny``: the whole flow on the CPU with a tiny config that splits over 8 ranks and contexts / 256 (a smoke run:
its times mean nothing); the indexer's split threshold is lowered with them (9 tokens a rank: the 128-token TTFT
point splits, the decode steps of at most 64 tokens still do not).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import itertools
import math
import os
import re
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import harness  # noqa: E402
from bench.layer_kernels import split_layers  # noqa: E402
from bench.routing_load import SteeredRouting  # noqa: E402
from bench.serving import GLM5_SERVING  # noqa: E402
from fxglm5 import settings  # noqa: E402
from fxglm5.compiler import act_quant_ops  # noqa: E402
from fxglm5.contracts import FP8_ROW_BYTES, INDEX_ROW_BYTES  # noqa: E402
from fxglm5.lowering.reference import collectives as split  # noqa: E402
from fxglm5.model.config import Glm5Config  # noqa: E402
from fxglm5.model.random_reader import RandomReader  # noqa: E402
from fxglm5.runtime.cache import available_memory  # noqa: E402
from fxglm5.runtime.decode_graphs import pow2_buckets  # noqa: E402
from fxglm5.runtime.runner import Runner, Sequence  # noqa: E402
from fxglm5.serve.build import build_runner  # noqa: E402

TP = 8
EP_LAYOUTS = (1, 2, 8)  # experts split along their intermediate dim (1), in groups (2), whole per rank (8)
MAX_DECODE_BATCH = 64
BLOCK = GLM5_SERVING.block_size
POINTS = {  # name -> (kind, batch, context)
    "ttft2k": ("ttft", 1, 2048), "ttft8k": ("ttft", 1, 8192), "ttft32k": ("ttft", 1, 32768),
    "tpot1x2k": ("tpot", 1, 2048), "tpot8x2k": ("tpot", 8, 2048), "tpot64x2k": ("tpot", 64, 2048),
    "tpot1x32k": ("tpot", 1, 32768), "tpot8x32k": ("tpot", 8, 32768),
}
TINY_SCALE = 256  # --tiny divides the contexts by this
WARM, TIMED = 2, 8  # decode steps per TPOT point, then profiled_steps more
# GPU memory left free beside the cache for a step's activations (a 16k-token prefill chunk's, the decode graphs'
# pools); a point whose cache needs more than the rest is skipped
ACTIVATION_RESERVE = 12 * 2**30
_IDS = itertools.count(1 << 40)  # request ids of the synthetic contexts (the runner's own count from 0)
# The bus bandwidth (nccl-tests' "busbw") per GPU the collectives' bytes are priced at: an assumption, not a
# measurement (the fake group moves nothing). H100 / H200 SXM GPUs have 18 NVLink4 links, 450 GB/s a direction;
# nccl-tests on 8-GPU HGX hosts report roughly 350-480 GB/s of bus bandwidth for large all-gathers / all-reduces
# (the upper end with NVLink SHARP), so 400 is a round middle figure; --nvlink-gbs takes a measured one.
NVLINK_BUS_GBS = 400.0
INDEXER_GATHER = "rtp_indexer all_gather"  # the all_gather inside a split rtp_indexer (shard_indexer)
# name -> (environment, {module.DICT: keys}): kernel settings a decode step is measured again under
VARIANTS = {
    "fixup_off": ({}, {"fp8_gemm.DECODE": {"FIXUP": False}}),  # the split-K GEMMs' separate reduce kernel
    "pdl": ({"FXGLM5_PDL": "1"}, {}),  # programmatic dependent launch (fxglm5.lowering.triton.device.pdl)
    # the decode MoE's K splits (moe.MOE_DECODE; its defaults CTAS_PER_SM1 16, SPLIT2 4 since 5cf6615, and at one
    # token moe.MOE_DECODE_ONE_TOKEN's CTAS_PER_SM1 8, timed at bd118d2): the gate|up GEMM unsplit (no fp32 partials, no
    # last-split reduce of them), its splits sized for 8 / 16 / 32 CTAs an SM at every batch, the down GEMM unsplit
    "moe_split1_1": ({}, {"moe.MOE_DECODE": {"SPLIT1": 1}}),
    **{f"moe_ctas{n}": ({}, {"moe.MOE_DECODE": {"CTAS_PER_SM1": n}, "moe.MOE_DECODE_ONE_TOKEN": {"CTAS_PER_SM1": n}})
       for n in (8, 16, 32)},
    "moe_split2_1": ({}, {"moe.MOE_DECODE": {"SPLIT2": 1}}),
    # the down GEMM's CTAs doubled, by K splits (its tiles still line up with the shared expert's, so it combines in
    # its launch) or by 64-column tiles (the combine then takes its own launch): alone at B=1 the 64-column down GEMM
    # took 19.79 against 30.76 us (bench/results/decode_h100_bd118d2/moe_rank_decode.json)
    "moe_split2_8": ({}, {"moe.MOE_DECODE": {"SPLIT2": 8}}),
    # the expert walk: two CTAs an SM (one wave at the launch's 255 registers) take the picked experts' gate|up tiles,
    # the K split sized from the routing, instead of a CTA per block, column tile and split (moe.MOE_DECODE)
    "moe_walk2": ({}, {"moe.MOE_DECODE": {"WALK_CTAS_PER_SM": 2}}),
    # the down launch over a reversed grid: the picked blocks' CTAs go out first (moe.MOE_DECODE's BLOCKS_LAST)
    "moe_blocks_last": ({}, {"moe.MOE_DECODE": {"BLOCKS_LAST": True}}),
    "moe_bn2_64": ({}, {"moe.MOE_DECODE": {"BLOCK_N2": 64}}),
    "gemv": ({}, {"fp8_gemv.GEMV": {"enabled": True}}),  # the decode GEMV (fp8_gemv.py) up to 16 rows
    "gemv_pdl": ({"FXGLM5_PDL": "1"}, {"fp8_gemv.GEMV": {"enabled": True}}),  # ... its weights loaded before the wait
    # ... and the next K step's weight tile requested before each step's math (fp8_gemv's PREFETCH)
    "gemv_prefetch_pdl": ({"FXGLM5_PDL": "1"}, {"fp8_gemv.GEMV": {"enabled": True, "PREFETCH": True}}),
    # the decode step's one-launch joins (fxglm5.settings.DECODE_JOINS), all of them or one at a time
    "joins_all": ({"FXGLM5_DECODE_JOINS": "all"}, {}),
    "joins_none": ({"FXGLM5_DECODE_JOINS": "none"}, {}),
    "joins_all_pdl": ({"FXGLM5_DECODE_JOINS": "all", "FXGLM5_PDL": "1"}, {}),
    # ... each with the default's (settings.DEFAULT_DECODE_JOINS)
    **{f"join_{name}": ({"FXGLM5_DECODE_JOINS": ",".join(sorted(settings.DEFAULT_DECODE_JOINS | {name}))}, {})
       for name in settings.DECODE_JOINS},
}


class TimedReader(RandomReader):
    """RandomReader that adds up the wall time spent inside its ``with`` blocks (the load), device work included."""

    seconds = 0.0

    def __enter__(self):
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.seconds += time.perf_counter() - self._start


def bench_config(layers: int | None, tiny: bool) -> Glm5Config:
    """GLM-5 (78 layers, or ``layers``) without its MTP layer; ``tiny``: widths that split over 8 ranks into whole
    128-blocks (16 heads: 2 per rank; dense / shared-expert widths 1024; 16 experts, 2 per rank)."""
    if tiny:
        cfg = Glm5Config.preset("tiny-tp").replace(
            num_attention_heads=16, num_key_value_heads=16, intermediate_size=1024, moe_intermediate_size=1024,
            n_routed_experts=16)
    else:
        cfg = Glm5Config.preset("glm5")
    depth = {} if layers is None else dict(num_hidden_layers=layers, mlp_layer_types=None, indexer_types=None)
    return cfg.replace(num_nextn_predict_layers=0, **depth)


def init_fake_group() -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=TP)


def probe_collectives(device: torch.device) -> dict:
    """Each implementation of fxglm5::all_reduce / all_gather (the custom op and what ``lower`` and ``reduce_in_place``
    bind) returns, with the fake group's values, eagerly and (on a GPU) inside a CUDA graph that is replayed on a new input."""
    from fxglm5.lowering.implementations import implementations
    from fxglm5.lowering.reference.collectives import all_reduce_c10d_in_place

    x = torch.randn(4, 256, device=device, dtype=torch.bfloat16)
    report = {}
    for op, extra, expect in (("all_reduce", (), lambda t: t), ("all_gather", (-1,), lambda t: t.repeat(1, TP))):
        fns = {"fxglm5::" + op: getattr(torch.ops.fxglm5, op).default,
               **{f"{op} ({backend})": impl.fn for backend, impl in implementations(op).items()},
               **({"all_reduce (in place)": all_reduce_c10d_in_place} if op == "all_reduce" else {})}
        for name, fn in fns.items():
            def call(t, fn=fn, extra=extra):
                return fn(t, *extra, "tp", TP)

            report[name] = dict(eager=torch.equal(call(x), expect(x)),
                                cuda_graph=_probe_capture(call, x, expect) if device.type == "cuda" else None)
    bad = [n for n, r in report.items() if not r["eager"] or r["cuda_graph"] is False]
    if bad:
        raise RuntimeError(f"fake process group: {bad} did not return the expected values: {report}")
    return report


def _probe_capture(call, x, expect) -> bool:
    static = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call(static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call(static)
    new = torch.randn_like(x)
    static.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    return torch.equal(out, expect(new))


def weight_bytes(graph) -> dict[str, int]:
    """Bytes of the weights the rank's graph holds, by category (derived constants under their layer's module)."""
    dense = re.compile(r"model\.layers\.\d+\.mlp\.(?!experts\.|shared_experts\.|gate\.)")
    rules = (("routed experts", ".mlp.experts."), ("shared experts", ".mlp.shared_experts."), ("router", ".mlp.gate."),
             ("attention + indexer", ".self_attn."), ("embedding", "embed_tokens"), ("lm_head shard", "lm_head"))
    out: dict[str, int] = collections.Counter()
    for name, t in itertools.chain(graph.named_parameters(), graph.named_buffers()):
        kind = next((k for k, s in rules if s in name), "dense MLPs" if dense.match(name) else "norms")
        out[kind] += t.numel() * t.element_size()
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def collectives(graph) -> list[dict]:
    """The graph's collectives (each runs once per step): op, count, bytes per token row of each call's input on the
    rank; and, as INDEXER_GATHER, the all_gather inside each rtp_indexer that shard_indexer split (``topk`` int32
    positions per row of the rank's share; it runs only in steps of at least MIN_ROWS_PER_RANK tokens a rank)."""
    found = collections.Counter()
    indexers = ("rtp_indexer", "fp8_linear_latent_query_indexer")  # the second: the indexer inside the q_b GEMM's op
    names = {op: [a.name for a in getattr(torch.ops.fxglm5, op).default._schema.arguments] for op in indexers}
    for node in graph.graph.nodes:
        op = getattr(node.target, "op", None)
        if op in ("all_reduce", "all_gather"):
            val = node.args[0].meta["val"]
            row = math.prod(int(d) for d in val.shape if isinstance(d, int)) * val.element_size()
            found[(op, row)] += 1
        elif op in indexers:
            args = {**dict(zip(names[op], node.args)), **node.kwargs}
            if args.get("world", 1) > 1:
                found[(INDEXER_GATHER, args["topk"] * 4)] += 1
    return [dict(op=op, count=n, bytes_per_row=row) for (op, row), n in sorted(found.items())]


def collective_rows(runner: Runner, kind: str, batch: int, ctx: int) -> dict[str, int]:
    """Rows of each collective's input on the rank, summed over a point's steps: the tokens (all_reduce: a TTFT
    point's prompt over its prefill steps of at most ``max_step_tokens``), the sampled rows (the lm_head's
    all_gather) and the rank's share of the split top-k rows (INDEXER_GATHER: ``split_rows`` of each step's tokens
    over the ranks; none below the threshold)."""
    steps = [min(runner.max_step_tokens, ctx - s) for s in range(0, ctx, runner.max_step_tokens)] if kind == "ttft" \
        else [batch]
    shares = sum(split.split_rows(t, TP) for t in steps) // TP
    return {"all_reduce": sum(steps), "all_gather": batch, INDEXER_GATHER: shares}


def priced_ms(op: str, size: int, gbs: float) -> float:
    """The bandwidth term of a collective whose result is ``size`` bytes on each rank, at bus bandwidth ``gbs`` GB/s
    (nccl-tests' model: an all_reduce sends 2 (W-1)/W x size through each GPU's links, an all_gather (W-1)/W x
    size). Each call's latency (some us) is left out: a lower bound, loose for decode's small messages."""
    return (2 if op == "all_reduce" else 1) * (TP - 1) / TP * size / (gbs * 1e9) * 1e3


def expected_local_experts(cfg: Glm5Config, batch: int, ep: int) -> float:
    """Distinct local experts that ``batch`` tokens route to on an average rank under uniform top-k routing: the
    rank's group holds ``E / ep`` experts, the rank a ``1 / (tp / ep)`` slice of each (whole experts at ``ep == tp``,
    a slice of every expert at ``ep == 1``; GLM-5 at B=1: 1 expert of 32 at ep 8, 4 of 128 at ep 2, 8 of 256 at
    ep 1, the same expert bytes each time)."""
    return cfg.n_routed_experts / ep * (1 - (1 - cfg.num_experts_per_tok / cfg.n_routed_experts) ** batch)


def step_bytes(cfg: Glm5Config, weights: dict[str, int], batch: int, ctx: int, ep: int,
               local_experts: float | None = None) -> int:
    """Bytes one decode step must read on the rank: its weights (the routed experts only as many as the batch
    routes to: ``local_experts`` distinct ones of the ``E / ep`` the rank holds a slice of, default the average
    rank's, each at the rank's bytes per local expert; the embedding only the batch's rows) and,
    per layer and request, the latent rows sparse attention gathers (top-k) and the index rows the indexer scores
    (the whole context)."""
    local = cfg.n_routed_experts / ep
    fixed = sum(v for k, v in weights.items() if k not in ("routed experts", "embedding"))
    if local_experts is None:
        local_experts = expected_local_experts(cfg, batch, ep)
    experts = weights.get("routed experts", 0) * local_experts / local
    embedding = weights.get("embedding", 0) * batch / cfg.vocab_size
    kv = sum(min(ctx, cfg.index_topk) * FP8_ROW_BYTES + ctx * INDEX_ROW_BYTES * cfg.has_indexer(i)
             for i in range(cfg.num_hidden_layers)) * batch
    return int(fixed + experts + embedding + kv)


def cache_writers(device: torch.device):
    """The cache-write kernels the graph's own steps use: Triton on a GPU, the torch reference on a CPU."""
    if device.type == "cuda":
        from fxglm5.lowering.triton.paged_cache import write_indexer_cache, write_latent_cache
    else:
        from fxglm5.lowering.reference.paged import write_indexer_cache, write_latent_cache
    return write_latent_cache, write_indexer_cache


def synthetic_context(runner: Runner, batch: int, ctx: int, gen: torch.Generator) -> list[Sequence]:
    """``batch`` requests of ``ctx`` cached tokens, as after their prefill: blocks allocated, valid random rows
    written at their slots in every layer's latent and index caches, one output token; appended to
    ``runner.active``."""
    cfg, cache, device = runner.config, runner.cache, torch.device(runner.device)
    seqs = [Sequence(next(_IDS), torch.randint(cfg.vocab_size, (ctx,), generator=gen).tolist()) for _ in range(batch)]
    for seq in seqs:
        if runner.blocks.allocate(seq.id, seq.prompt):
            raise RuntimeError("a synthetic context reused a cached prefix")
    pos = torch.arange(ctx)
    slots = torch.cat([torch.tensor(runner.blocks.tables[s.id])[pos // cache.block_size] * cache.block_size
                       + pos % cache.block_size for s in seqs]).to(device)
    rows = dict(device=device, dtype=cache.dtype)
    kv_c = torch.randn(len(slots), cfg.kv_lora_rank, **rows)
    k_pe = torch.randn(len(slots), cfg.qk_rope_head_dim, **rows)
    keys = torch.randn(len(slots), cfg.index_head_dim, **rows)
    write_latent, write_index = cache_writers(device)
    for kv_name, index_name in cache.spec.signature.layers:
        write_latent(cache.kernel_view(kv_name), kv_c, k_pe, slots, validate=False)
        if index_name is not None:
            write_index(cache.kernel_view(index_name), keys, slots, validate=False)
    for seq in seqs:
        seq.cached, seq.output = ctx, [int(torch.randint(cfg.vocab_size, (1,), generator=gen))]
    runner.active.extend(seqs)
    return seqs


def profile(fn, steps: int, device: torch.device, cfg: Glm5Config, wall_ms: float) -> dict:
    """``fn`` run ``steps`` times under torch.profiler: per step, the kernels and their device time, the top kernels,
    the unprofiled wall time ``wall_ms`` over the kernel time, and one decoder layer of each kind's kernels in order
    (``layer_kernels.split_layers`` on the first step); on a GPU also the copies and fills a step, which are not
    kernels (a graph may run a copy as a kernel, ``memcpy32_post``, or on a copy engine, ``Memcpy DtoD``). On a CPU
    the "kernels" are the top-level ops."""
    layers = cfg.num_hidden_layers
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda"
                                                    else [])
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            fn()
            sync(device)
    transfers = None
    if device.type == "cuda":
        on_device = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        events = [(e.name, e.device_time, e.time_range.start) for e in on_device
                  if not e.name.startswith(("Memcpy", "Memset"))]
        counts = collections.Counter(e.name[:40] for e in on_device if e.name.startswith(("Memcpy", "Memset")))
        transfers = {name: round(c / steps, 1) for name, c in counts.items()}
    else:
        events = [(e.name, e.cpu_time_total, e.time_range.start) for e in prof.events() if e.cpu_parent is None]
    events.sort(key=lambda e: e[2])
    first = [(name, us) for name, us, _ in events[:len(events) // steps]]
    moe = sum(cfg.is_moe_layer(i) for i in range(layers))
    per = collections.defaultdict(lambda: [0, 0.0])
    for name, us, _ in events:
        per[name[:90]][0] += 1
        per[name[:90]][1] += us
    count, us = sum(c for c, _ in per.values()) / steps, sum(t for _, t in per.values()) / steps
    top = sorted(per.items(), key=lambda kv: -kv[1][1])[:12]
    return dict(source="cuda kernels" if device.type == "cuda" else "top-level cpu ops (no GPU)",
                kernels_per_step=round(count, 1), kernels_per_layer=round(count / layers, 1),
                kernel_ms_per_step=round(us / 1e3, 3), wall_over_kernel=round(wall_ms / (us / 1e3), 2) if us else None,
                top=[dict(kernel=name, calls_per_step=round(c / steps, 1), us_per_step=round(t / steps, 1))
                     for name, (c, t) in top],
                layer_kernels=split_layers([(n[:90], us) for n, us in first], layers - moe, moe),
                **({} if transfers is None else dict(copies_and_fills_per_step=transfers)))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def memory(device: torch.device) -> dict:
    """The GPU's peak allocation since the point began and its free memory (nothing on a CPU)."""
    if device.type != "cuda":
        return {}
    return dict(peak_allocated_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                free_gib=round(torch.cuda.mem_get_info()[0] / 2**30, 2))


def measure_ttft(runner: Runner, ctx: int, gen: torch.Generator, device: torch.device) -> dict:
    """One prompt's prefill: a warm-up (compile, autotune), then timed, then profiled; fresh random tokens each
    time (no prefix reuse)."""
    vocab = runner.config.vocab_size

    def prefill():
        seq, = runner.prefill([torch.randint(vocab, (ctx,), generator=gen).tolist()])
        if seq.error is not None or seq.prefix_reused:
            raise RuntimeError(f"prefill of {ctx} tokens: {seq.error or 'reused a prefix'}")
        runner.release(seq)

    prefill()
    sync(device)
    start = time.perf_counter()
    prefill()
    sync(device)
    ms = (time.perf_counter() - start) * 1e3
    return dict(measured_ms=round(ms, 2), profile=profile(prefill, 1, device, runner.config, ms))


def measure_tpot(runner: Runner, batch: int, ctx: int, gen: torch.Generator, device: torch.device) -> dict:
    """Median decode step over a synthetic context (``synthetic_context``), then ``profiled_steps`` profiled."""
    seqs = synthetic_context(runner, batch, ctx, gen)
    try:
        for _ in range(WARM):
            runner.decode()
        times = []
        for _ in range(TIMED):
            sync(device)
            start = time.perf_counter()
            if len(runner.decode()) != batch:
                raise RuntimeError(f"a request left the batch: {[s.error for s in seqs]}")
            sync(device)
            times.append((time.perf_counter() - start) * 1e3)
        ms = statistics.median(times)
        graphs = runner.decode_graphs
        return dict(measured_ms=round(ms, 3), steps_ms=[round(t, 3) for t in times],
                    cuda_graphs=bool(graphs is not None and graphs.graphs and graphs.disabled is None),
                    profile=profile(runner.decode, profiled_steps(device), device, runner.config, ms))
    finally:
        for seq in seqs:
            runner.release(seq)


def profiled_steps(device: torch.device) -> int:
    """Decode steps under the profiler: 3, or 1 on a CPU (where it parses every op's events in Python, slowly)."""
    return 3 if device.type == "cuda" else 1


def blocks_for(kind: str, batch: int, ctx: int, device: torch.device) -> int:
    """Cache blocks a point needs (a TPOT point's requests grow by every decode step)."""
    steps = WARM + TIMED + profiled_steps(device) if kind == "tpot" else 0
    return batch * -(-(ctx + steps) // BLOCK)


def rank_runner(reader, device, num_blocks: int, ep: int, act_quant: bool, program=None, disabled=()) -> Runner:
    return build_runner(reader, GLM5_SERVING.replace(tp=TP, ep=ep, device=device, max_decode_batch=MAX_DECODE_BATCH,
                                                     num_blocks=num_blocks, disabled_passes=disabled,
                                                     act_quant=act_quant), program=program)


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def measure_point(runner: Runner, run: dict, kind: str, batch: int, ctx: int, copy_gbs, gen, device) -> dict:
    """One point's figures: the time and profile, the memory, the collectives' bytes and (TPOT) the roofline."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    if kind == "ttft":
        measure = measure_ttft(runner, ctx, gen, device)
    else:
        measure = measure_tpot(runner, batch, ctx, gen, device)
    rows = collective_rows(runner, kind, batch, ctx)
    sent = {c["op"]: c["count"] * c["bytes_per_row"] * rows[c["op"]] for c in run["collectives_per_step"]}
    result = {op: n if op == "all_reduce" else TP * n for op, n in sent.items()}  # an all_gather's result: TP inputs
    priced = {op: dict(bytes=n, ms=_digits(priced_ms(op, n, run["nvlink_bus_gbs"]))) for op, n in result.items()}
    measure.update(memory(device), collective_bytes_per_step=sent, collectives_priced=priced,
                   collective_mb=_digits(sum(result.values()) / 1e6),
                   collective_ms=_digits(sum(p["ms"] for p in priced.values())))
    if kind == "tpot":
        busiest = run["routing"].get(batch)
        need = step_bytes(runner.config, run["weight_bytes"], batch, ctx, run["ep"],
                          busiest and busiest["steered_distinct_experts"])
        roof = need / (copy_gbs * 1e9) * 1e3 if copy_gbs else None
        measure.update(step_bytes=need, roofline_ms=roof and round(roof, 3),
                       ratio=roof and round(measure["measured_ms"] / roof, 2))
    return measure


def _digits(x: float) -> float:
    return float(f"{x:.4g}")


class Variant:
    """Context manager: the decode step under VARIANTS[name] (environment set, module dicts patched, the runner's
    decode graphs dropped so that they are captured under it), everything put back after."""

    def __init__(self, runner: Runner, name: str):
        self.runner, (self.env, self.patches) = runner, VARIANTS[name]

    def __enter__(self):
        import importlib

        self.saved_env = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        self.saved = []
        for target, keys in self.patches.items():
            module, attr = target.rsplit(".", 1)
            table = getattr(importlib.import_module("fxglm5.lowering.triton." + module), attr)
            self.saved.append((table, {k: table.get(k) for k in keys}))
            table.update(keys)
        self._drop_graphs()
        return self

    def __exit__(self, *exc):
        for k, v in self.saved_env.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        for table, old in self.saved:
            for k, v in old.items():
                table.pop(k, None) if v is None else table.__setitem__(k, v)
        self._drop_graphs()

    def _drop_graphs(self):
        if self.runner.decode_graphs is not None:
            sync(torch.device(self.runner.device))
            self.runner.decode_graphs.reset()


def run_variants(runner: Runner, run: dict, names, points: dict, copy_gbs, table: harness.Results, save, gen,
                 device) -> None:
    """Each of ``names`` measured at ``points`` (TPOT) on ``runner``; a variant that fails is recorded as such."""
    for name in names:
        for point, (kind, batch, ctx) in points.items():
            row = dict(point=point, passes_disabled=run["disabled_passes"], variant=name, batch=batch, ctx=ctx)
            try:
                with Variant(runner, name):
                    m = measure_point(runner, run, kind, batch, ctx, copy_gbs, gen, device)
            except Exception as err:  # noqa: BLE001 - one setting failing leaves the run's other figures standing
                run.setdefault("variants", {}).setdefault(name, {})[point] = dict(failed=repr(err)[:400])
                table.add(**row, status=f"failed: {type(err).__name__}: {str(err)[:200]}")
                save()
                continue
            run.setdefault("variants", {}).setdefault(name, {})[point] = m
            table.add(**row, status="measured", ms=m["measured_ms"], collective_mb=m["collective_mb"],
                      collective_ms=m["collective_ms"], roofline_ms=m.get("roofline_ms"),
                      ratio=m.get("ratio"), kernels_per_step=m["profile"]["kernels_per_step"],
                      kernel_ms_per_step=m["profile"]["kernel_ms_per_step"],
                      wall_over_kernel=m["profile"]["wall_over_kernel"])
            save()


def run_points(reader, device, points: dict, disabled, copy_gbs, record: dict, table: harness.Results, save,
               ep: int, load: str, act_quant: bool, variants=(), variant_points=None) -> None:
    """Compile and load a runner with a 2-block cache, then rebuild it over the same graph with the cache sized for
    the points that fit beside the weights, and measure each point into ``record`` and ``table``. ``load``:
    ``busiest`` steers the rank's router to the busiest rank's routing (``routing_load``) for the TPOT batches, where
    ranks hold different experts (``ep > 1``); ``mean``: the router as the random weights make it. ``act_quant``:
    W8A8 FP8 GEMMs."""
    buckets = {batch: next(b for b in pow2_buckets(MAX_DECODE_BATCH) if b >= batch)
               for kind, batch, _ in points.values() if kind == "tpot"}
    steering, load_summary = contextlib.nullcontext(), {}
    if load == "busiest" and ep > 1:
        steering, load_summary = SteeredRouting.busiest(reader.config, ep, buckets, device)
    with steering:
        _run_points(reader, device, points, disabled, copy_gbs, record, table, save, ep,
                    dict(load=load, routing=load_summary), act_quant, variants, variant_points)


def _run_points(reader, device, points, disabled, copy_gbs, record, table, save, ep, load, act_quant, variants,
                variant_points) -> None:
    label = ",".join(disabled) or None
    start = time.perf_counter()
    first = rank_runner(reader, device, 2, ep, act_quant, disabled=disabled)
    built_s = time.perf_counter() - start
    per_token = nbytes(first.cache.tensors.values()) // (2 * BLOCK)
    free = available_memory(device) + nbytes(first.cache.tensors.values())
    reserve = ACTIVATION_RESERVE if device.type == "cuda" else 0
    need = {name: blocks_for(*spec, device) for name, spec in points.items()}
    fit = [n for n in points if need[n] <= (free - reserve) // (per_token * BLOCK) - 1]
    program = first.program
    del first
    gc.collect()
    runner = rank_runner(reader, device, max((need[n] for n in fit), default=1) + 1, ep, act_quant, program=program)
    weights = weight_bytes(program.graph)
    run = dict(disabled_passes=label, compile_s=round(built_s - reader.seconds, 2), load_s=round(reader.seconds, 2),
               weight_bytes=weights, weights_gb={k: round(v / 1e9, 3) for k, v in weights.items()},
               weights_total_gb=round(sum(weights.values()) / 1e9, 2), kv_bytes_per_token=per_token,
               free_after_load_gib=round(free / 2**30, 2),
               cache_gib=round(nbytes(runner.cache.tensors.values()) / 2**30, 2),
               collectives_per_step=collectives(program.graph), nvlink_bus_gbs=record["nvlink_bus_gbs"], ep=ep,
               fp8_gemms={f"{op} act_quant={quant}": n for (op, quant), n in act_quant_ops(program.graph).items()},
               load=load["load"],
               routing=load["routing"], points={})
    record.setdefault("runs", []).append(run)
    print(f"== passes disabled: {label}: compile {run['compile_s']} s, load {run['load_s']} s, weights "
          f"{run['weights_total_gb']} GB {run['weights_gb']}, free after load {run['free_after_load_gib']} GiB",
          flush=True)
    gen = torch.Generator().manual_seed(1)
    for name, (kind, batch, ctx) in points.items():
        row = dict(point=name, passes_disabled=label, batch=batch, ctx=ctx)
        if name in fit:
            m = run["points"][name] = measure_point(runner, run, kind, batch, ctx, copy_gbs, gen, device)
            table.add(**row, status="measured", ms=m["measured_ms"], collective_mb=m["collective_mb"],
                      collective_ms=m["collective_ms"], roofline_ms=m.get("roofline_ms"),
                      ratio=m.get("ratio"), step_gb=round(m["step_bytes"] / 1e9, 2) if "step_bytes" in m else None,
                      kernels_per_step=m["profile"]["kernels_per_step"],
                      kernel_ms_per_step=m["profile"]["kernel_ms_per_step"],
                      wall_over_kernel=m["profile"]["wall_over_kernel"], peak_gib=m.get("peak_allocated_gib"))
        else:
            reason = (f"its cache needs {need[name] * BLOCK * per_token / 2**30:.3g} GiB, "
                      f"{(free - reserve) / 2**30:.3g} GiB free after the weights and {reserve / 2**30:.3g} GiB "
                      "kept for activations")
            print(f"skip {name}: {reason}", flush=True)
            run["points"][name] = dict(skipped=reason)
            table.add(**row, status="skipped: " + reason)
        save()
    run_variants(runner, run, variants, {n: p for n, p in (variant_points or {}).items() if n in fit}, copy_gbs, table,
                 save, gen, device)
    del runner, program
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def notes(record: dict) -> str:
    """The markdown under the table: how it was measured, and per run what the rank holds and sends."""
    lines = ["", *(f"- {k}: {record[k]}" for k in ("setup", "context", "timing", "roofline", "collectives"))]
    for run in record.get("runs", []):
        lines += ["", f"## Passes disabled: {run['disabled_passes']}", "",
                  f"- compile {run['compile_s']} s, load (random weights drawn on the device) {run['load_s']} s",
                  f"- weights {run['weights_total_gb']} GB: "
                  + ", ".join(f"{k} {v}" for k, v in run["weights_gb"].items()),
                  f"- free after load {run['free_after_load_gib']} GiB; cache {run['cache_gib']} GiB, "
                  f"{run['kv_bytes_per_token']} B per token",
                  "- FP8 GEMM ops: " + ", ".join(f"{k} x{n}" for k, n in run["fp8_gemms"].items()),
                  "- collectives per step: " + ", ".join(f"{c['count']} {c['op']} of {c['bytes_per_row']} B per row"
                                                         for c in run["collectives_per_step"])]
        for batch, sim in run["routing"].items():
            lines.append(f"- busiest-rank routing at B={batch}: {sim['busiest_distinct_experts']} distinct local experts "
                         f"expected over {sim['trials']} simulated steps (average rank {sim['mean_distinct_experts']}), "
                         f"{sim['steered_distinct_experts']} over the {sim['layers']} steered MoE layers; "
                         f"{sim['busiest_pairs']} token-expert pairs (average {sim['mean_pairs']})")
        for point, m in run["points"].items():
            split = m.get("profile", {}).get("layer_kernels")
            for kind in ("dense", "moe") if split else ():
                lines.append(f"- {point}, one {kind} layer ({len(split[kind])} kernels, "
                             f"{sum(k['us'] for k in split[kind]):.1f} us): "
                             + ", ".join(f"{k['kernel'][:40]} {k['us']}" for k in split[kind]))
            if "collectives_priced" in m:
                lines.append(f"- {point}: collectives per step " + ", ".join(
                    f"{op} {p['bytes'] / 1e6:.3g} MB {p['ms']} ms" for op, p in m["collectives_priced"].items()))
            if "profile" in m:
                top = "; ".join(f"{k['kernel'][:60]} {k['calls_per_step']} x, {k['us_per_step']} us"
                                for k in m["profile"]["top"][:6])
                lines.append(f"- {point}: per step {top}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--points", default=",".join(POINTS), help=f"a subset of {','.join(POINTS)}, measured in "
                        "the order given")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the config's, 78)")
    parser.add_argument("--without", default="", help="also run a baseline with these passes disabled")
    parser.add_argument("--tiny", action="store_true", help="a tiny config on the CPU, contexts / 256 (smoke run)")
    parser.add_argument("--variants", default="", help=f"kernel settings measured again: of {','.join(VARIANTS)}")
    parser.add_argument("--variant-points", default="tpot1x2k,tpot64x2k", help="the TPOT points of the variants")
    parser.add_argument("--ep", type=int, default=8, choices=EP_LAYOUTS,
                        help="expert layout over the 8 ranks: 1 = every expert split along its intermediate dim, "
                             "2 = two groups of 128 experts, each split over 4 ranks, 8 = 32 whole experts a rank "
                             "(default: %(default)s)")
    parser.add_argument("--nvlink-gbs", type=float, default=NVLINK_BUS_GBS,
                        help="the bus bandwidth per GPU (nccl-tests' busbw, GB/s) the collectives' bytes are priced at "
                             "(default: %(default)s, an assumption for H100 / H200 NVLink4)")
    parser.add_argument("--load", choices=("busiest", "mean"), default="busiest",
                        help="busiest: the measured rank routes as the busiest rank of a uniformly routed step "
                             "(simulated; bench/routing_load.py), the rank the others wait for; mean: the random "
                             "router's own routing, an average rank (default: %(default)s)")
    parser.add_argument("--act-quant", action="store_true",
                        help="W8A8 FP8 GEMMs: activations quantized 1x128 to e4m3 on the fly (the checkpoint's recipe, "
                             "as SGLang and vLLM run it); default: W8A16, fxglm5's default (bf16 activations)")
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    for option, names, known in (("--points", args.points.split(","), POINTS), ("--variants", variants, VARIANTS),
                                 ("--variant-points", args.variant_points.split(","), POINTS)):
        unknown = sorted(set(names) - set(known))
        if unknown:
            parser.error(f"{option}: unknown {unknown}; choose from {','.join(known)}")
    if any(POINTS[n][0] != "tpot" for n in args.variant_points.split(",")):
        parser.error("--variant-points: TPOT points only (the variants are decode settings)")

    def scaled(names):
        return {n: (POINTS[n][0], POINTS[n][1], POINTS[n][2] // TINY_SCALE if args.tiny else POINTS[n][2])
                for n in names.split(",")}  # measured in the order given

    points = scaled(args.points)
    device = torch.device("cpu" if args.tiny else "cuda")
    torch.manual_seed(0)
    if args.tiny:  # contexts / 256: the split threshold with them, above the decode steps' 64 tokens still
        split.MIN_ROWS_PER_RANK = -(-(MAX_DECODE_BATCH + 1) // TP)
    init_fake_group()
    cfg = bench_config(args.layers, args.tiny)
    copy_gbs = harness.copy_bandwidth_gbs() if device.type == "cuda" else None
    name = (("rank_at_depth_tiny" if args.tiny else "rank_at_depth") + f"_ep{args.ep}_{args.load}"
            + ("_w8a8" if args.act_quant else ""))
    gemms = ("W8A8 FP8 GEMMs (--act-quant: activations quantized 1x128 to e4m3 on the fly)" if args.act_quant
             else "W8A16 FP8 GEMMs (bf16 activations times the widened e4m3 weights; --act-quant: W8A8)")
    table = harness.Results(copy_gbs)
    record = dict(
        setup=f"one rank (0) of TP{TP} / EP{args.ep}, {args.load} routed load, fake process group (collectives return without communicating); "
              f"{cfg.num_hidden_layers} layers, random block-FP8 weights drawn on the device (uniform routing); bf16 "
              f"compute, {gemms}, FP8 latent + index caches, {BLOCK}-token blocks; decode CUDA graphs on a GPU",
        context="TPOT contexts are synthetic: random valid rows written by the cache-write kernels into every "
                "layer's caches, each request's state as after its prefill",
        timing=f"TTFT: one prefill after one warm-up of that length; TPOT: median of {TIMED} Runner.decode() steps "
               f"after {WARM} warm-ups, synchronised around each; profiles: torch.profiler over 1 prefill / "
               f"{profiled_steps(device)} decode steps",
        roofline="bytes a decode step must read on the rank (weights with the routed experts the batch's tokens "
                 "choose on this rank under uniform routing: the busiest rank's simulated expectation with --load "
                 "busiest, the average rank's with mean; and the batch's embedding rows, + top-k latent rows and all index "
                 "rows per layer and request) over the copy bandwidth measured in this run",
        collectives=f"not timed (fake process group); per point, each collective's bytes per step on the rank (an "
                    f"all_reduce's tensor, an all_gather's gathered result, the indexer's top-k all_gather included) "
                    f"and their bandwidth term at {args.nvlink_gbs:g} GB/s of bus bandwidth (nccl-tests' model: "
                    f"2 (W-1)/W x bytes for an all_reduce, (W-1)/W x bytes for an all_gather; latency left out; the "
                    f"bandwidth assumed, not measured: NVLINK_BUS_GBS)",
        act_quant=args.act_quant, nvlink_bus_gbs=args.nvlink_gbs, copy_bandwidth_gbs=copy_gbs,
        collective_probe=probe_collectives(device))
    print("collective probe:", record["collective_probe"], flush=True)

    def save() -> None:
        harness.write_record(os.path.join(harness.out_dir(), f"{name}_detail.json"), record, echo=False)
        table.save(name, notes=notes(record))

    for disabled in [()] + ([tuple(args.without.split(","))] if args.without else []):
        run_points(TimedReader(cfg), device, points, disabled, copy_gbs, record, table, save, args.ep, args.load,
                   args.act_quant, variants=variants if not disabled else (), variant_points=scaled(args.variant_points))
    print("\n" + table.markdown(), flush=True)
    print("saved under", harness.out_dir())


if __name__ == "__main__":
    main()
