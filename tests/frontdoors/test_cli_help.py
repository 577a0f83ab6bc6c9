"""The CLI's help tells (issue 50 item 4): every flag of every subcommand has help text and shows its default (in
words where it has none to print), each description says what the command does today, ``--disable-passes`` lists
the pass names it takes, and a mistyped or abbreviated flag is named in the error, with the flag it may have meant,
even when a required flag is missing too."""

import argparse

import pytest

from fxglm5.cli import SUBCOMMANDS, build_parser, main
from fxglm5.compiler import PASS_NAMES


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


@pytest.mark.parametrize("command", list(SUBCOMMANDS))
def test_every_flag_has_help_and_shows_its_default(command):
    parser = subparsers()[command]
    text = " ".join(parser.format_help().split())
    chosen = {a for g in parser._mutually_exclusive_groups if g.required for a in g._group_actions}  # one of them
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        flag = action.option_strings[0]
        assert action.help and action.help.strip(), f"{command} {flag}: no help"
        helped = " ".join((parser._get_formatter()._get_help_string(action) % vars(action)).split())
        assert helped in text, (command, flag)
        if not (action.default is None or action.default is False or action.default is argparse.SUPPRESS):
            assert f"(default: {action.default})" in helped or "default" in action.help.lower(), (command, flag)
        elif not action.required and action.nargs != 0 and action.const is None and action not in chosen:
            assert "default" in helped.lower(), f"{command} {flag}: says nothing of what happens without it"


def test_the_descriptions_say_what_each_command_does_today():
    parsers = subparsers()
    generate = " ".join(parsers["generate"].format_help().split())
    assert "greedy generation from token ids" not in generate  # it takes text too, since issue 37
    for words in ("--prompt text", "tokenizer", "paged KV cache", "artifact", "--tp", "--speculative mtp"):
        assert words in generate, words
    assert "tokenizer" in parsers["export"].description and "checked against full recompute" in parsers["demo"].description


def test_disable_passes_lists_the_names_it_takes():
    for command in ("generate", "export", "inspect"):
        text = " ".join(subparsers()[command].format_help().split())
        assert all(name in text for name in PASS_NAMES), command


@pytest.mark.parametrize("argv, flag, meant", [
    (["--max-tokens", "3"], "--max-tokens", "--max-new-tokens"),  # and --max-new-tokens is missing
    (["--max-new-token", "3"], "--max-new-token", "--max-new-tokens"),  # an abbreviation is no flag
    (["--max-new-tokens", "3", "--kv_cache", "fp8"], "--kv_cache", "--kv-cache"),
])
def test_a_mistyped_flag_is_named(tmp_path, capsys, argv, flag, meant):
    with pytest.raises(SystemExit) as exited:
        main(["generate", "--model", str(tmp_path), "--prompt-ids", "1,2", *argv])
    assert exited.value.code == 2
    assert f"error: unrecognized argument {flag} (did you mean {meant}?)" in capsys.readouterr().err

