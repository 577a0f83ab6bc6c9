"""The Gluon Hopper MLA kernel, compiled for sm_90 without a GPU (Triton's bundled ptxas).

Gluon kernels do not run under TRITON_INTERPRET=1, so CI cannot check their numbers (tests/gpu does, on an
H200). What CI can check is what made the kernel's speed in the first place and breaks silently when the
kernel is edited: it compiles for sm_90 in every variant, fits shared memory, does not spill, and ptxas does not
serialize its asynchronous MMAs (the C7515 warning, which a register move of an in-flight accumulator causes);
and, launched for programmatic dependent launch, it waits on its predecessor before it touches memory.
"""

import functools
import re

import pytest
import torch

triton = pytest.importorskip("triton")

from fxglm5.lowering.triton import mla_hopper  # noqa: E402
from tests.kernels.sm90_reports import ptxas_report, report_each, reports_from_subprocess  # noqa: E402

SMEM_LIMIT = 232448  # bytes of shared memory one H100 / H200 block may use

_POINTERS = ("q_ptr", "lat_ptr", "pe_ptr", "sc_ptr", "bt_ptr", "req_ptr", "pos_ptr", "o_ptr", "po_ptr", "plse_ptr")


def _compile(sparse: bool, fp8: bool, direct: bool, heads: int = 64, pdl: bool = False):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = {"q_ptr": "*bf16", "stride_qt": "i32", "stride_qh": "i32", "H": "i32", "lat_ptr": "*fp8e4nv" if fp8 else "*bf16",
           "pe_ptr": "*bf16", "sc_ptr": "*fp32" if fp8 else "*bf16", "bt_ptr": "*i32", "stride_bt": "i32",
           "req_ptr": "*i32", "pos_ptr": "*i32", "stride_pt": "i32", "K": "i32", "o_ptr": "*bf16",
           "stride_ot": "i32", "stride_oh": "i32", "po_ptr": "*fp32", "plse_ptr": "*fp32", "sm_scale_log2": "fp32",
           "split_len": "i32", "num_splits": "i32", "n_rows": "i32", "BS": "constexpr", "DIRECT": "constexpr",
           "SPARSE": "constexpr", "FP8": "constexpr", "BLOCK": "constexpr", "STAGES_": "constexpr",
           "ROWS": "constexpr", "KEYS_AS_ROWS": "constexpr", "PDL": "constexpr"}
    rows, keys_as_rows = mla_hopper.rows_for(heads)
    const = dict(BS=64, DIRECT=direct, SPARSE=sparse, FP8=fp8, BLOCK=mla_hopper.BLOCK_N, STAGES_=mla_hopper.STAGES,
                 ROWS=rows, KEYS_AS_ROWS=keys_as_rows, PDL=pdl)
    names = list(sig)
    # what the launcher's JIT specializes: 16-byte aligned pointers (supported() requires the cache's)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in _POINTERS}
    src = GluonASTSource(mla_hopper._mla_hopper_kernel, sig, const, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4 if keys_as_rows else 8})


def _report(sparse: bool, fp8: bool, direct: bool, heads: int = 64, pdl: bool = False) -> dict:
    """Compile one variant and run ptxas -v on it (in a process where Triton does not interpret: importing
    triton under TRITON_INTERPRET=1 turns its library functions into interpreted ones)."""
    return ptxas_report(_compile(sparse, fp8, direct, heads, pdl))


# (sparse, fp8, direct, heads): the 64-head kernel's variants, then the few-heads kernel's
WIDE = [(False, False, False, 64), (True, False, False, 64), (False, True, False, 64), (True, True, False, 64),
        (True, True, True, 64)]
FEW_HEADS = [(False, True, False, 8), (True, True, False, 8), (False, False, False, 8), (True, True, True, 16)]
# (..., pdl): variants of both forms compiled with the PDL prologue (FXGLM5_PDL=1 on sm_90)
WITH_PDL = [(True, True, False, 64, True), (False, False, False, 8, True)]


def _compile_project(sparse: bool, fp8: bool, heads: int, tokens: int, splits: int):
    """The split-KV MLA with its W_UV combine in one launch (``_mla_hopper_project_kernel``), as ``launch_project``
    launches it with PDL for ``tokens`` tokens, ``splits`` splits and GLM-5's W_UV (512 latent columns)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = {"q_ptr": "*bf16", "stride_qt": "i32", "stride_qh": "i32", "H": "i32",
           "lat_ptr": "*fp8e4nv" if fp8 else "*bf16", "pe_ptr": "*bf16", "sc_ptr": "*fp32" if fp8 else "*bf16",
           "bt_ptr": "*i32", "stride_bt": "i32", "req_ptr": "*i32", "pos_ptr": "*i32", "stride_pt": "i32", "K": "i32",
           "po_ptr": "*fp32",
           "plse_ptr": "*fp32", "sm_scale_log2": "fp32", "split_len": "i32", "num_splits": "i32", "n_rows": "i32",
           "w_ptr": "*bf16", "o_ptr": "*bf16", "s_w_h": "i32", "s_w_v": "i32", "T": "i32", "V": "i32",
           "task_ptr": "*i32"}
    rows, keys_as_rows = mla_hopper.rows_for(heads)
    const = dict(BS=64, SPARSE=sparse, FP8=fp8, BLOCK=mla_hopper.BLOCK_N, STAGES_=mla_hopper.STAGES, ROWS=rows,
                 KEYS_AS_ROWS=keys_as_rows, **mla_hopper.project_tiles(tokens, splits, 512, keys_as_rows), PDL=True)
    sig.update({name: "constexpr" for name in const})
    names = list(sig)
    aligned = [n for n in names if n.endswith("_ptr")] + ["s_w_h", "s_w_v"]  # W_UV's strides: 256 x 512, 512
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = GluonASTSource(mla_hopper._mla_hopper_project_kernel, sig, const, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4 if keys_as_rows else 8})


def _project_report(tag: str, sparse: bool, fp8: bool, heads: int, tokens: int, splits: int) -> dict:
    return ptxas_report(_compile_project(sparse, fp8, heads, tokens, splits))


# ("project", sparse, fp8, heads, tokens, splits): the one-launch MLA + W_UV combine at a TP8 rank's 8 heads (sparse
# top-2048 at 1 token: 32 splits, at 16: 8; dense 32k at 1 token: 256 splits, at 4: 64; the largest token x split
# tiles of the split pick, 16 x 29 and 3 x 88 padded to 16 x 32 and 4 x 128), 16 heads, and 64
PROJECT = [("project", True, True, 8, 1, 32), ("project", True, False, 8, 16, 8), ("project", False, True, 8, 4, 64),
           ("project", False, False, 8, 1, 256), ("project", False, True, 8, 16, 29), ("project", False, False, 8, 3, 88),
           ("project", True, True, 16, 16, 8), ("project", True, True, 64, 1, 32), ("project", False, False, 64, 16, 8),
           ("project", False, True, 64, 16, 29)]


def _reports_of_every_variant() -> dict[str, dict]:
    """:func:`_report` of each variant of WIDE, FEW_HEADS and WITH_PDL, and :func:`_project_report` of each of
    PROJECT, by ``repr(variant)``."""
    return {**report_each(WIDE + FEW_HEADS + WITH_PDL, _report), **report_each(PROJECT, _project_report)}


@functools.lru_cache(maxsize=None)
def _reports() -> dict[str, dict]:
    """Every variant's report (:mod:`tests.kernels.sm90_reports`)."""
    return reports_from_subprocess("tests.kernels.test_mla_hopper_compile")


def _fits(variant: tuple) -> dict:
    """:func:`_report` of one variant, which fits shared memory, does not spill, and whose MMAs ptxas does not
    serialize (the C7515 warning)."""
    r = _reports()[repr(variant)]
    assert "error" not in r, r.get("error")
    assert r["shared"] <= SMEM_LIMIT, r["shared"]
    assert "0 bytes spill stores, 0 bytes spill loads" in r["ptxas"], r["ptxas"]
    assert "C7515" not in r["ptxas"], r["ptxas"]  # wgmma serialized
    return r


@pytest.mark.parametrize("variant", WIDE, ids=lambda v: "-".join(map(str, v[:3])))
def test_hopper_kernel_compiles_without_spills_or_serialized_mmas(variant):
    r = _fits(variant)
    assert "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16" in r["ptx"]  # QK^T: 32 key columns per warpgroup
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16" in r["ptx"]  # P @ V: 128 columns per warpgroup


@pytest.mark.parametrize("variant", FEW_HEADS, ids=lambda v: "-".join(map(str, v)))
def test_few_heads_kernel_makes_the_keys_the_mma_rows(variant):
    """Up to 16 heads, one warpgroup runs m64 x n(8 | 16) MMAs (the keys as rows, the padded heads as N), not
    the 64-head MMAs, and still fits shared memory without spills or serialized MMAs."""
    r = _fits(variant)
    mmas = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", r["ptx"]))
    assert mmas == {f"m64n{variant[3]}k16"}, mmas


@pytest.mark.parametrize("variant", [v for v in WIDE + FEW_HEADS if v[1]], ids=lambda v: "-".join(map(str, v)))
def test_fp8_dequantization_takes_no_quarter_rate_conversion(variant):
    """The FP8 tile's e4m3 -> bf16 goes through fp32 (unpack, HADD2.F32, pack: full-rate pipes), not a direct cast,
    which ptxas lowers to one F2F.BF16.F16 per element on the quarter-rate conversion unit (256 a thread per
    tile; the H200 profile of session 20 had that loop issue-bound at 36 % of copy, bench/results/kernel_goals_ncu_17c1af7)."""
    ops = _fits(variant)["sass_opcodes"]
    assert not any(op.startswith("F2F.BF16") for op in ops), {k: v for k, v in ops.items() if k.startswith("F2F")}
    assert ops.get("F2FP.F16.E4M3.UNPACK_B", 0) >= 64 and ops.get("F2FP.BF16.F32.PACK_AB", 0) >= 64, ops


@pytest.mark.parametrize("variant", WITH_PDL, ids=lambda v: "-".join(map(str, v[:4])))
def test_pdl_prologue_waits_before_the_first_memory_access(variant):
    """With PDL the kernel's first instructions are ``griddepcontrol.wait`` then ``launch_dependents``
    (:func:`fxglm5.lowering.triton.device.gluon_pdl_prologue`), ahead of every global load, copy and store, at the
    same registers as without it (which has neither instruction)."""
    r, plain = _fits(variant), _fits(variant[:4])
    ptx = r["ptx"]
    wait, go = ptx.find("griddepcontrol.wait;"), ptx.find("griddepcontrol.launch_dependents;")
    first_access = min(i for i in (ptx.find(op) for op in ("ld.global", "cp.async", "st.global")) if i >= 0)
    assert 0 <= wait < go < first_access, (wait, go, first_access)
    assert "griddepcontrol" not in plain["ptx"]
    registers = re.compile(r"Used (\d+) registers")
    assert registers.search(r["ptxas"]).group(1) == registers.search(plain["ptxas"]).group(1)


@pytest.mark.parametrize("variant", PROJECT, ids=lambda v: "-".join(map(str, v[1:])))
def test_the_mla_and_its_w_uv_combine_compile_as_one_launch(variant):
    """The split-KV MLA and its combine with W_UV in one launch of tasks (``_mla_hopper_project_kernel``): fits shared
    memory in the same bytes as the MLA's own launch (the combine's W_UV slice and merged rows reuse the split role's
    buffers), no spills, no serialized MMAs; the split tasks' MMAs those of the MLA's launch, the combine's mma_v2
    (m16n8k16: the tokens padded to 16 rows); the PDL wait before the queue's atomic and every memory access, the
    split tasks' release signal, the combine tasks' acquire spin, the partials read from L2 (``ld.global.cg``) and
    W_UV's slice copied with 16-byte cp.async; the last CTA's reset (an acq_rel count of the finished CTAs)."""
    _, sparse, fp8, heads, tokens, splits = variant
    r = _fits(variant)
    plain = _reports().get(repr((sparse, fp8, False, heads)))  # the MLA's own launch, where WIDE / FEW_HEADS has it
    assert plain is None or r["shared"] == plain["shared"], (r["shared"], plain["shared"])
    ptx = r["ptx"]
    mmas = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))
    rows, keys_as_rows = mla_hopper.rows_for(heads)
    assert mmas == ({f"m64n{rows}k16"} if keys_as_rows else {"m64n32k16", "m64n128k16"}), mmas
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in ptx
    wait, queue = ptx.find("griddepcontrol.wait;"), ptx.find("atom.global.gpu.relaxed.add")
    first_access = min(i for i in (ptx.find(op) for op in ("ld.global", "cp.async", "st.global")) if i >= 0)
    assert 0 <= wait < queue < first_access, (wait, queue, first_access)
    assert "atom.global.gpu.release.add" in ptx, "the split tasks' signal"
    assert "ld.global.gpu.acquire" in ptx, "the combine tasks' spin (an add of 0: an acquire load)"
    assert "ld.global.cg" in ptx, "the partials read from L2"
    assert re.search(r"cp\.async\.cg\.shared\.global \[[^]]+\], \[[^]]+\], 0x10", ptx), "W_UV's 16-byte copies"
    assert "atom.global.gpu.acq_rel.add" in ptx, "the finished CTAs' count"


def test_rows_for_pads_few_heads_to_the_mma_n():
    assert mla_hopper.rows_for(8) == (8, True)
    assert mla_hopper.rows_for(5) == (8, True)
    assert mla_hopper.rows_for(16) == (16, True)
    assert mla_hopper.rows_for(17) == (64, False)
    assert mla_hopper.rows_for(8, keys_as_rows=False) == (64, False)
    with pytest.raises(ValueError, match="up to 16 heads"):
        mla_hopper.rows_for(32, keys_as_rows=True)


def test_supported_only_on_hopper_cuda_with_bf16_queries():
    q = torch.zeros(1, 64, 576, dtype=torch.bfloat16)
    cache = torch.zeros(2, 64, 576, dtype=torch.bfloat16)
    assert not mla_hopper.supported(q, cache, sparse=False)  # a CPU tensor


@pytest.mark.parametrize("kernel", ["hopper", "hopper64"])
def test_forcing_the_hopper_kernel_where_it_does_not_apply_is_one_clear_error(kernel):
    """cfg={"kernel": "hopper" | "hopper64"} on inputs the Gluon kernel does not serve (CPU tensors here) is a
    ValueError naming the inputs, not a Triton launch with an unknown "kernel" argument."""
    from fxglm5.lowering.triton import mla

    q = torch.zeros(2, 8, 576, dtype=torch.bfloat16)
    cache = torch.zeros(4, 64, 576, dtype=torch.bfloat16)
    bt = torch.arange(1, 3, dtype=torch.int32).view(1, 2)
    req = torch.zeros(2, dtype=torch.int32)
    pos = torch.tensor([10, 20], dtype=torch.int32)
    with pytest.raises(ValueError, match="does not serve these inputs"):
        mla.launch_mla(q, cache, bt, req, pos, 0.1, sparse=False, cfg={"kernel": kernel})
