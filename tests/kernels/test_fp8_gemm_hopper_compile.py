"""The Gluon Hopper block-FP8 GEMM, compiled for sm_90 without a GPU (Triton's bundled ptxas).

Gluon kernels do not run under TRITON_INTERPRET=1, so CI cannot check their numbers (tests/gpu/test_gpu_fp8.py
does, on an H200). What CI checks is what the kernel's speed rests on and what breaks silently when it is
edited: every launched variant compiles for sm_90, fits shared memory, does not spill, ptxas does not serialize
its asynchronous MMAs (warning C7515: a register move of an in-flight accumulator; C7512: too few registers), and
the MMAs are the m64 x BLOCK_N x 32 e4m3 instructions with one kept in flight while the other's result is
promoted. The warp-specialized kernel (WS=True) also gets its setmaxnreg split and no CTA-wide barrier.
"""

import functools
import re

import pytest
import torch

triton = pytest.importorskip("triton")

from fxglm5.lowering.triton import fp8_gemm_hopper as hop  # noqa: E402
from tests.kernels.sm90_reports import ptxas_report, report_each, reports_from_subprocess  # noqa: E402

SMEM_LIMIT = 232448  # bytes of shared memory one H100 / H200 block may use
_POINTERS = ("a_ptr", "as_ptr", "b_ptr", "bs_ptr", "bias_ptr", "c_ptr")


def _compile(cfg: dict, out: str, bias: bool):
    """Compile the kernel ``launch`` would take for ``cfg`` (the WS kernel at ``WS=True``) with its constexprs."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = {"a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "b_ptr": "*fp8e4nv", "bs_ptr": "*fp32", "bias_ptr": f"*{out}",
           "c_ptr": f"*{out}", "M": "i32", "N": "i32", "K": "i32", "stride_am": "i32", "stride_asm": "i32",
           "stride_bn": "i32", "stride_bsn": "i32", "stride_cm": "i32"}
    keys = ("BLOCK_N", "STAGES", "GROUP_M", "UNROLL")
    if cfg["WS"]:
        kernel, const, warps = hop._fp8_gemm_hopper_ws_kernel, dict(MMA_REGS=hop.MMA_REGS, LOAD_REGS=hop.LOAD_REGS), 4
    else:
        kernel, const, warps = hop._fp8_gemm_hopper_kernel, dict(BLOCK_M=cfg["BLOCK_M"]), cfg["BLOCK_M"] // 16
    const = dict(HAS_BIAS=bias, **const, **{k: cfg[k] for k in keys})
    sig.update({k: "constexpr" for k in const})
    names = list(sig)
    # what the launcher's JIT specializes: 16-byte aligned pointers and strides (torch allocations, K % 256 == 0)
    attrs = {(names.index(n),): [["tt.divisibility", 16]]
             for n in _POINTERS + ("K", "stride_am", "stride_bn", "stride_cm")}
    src = GluonASTSource(kernel, sig, const, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


# the configs pick_config launches (wide, narrow and small N: all warp-specialized), each with bf16 / fp16 output,
# with / without bias; the wide config's 5-stage ring; and the kernel without warp specialization (WS=0) at the
# wide config and with 64-row tiles at the narrow and small ones (what tests/gpu/test_gpu_fp8.py runs it at)
VARIANTS = [("WIDE", "bf16", False), ("WIDE", "bf16", True), ("WIDE", "fp16", True), ("NARROW", "bf16", True),
            ("NARROW", "fp16", False), ("SMALL", "bf16", True), ("WIDE+STAGES=5", "bf16", True),
            ("WIDE+WS=0", "bf16", False), ("WIDE+WS=0", "bf16", True), ("WIDE+WS=0", "fp16", False),
            ("NARROW+WS=0+BLOCK_M=64", "bf16", True), ("SMALL+WS=0+BLOCK_M=64", "bf16", False)]


def _config(name: str) -> dict:
    """A variant's config: a default of the module, then ``+KEY=value`` overrides through pick_config."""
    base, *extra = name.split("+")
    over = {}
    for e in extra:
        key, _, val = e.partition("=")
        over[key] = bool(int(val)) if key == "WS" else int(val)
    return hop.pick_config(4096, {"WIDE": 6144, "NARROW": 576, "SMALL": 128}[base], over)


def _report(name: str, out: str, bias: bool) -> dict:
    return ptxas_report(_compile(_config(name), out, bias))


def _reports_of_every_variant() -> dict[str, dict]:
    return report_each(VARIANTS, _report)


@functools.lru_cache(maxsize=None)
def _reports() -> dict[str, dict]:
    """Every variant's report (:mod:`tests.kernels.sm90_reports`)."""
    return reports_from_subprocess("tests.kernels.test_fp8_gemm_hopper_compile")


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(map(str, v)))
def test_kernel_compiles_without_spills_or_serialized_mmas(variant):
    r = _reports()[repr(variant)]
    assert "error" not in r, r.get("error")
    assert r["shared"] <= SMEM_LIMIT, r["shared"]
    assert "0 bytes spill stores, 0 bytes spill loads" in r["ptxas"], r["ptxas"]
    assert not re.search(r"C751[0-9]", r["ptxas"]), r["ptxas"]  # wgmma serialized (C7514/C7515 moves, C7512 registers)
    cfg = _config(variant[0])
    bn = cfg["BLOCK_N"]
    mmas = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.f32\.e4m3\.e4m3", r["ptx"]))
    assert mmas == {f"m64n{bn}k32"}, mmas
    # the promotion overlaps the next step's MMA: a wait that leaves one group in flight
    assert "wgmma.wait_group.sync.aligned 1;" in r["ptx"]
    if cfg["WS"]:
        # the register split: MMA warpgroups raised to MMA_REGS, the load warp lowered to LOAD_REGS; one
        # mbarrier arrival (the stage release) and no CTA-wide barrier (bar.sync 0 of every thread) in the K loop
        assert f"setmaxnreg.inc.sync.aligned.u32 \t{hop.MMA_REGS};" in r["ptx"]
        assert f"setmaxnreg.dec.sync.aligned.u32 \t{hop.LOAD_REGS};" in r["ptx"]
        assert "mbarrier.arrive.shared::cta.b64" in r["ptx"]
        assert not re.search(r"\bbar\.sync\s+0;", r["ptx"]), "a barrier of the whole CTA in the WS kernel"


def test_pick_config_by_width_and_overrides():
    assert hop.pick_config(4096, 576) == hop.NARROW
    assert hop.pick_config(4096, 128) == hop.SMALL
    assert hop.pick_config(4096, 6144) == hop.WIDE
    assert hop.pick_config(4096, 6144, {"STAGES": 3, "kernel": "gluon"})["STAGES"] == 3
    with pytest.raises(ValueError, match="64 or 128"):
        hop.pick_config(4096, 6144, {"BLOCK_N": 256})
    with pytest.raises(ValueError, match="UNROLL 2 or 4"):
        hop.pick_config(4096, 6144, {"UNROLL": 3})
    assert all(hop.pick_config(4096, n)["WS"] for n in (128, 576, 6144))
    assert not hop.pick_config(4096, 6144, {"WS": False})["WS"]
    with pytest.raises(ValueError, match="WS=True needs BLOCK_M=128"):
        hop.pick_config(4096, 576, {"BLOCK_M": 64})


def test_supported_only_on_hopper_cuda():
    x = torch.zeros(1024, 256, dtype=torch.bfloat16)
    w = torch.zeros(128, 256, dtype=torch.float8_e4m3fn)
    assert not hop.supported(x, w, True)  # CPU tensors


@pytest.mark.parametrize("kernel", ["gluon", "cutlass"])
def test_fp8_linear_kernel_choice_errors(kernel):
    """config={"kernel": "gluon"} where the Gluon kernel does not apply (CPU tensors here) and an unknown kernel
    name are one clear ValueError each, not a launch with a stray argument."""
    from fxglm5.lowering.triton.fp8_gemm import fp8_linear

    x = torch.zeros(1024, 512, dtype=torch.bfloat16)
    w = torch.zeros(128, 512, dtype=torch.float8_e4m3fn)
    s = torch.ones(1, 4)
    with pytest.raises(ValueError, match="does not serve these inputs" if kernel == "gluon" else "must be 'triton'"):
        fp8_linear(x, w, s, None, True, config={"kernel": kernel})
