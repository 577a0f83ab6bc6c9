"""The decode GEMMs with the residual add and RMSNorm in their A loads (``fp8_gemm._gemm_kernel`` and
``fp8_gemv._gemv_kernel`` with NORM_A: ``fxglm5::add_rms_norm_fp8_linear``) compiled for sm_90 without a GPU (Triton's
bundled ptxas) at one GLM-5 TP8 rank's two such GEMMs, 6144 features: the attention's stacked q_a | kv_a | wk (N =
2048 + 576 + 128 = 2752, the normed rows kept for the indexer's head weights) and a dense layer's stacked gate | up
(N = 3072), on an H100's 132 SMs, at 1, 8 and 16 rows (the GEMV, off by default: 1 and 16), W8A16 and W8A8: no local-memory spills, the PDL wait, and the
CTAs an SM their registers allow: the tiled kernel at most 168 registers a thread (3 CTAs of 4 warps, as many as the
kernel without the norm gets at its 122-136), the GEMV at most 128 (its 2 CTAs of 8 warps, CTAS_PER_SM).

Registers when written: tiled 128-168 W8A16, 144-150 W8A8; GEMV 64-80 W8A16, 80-109 W8A8. With the sum's and the
normed rows' stores inside the K loop the tiled kernel took 246 at 1 and 2 rows (2 CTAs an SM): they are written after
it (``fp8_parts.write_add_rms``). What the norm's own work (every CTA reads its rows whole) costs is the GPU's to
measure (tests/gpu/test_gpu_fused.py times nothing; bench/kernels.py is where a sweep would).

Also: without the norm both kernels compile to the PTX they compiled to before it was added (9973e3b), debug lines
aside: the GEMMs that are not fused keep their bits. A change to those kernels must show its bits are still right and
record the new digests here; the digests hold for the Triton they were taken with (3.6.0) and are skipped with another.
"""

import hashlib
import re

import pytest

triton = pytest.importorskip("triton")

from tests.kernels.sm90_reports import ptxas_report, report_each, reports_from_subprocess  # noqa: E402

H100_SMS, HIDDEN = 132, 6144
NORMED = [(kernel, n, rows, act_quant) for kernel in ("gemm", "gemv") for n in (2752, 3072)
          for rows in ((1, 8, 16) if kernel == "gemm" else (1, 16)) for act_quant in (False, True)]
# kernels without the norm: (kernel, A mode, gated input, rows, K splits / PREFETCH) -> the digest of their PTX
PLAIN = {("gemm", 1, False, 1, 12): "088b5cb6b06ef7dc", ("gemm", 2, True, 1, 12): "948c983f4e906cd6",
         ("gemm", 2, False, 1, 1): "d00f1b0f1894e4ea", ("gemv", 1, False, 1, False): "6d9a711c37758661",
         ("gemv", 2, True, 16, True): "6566903d34dfc159"}
DIGESTS_TRITON = "3.6.0"


def _digest(ptx: str) -> str:
    """The PTX's digest without its debug lines (locations, files, inlining labels, comments, debug sections)."""
    text = "\n".join(line for line in ptx.splitlines() if not re.match(r"\s*(\.loc|\.file|//|\$L__tmp\d+:)", line))
    return hashlib.sha256(re.sub(r"\.section\s+\.debug.*", "", text, flags=re.S).encode()).hexdigest()[:16]


def _compile(source, sig: dict, const: dict, ints: dict, warps: int, stages: int) -> dict:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(sig, **{name: "constexpr" for name in const})
    aligned = [n for n in sig if (n.endswith("_ptr") and sig[n] != "constexpr") or ints.get(n, 1) % 16 == 0]
    attrs = {(source.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}  # by the kernel's positions
    kernel = triton.compile(ASTSource(source, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps, "num_stages": stages})
    report = ptxas_report(kernel)
    return dict(ptxas=report["ptxas"], digest=_digest(report["ptx"]), wait="griddepcontrol.wait" in report["ptx"])


def _norm_sig(rows: int, tile_rows: int, keep: bool) -> tuple[dict, dict]:
    sig = {"nw_ptr": "*bf16", "sum_ptr": "*bf16", "normed_ptr": "*bf16" if keep else "constexpr", "eps": "fp32"}
    const = dict(NORM_A=True, NORM_ROWS=triton.next_power_of_2(min(rows, tile_rows)))
    return sig, (const if keep else dict(const, normed_ptr=None))


def _gemm(rows, n, mode, gated, norm, keep, split=None):
    from fxglm5.lowering.triton import fp8_gemm

    cfg = fp8_gemm.pick_config(rows, n, HIDDEN, mode == 1, H100_SMS, None if split is None else dict(SPLIT_K=split))
    kg = HIDDEN // 128
    per = triton.cdiv(kg, cfg["SPLIT_K"])
    split = triton.cdiv(kg, per)
    sig = {"a_ptr": "*bf16", "as_ptr": "*bf16", "b_ptr": "*fp8e4nv", "bs_ptr": "*fp32", "bias_ptr": "*bf16",
           "c_ptr": "*fp32" if split > 1 else "*bf16", "out_ptr": "*bf16", "cnt_ptr": "*i32", "up_ptr": "*bf16",
           "M": "i32", "N": "i32", "K": "i32", "KG": "i32", "KG_PER_SPLIT": "constexpr",
           **{s: "i32" for s in ("stride_am", "stride_asm", "stride_bn", "stride_bsn", "stride_cm", "stride_cs",
                                 "stride_um")}}
    const = dict(KG_PER_SPLIT=per, A_MODE=mode, GATED_A=gated, DT=1, DOT_F32=False, INTERPRET=False, HAS_BIAS=False,
                 SPLIT_K=split, FIXUP=cfg["FIXUP"] and split > 1, NO_K_MASK=True, SCALAR_SB=True,
                 BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], GROUP_M=cfg["GROUP_M"], PDL=True)
    if norm:
        extra, norm_const = _norm_sig(rows, cfg["BLOCK_M"], keep)
        sig.update(extra)
        const.update(norm_const)
    ints = dict(M=rows, N=n, K=HIDDEN, KG=kg, stride_am=HIDDEN, stride_asm=HIDDEN, stride_bn=HIDDEN, stride_bsn=kg,
                stride_cm=n, stride_cs=rows * n, stride_um=HIDDEN)
    return _compile(fp8_gemm._gemm_kernel, sig, const, ints, cfg["num_warps"], cfg["num_stages"])


def _gemv(rows, n, mode, gated, norm, keep, prefetch=False):
    from fxglm5.lowering.triton import fp8_gemv

    c = fp8_gemv.plan(rows, n, HIDDEN, H100_SMS, dict(PREFETCH=prefetch))
    kg = HIDDEN // 128
    sig = {"a_ptr": "*bf16", "u_ptr": "*bf16", "b_ptr": "*fp8e4nv", "bs_ptr": "*fp32", "bias_ptr": "*bf16",
           "ws_ptr": "*fp32", "out_ptr": "*bf16", "cnt_ptr": "*i32",
           **{s: "i32" for s in ("M", "N", "K", "KG", "stride_am", "stride_um", "stride_bn", "stride_bsn")}}
    const = dict(KG_PER_SPLIT=c["KG_PER_SPLIT"], SPLIT_K=c["SPLIT_K"], M_PAD=c["M_PAD"], BLOCK_N=c["BLOCK_N"],
                 A_MODE=mode, GATED_A=gated, DT=1, USE_DOT=c["M_PAD"] == 16, F32=False, INTERPRET=False,
                 HAS_BIAS=False, NO_K_MASK=True, PREFETCH=prefetch, PDL=True)
    if norm:
        extra, norm_const = _norm_sig(rows, c["M_PAD"], keep)
        sig.update(extra)
        const.update(norm_const)
    ints = dict(M=rows, N=n, K=HIDDEN, KG=kg, stride_am=HIDDEN, stride_um=HIDDEN, stride_bn=HIDDEN, stride_bsn=kg)
    return _compile(fp8_gemv._gemv_kernel, sig, const, ints, c["num_warps"], c["num_stages"])


def _normed(kernel, n, rows, act_quant):
    compile_ = _gemm if kernel == "gemm" else _gemv
    return compile_(rows, n, 1 if act_quant else 2, False, True, n == 2752)


def _plain(kernel, mode, gated, rows, option):
    if kernel == "gemm":
        return _gemm(rows, 2752, mode, gated, False, False, split=option)
    return _gemv(rows, 2752, mode, gated, False, False, prefetch=option)


def _reports_of_every_variant() -> dict[str, dict]:
    return dict(normed=report_each(NORMED, _normed), plain=report_each(PLAIN, _plain), triton=triton.__version__)


@pytest.fixture(scope="module")
def reports():
    return reports_from_subprocess("tests.kernels.test_add_rms_norm_gemm_compile")


@pytest.mark.parametrize("variant", NORMED, ids=lambda v: f"{v[0]}_n{v[1]}_{v[2]}rows_{'w8a8' if v[3] else 'w8a16'}")
def test_the_normed_gemms_compile_for_hopper_without_spills(reports, variant):
    r = reports["normed"][repr(variant)]
    assert "error" not in r, r.get("error")
    assert re.search(r"\b0 bytes spill stores, 0 bytes spill loads", r["ptxas"]), r["ptxas"]
    registers = int(re.search(r"Used (\d+) registers", r["ptxas"]).group(1))
    assert registers <= (168 if variant[0] == "gemm" else 128), r["ptxas"]
    assert r["wait"]


@pytest.mark.parametrize("variant", list(PLAIN), ids=lambda v: "_".join(map(str, v)))
def test_without_the_norm_the_gemms_compile_as_before(reports, variant):
    if reports["triton"] != DIGESTS_TRITON:
        pytest.skip(f"digests taken with Triton {DIGESTS_TRITON}, this is {reports['triton']}")
    r = reports["plain"][repr(variant)]
    assert "error" not in r, r.get("error")
    assert r["digest"] == PLAIN[variant]
