"""The caches RTP-LLM allocates, checked against the program's CacheSpec before the plugin runs on them
(``fxglm5.rtpllm.context.bind_caches`` -> ``CacheSpec.check``): RTP's per-layer views, as its allocator makes them
(the stand-in's ``allocate_kv_cache`` layout), bind in the program's input order, the FP8 rows as RTP's
``float8_e4m3fn`` view of the bytes the program reads; a layer's tensor of the wrong dtype, of the wrong shape, or
not contiguous is refused naming that layer and RTP's field (``kv_cache_base`` or ``kv_scale_base``), whichever
layer it is."""

import pytest
import torch

from fxglm5.errors import InputError
from fxglm5.program import CacheSpec, PagedSignature
from tests.frontdoors.test_rtpllm_plugin import rtp  # noqa: F401 - fixture

INDEXED = [True, False, True]  # layer 1 reuses layer 0's top-k: no index cache of its own
BLOCKS, BLOCK, KERNEL_BLOCK = 4, 16, 8  # 8 kernel blocks of 8 rows per layer


def rtp_caches(kv_kind: str, dtype=torch.bfloat16):
    """Per-layer [kernel_blocks, kernel_block_size, row] views of one pool per layout, as RTP allocates them."""
    width, kv_dtype = (656, torch.float8_e4m3fn) if kv_kind == "fp8" else (576, dtype)
    kb = BLOCKS * BLOCK // KERNEL_BLOCK
    kv_pool = torch.zeros(len(INDEXED), BLOCKS, BLOCK * width, dtype=kv_dtype)
    index_pool = torch.zeros(len(INDEXED), BLOCKS, BLOCK * 132, dtype=torch.uint8)
    kv = [kv_pool[i].view(kb, KERNEL_BLOCK, width) for i in range(len(INDEXED))]
    scale = [index_pool[i].view(kb, KERNEL_BLOCK, 132) for i in range(len(INDEXED))]
    return kv, scale


def kv_cache(rtp_module, kv, scale):
    from rtp_llm.ops.compute_ops import KVCache

    return KVCache(kv, scale, BLOCK, KERNEL_BLOCK)


def spec(kv_kind: str) -> CacheSpec:
    return CacheSpec(PagedSignature.for_layers(INDEXED), kv_kind, "fp8", torch.bfloat16)


@pytest.mark.parametrize("kv_kind", ["bf16", "fp8"])
def test_rtps_caches_bind_in_the_programs_order(rtp, kv_kind):
    from fxglm5.rtpllm.context import bind_caches

    kv, scale = rtp_caches(kv_kind)
    inputs, layout = bind_caches(kv_cache(rtp, kv, scale), spec(kv_kind), 256)
    want = [kv[0], scale[0], kv[1], kv[2], scale[2]]  # the graph's order: kv_cache_0, index_cache_0, kv_cache_1, ...
    assert len(inputs) == len(want) == len(spec(kv_kind).names)
    for got, base in zip(inputs, want):
        assert got.data_ptr() == base.data_ptr() and got.shape == base.shape  # RTP's memory, not a copy
    assert all(t.dtype == torch.uint8 for t in inputs[1::3]) and (kv_kind == "bf16") == (inputs[0].dtype == torch.bfloat16)
    assert (layout.block_size, layout.kernel_block_size, layout.num_blocks) == (BLOCK, KERNEL_BLOCK, BLOCKS)


def _wrong_dtype(t):
    return t.view(torch.uint8).to(torch.float16) if t.dtype == torch.float8_e4m3fn else t.to(torch.float32)


def _wrong_shape(t):
    return t[:, :, :-4].contiguous()


def _not_contiguous(t):
    wide = torch.zeros(t.shape[0], t.shape[1], t.shape[2] + 4, dtype=t.dtype)
    return wide[:, :, :t.shape[2]]


@pytest.mark.parametrize("kv_kind", ["bf16", "fp8"])
@pytest.mark.parametrize("field, layer", [("kv_cache_base", 0), ("kv_cache_base", 1), ("kv_cache_base", 2),
                                          ("kv_scale_base", 0), ("kv_scale_base", 2)])
@pytest.mark.parametrize("broken", ["dtype", "shape", "contiguous"])
def test_a_bad_layer_cache_is_refused_by_layer_and_field(rtp, kv_kind, field, layer, broken):
    from fxglm5.rtpllm.context import bind_caches

    kv, scale = rtp_caches(kv_kind)
    tensors = kv if field == "kv_cache_base" else scale
    good = tensors[layer]
    tensors[layer] = {"dtype": _wrong_dtype, "shape": _wrong_shape, "contiguous": _not_contiguous}[broken](good)
    name = f"kv_cache layer {layer} {field}" + (" (indexer keys)" if field == "kv_scale_base" else "")
    if broken == "contiguous":
        message = f"{name}: must be contiguous"
    else:
        kind = "indexer keys, fp8" if field == "kv_scale_base" else f"latent rows, {kv_kind}"
        dtype = torch.bfloat16 if field == "kv_cache_base" and kv_kind == "bf16" else torch.uint8
        width = 132 if field == "kv_scale_base" else 656 if kv_kind == "fp8" else 576
        message = f"{name}: expected {dtype} [8, {KERNEL_BLOCK}, {width}] ({kind}), got "
    with pytest.raises(InputError) as raised:
        bind_caches(kv_cache(rtp, kv, scale), spec(kv_kind), 256)
    assert str(raised.value).startswith(message), str(raised.value)
