"""The indexer's one-launch kernel (``indexer._indexer_topk_kernel``: a decode step's logits and top-k, issue 45,
item 5) compiled for sm_90 without a GPU (Triton's bundled ptxas) at GLM-5's shapes (32 index heads of 128, the
query's RoPE inside, top-2048, 64-token blocks): CI cannot run it on a GPU (tests/gpu does), but it can check what
the kernel's registers must allow. Its programs carry the top-k round's row in registers (a key and an index per
entry) beside the logits tile, so at the longest rows it takes (indexer.ONE_LAUNCH_KEYS = 8192) every logits
configuration the autotuner may launch, FP8 gathers, TMA boxes and the exact mode's bfloat16 keys, must compile
without local-memory spills; at 16384 keys the 4-warp configurations spill (why the bound is 8192). Each has the
PDL wait before any memory access, one acquire-release ticket at GPU scope per program and the selecting program's
score loads from L2 (.cg)."""

import re

import pytest

triton = pytest.importorskip("triton")

from tests.kernels.sm90_reports import ptxas_report, report_each, reports_from_subprocess  # noqa: E402

HI, BS, TOPK = 32, 64, 2048
LONGEST = 8192  # indexer.ONE_LAUNCH_KEYS (checked below)


def _configs():
    from fxglm5.lowering.triton import indexer

    return [dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages) for c in indexer._LOGITS_CONFIGS]


# (cache, row length, index of the logits configuration in indexer._LOGITS_CONFIGS)
VARIANTS = [("fp8", LONGEST, i) for i in range(8)] + [("bf16", LONGEST, 0), ("bf16", LONGEST, 3), ("fp8", 16384, 6)]


def _compile(cache: str, max_len: int, index: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fxglm5.lowering.triton import indexer, topk

    cfg = _configs()[index]
    exact = cache == "bf16"
    width = max_len // BS
    # integer arguments as the JIT specializes them at these shapes (multiples of 16 marked so, as the pointers)
    ints = dict(stride_qt=HI * 128, stride_qh=128, stride_wt=HI, n_key_rows=4096 * BS * (128 if exact else 132) // 128,
                stride_bt=width, stride_c=32, HALF=32, stride_ot=max_len, HI=HI, max_len=max_len, T_BUCKET=None,
                stride_st=TOPK, topk=TOPK)
    sig = {"q_ptr": "*bf16", "stride_qt": "i32", "stride_qh": "i32", "w_ptr": "*fp32", "stride_wt": "i32",
           "kc_ptr": "*bf16" if exact else "*u8", "ks_ptr": "*bf16" if exact else "*fp32", "n_key_rows": "i32",
           "bt_ptr": "*i32", "stride_bt": "i32", "req_ptr": "*i32", "pos_ptr": "*i32", "cos_ptr": "*fp32",
           "sin_ptr": "*fp32", "stride_c": "i32", "HALF": "i32", "o_ptr": "*fp32", "stride_ot": "i32", "HI": "i32",
           "max_len": "i32", "T_BUCKET": "i32", "sel_ptr": "*i32", "stride_st": "i32", "bin_ptr": "*i32",
           "cnt_ptr": "*i32", "topk": "i32"}
    C, bin_c = topk.one_round(max_len, TOPK, False)
    const = dict(BS=BS, BLOCK_HI=HI, BLOCK_N=cfg["BLOCK_N"], TILES=cfg["TILES"], F32DOT=False, C=C, BIN_C=bin_c,
                 PDL=True, PROMOTE=128, USE_TMA=cfg.get("USE_TMA", False), EXACT=exact, ROPE_Q=True, DT=1)
    sig.update({name: "constexpr" for name in const})
    names = list(sig)
    aligned = [n for n in names if n.endswith("_ptr") or (ints.get(n) or 1) % 16 == 0]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    kernel = triton.compile(ASTSource(indexer._indexer_topk_kernel, sig, const, attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
    return ptxas_report(kernel)


def _reports_of_every_variant() -> dict[str, dict]:
    return report_each(VARIANTS, _compile)


@pytest.fixture(scope="module")
def reports():
    return reports_from_subprocess("tests.kernels.test_indexer_topk_compile")


def _spilled(ptxas: str) -> int:
    return int(re.search(r"(\d+) bytes spill stores", ptxas).group(1))


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(map(str, v)))
def test_one_launch_kernel_compiles_for_hopper(reports, variant):
    from fxglm5.lowering.triton import indexer

    assert indexer.ONE_LAUNCH_KEYS == LONGEST
    r = reports[repr(variant)]
    assert "error" not in r, r.get("error")
    if variant[1] > LONGEST:  # past the bound: the row does not fit the 4-warp programs' registers
        assert _spilled(r["ptxas"]) > 0, r["ptxas"]
        return
    assert "0 bytes spill stores, 0 bytes spill loads" in r["ptxas"], r["ptxas"]
    ptx = r["ptx"]
    wait = ptx.find("griddepcontrol.wait;")
    first_access = min(i for i in (ptx.find(op) for op in ("ld.global", "st.global", "atom.global", "red.global",
                                                           "cp.async")) if i >= 0)
    assert 0 <= wait < ptx.find("griddepcontrol.launch_dependents;") < first_access
    assert len(re.findall(r"atom\.global\.gpu\.acq_rel\.add", ptx)) == 1, "one ticket a program"
    assert "ld.global.cg" in ptx, "the selecting program reads the row's scores from L2"
