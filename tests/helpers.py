"""Test helpers: random weights for small GLM-5 models and modules (no checkpoint needed), latent rows with
distinct FP8 group scales, an independent block-FP8 quantizer, TF32 rounding, and an MTP head of its own for a tiny
checkpoint."""

import contextlib
import json
import struct
from pathlib import Path

import torch
import torch.distributed as dist

from fxglm5.model.config import Glm5Config
from fxglm5.model.modeling import Glm5ForCausalLM


def randomize_(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Fill every parameter with scaled random values: FP8 weights ~N(0, 1) in e4m3 with block scales
    ~1/sqrt(fan_in), plain weights ~1/sqrt(fan_in), norms around 1, biases small."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dtype == torch.float8_e4m3fn:
                p.copy_(torch.randn(p.shape, generator=gen).to(torch.float8_e4m3fn))
            elif name.endswith("scale_inv"):
                fan_in = p.shape[-1] * 128
                p.copy_((torch.rand(p.shape, generator=gen) + 0.5) / fan_in**0.5)
            elif p.dim() == 1:
                base = 0.0 if ("bias" in name) else 1.0
                p.copy_((base + 0.1 * torch.randn(p.shape, generator=gen)).to(p.dtype))
            else:
                p.copy_((torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5).to(p.dtype))
    return module


def random_model(cfg: Glm5Config, dtype=torch.float32, seed: int = 0) -> Glm5ForCausalLM:
    return randomize_(Glm5ForCausalLM(cfg, dtype=dtype), seed).eval()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| relative to the reference's scale (max |ref|)."""
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


def copy_to_dtype(model: Glm5ForCausalLM, dtype: torch.dtype) -> Glm5ForCausalLM:
    """The same weights (exactly: FP8 stays FP8, float params are converted) in another compute dtype."""
    twin = Glm5ForCausalLM(model.config, dtype=dtype)
    with torch.no_grad():
        for (name, p), (_, q) in zip(twin.named_parameters(), model.named_parameters()):
            p.copy_(q.to(p.dtype))
    return twin.eval()


# Gains of the four 128-wide groups of a 512-wide latent row. Unit-normal values give all four groups the same
# power-of-two FP8 scale (amax ~3 -> 2^-7), so a 656-byte row with one group's scale swapped, shared or
# misplaced would dequantize to the same values; with these gains the scales are 2^-7, 2^-6, 2^-8, 2^-9.
LATENT_GROUP_GAINS = (1.0, 2.0, 0.5, 0.25)


def tf32_rounded(w: torch.Tensor) -> torch.Tensor:
    """float32 ``w`` rounded to TF32 as a TF32 MMA reads it (10 mantissa bits, to nearest, ties away from zero):
    a weight run through a float32 GEMM in this form gives what one TF32 MMA gives of it."""
    return ((w.view(torch.int32) + 0x1000) & -8192).view(torch.float32)


def latent_values(n: int, rank: int = 512, generator: torch.Generator | None = None) -> torch.Tensor:
    """float32 [n, rank] normal latent values, group i (128 wide) scaled by LATENT_GROUP_GAINS[i]."""
    gains = torch.tensor(LATENT_GROUP_GAINS).repeat_interleave(128)[:rank]
    return torch.randn(n, rank, generator=generator) * gains


def _f32(v: float) -> float:
    return struct.unpack("f", struct.pack("f", v))[0]


def loop_quantize_fp8(x: torch.Tensor, block_rows: int, floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-FP8 quantization of a 2-D x written out per block in Python floats, independent of fxglm5's code:
    blocks of ``block_rows`` x 128 (short edge blocks: their real elements only), scale = max(amax, floor) / 448
    rounded to float32, each element x / scale rounded to float32, clamped to +-448 and cast to e4m3 by torch.
    Returns (e4m3 [R, C], float32 scales [ceil(R / block_rows), ceil(C / 128)])."""
    rows = x.float().tolist()
    n, k = len(rows), len(rows[0])
    nb, kb = -(-n // block_rows), -(-k // 128)
    scales = [[0.0] * kb for _ in range(nb)]
    values = [[0.0] * k for _ in range(n)]
    for bi in range(nb):
        for bj in range(kb):
            cells = [(i, j) for i in range(bi * block_rows, min(n, (bi + 1) * block_rows))
                     for j in range(bj * 128, min(k, (bj + 1) * 128))]
            amax = max(abs(rows[i][j]) for i, j in cells)
            scale = _f32(max(amax, floor) / 448.0)  # float32 division (one rounding of the exact quotient)
            scales[bi][bj] = scale
            for i, j in cells:
                values[i][j] = min(448.0, max(-448.0, _f32(rows[i][j] / scale)))
    return torch.tensor(values).to(torch.float8_e4m3fn), torch.tensor(scales)


def saturating_values(n: int, k: int, block_rows: int, generator: torch.Generator) -> torch.Tensor:
    """float32 [n, k] for the FP8 quantizers, each block_rows x 128 block of one kind (cycling): values far above
    448 (1e4 scale); an amax of exactly 448 (scale 1); multiples of 448; all zeros; unit normal; one -1000 among
    values ~1e-3 (e4m3 subnormals and underflow after scaling)."""
    i, j = torch.arange(n)[:, None], torch.arange(k)[None, :]
    kind = (i // block_rows + j // 128) % 6
    first = (i % block_rows == 0) & (j % 128 == 0)  # each block's first element
    x = torch.randn(n, k, generator=generator)
    multiples = 448.0 * torch.randint(-3, 4, (n, k), generator=generator).float()
    x = torch.where(kind == 0, x * 1e4, x)
    x = torch.where(kind == 1, torch.where(first, 448.0, (x * 100).clamp(-447, 447)), x)
    x = torch.where(kind == 2, multiples, x)
    x = torch.where(kind == 3, 0.0, x)
    return torch.where(kind == 5, torch.where(first, -1000.0, x * 1e-3), x)


def assert_saturates(q: torch.Tensor, scale: torch.Tensor, x: torch.Tensor, block_rows: int) -> None:
    """e4m3 ``q`` of ``x`` (blocks of block_rows x 128, ``scale`` per block): in every non-zero block the largest
    |x| is 448 * scale (to a float32 rounding) and quantizes to exactly +-448; a block whose amax is 448 has
    scale 1; nothing is NaN (e4m3fn has no infinity: a value past 448 that escaped the clamp would be NaN)."""
    assert not q.float().isnan().any()
    for bi in range(scale.shape[0]):
        for bj in range(scale.shape[1]):
            xb = x[bi * block_rows:(bi + 1) * block_rows, bj * 128:(bj + 1) * 128].float()
            qb = q[bi * block_rows:(bi + 1) * block_rows, bj * 128:(bj + 1) * 128].float()
            amax, sc = xb.abs().max().item(), scale[bi, bj].item()
            if amax == 0:
                continue
            assert abs(448.0 * sc - amax) <= amax * 2.0**-23, (bi, bj, amax, sc)
            assert qb.abs().max().item() == 448.0 and qb.flatten()[xb.abs().argmax()].abs().item() == 448.0
            if amax == 448.0:
                assert sc == 1.0


@contextlib.contextmanager
def fake_process_group(rank: int, world: int):
    """torch.distributed's fake backend (``torch.testing._internal.distributed.fake_pg``) as ``rank`` of ``world``:
    its collectives run, eagerly and in CUDA-graph capture, and return without communicating (an all_reduce leaves
    its input). Torn down after, so that later tests in the worker see no process group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def add_own_mtp_head(ckpt, seed: int = 7) -> torch.Tensor:
    """Give checkpoint ``ckpt``'s MTP layer a head of its own, as GLM-5.x variants store one
    (``model.layers.{L}.shared_head.head.weight``, bf16 [V, H], where GLM-5-FP8 has none and the model's lm_head
    serves): random rows unlike the lm_head's, in a shard of their own listed in the index. Returns the tensor."""
    from safetensors.torch import save_file

    from fxglm5.model.layout import mtp_prefix
    from fxglm5.model.st_files import INDEX

    ckpt = Path(ckpt)
    cfg = Glm5Config.from_json(ckpt / "config.json")
    name = mtp_prefix(cfg) + "shared_head.head.weight"
    gen = torch.Generator().manual_seed(seed)
    head = (torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen) * cfg.hidden_size ** -0.5).to(torch.bfloat16)
    save_file({name: head}, str(ckpt / "model-mtp-head.safetensors"), metadata={"format": "pt"})
    index = json.loads((ckpt / INDEX).read_text())
    index["weight_map"][name] = "model-mtp-head.safetensors"
    (ckpt / INDEX).write_text(json.dumps(index, indent=2))
    return head
