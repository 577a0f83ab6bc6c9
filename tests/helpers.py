"""Test helpers: random weights for small GLM-5 models and modules (no checkpoint needed)."""

import torch

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
