"""The options the benches serve GLM-5 with, built through the one builder (``fxglm5.serve.build.build_runner``),
as ``fxglm5 generate`` and ``fxglm5 serve`` build theirs.

``GLM5_SERVING`` is GLM-5's serving cache: FP8 latent and index rows (656-byte ds_mla rows) in blocks of 64
tokens, bf16 compute. A bench replaces what it varies (device, cache size, tp, ...):

    build_runner(model, GLM5_SERVING.replace(device="cuda", max_cache_tokens=n), program=program)
"""

from __future__ import annotations

import torch

from fxglm5.runtime.options import RunnerOptions

GLM5_SERVING = RunnerOptions(kv_cache="fp8", index_cache="fp8", block_size=64, dtype=torch.bfloat16)
