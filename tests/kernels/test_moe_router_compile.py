"""The router kernel (``moe._router_kernel``: f32_linear's GEMV and the routing in one launch) compiled for sm_90
without a GPU (Triton's bundled ptxas) at GLM-5's router (256 experts of 6144 features, top-8, renormalized, the
ids local to an EP8 rank's 32 experts) on an H100's 132 SMs, at decode batches of 1, 8 and 16 tokens: no
local-memory spills, at most 128 registers a thread (four CTAs an SM, where the GEMV's split wants CTAS_PER_SM),
the PDL wait in it, and the tickets taken with acquire-release semantics at GPU scope (tests/gpu runs it)."""

import re

import pytest

triton = pytest.importorskip("triton")

from tests.kernels.sm90_reports import ptxas_report, report_each, reports_from_subprocess  # noqa: E402

VARIANTS = [(1,), (8,), (16,)]  # tokens
H100_SMS = 132
# integer arguments as the JIT specializes them at GLM-5's shapes (multiples of 16 are marked so, as the pointers)
INTS = {"M": None, "E": 256, "K": 6144, "stride_xm": 6144, "stride_rw": 6144, "num_local": 32}


def _compile(rows: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fxglm5.lowering.triton import f32_linear, moe

    grid, cfg = f32_linear.gemv_launch(256, 6144, rows, H100_SMS)
    sig = {"x_ptr": "*bf16", "rw_ptr": "*fp32", "part_ptr": "*fp32", "logits_ptr": "*fp32", "cnt_ptr": "*i32",
           "bias_ptr": "*fp32", "w_ptr": "*fp32", "ids_ptr": "*i32", "offset_ptr": "*i32",
           **{name: "i32" for name in INTS}, "scaling": "fp32"}
    const = dict(STEPS=cfg["STEPS"], SPLIT=cfg["SPLIT"], BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                 BLOCK_K=cfg["BLOCK_K"], TOP_K=8, BLOCK_E=256, BLOCK_TOPK=8,
                 ROUTE_ROWS=min(cfg["BLOCK_M"], moe.ROUTE_ROWS), RENORM=True, LOCAL=True, PDL=True)
    sig.update({name: "constexpr" for name in const})
    names = list(sig)
    aligned = [n for n in names if n.endswith("_ptr") or (INTS.get(n) or 1) % 16 == 0]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    kernel = triton.compile(ASTSource(moe._router_kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": cfg["num_warps"]})
    return dict(ptxas_report(kernel), split=cfg["SPLIT"])


def _reports_of_every_variant() -> dict[str, dict]:
    return report_each(VARIANTS, _compile)


@pytest.fixture(scope="module")
def reports():
    return reports_from_subprocess("tests.kernels.test_moe_router_compile")


@pytest.mark.parametrize("variant", VARIANTS, ids=["1_token", "8_tokens", "16_tokens"])
def test_router_kernel_compiles_for_hopper_without_spills(reports, variant):
    r = reports[repr(variant)]
    assert "error" not in r, r.get("error")
    assert r["split"] > 1  # K split over CTAs: the tiles' fix-up and the step's ticket both compiled
    assert re.search(r"\b0 bytes spill stores, 0 bytes spill loads", r["ptxas"]), r["ptxas"]
    registers = int(re.search(r"Used (\d+) registers", r["ptxas"]).group(1))
    assert registers <= 128, r["ptxas"]
    assert "griddepcontrol.wait" in r["ptx"]
    assert len(re.findall(r"atom\.global\.gpu\.acq_rel\.add", r["ptx"])) == 2, "the tile's and the step's tickets"
