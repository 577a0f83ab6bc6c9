"""The q_b | wq_b GEMM, the latent query and the DSA indexer in one launch of tasks
(``latent_query_indexer._gemm_latent_query_indexer_kernel``) compiled for sm_90 without a GPU (Triton's bundled ptxas),
launched as ``latent_query_indexer.fp8_linear_latent_query_indexer`` launches it (its arguments taken from the host
code over meta tensors) at one GLM-5 TP8 rank's decode shapes: the stacked q_b | wq_b GEMM (8 heads of 192 + 64
query columns, then the indexer's 32 x 128, over the 2048 features of the query latent), W_UK [8, 192, 512], the RoPE
tables of 64 features, an FP8 index cache of 64-token blocks (and the exact mode's bfloat16 keys) whose rows are
8192 keys (indexer.ONE_LAUNCH_KEYS: the longest the launch takes), top-2048, on an H100's 132 SMs, W8A16 and W8A8, at 1,
8 and 16 tokens. Checked: no local-memory spills, the PDL wait before the queue's atomic, the finished tiles' release
signals, the acquire spins, the index query read from L2 (.cg: more such loads than the latent query's launch and the
indexer's together), the rows' tickets (one acq_rel add more than the latent query's launch), and the registers a
thread against the launch without the
indexer (``paged_cache._gemm_latent_query_kernel``) and the indexer's own one launch under the same logits
configuration (``indexer._indexer_topk_kernel``): a launch of tasks holds every role's code and the largest sets the
registers, which bound the CTAs an SM holds (the report's ``ctas_per_sm``, 4 warps a CTA).

Registers a thread when written (this launch / the latent query's launch / the indexer's own launch), none spilled,
ptxas for sm_90a with Triton 3.6: 252 / 128 to 150 / 250 in every FP8 variant, 254 / 130 / 246 over the exact mode's
bfloat16 keys; shared memory the GEMM pipeline's (40 KiB W8A16, 44 KiB W8A8; the indexer's launch alone takes 20 KiB
over FP8 keys). So two CTAs an SM by registers, where the latent query's launch holds three: the indexer's selection
(a row of 8192 keys in registers, a key and an index per entry) sets the launch's registers, and the GEMM's tiles
(528 to 768 tasks in all) run at its occupancy in this launch. A count from the compiler, not a measurement; whether
the launch it saves outweighs that is not timed. ``test_registers_and_ctas_per_sm`` prints the figures (``-s``)."""

import os
import re

import pytest

triton = pytest.importorskip("triton")

from tests.kernels.sm90_reports import report_each, reports_from_subprocess  # noqa: E402
from tests.kernels.test_gemm_latent_query_compile import H100_SMS, HEADS, INDEX, NOPE, Q_LORA, RANK, ROPE  # noqa: E402
from tests.kernels.test_gemm_latent_query_compile import _compile  # noqa: E402

HI, DI, BS, TOPK, KEYS = 32, 128, 64, 2048, 8192
_ACQ_REL = r"atom\.global\.gpu\.acq_rel\.add"
VARIANTS = [(tokens, act_quant, "fp8") for tokens in (1, 8, 16) for act_quant in (False, True)] + [(16, False, "bf16")]


def _launches(tokens: int, act_quant: bool, cache: str) -> dict:
    """kernel name -> (positional arguments, keywords) of the fused launch and of the latent query's launch without
    the indexer (fp8_linear_latent_query of the same operands), from the host code over meta tensors."""
    import torch

    from fxglm5.lowering.triton import fp8_gemm, latent_query_indexer, paged_cache

    captured = {}

    class Capture:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: captured.setdefault(self.name, (args, kwargs, grid))

    patches = [(latent_query_indexer, "_gemm_latent_query_indexer_kernel",
                Capture("_gemm_latent_query_indexer_kernel")),
               (paged_cache, "_gemm_latent_query_kernel", Capture("_gemm_latent_query_kernel")),
               (fp8_gemm, "num_sms", lambda device: H100_SMS), (latent_query_indexer, "interpreted", lambda d: False)]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    for module, name, value in patches:
        setattr(module, name, value)
    try:
        meta = dict(device="meta")
        x = torch.empty(1, tokens, Q_LORA, dtype=torch.bfloat16, **meta)
        n = HEADS * (NOPE + ROPE) + INDEX
        weight = torch.empty(n, Q_LORA, dtype=torch.float8_e4m3fn, **meta)
        scale = torch.empty(n // 128, Q_LORA // 128, dtype=torch.float32, **meta)
        w_uk = torch.empty(HEADS, NOPE, RANK, dtype=torch.bfloat16, **meta)
        cos, sin = (torch.empty(1, tokens, ROPE // 2, dtype=torch.float32, **meta) for _ in range(2))
        weights = torch.empty(1, tokens, HI, dtype=torch.float32, **meta)
        blocks = 4096
        index_cache = torch.empty(blocks, BS, 132, dtype=torch.uint8, **meta) if cache == "fp8" else \
            torch.empty(blocks, BS, 128, dtype=torch.bfloat16, **meta)
        table = torch.empty(tokens, KEYS // BS, dtype=torch.int32, **meta)
        req, pos = (torch.empty(tokens, dtype=torch.int32, **meta) for _ in range(2))
        result = latent_query_indexer.fp8_linear_latent_query_indexer(
            x, weight, scale, None, act_quant, w_uk, 0, ROPE, cos, sin, HEADS * (NOPE + ROPE), HI, DI, weights, TOPK,
            index_cache, table, req, pos, True, 1)
        assert result is not None
        paged_cache.fp8_linear_latent_query(x, weight, scale, None, act_quant, w_uk, 0, ROPE,
                                            (cos.view(tokens, -1), sin.view(tokens, -1)))
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
    return captured


def _indexer_alone(cache: str, kwargs: dict) -> dict:
    """The indexer's own one launch (``_indexer_topk_kernel``) under the fused launch's logits configuration."""
    from tests.kernels.test_indexer_topk_compile import _compile as compile_indexer

    assert (kwargs["I_BLOCK_N"], kwargs["TILES"]) == (128, 4)  # indexer._GATHER_DEFAULT: index 0 of its configs
    return compile_indexer(cache, KEYS, 0)


def _report(tokens: int, act_quant: bool, cache: str) -> dict:
    from fxglm5.lowering.triton import latent_query_indexer, paged_cache

    launches = _launches(tokens, act_quant, cache)
    args, kwargs, grid = launches["_gemm_latent_query_indexer_kernel"]
    fused = _compile(latent_query_indexer._gemm_latent_query_indexer_kernel, args, kwargs)
    alone = _compile(paged_cache._gemm_latent_query_kernel, *launches["_gemm_latent_query_kernel"][:2])
    indexer = _indexer_alone(cache, kwargs)
    return dict(fused, tasks=grid[0], latent_query_ptxas=alone["ptxas"], latent_query_shared=alone["shared"],
                latent_query_cg=alone["ptx"].count("ld.global.cg"),
                latent_query_acq_rel=len(re.findall(_ACQ_REL, alone["ptx"])), indexer_ptxas=indexer["ptxas"],
                indexer_shared=indexer["shared"], indexer_cg=indexer["ptx"].count("ld.global.cg"),
                num_warps=kwargs["num_warps"], F32DOT=kwargs["F32DOT"],
                split=kwargs["SPLIT_K"], fixup=kwargs["FIXUP"])


def _reports_of_every_variant() -> dict[str, dict]:
    os.environ["FXGLM5_DECODE_JOINS"] = "all"  # this subprocess compiles the joined launch (an opt-in join)
    return report_each(VARIANTS, _report)


@pytest.fixture(scope="module")
def reports():
    return reports_from_subprocess("tests.kernels.test_gemm_latent_query_indexer_compile")


def _registers(log: str) -> int:
    return int(re.search(r"Used (\d+) registers", log).group(1))


def _ctas_per_sm(registers: int, shared: int, warps: int) -> int:
    """CTAs an H100 SM holds by registers (64 K a SM, allocated per warp in 256s) and shared memory (227 KiB)."""
    per_warp = -(-registers * 32 // 256) * 256
    return min(65536 // (per_warp * warps), (227 * 1024) // max(shared, 1))


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"{v[0]}tok_{'w8a8' if v[1] else 'w8a16'}_{v[2]}")
def test_the_launch_compiles_for_hopper_without_spills(reports, variant):
    r = reports[repr(variant)]
    assert "error" not in r, r.get("error")
    assert r["num_warps"] == 4 and r["F32DOT"] is False  # the GPU's configuration, not the interpreter's
    assert r["split"] > 1 and r["fixup"]  # the split-K fix-up compiled in: a tile's last split signals
    assert re.search(r"\b0 bytes spill stores, 0 bytes spill loads", r["ptxas"]), r["ptxas"]
    ptx = r["ptx"]
    assert "griddepcontrol.wait" in ptx
    assert ptx.index("griddepcontrol.wait") < ptx.index("atom.global")  # the wait before the queue's atomic
    assert re.search(r"atom\.global\.gpu\.release\.add", ptx), "the finished tiles' signals"
    assert re.search(r"ld\.global\.gpu\.acquire", ptx), "the consumers' spins (an add of 0: an acquire load)"
    # the latent query's launch's (the tasks' done count, the FIXUP's arrivals) and the rows' tickets
    assert len(re.findall(_ACQ_REL, ptx)) == r["latent_query_acq_rel"] + 1, "one more: the row's ticket"
    # beyond the two launches' own L2 loads (the latent query's q_nope / q_pe and FIXUP partials, the selecting
    # program's scores): the index query's
    assert ptx.count("ld.global.cg") > r["latent_query_cg"] + r["indexer_cg"], "the index query read from L2"


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"{v[0]}tok_{'w8a8' if v[1] else 'w8a16'}_{v[2]}")
def test_registers_and_ctas_per_sm(reports, variant):
    """The launch's registers are the largest role's (within a few of the indexer's own launch, which the selection's
    row sets), at least the latent query's launch's; its shared memory the GEMM's pipeline's or the indexer's, the
    larger. At least one CTA an SM, and the figures printed (``pytest -s``)."""
    r = reports[repr(variant)]
    assert "error" not in r, r.get("error")
    regs, lq, alone = _registers(r["ptxas"]), _registers(r["latent_query_ptxas"]), _registers(r["indexer_ptxas"])
    ctas = _ctas_per_sm(regs, r["shared"], 4)
    print(f"{variant}: {regs} registers a thread (latent query launch {lq}, indexer launch {alone}), shared "
          f"{r['shared']} B (latent query launch {r['latent_query_shared']}, indexer launch {r['indexer_shared']}), "
          f"{ctas} CTAs an SM, {r['tasks']} tasks")
    assert regs >= lq and regs >= alone - 16
    assert r["shared"] >= max(r["latent_query_shared"], r["indexer_shared"]) - 1024
    assert ctas >= 1
