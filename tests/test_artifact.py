"""The exported-artifact front door: a checkpoint exported once (the matched and fused program, torch.export
.pt2 with its weights) and served from the file alone gives the tokens and hidden states of the model it came
from; the cache and lower stages run at load with the same matches; a file that is not an artifact is refused
by name; the CLI exports and generates from it."""

import json
import zipfile

import pytest
import torch

from fxglm5.artifact import FORMAT, RECORD, export_artifact, load_artifact
from fxglm5.cli import main
from fxglm5.errors import CheckpointError
from fxglm5.model.checkpoint import load_checkpoint
from fxglm5.model.tiny import make_tiny_checkpoint
from fxglm5.runtime.runner import Runner

PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46], [7, 1, 8]]  # around index_topk (8)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-fp8"), fp8=True)


@pytest.fixture(scope="module")
def model(ckpt):
    return load_checkpoint(ckpt, dtype=torch.float32, progress=False)


@pytest.fixture(scope="module")
def artifact_path(model, tmp_path_factory):
    return export_artifact(model, tmp_path_factory.mktemp("art") / "tiny.pt2")


def test_an_artifact_generates_the_tokens_of_its_checkpoint(model, artifact_path):
    art = load_artifact(artifact_path)
    assert art.config == model.config and art.dtype == torch.float32 and art.head == "logits"
    assert art.record["passes"]["match_sparse_mla"]["matches"] == 4  # what ran before the export
    runner = art.runner(kv_cache="fp8", block_size=16, max_cache_tokens=512)
    matches = {r.name: r.num_matches for r in runner.pass_results}
    assert matches["insert_paged_cache"] == 4 and matches["fuse_norm_rope_into_cache_writes"] == 8
    direct = Runner(model, kv_cache="fp8", block_size=16, max_cache_tokens=512)
    assert runner.generate(PROMPTS, 6) == direct.generate(PROMPTS, 6)


def test_a_hidden_head_artifact_gives_the_decoder_output(model, tmp_path):
    """head="hidden" (what RTP-LLM takes): one prefill of 11 tokens over a compute-dtype cache (exact top-k)
    against ``Glm5Model`` without a cache."""
    from fxglm5.runtime.cache import PagedCache
    from fxglm5.runtime.forward_context import ForwardContext

    art = load_artifact(export_artifact(model, tmp_path / "hidden.pt2", head="hidden"))
    graph, _ = art.paged_graph()
    ids = torch.tensor(PROMPTS[0])
    T = ids.shape[0]
    cache = PagedCache(graph.meta["paged_cache"], 4, 16, dtype=torch.float32)
    ctx = ForwardContext.build(True, [T], [0], [[1]], block_size=16, kernel_block_size=16, num_blocks=4,
                               max_position_embeddings=model.config.max_position_embeddings).validate()
    hidden = graph(ids[None], ctx.positions[None], *ctx.graph_args(), torch.arange(T), *cache.graph_inputs())
    with torch.no_grad():
        ref = model.model(ids[None])
    assert hidden.shape == ref.shape == (1, T, model.config.hidden_size)
    assert (hidden - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_files_that_are_not_artifacts_are_refused_by_name(tmp_path, artifact_path):
    with pytest.raises(CheckpointError, match="no such artifact"):
        load_artifact(tmp_path / "missing.pt2")
    junk = tmp_path / "junk.pt2"
    junk.write_bytes(b"not a zip")
    with pytest.raises(CheckpointError, match="junk.pt2: not a torch.export archive"):
        load_artifact(junk)
    # a genuine .pt2 whose fxglm5 record says another format
    other = tmp_path / "other.pt2"
    with zipfile.ZipFile(artifact_path) as src, zipfile.ZipFile(other, "w") as dst:
        for item in src.infolist():
            data = src.read(item.filename)
            if item.filename.endswith(RECORD):
                data = json.dumps(dict(json.loads(data), format="something-else/9")).encode()
            dst.writestr(item, data)
    with pytest.raises(CheckpointError, match=f"other.pt2: not an fxglm5 artifact.*{FORMAT}"):
        load_artifact(other)


def test_cli_exports_and_generates_from_the_artifact(ckpt, tmp_path, capsys):
    out = tmp_path / "cli.pt2"
    assert main(["export", "--model", str(ckpt), "--out", str(out), "--dtype", "float32"]) == 0
    ids = ",".join(map(str, PROMPTS[0]))
    common = ["--prompt-ids", ids, "--max-new-tokens", "5", "--kv-cache", "fp8", "--block-size", "16"]
    capsys.readouterr()
    assert main(["generate", "--model", str(out), *common]) == 0
    from_artifact = capsys.readouterr().out
    assert main(["generate", "--model", str(ckpt), "--dtype", "float32", *common]) == 0
    assert from_artifact == capsys.readouterr().out
    assert main(["generate", "--model", str(out), "--backend", "reference", *common]) == 2
    assert "not an artifact" in capsys.readouterr().err


def test_loading_for_another_device_moves_every_tensor_and_device_argument(artifact_path):
    """Export records the device it ran on (``torch.arange(..., device=cpu)``); serving elsewhere must not
    keep it (the GPU run of an unmoved program failed with a device mismatch). Checked with the meta device."""
    from fxglm5.artifact import _on_device

    gm = load_artifact(artifact_path).program.module()
    assert any(n.kwargs.get("device") == torch.device("cpu") for n in gm.graph.nodes)  # what export recorded
    gm = _on_device(gm, torch.device("meta"))
    assert not any(isinstance(n.kwargs.get("device"), torch.device) and n.kwargs["device"].type != "meta"
                   for n in gm.graph.nodes)
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = gm
            for part in node.target.split("."):
                value = getattr(value, part)
            assert not isinstance(value, torch.Tensor) or value.device.type == "meta", node.target
