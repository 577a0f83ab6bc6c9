"""The fxglm5 command line: make-tiny, quantize, generate, demo."""

import json

import pytest
import torch

from fxglm5.cli import DEMO_TEXT, main
from fxglm5.model.tokenizer import Tokenizer
from fxglm5.model.modeling import Glm5ForCausalLM
from fxglm5.model.generate import greedy_generate
from fxglm5.model.tiny import make_tiny_checkpoint


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out.strip().splitlines()


def ids_line(line, n, vocab=512):
    ids = [int(x) for x in line.split(" ")]
    assert len(ids) == n and all(0 <= i < vocab for i in ids)
    return ids


@pytest.mark.parametrize("bf16", [False, True])
def test_make_tiny_then_generate(tmp_path, capsys, bf16):
    out = tmp_path / "tiny"
    run(capsys, "make-tiny", "--out", str(out), "--seed", "3", *(["--bf16"] if bf16 else []))
    config = json.loads((out / "config.json").read_text())
    assert ("quantization_config" in config) != bf16
    lines = run(capsys, "generate", "--model", str(out), "--prompt-ids", "1,2,3", "--max-new-tokens", "4")
    ids = ids_line(lines[-1], 4)
    # the printed ids are the library's greedy continuation of the same prompt
    model = Glm5ForCausalLM.from_pretrained(out, dtype=torch.float32, progress=False)
    assert ids[:2] == greedy_generate(model, [1, 2, 3], 2)
    lines = run(capsys, "generate", "--model", str(out), "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--dtype", "bfloat16")
    ids_line(lines[-1], 2)


def test_quantize_round_trip(tmp_path, capsys):
    """make-tiny --bf16 then quantize gives the same checkpoint as make-tiny (FP8 is its quantization)."""
    run(capsys, "make-tiny", "--out", str(tmp_path / "bf16"), "--bf16")
    run(capsys, "quantize", "--in", str(tmp_path / "bf16"), "--out", str(tmp_path / "fp8"))
    run(capsys, "make-tiny", "--out", str(tmp_path / "ref"))
    ours = Glm5ForCausalLM.from_pretrained(tmp_path / "fp8", dtype=torch.bfloat16, progress=False)
    ref = dict(Glm5ForCausalLM.from_pretrained(tmp_path / "ref", dtype=torch.bfloat16, progress=False).named_parameters())
    assert ours.config.is_fp8
    for name, p in ours.named_parameters():
        assert ref[name].dtype == p.dtype and torch.equal(ref[name].view(torch.uint8), p.view(torch.uint8)), name
    gen = ["generate", "--prompt-ids", "5,6,7,8", "--max-new-tokens", "3"]
    assert run(capsys, *gen, "--model", str(tmp_path / "fp8")) == run(capsys, *gen, "--model", str(tmp_path / "ref"))


def test_demo_uses_and_reuses_its_cache(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FXGLM5_CACHE", str(tmp_path))
    first = run(capsys, "demo")
    target = tmp_path / "tiny-fp8"
    assert (target / "config.json").is_file() and len(first) == 4
    assert "match_sparse_mla 4" in first[3] and first[3].endswith(
        "every token the full-recompute model's greedy token after the same tokens, within float32 rounding: yes")
    assert first[0].startswith("fxglm5 demo: made") and str(target) in first[0]
    ids = ids_line(first[2], 16)
    model = Glm5ForCausalLM.from_pretrained(target, dtype=torch.float32, progress=False)
    tokenizer = Tokenizer.from_checkpoint(target, model.config)
    assert json.loads(first[1]) == DEMO_TEXT + tokenizer.decode(ids)  # the text: the prompt and what followed it
    stamp = (target / "config.json").stat().st_mtime_ns
    second = run(capsys, "demo")
    assert second[0].startswith("fxglm5 demo: cached") and second[1:3] == first[1:3]
    assert (target / "config.json").stat().st_mtime_ns == stamp
    with torch.no_grad():  # the first generated token is the model's argmax after the prompt
        assert ids[0] == int(model(torch.tensor([tokenizer.encode(DEMO_TEXT)]))[0, -1].argmax())
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-fp8"]  # no temporary folder left behind


def test_demo_in_bfloat16_passes_its_own_check(tmp_path, capfd, monkeypatch):
    """Every dtype demo and generate offer passes the demo's check: each token is the full-recompute model's greedy
    token after the same tokens (one teacher-forced forward), within the dtype's rounding; in bfloat16 that is what
    a comparison of whole greedy runs cannot be (a near-tie may go either way, then the runs part). The stages are
    shown on stderr as they pass, the weights are said to be random, no pytree FutureWarning is printed."""
    from fxglm5.cli import DTYPES, build_parser

    parsers = build_parser()._subparsers._group_actions[0].choices
    assert [a.choices for a in parsers["demo"]._actions if a.dest == "dtype"] == [DTYPES] == [
        a.choices for a in parsers["generate"]._actions if a.dest == "dtype"]
    monkeypatch.setenv("FXGLM5_CACHE", str(tmp_path))
    assert main(["demo", "--dtype", "bfloat16"]) == 0
    out, err = capfd.readouterr()
    lines = out.strip().splitlines()
    assert "the weights are random" in lines[0]
    assert lines[3].endswith("every token the full-recompute model's greedy token after the same tokens, within "
                             "bfloat16 rounding: yes")
    assert [line.split(" ...")[0] for line in err.strip().splitlines()] == [
        f"fxglm5 demo: making the random tiny GLM-5-FP8 checkpoint at {tmp_path / 'tiny-fp8'}",
        "fxglm5 demo: loading it and compiling the model (bfloat16)", "fxglm5 demo: generating",
        "fxglm5 demo: checking against the full-recompute model"]
    assert "FutureWarning" not in err


def test_the_demos_check_fails_on_a_token_that_is_not_the_greedy_one(tmp_path):
    """The check itself: the model's own greedy tokens pass; the runner-up in their place fails, at the position
    where it is nearest the best while still more than the rounding margin away (in float32 and bfloat16)."""
    from fxglm5.cli import greedy_agrees

    ckpt = make_tiny_checkpoint(tmp_path / "tiny")
    prompt = [1, 2, 3]
    for dtype in (torch.float32, torch.bfloat16):
        model = Glm5ForCausalLM.from_pretrained(ckpt, dtype=dtype, progress=False)
        tokens = greedy_generate(model, prompt, 8)
        assert greedy_agrees(model, prompt, tokens)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens]))[0, len(prompt) - 1:-1].float()
        top = logits.topk(2, dim=-1)
        gaps = top.values[:, 0] - top.values[:, 1]
        margin = 4 * torch.finfo(dtype).eps * logits.abs().max()
        i = int(torch.where(gaps > margin, gaps, torch.inf).argmin())
        assert gaps[i] > margin and gaps[i] < 1, gaps  # a close call the check still decides
        wrong = tokens[:i] + [int(top.indices[i, 1])]  # (the tokens after it would see another context)
        assert not greedy_agrees(model, prompt, wrong)


def test_demo_remakes_a_cached_checkpoint_without_a_tokenizer(tmp_path, capsys, monkeypatch):
    """An older fxglm5 cached its demo checkpoint without tokenizer files: the demo makes it again instead of failing
    on the missing tokenizer.json."""
    monkeypatch.setenv("FXGLM5_CACHE", str(tmp_path))
    run(capsys, "demo")
    (tmp_path / "tiny-fp8" / "tokenizer.json").unlink()
    assert run(capsys, "demo")[0].startswith("fxglm5 demo: made")
