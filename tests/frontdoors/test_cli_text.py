"""Text in, text out (issue 37, item 4): the tiny checkpoint ships a tokenizer made with Hugging Face ``tokenizers``
(and a chat template, and its EOS ids), and ``generate --prompt`` goes through it as the real GLM-5-FP8 does: the
prompt encoded by the checkpoint's tokenizer.json, the output decoded and streamed, ending at the EOS ids;
``--chat`` renders the checkpoint's template; ``--ids`` keeps the ids; what cannot work says so in one line."""

import json
import shutil

import pytest

from fxglm5.cli import main
from fxglm5.model.config import Glm5Config
from fxglm5.model.tiny import make_tiny_checkpoint
from fxglm5.model.tokenizer import TextStream, Tokenizer

COMMON = ["--max-new-tokens", "10", "--block-size", "16"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("text") / "tiny")


@pytest.fixture(scope="module")
def tokenizer(ckpt):
    return Tokenizer.from_checkpoint(ckpt, Glm5Config.from_json(ckpt / "config.json"))


def run(capsys, *argv) -> list[str]:
    code = main(list(argv))
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out.splitlines()


def test_the_tiny_tokenizer_round_trips_any_text(ckpt, tokenizer, tmp_path):
    text = "Hello, world! The capital of France is Paris. héllo 日本 🙂"
    ids = tokenizer.encode(text)
    assert all(0 <= i < 512 for i in ids) and tokenizer.decode(ids) == text
    assert tokenizer.eos_ids == {1, 4}  # <|endoftext|> and GLM's <|user|>, from generation_config.json
    again = make_tiny_checkpoint(tmp_path / "again")  # the same files for the same config
    assert all((again / f).read_bytes() == (ckpt / f).read_bytes()
               for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"))


def test_a_stream_holds_a_character_back_until_its_bytes_are_all_there(tokenizer):
    ids = tokenizer.encode("a日b")
    stream = TextStream(tokenizer)
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) + stream.rest() == "a日b" and "\ufffd" not in "".join(pieces)


def test_generate_prompt_prints_the_text_of_the_ids(ckpt, tokenizer, capsys):
    prompt = "The capital of France is"
    ids = run(capsys, "generate", "--model", str(ckpt), "--prompt", prompt, "--ids", *COMMON)[-1]
    same = run(capsys, "generate", "--model", str(ckpt), "--prompt-ids", ",".join(map(str, tokenizer.encode(prompt))),
               *COMMON)[-1]
    assert ids == same  # --prompt is the tokenizer's ids; --ids prints what --prompt-ids prints
    tokens = [int(t) for t in ids.split()]
    assert not tokenizer.eos_ids & set(tokens[:-1])
    text = run(capsys, "generate", "--model", str(ckpt), "--prompt", prompt, *COMMON)
    assert text == [tokenizer.decode(tokens)]  # streamed, then the line ended


@pytest.mark.parametrize("backend", ["paged", "reference"])
def test_generation_ends_at_the_checkpoints_eos(ckpt, tokenizer, capsys, tmp_path, backend):
    """With the third generated token made an EOS id (generation_config.json), generation stops there, as the README
    says: ``--ids`` prints the ids up to and with that EOS id; the text (streamed for one prompt, a JSON string a
    line for several) stops before it, on either backend."""
    ids = [int(t) for t in run(capsys, "generate", "--model", str(ckpt), "--prompt", "Hello", "--ids", *COMMON)[-1].split()]
    edited = tmp_path / "eos"
    edited.mkdir()
    for f in ckpt.iterdir():
        shutil.copy(f, edited / f.name)
    (edited / "generation_config.json").write_text(json.dumps({"eos_token_id": [ids[2]]}))
    end = ids.index(ids[2])
    assert tokenizer.decode(ids[end:end + 1])  # an EOS with text of its own: leaving it out shows
    argv = ("generate", "--model", str(edited), "--backend", backend, *COMMON)
    stopped = run(capsys, *argv, "--prompt", "Hello", "--ids")[-1]
    assert [int(t) for t in stopped.split()] == ids[:end + 1]
    assert run(capsys, *argv, "--prompt", "Hello") == [tokenizer.decode(ids[:end])]  # plain text on either backend
    batch = run(capsys, *argv, "--prompt", "Hello", "--prompt", "Hello")
    assert [json.loads(line) for line in batch] == [tokenizer.decode(ids[:end])] * 2


def test_chat_renders_the_checkpoints_template(ckpt, tokenizer, capsys):
    chat = tokenizer.chat("Tell me a story")
    assert tokenizer.backend.decode(chat, skip_special_tokens=False) == (
        "[gMASK]<sop><|user|>\nTell me a story<|assistant|>\n")
    got = run(capsys, "generate", "--model", str(ckpt), "--prompt", "Tell me a story", "--chat", "--ids", *COMMON)[-1]
    want = run(capsys, "generate", "--model", str(ckpt), "--prompt-ids", ",".join(map(str, chat)), *COMMON)[-1]
    assert [int(t) for t in got.split()] == [int(t) for t in want.split()][:len(got.split())]


def test_a_batch_of_text_prompts_prints_one_line_each(ckpt, tokenizer, capsys):
    """Several prompts: each one's text as a JSON string on its line (generated text may hold newlines)."""
    lines = run(capsys, "generate", "--model", str(ckpt), "--prompt", "Hello", "--prompt", "What is", *COMMON)
    ids = run(capsys, "generate", "--model", str(ckpt), "--prompt", "Hello", "--prompt", "What is", "--ids", *COMMON)
    assert [json.loads(line) for line in lines] == [tokenizer.decode([int(t) for t in i.split()]) for i in ids]


@pytest.mark.parametrize("argv, message", [
    (["--prompt-ids", "1,2", "--chat"], "--chat: only with --prompt"),
    (["--prompt", ""], "prompt: expected non-empty text"),
])
def test_bad_text_options_are_one_line(ckpt, capsys, argv, message):
    assert main(["generate", "--model", str(ckpt), *argv, "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fxglm5: error: ") and message in err and err.count("\n") == 1


def test_a_checkpoint_without_a_tokenizer_names_the_file(ckpt, capsys, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ckpt.iterdir():
        if f.name != "tokenizer.json":
            shutil.copy(f, bare / f.name)
    assert main(["generate", "--model", str(bare), "--prompt", "Hi", "--max-new-tokens", "2"]) == 2
    assert f"{bare / 'tokenizer.json'}: not found" in capsys.readouterr().err
