"""Programmatic dependent launch (FXGLM5_PDL=1) on the GPU: the decode path's Triton and Gluon kernels launched so
that each may start while its predecessor drains give the same results as plain launches, eagerly and replayed from a
CUDA graph: a chain of dependent GEMM / norm kernels (half of its residual add + norms in the A loads of the GEMM
after them, add_rms_norm_fp8_linear, at decode) and a chain through the attention kernels at GLM-5's shapes
(each reading what the one before wrote, where a missing wait would read stale data), and the tiny model's decode
steps, token for token and bitwise. Each kernel of the chains is checked to have been compiled with ``launch_pdl``,
so the option reached Triton's launcher through every launch path (the autotuners, the Gluon kernel)."""

import pytest
import torch

from fxglm5.lowering.reference import paged as ref
from fxglm5 import settings
from fxglm5.lowering.triton import (device, f32_linear, fp8_gemm, indexer, latent_query_indexer, mla, mla_hopper,
                                    norm_rope, paged_cache, sparse_mla, topk)
from fxglm5.model.config import Glm5Config
from fxglm5.runtime.runner import Runner
from tests.helpers import random_model

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("all_decode_joins")]  # the joined kernels (opt-in)

H, R, DR, HI, BS, TOPK, SCALE = 64, 512, 64, 32, 64, 2048, 1.0 / 16  # GLM-5's attention shapes, 64-token blocks
DN = 192  # qk_nope_head_dim, here also W_UV's outputs, so that a step's output is the next step's q_nope
LENS = [5000, 2600]  # two requests' cached contexts, both longer than the top-k
REQ, POS = [0, 1, 1], [4999, 2599, 100]  # a decode step's tokens: two select from their scores, one fits in the top-k


def _sm90_or_later() -> bool:
    """Where :func:`fxglm5.lowering.triton.device.pdl` turns PDL on when asked."""
    return device.capability(torch.device("cuda"))[0] >= 9


def _launched_with_pdl(kernel) -> bool:
    """Whether a compiled variant of ``kernel`` (a JIT or Gluon function) took ``launch_pdl``."""
    return any(compiled.metadata.launch_pdl
               for cache, *_ in kernel.device_caches.values() for compiled in cache.values())


def _forget_compiled(kernels) -> None:
    """Drop the kernels' compiled variants, so that :func:`_launched_with_pdl` sees only what runs next (an earlier
    test may have compiled them with ``launch_pdl``). Triton never unloads a compiled module, so graphs captured
    before stay valid."""
    for kernel in kernels:
        kernel.device_caches.clear()


def test_pdl_is_on_only_where_asked(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setenv("FXGLM5_PDL", "0")
    assert device.pdl(cuda) == {"PDL": False}
    monkeypatch.setenv("FXGLM5_PDL", "1")
    hopper = device.capability(cuda)[0] >= 9
    assert device.pdl(cuda) == ({"PDL": True, "launch_pdl": True} if hopper else {"PDL": False})
    assert device.pdl(torch.device("cpu")) == {"PDL": False}


def _chain(x, w, s, norm_w, router):
    """Dependent launches: add + norm -> GEMM -> norm ... -> a float32 GEMV at the end, each reading the last output;
    every other add + norm inside the GEMM (one launch at decode, whose every CTA reads the rows the kernel before it
    wrote)."""
    h = x
    for i in range(10):
        if i % 2:
            h = fp8_gemm.add_rms_norm_fp8_linear(h, x, norm_w, 1e-5, w, s, None, False, config={"FIXUP": True})[0]
        else:
            normed, h = norm_rope.add_rms_norm(h, x, norm_w, 1e-5)
            h = fp8_gemm.fp8_linear(normed, w, s, None, False, config={"FIXUP": True})
        h = norm_rope.rms_norm(h, norm_w, 1e-5)
    return f32_linear.f32_linear(h, router, [0.5])


@pytest.mark.parametrize("rows", [1, 64])
def test_a_dependent_chain_is_the_same_with_and_without_pdl(rows, monkeypatch):
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 2048, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(2048, 2048, device="cuda", generator=g) * 0.5).to(torch.float8_e4m3fn)
    s = torch.rand(16, 16, device="cuda", generator=g) * 0.02 + 0.005
    norm_w = torch.ones(2048, device="cuda", dtype=torch.bfloat16)
    router = torch.randn(256, 2048, device="cuda", generator=g)
    monkeypatch.setenv("FXGLM5_PDL", "0")
    want = _chain(x, w, s, norm_w, router)
    monkeypatch.setenv("FXGLM5_PDL", "1")
    assert torch.equal(_chain(x, w, s, norm_w, router), want)  # eager, compiled with the PDL prologue
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _chain(x, w, s, norm_w, router)
    for _ in range(3):
        out.zero_()
        graph.replay()
        assert torch.equal(out, want)


def _attention_state() -> dict:
    """Two requests' FP8 latent and index caches (written by the reference), pristine copies to reset them from, and
    the inputs of a decode step of three tokens (:data:`REQ`, :data:`POS`)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    blocks = -(-max(LENS) // BS)
    bt = (torch.randperm(2 * blocks, device="cuda", generator=g) + 1).view(2, blocks).to(torch.int32)
    cache = torch.zeros(2 * blocks + 1, BS, 656, dtype=torch.uint8, device="cuda")
    kc = torch.zeros(2 * blocks + 1, BS, 132, dtype=torch.uint8, device="cuda")
    req_all = torch.cat([torch.full((n,), b, device="cuda") for b, n in enumerate(LENS)])
    slots = ref.slots_from_positions(bt, req_all, torch.cat([torch.arange(n, device="cuda") for n in LENS]), BS)
    n, t = slots.numel(), len(REQ)
    ref.write_latent_cache(cache, torch.randn(n, R, device="cuda", generator=g),
                           torch.randn(n, DR, device="cuda", generator=g), slots)
    ref.write_indexer_cache(kc, torch.randn(n, 128, device="cuda", generator=g), slots)
    req = torch.tensor(REQ, dtype=torch.int32, device="cuda")
    pos = torch.tensor(POS, dtype=torch.int32, device="cuda")

    def bf16(*shape):
        return torch.randn(*shape, device="cuda", generator=g).to(torch.bfloat16)

    return dict(bt=bt, cache=cache, kc=kc, cache0=cache.clone(), kc0=kc.clone(), req=req, pos=pos,
                slots=ref.slots_from_positions(bt, req, pos, BS), o=bf16(t, H, DN), q_pe=bf16(t, H, DR),
                w_uk=bf16(H, DN, R) * DN ** -0.5, w_uv=bf16(H, DN, R) * R ** -0.5,
                k_pe=bf16(t, DR), qi=bf16(t, HI, 128), w=torch.rand(t, HI, device="cuda", generator=g) * HI ** -0.5,
                logits=torch.empty(t, bt.shape[1] * BS, device="cuda"),
                top=torch.empty(t, TOPK, dtype=torch.int32, device="cuda"))


def _attention_chain(st: dict, method: str):
    """Three decode steps through the attention kernels, each reading what the kernel before it wrote: the last
    output's first 512 values, quantized 1x128 to FP8 (and dequantized by torch), are the token's latent row, written
    into the cache that both MLAs then read; the sparse MLA's output (W_UV applied in its combine) is the next q_nope
    (the latent query kernel, W_UK applied in it); the dense MLA's latent output the token's index key, written where
    the next step's indexer reads. The sparse MLA takes the Gluon kernel on sm_90, the dense one the autotuned Triton
    kernel (``cfg={}``); both split the keys, so both combine kernels run.
    Returns (sparse output, dense output, selection) of the last step."""
    o, t = st["o"], len(REQ)
    for _ in range(3):
        q8, s8 = fp8_gemm.quantize_act_1x128(o.reshape(t, -1)[:, :R].contiguous())
        kv = (q8.float().view(t, R // 128, 128) * s8[:, :, None]).view(t, R).to(torch.bfloat16)
        paged_cache.write_latent_cache(st["cache"], kv, st["k_pe"], st["slots"], validate=False)
        q = paged_cache.latent_query(o, st["w_uk"], st["q_pe"])
        if method == "one_launch":  # the decode step's logits and top-k in one launch
            top = indexer.indexer_topk_paged(st["qi"], st["w"], st["kc"], st["bt"], st["req"], st["pos"], TOPK,
                                             validate=False, logits_buf=st["logits"], out=st["top"])
        else:
            logits = indexer.indexer_logits_paged(st["qi"], st["w"], st["kc"], st["bt"], st["req"], st["pos"],
                                                  out=st["logits"], validate=False, skip_window=TOPK)
            top = topk.topk_from_logits(logits, st["pos"], TOPK, out=st["top"], method=method, validate=False)
        o = sparse_mla.sparse_mla_paged(q, st["cache"], st["bt"], st["req"], top, SCALE, validate=False,
                                        w_uv=st["w_uv"])
        dense = mla.mla_decode_paged(q, st["cache"], st["bt"], st["req"], st["pos"], SCALE, validate=False, cfg={})
        paged_cache.write_indexer_cache(st["kc"], dense[:, 0, :128], st["slots"], validate=False)
    return o, dense, top


def _attention_kernels(method: str) -> dict:
    """The kernels :func:`_attention_chain` launches, by name. Under the module's joins (``mla_project`` among them)
    the sparse MLA and its W_UV combine are one launch of tasks (three tokens), the Gluon one on sm_90."""
    hopper = device.capability(torch.device("cuda")) == (9, 0)  # mla_hopper.supported: the sparse MLA's kernel there
    kernels = {"1x128 quantization": fp8_gemm._quant_kernel, "latent write": paged_cache._write_latent_fp8_kernel,
               "latent query": paged_cache._latent_query_kernel, "index write": paged_cache._write_index_kernel,
               "MLA": mla._mla_fwd_kernel, "MLA combine": mla._mla_combine_kernel}
    if settings.joins("mla_project"):
        kernels["MLA with W_UV in one launch"] = (mla_hopper._mla_hopper_project_kernel if hopper
                                                  else mla._mla_project_kernel)
    else:
        kernels["MLA combine with W_UV"] = mla._mla_combine_project_kernel
        if hopper:
            kernels["Hopper MLA"] = mla_hopper._mla_hopper_kernel
    if method == "one_launch":
        kernels["indexer logits and top-k"] = indexer._indexer_topk_kernel
    else:
        kernels["indexer logits"] = indexer._indexer_logits_kernel
    if method == "segments":
        kernels["segment top-k"] = topk._segment_topk_kernel
    elif method == "multi":
        kernels.update({"radix histogram": topk._radix_hist_kernel, "radix count": topk._radix_count_kernel,
                        "radix write": topk._radix_write_kernel})
    return kernels


@pytest.mark.parametrize("method", ["segments", "multi", "one_launch"])
def test_attention_chain_is_the_same_with_and_without_pdl(method, monkeypatch):
    """The attention kernels of a decode step (both top-k methods after the logits kernel, and the decode step's
    one launch of both), eagerly and from a CUDA graph, give bitwise the results of plain launches; one token's
    window fits in the top-k, so the indexer's and the top-k's early exits (after their prologue) run too."""
    if not _sm90_or_later():
        pytest.skip("programmatic dependent launch needs sm_90 or later")
    st = _attention_state()
    assert indexer.one_launch_round(len(REQ), st["logits"].shape[1], TOPK, False) is not None  # a decode step's shape

    def run():
        st["cache"].copy_(st["cache0"])
        st["kc"].copy_(st["kc0"])
        return _attention_chain(st, method)

    monkeypatch.setenv("FXGLM5_PDL", "0")
    want = [t.clone() for t in run()]  # the autotuners pick their launches here (PDL is not part of their keys)
    assert (want[2][:2] >= 0).all() and (want[2][2, 101:] == -1).all()  # two rows selected, one took its window
    monkeypatch.setenv("FXGLM5_PDL", "1")
    kernels = _attention_kernels(method)
    _forget_compiled(kernels.values())
    got = run()
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert [name for name, kernel in kernels.items() if not _launched_with_pdl(kernel)] == []
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _attention_chain(st, method)
    for _ in range(3):
        for t in out:
            t.zero_()
        st["cache"].copy_(st["cache0"])
        st["kc"].copy_(st["kc0"])
        graph.replay()
        assert all(torch.equal(a, b) for a, b in zip(out, want))


# The attention kernels a decode step of the tiny model may launch, by name; which of them run depends on the joins
# and on what the Gluon kernels serve (the Hopper MLA, its one launch with W_UV where W_UV suits it).
_STEP_KERNELS = {
    "norm and cache writes": paged_cache._norm_write_caches_kernel,
    "latent query": paged_cache._latent_query_kernel,
    "indexer logits and top-k": indexer._indexer_topk_kernel,
    "q_b GEMM with the latent query and the indexer": latent_query_indexer._gemm_latent_query_indexer_kernel,
    "MLA": mla._mla_fwd_kernel, "Hopper MLA": mla_hopper._mla_hopper_kernel,
    "MLA combine with W_UV": mla._mla_combine_project_kernel,
    "MLA with W_UV in one launch": mla._mla_project_kernel,
    "Hopper MLA with W_UV in one launch": mla_hopper._mla_hopper_project_kernel,
}
# what must run: by default (no attention join) the chain's own launches; with every join the q_b launch that holds
# the latent query and the indexer, and one of the sparse MLA's one-launch kernels (or its two launches)
_REQUIRED = {"default": {"norm and cache writes", "latent query", "indexer logits and top-k", "MLA combine with W_UV"},
             "all": {"norm and cache writes", "q_b GEMM with the latent query and the indexer"}}


@pytest.mark.parametrize("joins", ["default", "all"])
def test_tiny_model_decodes_the_same_with_pdl(joins, monkeypatch):
    """The whole paged step, prefill and decode, with the default launches and with every decode join. Its decode
    contexts (11 to 19 and 3 to 11 tokens) pass the tiny preset's index_topk of 8, so the indexer scores and selects
    (every step here in one launch: 14 tokens at most, a short block table); the caches are written and the sparse
    MLA (the Gluon kernel on sm_90, bf16) reads them. Every attention kernel that ran took ``launch_pdl`` where the
    flag is on, none where it is off, and the same kernels ran both times."""
    if joins == "default":
        monkeypatch.delenv("FXGLM5_DECODE_JOINS")
    model = random_model(Glm5Config.preset("tiny"), torch.bfloat16).cuda()
    prompts = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46], [7, 1, 8]]
    runs, ran = {}, {}
    for flag in ("0", "1"):
        monkeypatch.setenv("FXGLM5_PDL", flag)
        _forget_compiled(_STEP_KERNELS.values())
        runner = Runner(model, kv_cache="fp8", block_size=16, dtype=torch.bfloat16, device="cuda", keep_logits=True)
        seqs = runner.run(prompts, 8)
        assert runner.decode_graphs.graphs  # decode steps replayed from CUDA graphs
        runs[flag] = [s.output for s in seqs], [torch.stack(s.logits) for s in seqs]
        ran[flag] = {name for name, kernel in _STEP_KERNELS.items()
                     if any(cache for cache, *_ in kernel.device_caches.values())}  # compiled since forgotten
        took_pdl = {name for name, kernel in _STEP_KERNELS.items() if _launched_with_pdl(kernel)}
        assert took_pdl == (ran[flag] if flag == "1" and _sm90_or_later() else set()), (took_pdl, ran[flag])
    assert ran["0"] == ran["1"] and _REQUIRED[joins] <= ran["1"], ran
    sparse = {"MLA", "Hopper MLA", "MLA with W_UV in one launch", "Hopper MLA with W_UV in one launch"} & ran["1"]
    assert sparse, ran  # the sparse MLA ran through one of its kernels
    assert runs["1"][0] == runs["0"][0]
    assert all(torch.equal(a, b) for a, b in zip(runs["1"][1], runs["0"][1]))
