"""The grouped MoE GEMM kernel with the shared expert's GEMM as extra CTAs (``moe._moe_gemm_kernel`` with SHARED)
compiled for sm_90 without a GPU (Triton's bundled ptxas) at one GLM-5 TP8 / EP8 rank's decode shapes: 6144
features, 32 local experts of 2048 intermediate features, top-8 (the GEMMs' scan), the shared expert's 2048
intermediate features sliced by 8 (its gate|up 512 x 6144, its down 6144 x 256), on an H100's 132 SMs, both
launches (gate|up with the routed split-K fold beside the shared gate|up's FIXUP; down with the shared down's gated A
loads and the combine, as launched up to BLOCK_M tokens), W8A16 and W8A8, at 1 and 8 tokens: no local-memory spills,
at least two CTAs an SM by registers, the PDL wait, and the shared tiles' acq_rel tickets beside the routed ones.

Registers a thread, without / with the shared role, when written: gate|up W8A16 168 / 252 at 1 token, 224 / 221 at
8; gate|up W8A8 about 220 either way; down with the combine W8A16 128 / 128, W8A8 149 / 158-160 (the combine's loop
over the slots is not unrolled: unrolled, its loads took 255 registers and spilled). The W8A16 gate|up launch at 1 token thus drops from three CTAs an SM (its 72 KiB
of shared memory's bound) to two: what that costs is the GPU's to measure (tests/gpu/test_gpu_fused.py)."""

import re

import pytest

triton = pytest.importorskip("triton")

from tests.kernels.sm90_reports import ptxas_report, report_each, reports_from_subprocess  # noqa: E402

H100_SMS = 132
HIDDEN, EXPERTS, INTER, SHARED_INTER, TOP_K = 6144, 32, 2048, 2048 // 8, 8
VARIANTS = [(launch, tokens, act_quant, shared) for launch in ("gate_up", "down") for tokens in (1, 8)
            for act_quant in (False, True) for shared in (True, False)]
# (launch, tokens, act_quant, shared, BLOCKS_LAST): the down launch over its reversed grid (opt-in)
BLOCKS_LAST_VARIANTS = [("down", 1, False, True, True), ("down", 8, True, True, True)]


def _compile(launch: str, tokens: int, act_quant: bool, shared: bool, blocks_last: bool = False):
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fxglm5.lowering.triton import fp8_gemm, moe
    from fxglm5.lowering.triton.norm_rope import DTYPE_CODES

    cfg = moe.pick_moe_config(tokens, TOP_K, EXPERTS)
    assert moe.scans(tokens, cfg)
    blocks = moe.num_blocks(tokens, TOP_K, EXPERTS, cfg)
    rows, entries = blocks * cfg["BLOCK_M"], tokens * TOP_K
    gated = launch == "gate_up"
    h_type = "fp32" if act_quant else "bf16"  # the gated output hmid (the down launch's A)
    if gated:
        split = moe._split1(blocks, HIDDEN, INTER, cfg, H100_SMS)
        n, k, up_sb = INTER, HIDDEN, INTER // 128
        a_type, c_stride = "bf16", (2 * INTER, rows * 2 * INTER, INTER)
        s_n, s_k, s_a_stride, s_b_stride = 2 * SHARED_INTER, HIDDEN, HIDDEN, HIDDEN
    else:
        split = moe._split2(INTER, cfg)
        n, k, up_sb = HIDDEN, INTER, 0
        a_type, c_stride = h_type, (HIDDEN, entries * HIDDEN, 0)
        s_n, s_k, s_a_stride, s_b_stride = HIDDEN, SHARED_INTER, 2 * SHARED_INTER, SHARED_INTER
    kg, s_kg = k // 128, s_k // 128
    s_cfg = fp8_gemm.pick_config(tokens, s_n, s_k, act_quant, H100_SMS)
    s_split = triton.cdiv(s_kg, triton.cdiv(s_kg, s_cfg["SPLIT_K"]))
    ints = {"n_entries": entries, "E": EXPERTS, "N": n, "K": k, "KG": kg, "UP_SB": up_sb,
            "stride_am": k, "stride_asm": k, "stride_we": (2 * n if gated else n) * k, "stride_wn": k,
            "stride_wse": (2 * n if gated else n) // 128 * kg, "stride_wsn": kg, "stride_cm": c_stride[0],
            "stride_cs": c_stride[1], "stride_hm": c_stride[2], "num_blocks": blocks}
    s_ints = {"S_M": tokens, "S_N": s_n, "S_K": s_k, "S_KG": s_kg}
    s_strides = {"s_stride_am": s_a_stride, "s_stride_asm": s_a_stride, "s_stride_bn": s_b_stride,
                 "s_stride_bsn": s_kg, "s_stride_cm": s_n, "s_stride_cs": tokens * s_n, "s_stride_um": s_a_stride}
    sig = {"a_ptr": f"*{a_type}", "as_ptr": f"*{a_type}", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "sorted_ptr": "*i32",
           "block_expert_ptr": "*i32", "ids_ptr": "*i32", "c_ptr": "*fp32", "h_ptr": f"*{h_type}" if gated else "*fp32",
           "cnt_ptr": "*i32", "tw_ptr": "*fp32", "add_ptr": "*bf16", "out_ptr": "*bf16", "tcnt_ptr": "*i32",
           **{name: "i32" for name in ints}, "s_a_ptr": "*bf16", "s_as_ptr": "*bf16",
           "s_b_ptr": "*fp8e4nv", "s_bs_ptr": "*fp32", "s_bias_ptr": "*bf16", "s_c_ptr": "*fp32", "s_out_ptr": "*bf16",
           "s_cnt_ptr": "*i32", "s_up_ptr": "*bf16", **{name: "i32" for name in s_ints},
           "S_KG_PER_SPLIT": "constexpr", **{name: "i32" for name in s_strides}}
    mode = 1 if act_quant else 2
    const = dict(S_KG_PER_SPLIT=triton.cdiv(s_kg, s_split), TOP_K=TOP_K, GATED=gated, SPLIT_K=split, A_MODE=mode, DOT_F32=False,
                 INTERPRET=False, K_PER_SPLIT=triton.cdiv(kg, split), NO_K_MASK=True, SCALAR_SB=True,
                 BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N1" if gated else "BLOCK_N2"], SCAN=True,
                 BLOCK_IDS=max(16, triton.next_power_of_2(entries)), BLOCK_E=triton.next_power_of_2(EXPERTS + 1),
                 SHARED=shared, S_A_MODE=mode, S_GATED_A=not gated, S_DT=DTYPE_CODES[torch.bfloat16], S_DOT_F32=False,
                 S_INTERPRET=False, S_HAS_BIAS=False, S_SPLIT_K=s_split, S_FIXUP=s_split > 1, S_NO_K_MASK=True,
                 S_SCALAR_SB=True, S_BLOCK_M=s_cfg["BLOCK_M"], S_BLOCK_N=s_cfg["BLOCK_N"], S_GROUP_M=s_cfg["GROUP_M"],
                 COMBINE=not gated, ADD=shared, DT=DTYPE_CODES[torch.bfloat16], PDL=True, BLOCKS_LAST=blocks_last)
    sig.update({name: "constexpr" for name in const})
    names = list(sig)
    values = {**ints, **s_ints, **s_strides}
    aligned = [n for n in names if n.endswith("_ptr") or (n in values and values[n] % 16 == 0)]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    kernel = triton.compile(ASTSource(moe._moe_gemm_kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
    return dict(ptxas_report(kernel), split=split, s_split=s_split)


def _reports_of_every_variant() -> dict[str, dict]:
    return report_each(VARIANTS + BLOCKS_LAST_VARIANTS, _compile)


@pytest.fixture(scope="module")
def reports():
    return reports_from_subprocess("tests.kernels.test_moe_shared_compile")


def _registers(report) -> int:
    return int(re.search(r"Used (\d+) registers", report["ptxas"]).group(1))


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v[3]],
                         ids=lambda v: f"{v[0]}_{v[1]}tok_{'w8a8' if v[2] else 'w8a16'}")
def test_the_shared_role_compiles_for_hopper_without_spills(reports, variant):
    r, alone = reports[repr(variant)], reports[repr((*variant[:3], False))]
    assert "error" not in r, r.get("error")
    assert "error" not in alone, alone.get("error")
    assert r["split"] > 1 and r["s_split"] > 1  # both split over K: the routed fold / partials and the shared FIXUP
    assert re.search(r"\b0 bytes spill stores, 0 bytes spill loads", r["ptxas"]), r["ptxas"]
    assert _registers(r) * 128 * 2 <= 65536, r["ptxas"]  # 4 warps: two CTAs an SM
    assert "griddepcontrol.wait" in r["ptx"]
    tickets = len(re.findall(r"atom\.global\.gpu\.acq_rel\.add", r["ptx"]))
    # the shared tiles' FIXUP ticket and, in the down launch, their tickets of the combine
    assert tickets == len(re.findall(r"atom\.global\.gpu\.acq_rel\.add", alone["ptx"])) + 1 + (variant[0] == "down")


@pytest.mark.parametrize("variant", BLOCKS_LAST_VARIANTS, ids=lambda v: f"{v[1]}tok_{'w8a8' if v[2] else 'w8a16'}")
def test_the_reversed_grid_compiles_as_the_plain_one(reports, variant):
    """BLOCKS_LAST reads the program's coordinates in the reversed order and changes nothing else: no spills, and
    within two registers a thread of the plain launch."""
    r, plain = reports[repr(variant)], reports[repr(variant[:4])]
    assert "error" not in r, r.get("error")
    assert re.search(r"\b0 bytes spill stores, 0 bytes spill loads", r["ptxas"]), r["ptxas"]
    assert abs(_registers(r) - _registers(plain)) <= 2, (r["ptxas"], plain["ptxas"])
