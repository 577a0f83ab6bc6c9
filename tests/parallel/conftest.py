"""The tiny-TP model (random FP8 weights, float32 compute) matched and fused once for every test here."""

import pytest
import torch
from tests.helpers import random_model

from fxglm5.compiler import compile_model
from fxglm5.model.config import Glm5Config
from fxglm5.passes.pipeline import Stage


@pytest.fixture(scope="session")
def tiny_tp():
    """(model, its match + fuse graph at world size 1, example (input_ids, position_ids) of 24 tokens > index_topk)."""
    model = random_model(Glm5Config.preset("tiny-tp"), torch.float32)
    graph = compile_model(model, stages=(Stage.MATCH, Stage.FUSE), strict=True).graph
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=gen)
    pos = (torch.arange(24) + 5)[None].expand(2, 24)
    return model, graph, (ids, pos)
