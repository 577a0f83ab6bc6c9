"""The q_b | wq_b GEMM and the latent query in one launch of tasks (``paged_cache._gemm_latent_query_kernel``)
compiled for sm_90 without a GPU (Triton's bundled ptxas), launched as ``paged_cache.fp8_linear_latent_query``
launches it (its arguments taken from the host code over meta tensors) at one GLM-5 TP8 rank's decode shapes: the
stacked q_b | wq_b GEMM (8 heads of 192 + 64 query columns, then the indexer's 32 x 128, over the 2048 features of the
query latent), W_UK [8, 192, 512], the RoPE tables of 64 features, on an H100's 132 SMs, W8A16 and W8A8, at 1, 8 and
16 tokens: no local-memory spills, the PDL wait first, the task queue's atomic, the finished tiles' release signals,
the query programs' acquire spin, q_nope and q_pe read from L2, and the registers a thread against the GEMM's own
launch (``fp8_gemm._gemm_kernel`` compiled as fp8_linear launches it): a launch of tasks holds both roles' code and
the larger sets the registers, which bound the CTAs an SM holds (the decode GEMM's split asks for CTAS_PER_SM of
them). Compiled as launched with PDL.

Registers a thread when written (this launch / the GEMM's own, W8A16 then W8A8): 128 / 130 and 128 / 128 at 1 token,
130 / 104 and 150 / 146 at 8 and at 16 tokens; none spilled; shared memory 40 KiB (W8A16) and 44 KiB (W8A8), the
GEMM's own. So three CTAs an SM by registers in every variant (the GEMM alone holds four at 8 and 16 tokens W8A16,
three elsewhere); the 26 more registers at 8 and 16 tokens W8A16 come from ptxas' schedule of the same tile code
(``gemm_tile`` launched over ``program_id(0)`` alone takes 130 there too), and ``maxnreg=128`` brings them to 128
without spills (W8A8 then spills 8 bytes): not set, not timed."""

import os
import re

import pytest

triton = pytest.importorskip("triton")

from tests.kernels.sm90_reports import ptxas_report, report_each, reports_from_subprocess  # noqa: E402

H100_SMS = 132
HEADS, NOPE, ROPE, RANK, Q_LORA, INDEX = 8, 192, 64, 512, 2048, 32 * 128
VARIANTS = [(tokens, act_quant) for tokens in (1, 8, 16) for act_quant in (False, True)]
_TYPES = {"bfloat16": "bf16", "float32": "fp32", "int32": "i32", "float8_e4m3fn": "fp8e4nv", "uint8": "u8"}
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "launch_pdl")


def _launches(tokens: int, act_quant: bool) -> dict:
    """kernel name -> (positional arguments, keywords) of the fused launch and of the GEMM's own launch (fp8_linear
    of the same operands), from the host code over meta tensors (no memory, no kernel run), the SMs an H100's."""
    import torch

    from fxglm5.lowering.triton import fp8_gemm, paged_cache

    captured = {}

    class Capture:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: captured.setdefault(self.name, (args, kwargs))

    patches = [(paged_cache, "_gemm_latent_query_kernel", Capture("_gemm_latent_query_kernel")),
               (fp8_gemm, "_gemm_kernel", Capture("_gemm_kernel")), (fp8_gemm, "num_sms", lambda device: H100_SMS),
               (paged_cache, "_latent_query_kernel", Capture("_latent_query_kernel"))]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    for module, name, value in patches:
        setattr(module, name, value)
    try:
        meta = dict(device="meta")
        x = torch.empty(tokens, Q_LORA, dtype=torch.bfloat16, **meta)
        n = HEADS * (NOPE + ROPE) + INDEX
        weight = torch.empty(n, Q_LORA, dtype=torch.float8_e4m3fn, **meta)
        scale = torch.empty(n // 128, Q_LORA // 128, dtype=torch.float32, **meta)
        w_uk = torch.empty(HEADS, NOPE, RANK, dtype=torch.bfloat16, **meta)
        rope = tuple(torch.empty(tokens, ROPE // 2, dtype=torch.float32, **meta) for _ in range(2))
        paged_cache.fp8_linear_latent_query(x, weight, scale, None, act_quant, w_uk, 0, ROPE, rope)
        fp8_gemm.fp8_linear(x, weight, scale, None, act_quant)
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
    return captured


def _compile(kernel, args, kwargs):
    import inspect

    import torch
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(kernel.fn).parameters)
    sig, const, aligned = {}, {}, []
    for name, value in zip(names, args):
        if isinstance(value, torch.Tensor):
            sig[name] = "*" + _TYPES[str(value.dtype).removeprefix("torch.")]
            aligned.append(name)
        elif isinstance(value, bool) or name in ("KG_PER_SPLIT", "H"):  # the kernels' positional constexprs
            sig[name], const[name] = "constexpr", value
        elif isinstance(value, float):
            sig[name] = "fp32"
        elif value == 1:  # the JIT specializes an integer 1 to a constant
            sig[name], const[name] = "constexpr", 1
        else:
            sig[name] = "i32"
            if value % 16 == 0:
                aligned.append(name)
    const.update({name: value for name, value in kwargs.items() if name not in _LAUNCH_OPTIONS}, PDL=True)
    sig.update({name: "constexpr" for name in kwargs if name not in _LAUNCH_OPTIONS})
    sig["PDL"] = "constexpr"
    for name, param in inspect.signature(kernel.fn).parameters.items():  # defaults left out (the GEMM's norm's)
        if name not in sig:
            sig[name], const[name] = "constexpr", param.default
    sig = {name: sig[name] for name in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    compiled = triton.compile(ASTSource(kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": kwargs["num_warps"], "num_stages": kwargs.get("num_stages", 3)})
    return ptxas_report(compiled)


def _report(tokens: int, act_quant: bool) -> dict:
    from fxglm5.lowering.triton import fp8_gemm, paged_cache

    launches = _launches(tokens, act_quant)
    assert "_latent_query_kernel" not in launches  # the fused launch ran, not the fallback
    fused = _compile(paged_cache._gemm_latent_query_kernel, *launches["_gemm_latent_query_kernel"])
    gemm = _compile(fp8_gemm._gemm_kernel, *launches["_gemm_kernel"])
    kwargs = launches["_gemm_latent_query_kernel"][1]
    return dict(fused, gemm_ptxas=gemm["ptxas"], gemm_shared=gemm["shared"], gemm_cg=gemm["ptx"].count("ld.global.cg"),
                split=kwargs["SPLIT_K"], fixup=kwargs["FIXUP"])


def _reports_of_every_variant() -> dict[str, dict]:
    os.environ["FXGLM5_DECODE_JOINS"] = "all"  # this subprocess compiles the joined launch (an opt-in join)
    return report_each(VARIANTS, _report)


@pytest.fixture(scope="module")
def reports():
    return reports_from_subprocess("tests.kernels.test_gemm_latent_query_compile")


def _registers(log: str) -> int:
    return int(re.search(r"Used (\d+) registers", log).group(1))


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"{v[0]}tok_{'w8a8' if v[1] else 'w8a16'}")
def test_the_gemm_and_latent_query_launch_compiles_for_hopper_without_spills(reports, variant):
    r = reports[repr(variant)]
    assert "error" not in r, r.get("error")
    assert r["split"] > 1 and r["fixup"]  # the split-K fix-up compiled in: a tile's last split signals
    assert re.search(r"\b0 bytes spill stores, 0 bytes spill loads", r["ptxas"]), r["ptxas"]
    assert _registers(r["ptxas"]) * 128 * 3 <= 65536, r["ptxas"]  # 4 warps: three CTAs an SM
    assert r["shared"] == r["gemm_shared"]  # the GEMM's stages set it, the query programs' tiles add nothing
    ptx = r["ptx"]
    assert "griddepcontrol.wait" in ptx
    assert ptx.index("griddepcontrol.wait") < ptx.index("atom.global")  # the wait before the queue's atomic
    assert re.search(r"atom\.global\.gpu\.release\.add", ptx), "the finished tiles' signals"
    assert re.search(r"ld\.global\.gpu\.acquire", ptx), "the query programs' spin (an add of 0: an acquire load)"
    # q_nope and q_pe read from L2, beyond the FIXUP's partials (the GEMM's own launch reads those so)
    assert ptx.count("ld.global.cg") > r["gemm_cg"], "q_nope and q_pe read from L2"
