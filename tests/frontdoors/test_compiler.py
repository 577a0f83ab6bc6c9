"""Every front door that captures a model does it through fxglm5.compiler (one capture call, compiler._capture):
the Runner, the artifact export and ``fxglm5 inspect``; the pass options each one takes reach the compile."""

import pytest

import fxglm5.compiler as compiler
from fxglm5.artifact import export_artifact
from fxglm5.cli import main
from fxglm5.model.config import Glm5Config
from fxglm5.parallel import Mapping
from fxglm5.passes.pipeline import Stage
from fxglm5.runtime.runner import Runner
from tests.helpers import random_model


class Captured(Exception):
    pass


@pytest.fixture
def capture_calls(monkeypatch):
    calls = []

    def fake(model, **options):
        calls.append(options)
        raise Captured

    monkeypatch.setattr(compiler, "_capture", fake)
    return calls


def test_front_doors_capture_through_the_compiler(tmp_path, capture_calls):
    model = random_model(Glm5Config.preset("tiny"))
    with pytest.raises(Captured):
        Runner(model, block_size=16, max_cache_tokens=64)
    with pytest.raises(Captured):
        export_artifact(model, tmp_path / "tiny.pt2", head="hidden")
    with pytest.raises(Captured):
        main(["inspect", "--preset", "tiny"])
    match_fuse = dict(strict=False, act_quant=False, disabled=(), dump_dir=None, stages=(Stage.MATCH, Stage.FUSE),
                      mapping=Mapping())
    # the Runner's compile shards (a no-op at world size 1); an exported artifact is match + fuse only (rank-agnostic)
    assert capture_calls == [dict(max_tokens=model.config.max_position_embeddings, head="logits",
                                  rewrite={**match_fuse, "stages": compiler.KIND_STAGES}),
                             dict(max_tokens=compiler.MAX_STEP_TOKENS, head="hidden", rewrite={**match_fuse, "strict": True}),
                             dict(max_tokens=None, head="logits", rewrite={**match_fuse, "strict": True})]
