"""Where and how the cached ops store a token: slot = block * block_size + pos % block_size (physical
block from the request's table), in RTP's rows: 576 compute-dtype values, 656-byte FP8 ds_mla rows
(e4m3 c_kv, one power-of-two fp32 scale per 128 values, bf16 k_pe) and the indexer cache (132 bytes per
token, block-major: a block's e4m3 keys, then their fp32 scales). Caches are
filled with a sentinel first: every slot the step does not own, block 0 included, must keep it.
"""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fxglm5.ops.cached  # noqa: F401  (registers the ops)
from fxglm5.program import CacheSpec, PagedSignature
from fxglm5.runtime.cache import PagedCache, kernel_block_table
from fxglm5.runtime.forward_context import ForwardContext
from tests.helpers import latent_values

ops = torch.ops.fxglm5
SENTINEL_BYTE, SENTINEL = 0xA5, 12345.0
NB = 64  # physical blocks: enough for 3 requests of up to 15 tokens in blocks of 1


def pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """Independent statement of the rule: amax / 448 rounded up to a power of two."""
    return torch.tensor([2.0 ** math.ceil(math.log2(max(a, 1e-10) / 448.0)) for a in amax.flatten().tolist()]).view(amax.shape)


def make_context(gen, block_size, ratio, specs, num_blocks):
    """specs: [(cached prefix, new tokens)] per request; random distinct physical blocks (never 0)."""
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = []
    for prefix, new in specs:
        n = -(-(prefix + new) // block_size)
        tables.append([free.pop() for _ in range(n)])
    ctx = ForwardContext.build(True, [n for _, n in specs], [p for p, _ in specs], tables, block_size=block_size,
                               kernel_block_size=block_size // ratio, num_blocks=num_blocks,
                               max_position_embeddings=4096)
    return ctx.validate(), tables


def physical_slots(ctx, tables, block_size):
    return torch.tensor([tables[r][p // block_size] * block_size + p % block_size
                         for r, p in zip(ctx.req_idx.tolist(), ctx.positions.tolist())])


def run_attention(ctx, kv_cache, gen, rank=512, rope=64, heads=2):
    T = ctx.positions.shape[0]
    kv_c = latent_values(T, rank, gen)[None]  # at rank 512, four distinct FP8 group scales
    k_pe = torch.randn(1, T, rope, generator=gen)
    q_nope, q_pe = torch.randn(1, T, heads, 16, generator=gen), torch.randn(1, T, heads, rope, generator=gen)
    w_uk, w_uv = torch.randn(heads, 16, rank, generator=gen), torch.randn(heads, 8, rank, generator=gen)
    own = ctx.positions.view(1, T, 1).to(torch.int32)  # each token attends to its own, just written row
    out = ops.rtp_sparse_mla(q_nope, q_pe, kv_c, k_pe, w_uk, w_uv, own, 0.1, kv_cache, ctx.slot_mapping,
                             ctx.kernel_block_table, ctx.req_idx, ctx.positions, 4096)
    return kv_c[0], k_pe[0], out[0], w_uv


def untouched(flat: torch.Tensor, slots: torch.Tensor, sentinel) -> bool:
    mask = torch.ones(flat.shape[0], dtype=torch.bool)
    mask[slots] = False
    return bool((flat[mask] == sentinel).all())


specs_st = st.lists(st.tuples(st.integers(0, 9), st.integers(1, 6)), min_size=1, max_size=3)


@given(block_size=st.sampled_from([1, 2, 4, 8]), ratio=st.sampled_from([1, 2]), specs=specs_st,
       seed=st.integers(0, 1000))
def test_latent_rows_compute_dtype(block_size, ratio, specs, seed):
    ratio = ratio if block_size % ratio == 0 else 1
    gen = torch.Generator().manual_seed(seed)
    ctx, tables = make_context(gen, block_size, ratio, specs, num_blocks=NB)
    cache = torch.full((NB, block_size, 576), SENTINEL)
    kernel_view = cache.view(NB * ratio, block_size // ratio, 576)
    kv_c, k_pe, out, w_uv = run_attention(ctx, kernel_view, gen)
    slots = physical_slots(ctx, tables, block_size)
    flat = cache.view(-1, 576)
    assert torch.equal(flat[slots], torch.cat([kv_c, k_pe], dim=1))
    assert untouched(flat, slots, SENTINEL)
    assert bool((cache[0] == SENTINEL).all())
    # a softmax over one row is 1: the output is that row's c_kv through W_UV
    torch.testing.assert_close(out, torch.einsum("tr,hvr->thv", kv_c, w_uv), rtol=1e-5, atol=1e-4)


@given(block_size=st.sampled_from([2, 4, 8]), ratio=st.sampled_from([1, 2]), specs=specs_st,
       seed=st.integers(0, 1000))
def test_latent_rows_fp8_ds_mla(block_size, ratio, specs, seed):
    gen = torch.Generator().manual_seed(seed)
    ctx, tables = make_context(gen, block_size, ratio, specs, num_blocks=NB)
    cache = torch.full((NB, block_size, 656), SENTINEL_BYTE, dtype=torch.uint8)
    kv_c, k_pe, out, w_uv = run_attention(ctx, cache.view(NB * ratio, block_size // ratio, 656), gen)
    slots = physical_slots(ctx, tables, block_size)
    rows = cache.view(-1, 656)[slots]
    scales = rows[:, 512:528].contiguous().view(torch.float32)  # [T, 4]
    groups = kv_c.view(-1, 4, 128)
    assert torch.equal(scales, pow2_scale(groups.abs().amax(-1)))
    e4m3 = rows[:, :512].contiguous().view(torch.float8_e4m3fn).view(-1, 4, 128)
    assert torch.equal(e4m3.float(), (groups / scales[..., None]).to(torch.float8_e4m3fn).float())
    assert torch.equal(rows[:, 528:].contiguous().view(torch.bfloat16), k_pe.to(torch.bfloat16))
    assert untouched(cache.view(-1, 656), slots, SENTINEL_BYTE)
    assert bool((cache[0] == SENTINEL_BYTE).all())
    deq = (e4m3.float() * scales[..., None]).view(-1, 512)
    torch.testing.assert_close(out, torch.einsum("tr,hvr->thv", deq, w_uv), rtol=1e-4, atol=1e-3)


@given(block_size=st.sampled_from([1, 4, 8]), specs=specs_st, seed=st.integers(0, 1000))
def test_indexer_rows_fp8(block_size, specs, seed):
    gen = torch.Generator().manual_seed(seed)
    ctx, tables = make_context(gen, block_size, 1, specs, num_blocks=NB)
    cache = torch.full((NB, block_size, 132), SENTINEL_BYTE, dtype=torch.uint8)
    T = ctx.positions.shape[0]
    k = torch.randn(1, T, 128, generator=gen) * 3
    q, w = torch.randn(1, T, 4, 128, generator=gen), torch.rand(1, T, 4, generator=gen)
    top = ops.rtp_indexer(q, k, w, 4, cache, ctx.slot_mapping, ctx.kernel_block_table, ctx.req_idx, ctx.positions, 4096)
    assert top.shape == (1, T, 4) and top.dtype == torch.int32
    slots = physical_slots(ctx, tables, block_size)
    # block-major blocks: the block's 128-byte keys, then its float32 scales
    blocks = cache.view(NB, block_size * 132)
    blk, off = slots // block_size, slots % block_size
    key_at = (off * 128)[:, None] + torch.arange(128)
    scale_at = (block_size * 128 + off * 4)[:, None] + torch.arange(4)
    scale = blocks[blk[:, None], scale_at].contiguous().view(torch.float32)[:, 0]
    assert torch.equal(scale, pow2_scale(k[0].abs().amax(-1)))
    e4m3 = blocks[blk[:, None], key_at].contiguous().view(torch.float8_e4m3fn).float()
    assert torch.equal(e4m3, (k[0] / scale[:, None]).to(torch.float8_e4m3fn).float())
    owned = torch.zeros_like(blocks, dtype=torch.bool)
    owned[blk[:, None], key_at] = True
    owned[blk[:, None], scale_at] = True
    assert bool((blocks[~owned] == SENTINEL_BYTE).all())
    # selected positions are causal and belong to the window 0..pos; -1 only pads a short window
    pos = ctx.positions
    valid = top[0] >= 0
    assert bool((top[0].long() <= pos[:, None]).all())
    assert torch.equal(valid.sum(1), torch.clamp(pos + 1, max=4))


def test_smaller_model_widths_are_zero_padded_rows():
    """The tiny config (rank 128, rope 32, indexer dim 64) uses GLM-5's rows, zero-padded."""
    gen = torch.Generator().manual_seed(0)
    ctx, tables = make_context(gen, 4, 1, [(0, 5)], num_blocks=4)
    cache = torch.full((4, 4, 576), SENTINEL)
    kv_c, k_pe, _, _ = run_attention(ctx, cache, gen, rank=128, rope=32)
    rows = cache.view(-1, 576)[physical_slots(ctx, tables, 4)]
    assert torch.equal(rows[:, :128], kv_c) and bool((rows[:, 128:512] == 0).all())
    assert torch.equal(rows[:, 512:544], k_pe) and bool((rows[:, 544:] == 0).all())
    index = torch.full((4, 4, 128), SENTINEL)
    k = torch.randn(1, 5, 64, generator=gen)
    ops.rtp_indexer(torch.randn(1, 5, 2, 64), k, torch.rand(1, 5, 2), 3, index, ctx.slot_mapping,
                    ctx.kernel_block_table, ctx.req_idx, ctx.positions, 4096)
    rows = index.view(-1, 128)[physical_slots(ctx, tables, 4)]
    assert torch.equal(rows[:, :64], k[0]) and bool((rows[:, 64:] == 0).all())


@pytest.mark.parametrize("kv,index", [("bf16", "fp8"), ("fp8", "fp8"), ("bf16", "bf16")])
def test_runtime_allocation_layouts(kv, index):
    sig = PagedSignature((("kv_cache_0", "index_cache_0"), ("kv_cache_1", None)))
    cache = PagedCache(CacheSpec(sig, kv, index, torch.bfloat16), num_blocks=5, block_size=8, kernel_block_size=2)
    kv_shape = (5, 8, 656) if kv == "fp8" else (5, 8, 576)
    index_shape = (5, 8, 132) if index == "fp8" else (5, 8, 128)
    assert tuple(cache.tensors["kv_cache_0"].shape) == kv_shape
    assert cache.tensors["kv_cache_0"].dtype == (torch.uint8 if kv == "fp8" else torch.bfloat16)
    assert tuple(cache.tensors["index_cache_0"].shape) == index_shape
    assert "index_cache_1" not in cache.tensors
    views = cache.graph_inputs()
    assert [tuple(v.shape[:2]) for v in views] == [(20, 2)] * 3
    assert views[0].data_ptr() == cache.tensors["kv_cache_0"].data_ptr()


@pytest.mark.parametrize("ratio", [2, 4])
def test_kernel_sub_blocks_keep_token_order_inside_a_physical_block(ratio):
    """Kernel block physical * ratio + j holds tokens j * kbs .. (j + 1) * kbs - 1 of that physical block: rows
    written through the step's slots sit at physical * block_size + pos % block_size, and a read through the
    step's kernel table finds each token's own row, while the same read through a table whose sub-blocks are
    swapped inside each physical block finds other rows (the check has power)."""
    bs, gen = 8, torch.Generator().manual_seed(ratio)
    ctx, tables = make_context(gen, bs, ratio, [(0, 16), (0, 11)], num_blocks=NB)
    cache = torch.full((NB, bs, 576), SENTINEL)
    view = cache.view(NB * ratio, bs // ratio, 576)
    kv_c, k_pe, out, w_uv = run_attention(ctx, view, gen)
    assert torch.equal(cache.view(-1, 576)[physical_slots(ctx, tables, bs)], torch.cat([kv_c, k_pe], dim=1))

    def read(kernel_table):  # attention of every token to its own position only, writing nothing
        T = ctx.positions.shape[0]
        q_nope, q_pe = torch.randn(1, T, 2, 16, generator=gen), torch.zeros(1, T, 2, 64)
        own = ctx.positions.view(1, T, 1).to(torch.int32)
        return ops.rtp_sparse_mla(q_nope, q_pe, torch.zeros(1, T, 512), torch.zeros(1, T, 64),
                                  torch.randn(2, 16, 512, generator=gen), w_uv, own, 0.1, view,
                                  torch.full_like(ctx.slot_mapping, -1), kernel_table, ctx.req_idx, ctx.positions,
                                  4096)[0]

    expected = torch.einsum("tr,hvr->thv", kv_c, w_uv)
    torch.testing.assert_close(read(ctx.kernel_block_table), expected, rtol=1e-5, atol=1e-4)
    kt = ctx.kernel_block_table
    swapped = kt.view(kt.shape[0], -1, ratio).flip(-1).reshape(kt.shape)
    assert not torch.allclose(read(swapped), expected, rtol=1e-2, atol=1e-2)


def test_kernel_block_table():
    table = torch.tensor([[3, 1, 0]], dtype=torch.int32)
    assert kernel_block_table(table, 4).tolist() == [[12, 13, 14, 15, 4, 5, 6, 7, 0, 0, 0, 0]]


@pytest.mark.parametrize("latent,index", [("compute", "fp8"), ("fp8", "compute")])
def test_opcheck_cached_ops(latent, index):
    """Schemas declare the cache mutation, fake impls match real outputs (also under AOT dispatch)."""
    ctx = ForwardContext.build(True, [5, 3], [2, 0], [[1, 2], [3]], block_size=4, kernel_block_size=4, num_blocks=6,
                               max_position_embeddings=64).validate()
    T, gen = 8, torch.Generator().manual_seed(0)
    kv = torch.zeros(6, 4, 656, dtype=torch.uint8) if latent == "fp8" else torch.zeros(6, 4, 576)
    index = torch.zeros(6, 4, 132, dtype=torch.uint8) if index == "fp8" else torch.zeros(6, 4, 128)
    context = (ctx.slot_mapping, ctx.kernel_block_table, ctx.req_idx, ctx.positions, 64)
    indexer = (torch.randn(1, T, 2, 128, generator=gen), torch.randn(1, T, 128, generator=gen),
               torch.rand(1, T, 2, generator=gen), 3, index, *context)
    torch.library.opcheck(ops.rtp_indexer.default, indexer)
    top = ops.rtp_indexer(*indexer)
    latent_args = (torch.randn(1, T, 2, 8, generator=gen), torch.randn(1, T, 2, 64, generator=gen),
                   torch.randn(1, T, 512, generator=gen), torch.randn(1, T, 64, generator=gen),
                   torch.randn(2, 8, 512, generator=gen), torch.randn(2, 4, 512, generator=gen))
    torch.library.opcheck(ops.rtp_sparse_mla.default, (*latent_args, top, 0.1, kv, *context))
    torch.library.opcheck(ops.rtp_mla.default, (*latent_args, 0.1, kv, *context))
    made = {"q_latent": torch.randn(1, T, 2, 576, generator=gen)}  # the latent query given (fp8_linear_latent_query's)
    torch.library.opcheck(ops.rtp_sparse_mla.default, (*latent_args, top, 0.1, kv, *context), made)
    torch.library.opcheck(ops.rtp_mla.default, (*latent_args, 0.1, kv, *context), made)
    # the q_b | wq_b GEMM (2 heads of 8 + 64 query columns, then the indexer's 2 heads of 128) with the latent query
    # and this indexer over the index cache (its keys written already: the op only reads it), both turned by the
    # tables; no test_schema: its alias checker multiplies tensors, which CPU float8 does not support
    weight = (torch.randn(2 * 72 + 256, 256, generator=gen) * 0.1).to(torch.float8_e4m3fn)
    angles = torch.rand(1, T, 32, generator=gen)
    fused = (torch.randn(1, T, 256, generator=gen), weight, torch.rand(4, 2, generator=gen), None, False,
             latent_args[4], 0, 64, angles.cos(), angles.sin(), 144, 2, 128, indexer[2], 3, index, *context, True)
    torch.library.opcheck(ops.fp8_linear_latent_query_indexer.default, fused,
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
