"""The Gluon sparse MLA prefill tile (``sparse_mla_tile_hopper``) compiled for sm_90 without a GPU (Triton's bundled
ptxas), as ``sparse_mla_tile_paged`` launches it at a TP8 rank's 8 heads (8 tokens a tile) and a TP4 rank's 16 (4
tokens). Gluon does not run under TRITON_INTERPRET=1 (tests/gpu checks its numbers); CI checks what it exists for
and what an edit breaks silently: both cache layouts compile, fit shared memory, do not spill; QK^T is issued once
per key block, each warpgroup computing its own 32 key columns (Triton's tile kernel issues the same 64-column QK^T
from both warpgroups); the MMAs are asynchronous and not serialized by ptxas (C7515); the counts load while QK^T
runs; the gathers are 16-byte cp.async copies that zero-fill unlisted rows, one block (bf16) or two (FP8) ahead."""

import functools
import re

import pytest

triton = pytest.importorskip("triton")

from tests.kernels.sm90_reports import ptxas_report, report_each, reports_from_subprocess  # noqa: E402

SMEM_LIMIT = 232448  # bytes of shared memory one H100 / H200 block may use
VARIANTS = [(False, 8), (True, 8), (True, 16)]  # (FP8 cache, heads)
QK_STEPS = 576 // 16  # k16 steps of one QK^T over the 576 query columns


def _compile(fp8: bool, heads: int):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from fxglm5.lowering.triton import mla_hopper, sparse_mla_tile, sparse_mla_tile_hopper as th

    sig = {"q_ptr": "*bf16", "stride_qt": "i32", "stride_qh": "i32", "lat_ptr": "*fp8e4nv" if fp8 else "*bf16",
           "pe_ptr": "*bf16", "sc_ptr": "*fp32" if fp8 else "*bf16", "bt_ptr": "*i32", "stride_bt": "i32",
           "req_ptr": "*i32", "counts_ptr": "*i16", "count_stride": "i32", "n_pos": "i32", "blocks_ptr": "*i32",
           "n_key_blocks": "i32", "n_blocks_ptr": "*i32", "leads_ptr": "*i32", "n_slots": "i32", "o_ptr": "*bf16",
           "stride_ot": "i32", "stride_oh": "i32", "T": "i32", "H": "i32", "sm_scale_log2": "fp32"}
    const = dict(BS=64, BLOCK_Q=sparse_mla_tile.block_q(heads), HEADS=heads, FP8=fp8, BLOCK=mla_hopper.BLOCK_N,
                 STAGES_=mla_hopper.STAGES)
    sig.update({name: "constexpr" for name in const})
    names = list(sig)
    # what the launcher's JIT specializes: 16-byte aligned pointers (supported() requires the cache's)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n.endswith("_ptr")}
    return triton.compile(GluonASTSource(th._tile_hopper_kernel, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": th.NUM_WARPS})


def _reports_of_every_variant() -> dict[str, dict]:
    return report_each(VARIANTS, lambda fp8, heads: ptxas_report(_compile(fp8, heads)))


@functools.lru_cache(maxsize=None)
def _reports() -> dict[str, dict]:
    return reports_from_subprocess("tests.kernels.test_sparse_mla_tile_hopper_compile")


def _report(variant) -> dict:
    r = _reports()[repr(variant)]
    assert "error" not in r, r.get("error")
    return r


def _ids(v):
    return f"{'fp8' if v[0] else 'bf16'}-{v[1]}heads"


@pytest.mark.parametrize("variant", VARIANTS, ids=_ids)
def test_tile_compiles_without_spills_or_serialized_mmas(variant):
    r = _report(variant)
    assert r["shared"] <= SMEM_LIMIT, r["shared"]
    assert "0 bytes spill stores, 0 bytes spill loads" in r["ptxas"], r["ptxas"]
    assert "C7515" not in r["ptxas"], r["ptxas"]  # wgmma serialized


@pytest.mark.parametrize("variant", VARIANTS, ids=_ids)
def test_qk_is_issued_once_per_block_split_over_the_warpgroups(variant):
    """The 64 (token, head) rows x 64 keys of QK^T: each warpgroup issues m64n32k16 over its own 32 key columns, at
    one place in the loop (36 k-steps over the 576 columns); a QK^T duplicated over the warpgroups would be
    m64n64k16. P @ V: 128 latent columns a warpgroup (m64n128k16) in the loop and after it."""
    ptx = _report(variant)["ptx"]
    mmas = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.f32\.bf16\.bf16", ptx)
    assert set(mmas) == {"m64n32k16", "m64n128k16"}, set(mmas)
    assert mmas.count("m64n32k16") == QK_STEPS, mmas.count("m64n32k16")


@pytest.mark.parametrize("variant", VARIANTS, ids=_ids)
def test_counts_and_next_rows_load_while_qk_runs(variant):
    """Between the last QK^T instruction and the first wgmma wait after it the kernel loads the block's counts and
    the next block's (then its block-table slots): the MMAs are asynchronous and those dependent loads hide under
    them. With the bf16 cache it then waits for P @ V of the block before while the three QK^T
    groups stay in flight (``wait_group 3``: the stage the next gathers reuse)."""
    ptx = _report(variant)["ptx"]
    lines = ptx.splitlines()
    last_qk = max(i for i, line in enumerate(lines) if "wgmma.mma_async.sync.aligned.m64n32k16" in line)
    wait = next(i for i in range(last_qk, len(lines)) if "wgmma.wait_group" in lines[i])
    # 16-bit counters: the block's ([64, 64] over 256 threads: 16 a thread) and the next block's (each of a
    # thread's two gather rows, for every token of the tile)
    from fxglm5.lowering.triton.sparse_mla_tile import block_q

    counters = sum("ld.global.b16" in line for line in lines[last_qk:wait])
    assert counters >= 16 + 2 * block_q(variant[1]), counters
    if not variant[0]:
        assert re.search(r"wgmma\.wait_group\.sync\.aligned 3;", ptx)


@pytest.mark.parametrize("variant", VARIANTS, ids=_ids)
def test_gathers_zero_fill_unlisted_rows_ahead_of_the_mmas(variant):
    """Every gather is a 16-byte cp.async with a source-size operand (0 for rows no token of the request lists:
    zero-filled, so stale bytes never reach P @ V), and the loop waits for all but the blocks in flight: none past
    the current one with the bf16 cache, one with FP8 (whose stage frees after the dequantization)."""
    r = _report(variant)
    ptx = r["ptx"]
    # cp.async [dst], [src], 16 bytes, source size: a register (16 or 0) where the copy is masked
    sizes = re.findall(r"cp\.async\.cg\.shared\.global \[[^]]+\], \[[^]]+\], 0x10, (\S+);", ptx)
    assert sizes and all(re.fullmatch(r"%r\d+", size) for size in sizes), sorted(set(sizes))
    assert not re.search(r"cp\.async\.ca\.", ptx)
    waits = set(re.findall(r"cp\.async\.wait_group\s+(\d+);", ptx))
    assert waits == {"1" if variant[0] else "0"}, waits
    assert r["sass_opcodes"].get("LDGSTS.E.BYPASS.128.ZFILL", 0) + r["sass_opcodes"].get("LDGSTS.E.BYPASS.128", 0)
