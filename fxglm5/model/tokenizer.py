"""A checkpoint's text side, as GLM-5-FP8 ships it: ``tokenizer.json`` (Hugging Face ``tokenizers``), the chat
template of ``tokenizer_config.json`` (rendered with jinja2 in a sandbox, as transformers renders it) and the end
of sequence ids of ``generation_config.json`` (else config.json's ``eos_token_id``).

Nothing is tokenized by hand: the tokenizer file defines the vocabulary, the pre-tokenizer and the decoder, and
the chat template is the checkpoint's own jinja text. :class:`TextStream` turns the tokens of one request into text
as they come, holding back the bytes of a character whose tokens have not all arrived (a byte-level vocabulary
splits one UTF-8 character over tokens).
"""

from __future__ import annotations

import json
from pathlib import Path

from fxglm5.errors import CheckpointError, InputError

TOKENIZER, TOKENIZER_CONFIG, GENERATION_CONFIG = "tokenizer.json", "tokenizer_config.json", "generation_config.json"
TEXT_FILES = (TOKENIZER, TOKENIZER_CONFIG, GENERATION_CONFIG)  # a checkpoint's text side (an artifact carries them)


class Tokenizer:
    """Text <-> token ids of a checkpoint (``from_checkpoint``), checked against the model's vocabulary."""

    def __init__(self, backend, vocab_size: int, eos_ids: frozenset[int], chat_template: str | None,
                 special: dict[str, str], where: str):
        self.backend, self.vocab_size, self.eos_ids = backend, vocab_size, eos_ids
        self.chat_template, self.special, self.where = chat_template, special, where

    @classmethod
    def from_checkpoint(cls, directory: str | Path, config) -> "Tokenizer":
        """The tokenizer of checkpoint ``directory`` (its ``config``: the vocabulary size, the fallback EOS ids);
        CheckpointError naming the file that is missing or unreadable."""
        return cls.from_texts(read_texts(directory), config, str(directory))

    @classmethod
    def from_texts(cls, texts: dict[str, str], config, where: str) -> "Tokenizer":
        """The tokenizer whose :data:`TEXT_FILES` are ``texts`` (file name -> its text; the two config files may be
        absent), found at ``where`` (a checkpoint directory, or an artifact that carries them)."""
        from tokenizers import Tokenizer as HfTokenizer

        if TOKENIZER not in texts:
            raise CheckpointError(f"{where}/{TOKENIZER}: not found; text in and out needs the checkpoint's tokenizer "
                                  "(give token ids with --prompt-ids and print them with --ids without it)")
        try:
            backend = HfTokenizer.from_str(texts[TOKENIZER])
        except Exception as err:  # noqa: BLE001 - the library's parse errors name no file
            raise CheckpointError(f"{where}/{TOKENIZER}: not a tokenizers file: {err}") from None
        settings = _json(texts.get(TOKENIZER_CONFIG), f"{where}/{TOKENIZER_CONFIG}")
        generation = _json(texts.get(GENERATION_CONFIG), f"{where}/{GENERATION_CONFIG}")
        eos = generation.get("eos_token_id", config.eos_token_id)
        eos_ids = frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)
        special = {k: _token_text(settings.get(k)) for k in ("bos_token", "eos_token") if settings.get(k)}
        return cls(backend, config.vocab_size, eos_ids, settings.get("chat_template"), special, where)

    def encode(self, text: str) -> list[int]:
        """The ids of ``text`` as written (special tokens spelled in it are recognised; none is added)."""
        if not isinstance(text, str) or not text:
            raise InputError(f"prompt: expected non-empty text, got {text!r}")
        ids = self.backend.encode(text, add_special_tokens=False).ids
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise CheckpointError(f"{self.where}/{TOKENIZER}: token id {bad[0]} is outside the model's vocabulary "
                                  f"[0, {self.vocab_size})")
        return ids

    def chat(self, text: str) -> list[int]:
        """``text`` as the user's message under the checkpoint's chat template, the assistant's turn opened."""
        return self.encode(self.render_chat([{"role": "user", "content": text}]))

    def render_chat(self, messages: list[dict]) -> str:
        """``messages`` (each a dict with ``role`` and ``content``) under the checkpoint's chat template, the
        assistant's turn opened: the text to encode."""
        if not self.chat_template:
            raise CheckpointError(f"{self.where}/{TOKENIZER_CONFIG}: no chat_template for --chat")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.chat_template).render(messages=messages, add_generation_prompt=True,
                                                          **self.special)

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=True)


class TextStream:
    """One request's generated text as its tokens arrive: ``push(token)`` returns the text that is complete now."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer, self.ids, self.shown = tokenizer, [], ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):  # a character whose bytes are still coming
            return ""
        return self.rest()

    def rest(self) -> str:
        """The text not returned yet (at the end: also bytes that never became a whole character)."""
        text = self.tokenizer.decode(self.ids)
        new, self.shown = text[len(self.shown):], text
        return new


class TextPrinter:
    """``Runner.run``'s ``on_token`` for one request: its text printed as it becomes complete, the stop token it ends
    at left out (the CLI's text leaves it out); ``finish`` prints the rest and ends the line."""

    def __init__(self, tokenizer: Tokenizer, stop: frozenset = frozenset()):
        self.stream, self.stop = TextStream(tokenizer), frozenset(stop)

    def __call__(self, seq, token: int) -> None:
        if token not in self.stop:
            print(self.stream.push(token), end="", flush=True)

    def finish(self) -> None:
        print(self.stream.rest(), flush=True)


def read_texts(directory: str | Path) -> dict[str, str]:
    """The :data:`TEXT_FILES` that checkpoint ``directory`` holds, by name; CheckpointError naming one that is no
    text."""
    texts = {}
    for name in TEXT_FILES:
        path = Path(directory) / name
        if path.is_file():
            try:
                texts[name] = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as err:
                raise CheckpointError(f"{path}: not readable text: {err}") from None
    return texts


def _json(text: str | None, where: str) -> dict:
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except ValueError as err:
        raise CheckpointError(f"{where}: not readable JSON: {err}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{where}: not a JSON object")
    return value


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json gives it: a string, or a dict with its ``content``."""
    return value.get("content") if isinstance(value, dict) else value
