"""Fixtures the front-door tests share: the tiny FP8 checkpoint and its float32 model, built once per module that
uses them (a module that needs another checkpoint defines its own ``ckpt``, which takes precedence)."""

import pytest
import torch

from fxglm5.model.modeling import Glm5ForCausalLM
from fxglm5.model.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-fp8"), fp8=True)


@pytest.fixture(scope="module")
def model(ckpt):
    return Glm5ForCausalLM.from_pretrained(ckpt, dtype=torch.float32, progress=False)
