"""torch.compile(model, backend="fxglm5"): listed through the entry point, runs the passes, gives the eager logits."""

import logging

import torch

from fxglm5.model.config import Glm5Config
from tests.helpers import random_model, rel_err


def test_backend_is_listed():
    assert "fxglm5" in torch._dynamo.list_backends()


def test_compiled_tiny_model_matches_eager(caplog):
    cfg = Glm5Config.preset("tiny")
    model = random_model(cfg)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fxglm5", dynamic=False)
    ids = torch.randint(0, cfg.vocab_size, (2, 13), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(13)[None].expand(2, 13)
    with caplog.at_level(logging.INFO, logger="fxglm5.backend"):
        out = compiled(ids, pos)
    assert rel_err(out, model(ids, pos)) < 1e-4
    summaries = [r.getMessage() for r in caplog.records]
    assert any("match_sparse_mla" in s and "matches=4" in s for s in summaries)
    assert any("fuse_fp8_moe" in s and "matches=3" in s for s in summaries)
