"""RandomReader: random GLM-5 weights with :class:`~fxglm5.model.checkpoint.CheckpointReader`'s interface, for
measuring one rank of a deployment (``bench/rank_at_depth.py``) without the checkpoint (744 B parameters).

:func:`fxglm5.runtime.shard_loader.load_sharded` asks a reader for each attribute (and each derivation's source)
by model parameter name, with a meta tensor of the rank's shape and the plan's ``Slice``; this reader draws that
slice directly on the device (97 GB for one TP8 / EP8 rank of GLM-5-FP8 in seconds, no host round trip), after
checking that the slice is a part of the parameter the config gives. Values are a function of (seed, name, part):
replicated tensors (norms, embedding, router) are the same on every rank and in every run.

Timing depends on values only through the MoE routing and through NaN / Inf, so the values are drawn for those:
activations keep about unit scale through 78 layers (block scales 1/sqrt(K) around e4m3's unit-variance codes,
norm gains near 1, small biases), and the router's logits spread over the experts, which routes tokens about
uniformly (optimistic for MoE: trained routers are skewed).
"""

from __future__ import annotations

import zlib

import torch

from fxglm5.contracts import FP8_BLOCK, FP8_MAX
from fxglm5.errors import CheckpointError
from fxglm5.model.config import Glm5Config
from fxglm5.model.layout import SCALE_SUFFIX, expected_tensors

_CHUNK = 1 << 27  # elements drawn at once: bounds the float temporaries of a 3 GB expert stack


class RandomReader:
    """Random weights for ``config`` (the parameter names, shapes and parts of ``Glm5ForCausalLM``), counted in
    ``bytes_read`` like a checkpoint's."""

    def __init__(self, config: Glm5Config, seed: int = 0):
        self.config, self.seed = config, seed
        self.shapes = {name: spec.shape for name, spec in expected_tensors(config, packed=True).items()}
        self.bytes_read: dict[str, int] = {}

    def __enter__(self) -> "RandomReader":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def param(self, name: str, like: torch.Tensor, device, part=None) -> torch.Tensor:
        """A random tensor of ``like``'s shape and dtype on ``device``: the parameter ``name``, or its ``part`` (a
        ``fxglm5.parallel.Slice``). CheckpointError when ``name`` is no parameter of the config or ``like`` is
        not the shape of that part."""
        if name not in self.shapes:
            raise CheckpointError(f"random weights: {name!r} is not a parameter of GLM-5 with this config")
        full = torch.empty(self.shapes[name], device="meta")
        try:
            shape = tuple((full if part is None else part.apply(full)).shape)
        except (IndexError, RuntimeError) as err:
            raise CheckpointError(f"random weights: tensor {name!r} of shape {list(full.shape)} has no part {part}: "
                                  f"{err}") from err
        if shape != tuple(like.shape):
            raise CheckpointError(f"random weights: tensor {name!r}{'' if part is None else f' part {part}'} has "
                                  f"shape {list(shape)}, the model expects {list(like.shape)}")
        gen = torch.Generator(device=device)
        gen.manual_seed(zlib.crc32(f"{self.seed}:{name}:{part}".encode()))
        out = torch.empty(like.shape, dtype=like.dtype, device=device)
        for chunk in out.view(-1).split(_CHUNK):
            chunk.copy_(_draw(name, like, chunk.numel(), gen, device))
        self.bytes_read[name] = self.bytes_read.get(name, 0) + out.numel() * out.element_size()
        return out


def _draw(name: str, like: torch.Tensor, n: int, gen: torch.Generator, device) -> torch.Tensor:
    """``n`` values of the parameter ``name`` (rank-local shape and dtype of ``like``), float32."""
    if like.dtype == torch.float8_e4m3fn:  # unit-variance codes; the block scales set the magnitude
        return torch.randn(n, generator=gen, device=device).clamp_(-FP8_MAX, FP8_MAX)
    if name.endswith(SCALE_SUFFIX):  # K = the weight's input width: y = W x keeps x's scale
        width = FP8_BLOCK * like.shape[-1]
        return torch.rand(n, generator=gen, device=device).add_(1).mul_(0.5 / width ** 0.5)
    noise = torch.randn(n, generator=gen, device=device)
    if like.dim() == 1:  # norm gains near 1; the LayerNorm bias and the router's correction bias small
        return noise.mul_(0.05) if name.endswith("bias") else noise.mul_(0.05).add_(1)
    return noise.mul_(like.shape[-1] ** -0.5)  # embedding, lm_head, router, indexer weights_proj
