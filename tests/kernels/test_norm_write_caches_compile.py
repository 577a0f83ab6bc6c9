"""rms_norm_write_caches' kernel (the query latent's RMSNorm and both cache writes, programs in three roles, and at
decode the indexer head weights' GEMV) compiled for sm_90 without a GPU (Triton's bundled ptxas), at GLM-5's decode
shapes (q_a 2048 wide, bf16, rows of the stacked q_a | kv_a | wk GEMM; 32 head weights of 6144 features, split over
an H100's 132 SMs as f32_linear splits them, at 1, 8 and 16 tokens): CI cannot run it on a GPU (tests/gpu does), but
it can check that every role compiles in every cache layout without local-memory spills (one kernel's registers are
its biggest role's: the 2048-wide norm, the FP8 latent row and the GEMV's products must not push another role into
spilling), and that with PDL the wait comes before the first memory access of any role, but for the head weights'
first tile, which is loaded before it (nothing stored, no atomic before the wait)."""

import re

import pytest

triton = pytest.importorskip("triton")

from tests.kernels.sm90_reports import ptxas_report, report_each, reports_from_subprocess  # noqa: E402

# (latent cache, index cache, PDL, tokens whose head weights the launch computes (0: none)): FP8 both (GLM-5-FP8's
# serving caches), bf16 both (the exact index keys), FP8 latent without an indexer (a layer that reuses the previous
# top-k), and FP8 both with the head weights at decode batches of 1, 8 and 16 tokens
VARIANTS = [("fp8", "fp8", False, 0), ("bf16", "bf16", False, 0), ("fp8", None, False, 0), ("fp8", "fp8", True, 0),
            ("fp8", "fp8", True, 1), ("fp8", "fp8", True, 8), ("fp8", "fp8", True, 16)]
STACKED = 2048 + 576 + 128  # the stacked first GEMM's row: q_a | kv_c, k_pe | the indexer's k
HIDDEN, HEADS, H100_SMS = 6144, 32, 132


def _compile(latent: str, index, pdl: bool, tokens: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fxglm5.lowering.triton import f32_linear
    from fxglm5.lowering.triton import paged_cache as pc

    fp8 = latent == "fp8"
    lat = {"c8_ptr": "*u8", "c32_ptr": "*fp32", "c16_ptr": "*i16"} if fp8 else \
        {"c8_ptr": "*i16", "c32_ptr": "*bf16", "c16_ptr": "*bf16"}
    idx = {"i8_ptr": "*u8", "i32_ptr": "*fp32"} if index == "fp8" else {"i8_ptr": "*i16", "i32_ptr": "*bf16"}
    sig = {"x_ptr": "*bf16", "xw_ptr": "*bf16", "out_ptr": "*bf16", "stride_x": "i32", "QD": "i32", "q_eps": "fp32",
           "Q_BLOCK": "constexpr", "Q_DT": "constexpr",
           "kv_ptr": "*bf16", "pe_ptr": "*bf16", "slot_ptr": "*i32", **lat, "kv_w_ptr": "*bf16", "cos_ptr": "*fp32",
           "sin_ptr": "*fp32", "stride_kv": "i32", "stride_pe": "i32", "stride_c": "i32", "RK": "i32", "RP": "i32",
           "HALF": "i32", "kv_eps": "fp32", "R": "constexpr", "DR": "constexpr", "G": "constexpr",
           "KV_NORM": "constexpr", "KV_ROPE": "constexpr", "KV_DT": "constexpr", "KV_FP8": "constexpr",
           "KV_BF16": "constexpr",
           "k_ptr": "*bf16", "k_slot_ptr": "*i32", **idx, "k_w_ptr": "*bf16", "k_b_ptr": "*bf16",
           "k_cos_ptr": "*fp32", "k_sin_ptr": "*fp32", "stride_k": "i32", "k_stride_c": "i32", "KD": "i32",
           "K_HALF": "i32", "k_eps": "fp32", "D": "constexpr", "BS": "constexpr", "K_NORM": "constexpr",
           "K_ROPE": "constexpr", "K_DT": "constexpr", "K_EXACT": "constexpr", "K_BF16": "constexpr",
           "hx_ptr": "*bf16", "hw_ptr": "*fp32", "hws_ptr": "*fp32", "hout_ptr": "*fp32", "hcnt_ptr": "*i32",
           "HM": "i32", "HN": "i32", "HK": "i32", "stride_hx": "i32", "stride_hw": "i32", "s0": "fp32", "s1": "fp32",
           "s2": "fp32", "s3": "fp32", "NUM_SCALES": "constexpr", "STEPS": "constexpr", "SPLIT": "constexpr",
           "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "T": "i32",
           "INDEX": "constexpr", "WEIGHTS": "constexpr", "PDL": "constexpr"}
    _, gemv = f32_linear.gemv_launch(HEADS, HIDDEN, max(tokens, 1), H100_SMS)
    const = dict(Q_BLOCK=2048, Q_DT=1, R=512, DR=64, G=128, KV_NORM=True, KV_ROPE=True, KV_DT=1, KV_FP8=fp8,
                 KV_BF16=not fp8, D=128, BS=64, K_NORM=True, K_ROPE=True, K_DT=1, K_EXACT=index != "fp8",
                 K_BF16=index == "bf16", NUM_SCALES=2, **{n: gemv[n] for n in ("STEPS", "SPLIT", "BLOCK_M", "BLOCK_N",
                                                                             "BLOCK_K")},
                 INDEX=index is not None, WEIGHTS=tokens > 0, PDL=pdl)
    names = list(sig)
    # what the launcher's JIT specializes: 16-byte aligned pointers (torch allocations; the GEMM's row slices are
    # 16-byte aligned too: 2048, 2560 and 2624 bf16 values from the row's start), and the GEMV's K and row strides
    # (6144, multiples of 16)
    aligned = [n for n in names if n.endswith("_ptr") or n in ("HK", "stride_hx", "stride_hw")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    return triton.compile(ASTSource(pc._norm_write_caches_kernel, sig, const, attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": pc.WRITE_WARPS})


def _reports_of_every_variant() -> dict[str, dict]:
    return report_each(VARIANTS, lambda *variant: ptxas_report(_compile(*variant)))


@pytest.fixture(scope="module")
def reports():
    return reports_from_subprocess("tests.kernels.test_norm_write_caches_compile")


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(map(str, v)))
def test_compiles_for_hopper_without_spills(reports, variant):
    r = reports[repr(variant)]
    assert "error" not in r, r.get("error")
    assert "0 bytes spill stores, 0 bytes spill loads" in r["ptxas"], r["ptxas"]
    assert "griddepcontrol" not in r["ptx"] or variant[2]
    weights = variant[3] > 0
    if variant[2]:
        ptx = r["ptx"]
        wait = ptx.find("griddepcontrol.wait;")
        accesses = ("st.global", "atom.global", "red.global") + (() if weights else ("ld.global",))
        first_access = min(i for i in (ptx.find(op) for op in accesses) if i >= 0)
        assert 0 <= wait < ptx.find("griddepcontrol.launch_dependents;") < first_access
        assert ("ld.global" in ptx[:wait]) == weights  # the head weights' first tile requested before the wait
    if weights:  # the GEMV's split-K fix-up: a ticket per column tile, acquire-release at GPU scope
        assert len(re.findall(r"atom\.global\.gpu\.acq_rel\.add", r["ptx"])) == 1
    # one role's registers are every program's: 60 to 64 a thread, the head weights' GEMV included (ptxas, Triton
    # 3.6), bounded so that a grid of 128-thread programs keeps the SMs full (the GEMV's CTAS_PER_SM CTAs an SM
    # beside the rows' programs)
    assert int(re.search(r"Used (\d+) registers", r["ptxas"]).group(1)) <= 96, r["ptxas"]
