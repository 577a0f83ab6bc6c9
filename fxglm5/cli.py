"""The ``fxglm5`` command line: thin argument parsing over the library.

Subcommands live in ``SUBCOMMANDS`` (name -> Subcommand(help, add_arguments, run)) so new ones (inspect,
serve, ...) and new options (--backend, --kv-cache) slot in without touching ``main``. Every
``Fxglm5Error`` becomes one line ``fxglm5: error: <message>`` on stderr and exit code 2, as argparse does
for usage errors: a bad input is the user's to fix, and a traceback would only hide the message.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Callable

from fxglm5.errors import Fxglm5Error, InputError

DEMO_TEXT = "The capital of France is"
DEMO_TOKENS = 16
DTYPES = ("float32", "bfloat16")  # the compute dtypes generate, export and demo offer
DEFAULT_DTYPE = "float32"  # theirs: an artifact exported without --dtype generates what generate without it does


@dataclasses.dataclass(frozen=True)
class Subcommand:
    help: str  # one line, in the command list
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    description: str = ""  # what the command does, at the top of its --help (default: ``help``)


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Each option's help ends with its default, where it has one that the help does not already say in words."""

    def _get_help_string(self, action):
        text = action.help or ""
        if _no_default(action) or "%(default)" in text or "default" in text.lower():
            return text
        return text + " (default: %(default)s)"


def _no_default(action) -> bool:
    """An option whose default is nothing to print: unset (None), off (a flag's False) or suppressed."""
    return action.default is None or action.default is False or action.default is argparse.SUPPRESS


class _Parser(argparse.ArgumentParser):
    """argparse, with no abbreviated flags, and an unknown flag named in the error (with the flag it may have meant)
    even when a required one is also missing (argparse reports the missing one alone)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, formatter_class=_Formatter, **kwargs)

    argv: list[str] = []

    def error(self, message: str):
        parser = self
        for action in self._actions:  # the top parser's leftovers are its subcommand's unknown flags
            if isinstance(action, argparse._SubParsersAction):
                parser = next((action.choices[a] for a in _Parser.argv if a in action.choices), self)
        known = [s for s in parser._option_string_actions if s.startswith("--")]
        unknown = [a.split("=", 1)[0] for a in _Parser.argv if a.startswith("--") and a.split("=", 1)[0] not in known]
        if unknown:
            close = difflib.get_close_matches(unknown[0], known, n=1)
            message = f"unrecognized argument {unknown[0]}" + (f" (did you mean {close[0]}?)" if close else "")
        super().error(message)




def parse_token_ids(text: str, vocab_size: int) -> list[int]:
    """'1,2,3' (or '1 2 3', '1, 2, 3': commas and / or spaces between the ids) -> [1, 2, 3], each checked against the
    vocabulary. Spaces separate ids: '1 2 3' is three tokens, never the one token 123."""
    try:
        ids = [int(part) for part in re.split(r"[,\s]+", text.strip()) if part]
    except ValueError:
        raise InputError(f"--prompt-ids must be integers separated by commas or spaces, got {text!r}") from None
    if not ids:
        raise InputError("--prompt-ids is empty")
    for tok in ids:
        if not 0 <= tok < vocab_size:
            raise InputError(f"--prompt-ids: token id {tok} is out of range [0, {vocab_size}) (vocab_size)")
    return ids


def device_arg(text: str) -> str:
    """``--device``: ``cpu``, ``cuda`` or ``cuda:N`` (argparse names the flag in its error otherwise)."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device fxglm5 runs on (cpu, cuda or cuda:N)")
    return text


def check_device(device: str) -> None:
    """``--device cuda`` / ``cuda:N`` on a torch without CUDA (or without that device) is refused before any weight
    is read (it failed with an AssertionError from deep inside torch, half-way through the load)."""
    import torch

    if not device.startswith("cuda"):
        return
    if not torch.cuda.is_available():
        raise InputError(f"--device {device}: this torch has no CUDA device (torch.cuda.is_available() is False; "
                         f"torch {torch.__version__})")
    index = torch.device(device).index
    if index is not None and index >= torch.cuda.device_count():
        raise InputError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def _pass_options(p: argparse.ArgumentParser, dump: bool = True) -> None:
    """The compile's options, for the subcommands that compile."""
    from fxglm5.compiler import PASS_NAMES

    p.add_argument("--disable-passes", default="", metavar="NAME,NAME",
                   help=f"comma-separated passes to skip, of: {', '.join(PASS_NAMES)} (default: none)")
    p.add_argument("--act-quant", action="store_true",
                   help="W8A8: the FP8 GEMMs quantize their activations 1x128 to e4m3 on the fly (the checkpoint's "
                        "recipe, as SGLang and vLLM run it; FP8 tensor-core rate). Default: W8A16, the activations "
                        "in the compute dtype times the e4m3 weights widened, closer to the bf16 reference; an "
                        "artifact's GEMMs are the ones it was exported with")
    if dump:
        p.add_argument("--dump-dir", help="write each pass's graph before and after (Python) and a summary.txt into "
                                          "this new or empty directory (default: no dump)")


def act_quant(args: argparse.Namespace, artifact) -> bool:
    """``--act-quant`` for ``args.model``. An artifact's GEMMs were fixed at export: without the flag it runs them
    as they are; with it, a W8A16 artifact is refused (the flag asks for what the file cannot do)."""
    if artifact is None:
        return args.act_quant
    if args.act_quant and not artifact.act_quant:
        raise InputError(f"--act-quant: {args.model} was exported without --act-quant (W8A16 FP8 GEMMs, fixed in its "
                         "program); omit --act-quant, or export the checkpoint again with it")
    return artifact.act_quant


@contextlib.contextmanager
def dump_into(path: str | None):
    """``--dump-dir``, written as every output is (``st_files.new_output_dir``): a new or empty directory, checked
    before the work, filled beside it and put in place at the end, also when the compile fails (the dump is what
    shows why); yields where the passes write, or None without the flag."""
    if not path:
        yield None
        return
    from fxglm5.model.st_files import new_output_dir

    with new_output_dir(Path(path), keep_on=(Fxglm5Error,)) as tmp:
        yield tmp


def disabled_passes(text: str) -> tuple[str, ...]:
    """'a,b' -> ('a', 'b'), each a declared pass (checked before a checkpoint is loaded)."""
    from fxglm5.compiler import PASS_NAMES

    names = tuple(name for name in text.replace(" ", "").split(",") if name)
    unknown = [name for name in names if name not in PASS_NAMES]
    if unknown:
        raise InputError(f"--disable-passes: no pass named {unknown[0]!r}; passes are {', '.join(PASS_NAMES)}")
    return names


def _generate(model_dir: str, prompt: list[int], max_new_tokens: int, dtype: str) -> list[int]:
    from fxglm5.model.generate import greedy_generate
    from fxglm5.model.modeling import Glm5ForCausalLM

    model = Glm5ForCausalLM.from_pretrained(model_dir, dtype=dtype, device="cpu", progress=False)
    return greedy_generate(model, prompt, max_new_tokens)


# ---- make-tiny ----------------------------------------------------------------------------------
def _make_tiny_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="output directory: new or empty")
    p.add_argument("--bf16", action="store_true", help="write the bf16 source instead of the FP8 checkpoint")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--preset", choices=["tiny", "tiny-tp"], default="tiny",
                   help="tiny-tp: widths that split over 2 and 4 ranks (generate --tp 2 / --tp 4)")


def _make_tiny(args: argparse.Namespace) -> int:
    from fxglm5.model.config import Glm5Config
    from fxglm5.model.tiny import make_tiny_checkpoint

    out = make_tiny_checkpoint(args.out, fp8=not args.bf16, seed=args.seed, config=Glm5Config.preset(args.preset))
    print(f"wrote {args.preset} GLM-5 {'bf16' if args.bf16 else 'FP8'} checkpoint to {out}")
    return 0


# ---- quantize -----------------------------------------------------------------------------------
def _quantize_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--in", dest="in_dir", required=True, help="bf16 checkpoint directory")
    p.add_argument("--out", required=True, help="output directory (GLM-5-FP8 format): new or empty")


def _quantize(args: argparse.Namespace) -> int:
    from fxglm5.model.quantize import quantize_checkpoint

    files = quantize_checkpoint(args.in_dir, args.out)
    print(f"wrote FP8 checkpoint to {args.out} ({len(files)} file(s))")
    return 0


# ---- generate -----------------------------------------------------------------------------------
def _generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory, or an artifact file (fxglm5 export)")
    given = p.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt", action="append",
                       help="text, encoded with the checkpoint's tokenizer.json; repeat for a batch. The output is "
                            "text, ending at the checkpoint's EOS ids: streamed for one prompt, one JSON string a "
                            "line for several")
    given.add_argument("--prompt-ids", action="append",
                       help="token ids separated by commas or spaces, e.g. 1,2,3; repeat for a batch (one output line "
                            "per prompt)")
    p.add_argument("--chat", action="store_true", help="--prompt as a user message under the checkpoint's chat template")
    p.add_argument("--ids", action="store_true", help="with --prompt: print the token ids, not the text")
    p.add_argument("--max-new-tokens", type=int, required=True, help="tokens to generate per prompt (fewer where "
                                                                      "the text ends at an EOS id first)")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help=f"compute dtype (default: {DEFAULT_DTYPE} for a checkpoint directory, as export's, the "
                        "artifact's own for a .pt2)")
    p.add_argument("--backend", choices=["paged", "reference"], default="paged",
                   help="paged: compiled graph over a paged KV cache (fxglm5.runtime); reference: full recompute")
    p.add_argument("--kv-cache", choices=["bf16", "fp8"], default="bf16",
                   help="paged latent cache: the compute dtype (bf16) or FP8 ds_mla rows (fp8)")
    p.add_argument("--block-size", type=int, default=64, help="paged cache block size (tokens)")
    p.add_argument("--max-step-tokens", type=int, default=16384,
                   help="paged: the most tokens one prefill step computes (longer prompts: chunked prefill)")
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor-parallel ranks: N local ranks are started (gloo on cpu, NCCL on cuda), or, under "
                        "torchrun, this process is one of them; each reads only its slices of the checkpoint")
    p.add_argument("--ep", type=int, metavar="N",
                   help="expert groups with --tp, a divisor of it: N (the default: each rank holds 1/N of the "
                        "experts), 1 (every expert split along its intermediate dim over all ranks) or a divisor "
                        "between (groups of N/ep ranks, each holding 1/ep of the experts split over its ranks)")
    p.add_argument("--device", type=device_arg, default="cpu", metavar="cpu|cuda|cuda:N",
                   help="where the paged graph runs (with --tp on cuda: rank r on cuda:r)")
    p.add_argument("--speculative", choices=["mtp"],
                   help="speculative decoding: drafts from the checkpoint's MTP layer, verified in one step (the "
                        "same tokens); prints the mean acceptance length after the tokens (default: none)")
    p.add_argument("--num-speculative-tokens", type=int, metavar="K",
                   help="drafts per step with --speculative, 1..4 (no default: give it with --speculative)")
    _pass_options(p, dump=False)


def _generate_cmd(args: argparse.Namespace) -> int:
    from fxglm5.model.config import Glm5Config

    artifact = None
    if Path(args.model).is_file():  # an exported artifact (fxglm5 export)
        from fxglm5.artifact import load_artifact

        artifact = load_artifact(args.model)
        if artifact.head != "logits":
            raise InputError(f"--model {args.model}: exported with head={artifact.head!r}; generation needs logits")
        exported = str(artifact.dtype).removeprefix("torch.")
        if args.dtype not in (None, exported):
            raise InputError(f"--dtype {args.dtype}: {args.model} was exported in {exported} and its program computes in "
                             f"it; omit --dtype, or export the checkpoint again with --dtype {args.dtype}")
        args.dtype = exported
        print(f"fxglm5: {args.model} runs in {exported}, the dtype it was exported in"
              + (", with W8A8 FP8 GEMMs (exported with --act-quant)" if artifact.act_quant else ""), file=sys.stderr)
        config = artifact.config
    else:
        config = Glm5Config.from_json(Path(args.model) / "config.json")
        args.dtype = args.dtype or DEFAULT_DTYPE
    tokenizer = _tokenizer(args, artifact, config)
    if tokenizer is None:
        prompts = [parse_token_ids(text, config.vocab_size) for text in args.prompt_ids]
    else:
        prompts = [tokenizer.chat(text) if args.chat else tokenizer.encode(text) for text in args.prompt]
    disabled = disabled_passes(args.disable_passes)
    args.act_quant = act_quant(args, artifact)
    if args.act_quant and artifact is None and args.backend == "reference":
        raise InputError("--act-quant: --backend reference recomputes with the model code, whose FP8 weights are "
                         "widened to the compute dtype (W8A16); W8A8 runs on the paged backend")
    check_device(args.device)
    if args.max_new_tokens < 0:
        raise InputError(f"max_new_tokens must be a non-negative integer, got {args.max_new_tokens}")
    from fxglm5.runtime.runner import check_lengths

    check_lengths(prompts, args.max_new_tokens, config.max_position_embeddings)  # before a cache is sized from them
    speculative = _speculative(args, artifact)
    # text ends at the checkpoint's EOS ids (a verify step emits several tokens at once: not with --speculative)
    stop = tokenizer.eos_ids if tokenizer is not None and speculative is None else frozenset()
    if args.tp != 1:
        return _generate_sharded(args, artifact, prompts, disabled, tokenizer, stop, speculative)
    if args.ep not in (None, 1):
        raise InputError(f"--ep {args.ep}: experts are split over the --tp ranks; give a --tp that {args.ep} divides")
    printer = None  # one prompt's text is printed as it is generated (the paged runtime streams)
    if artifact is None and (args.backend == "reference" or args.max_new_tokens == 0):
        outputs = [_until_stop(_generate(args.model, prompt, args.max_new_tokens, args.dtype), stop)
                   for prompt in prompts]
    elif args.backend == "reference":
        raise InputError("--backend reference runs the model code on a checkpoint directory, not an artifact")
    elif args.max_new_tokens == 0:
        outputs = [[] for _ in prompts]
    else:
        from fxglm5.runtime.options import RunnerOptions
        from fxglm5.serve.build import build_runner

        runner = build_runner(artifact or args.model, RunnerOptions(
            dtype=args.dtype, device=args.device, speculative=speculative, **_paged_options(args, prompts, disabled)))
        if tokenizer is not None and not args.ids and len(prompts) == 1:
            from fxglm5.model.tokenizer import TextPrinter

            printer = TextPrinter(tokenizer, stop)
        outputs = runner.generate(prompts, args.max_new_tokens, stop, on_token=printer)
        if speculative is not None:
            _print_outputs(outputs, None if args.ids else tokenizer, printer, stop)
            _print_acceptance(runner.acceptance.mean_length, runner.acceptance.steps, speculative)
            return 0
    _print_outputs(outputs, None if args.ids else tokenizer, printer, stop)
    return 0


def _print_acceptance(mean: float, steps: int, speculative) -> None:
    why = " (no draft was accepted: an MTP layer with random weights, as make-tiny writes, predicts " \
          "nothing)" if mean < 1.005 else ""
    print(f"mean acceptance length: {mean:.2f} tokens per verify step "
          f"({steps} steps, {speculative.num_tokens} drafts each at most){why}")


def _tokenizer(args: argparse.Namespace, artifact, config):
    """The checkpoint's tokenizer where the prompts are text (None for --prompt-ids): the directory's, or the one an
    artifact carries; --chat / --ids without text are refused."""
    if args.prompt is None:
        if args.chat or args.ids:
            raise InputError(f"{'--chat' if args.chat else '--ids'}: only with --prompt (text)")
        return None
    if artifact is not None:
        return artifact.tokenizer(args.model)
    from fxglm5.model.tokenizer import Tokenizer

    return Tokenizer.from_checkpoint(args.model, config)


def _until_stop(tokens: list[int], stop: frozenset) -> list[int]:
    """``tokens`` up to and with the first stop token (the reference path generates past it)."""
    end = next((i + 1 for i, t in enumerate(tokens) if t in stop), len(tokens))
    return tokens[:end]


def _speculative(args: argparse.Namespace, artifact):
    """``--speculative`` / ``--num-speculative-tokens`` as a SpeculativeConfig (None without them); only the paged
    runtime on a checkpoint directory speculates (one process, or ``--tp`` ranks: the MTP layer sharded as the
    target)."""
    from fxglm5.runtime.speculative import SpeculativeConfig

    if args.speculative is None:
        if args.num_speculative_tokens is not None:
            raise InputError("--num-speculative-tokens: only with --speculative mtp")
        return None
    if args.num_speculative_tokens is None:
        raise InputError("--speculative: give --num-speculative-tokens K (1..4)")
    if args.backend != "paged" or artifact is not None:
        raise InputError("--speculative: runs on the paged backend from a checkpoint directory "
                         "(not --backend reference or an artifact)")
    return SpeculativeConfig(args.speculative, args.num_speculative_tokens)


def _print_outputs(outputs: list[list[int]], tokenizer=None, streamed=None,
                   stop: frozenset = frozenset()) -> None:
    """One line per prompt: its ids (the stop id it ended at the last of them), or with ``tokenizer`` its text, the
    stop token left out: one prompt's as plain text (printed as it came where ``streamed``, a TextPrinter), several
    prompts' as JSON strings, one a line (generated text holds newlines)."""
    if streamed is not None:
        streamed.finish()
        return
    for tokens in outputs:
        if tokenizer is None:
            print(" ".join(map(str, tokens)))
            continue
        text = tokenizer.decode(tokens[:-1] if tokens and tokens[-1] in stop else tokens)
        print(text if len(outputs) == 1 else json.dumps(text, ensure_ascii=False))


def _paged_options(args: argparse.Namespace, prompts: list[list[int]], disabled: tuple[str, ...]) -> dict:
    """The Runner's options for ``generate``: a cache sized for the batch's prompts and new tokens."""
    tokens = sum(len(p) for p in prompts) + len(prompts) * args.max_new_tokens
    return dict(kv_cache=args.kv_cache, block_size=args.block_size, max_cache_tokens=tokens + len(prompts) * args.block_size,
                disabled_passes=disabled, max_step_tokens=args.max_step_tokens, act_quant=args.act_quant)


def _generate_sharded(args: argparse.Namespace, artifact, prompts: list[list[int]], disabled: tuple[str, ...],
                      tokenizer, stop: frozenset, speculative=None) -> int:
    """``generate --tp N``: N ranks (started here, or joined under torchrun) each run the sharded Runner on the
    same request; rank 0 prints the tokens (or their text), which every rank computed alike."""
    if artifact is not None:
        raise InputError(f"--tp {args.tp}: each rank reads its slices of a checkpoint directory; {args.model} is an "
                         "exported artifact")
    if args.backend != "paged":
        raise InputError(f"--tp {args.tp}: only the paged backend runs sharded (--backend {args.backend})")
    if ":" in args.device:
        raise InputError(f"--device {args.device} with --tp {args.tp}: rank r runs on cuda:r; give --device cuda")
    from fxglm5.model.config import Glm5Config
    from fxglm5.parallel import Mapping

    # what config.json alone refuses is refused here, before any rank is spawned (it took 8 interpreters 12 s)
    Mapping(tp=args.tp, ep=args.tp if args.ep is None else args.ep).check(
        Glm5Config.from_json(Path(args.model) / "config.json"))
    if args.max_new_tokens == 0:
        _print_outputs([[] for _ in prompts])
        return 0
    from fxglm5.runtime.options import RunnerOptions
    from fxglm5.serve.build import generate_on_rank, on_ranks

    options = RunnerOptions(dtype=args.dtype, ep=args.ep, speculative=speculative, tp=args.tp, device=args.device,
                            **_paged_options(args, prompts, disabled))
    stream = tokenizer is not None and not args.ids and len(prompts) == 1  # rank 0 prints the text as it comes
    rank, (outputs, acceptance) = on_ranks(generate_on_rank, args.model, options, prompts, args.max_new_tokens,
                                           sorted(stop), stream)
    if rank == 0:
        if not stream:
            _print_outputs(outputs, None if args.ids else tokenizer, stop=stop)
        if speculative is not None:
            _print_acceptance(*acceptance, speculative)
    return 0


# ---- export -------------------------------------------------------------------------------------
def _export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--out", required=True, help="artifact file to write (fxglm5-artifact/3 zip, e.g. glm5.pt2)")
    p.add_argument("--dtype", choices=DTYPES, default=DEFAULT_DTYPE, help="compute dtype, as generate's")
    p.add_argument("--head", choices=["logits", "hidden"], default="logits",
                   help="logits, or the final-norm hidden states (engines that apply the lm_head themselves)")
    _pass_options(p)


def _export(args: argparse.Namespace) -> int:
    from fxglm5.artifact import check_out_path, export_artifact
    from fxglm5.model.modeling import Glm5ForCausalLM

    check_out_path(args.out)  # before the load and the export, not after
    disabled = disabled_passes(args.disable_passes)
    with dump_into(args.dump_dir) as dump:
        model = Glm5ForCausalLM.from_pretrained(args.model, dtype=args.dtype, device="cpu", progress=False)
        path = export_artifact(model, args.out, head=args.head, disabled_passes=disabled, act_quant=args.act_quant,
                               dump_dir=dump, tokenizer_dir=args.model)
    print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB): the matched and fused program, {args.dtype}, "
          f"head={args.head}, {'W8A8' if args.act_quant else 'W8A16'} FP8 GEMMs")
    return 0


# ---- demo ---------------------------------------------------------------------------------------
def demo_dir() -> Path:
    from fxglm5 import settings

    return settings.cache_dir() / "tiny-fp8"


def _demo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", choices=DTYPES, default=DEFAULT_DTYPE, help="compute dtype, as generate's")


def _stage(text: str) -> None:
    """A demo stage as it starts (stderr: the tokens on stdout stay the output), so the seconds are not silent."""
    print(f"fxglm5 demo: {text} ...", file=sys.stderr, flush=True)


def _demo(args: argparse.Namespace) -> int:
    """Make (once) the tiny FP8 checkpoint, generate through the compiled paged path, check it against
    the full-recompute model (in float32, where both paths round alike; bf16 rounds the two differently)."""
    from fxglm5.model.tiny import make_tiny_checkpoint

    target = demo_dir()

    def complete() -> bool:
        return all((target / name).is_file() for name in ("config.json", "tokenizer.json"))

    made = False
    if not complete():  # built beside the target and renamed into place: an interrupted run leaves no half checkpoint
        from fxglm5.model.st_files import check_output_dir, locked

        check_output_dir(target)  # FXGLM5_CACHE naming a file, a home that cannot be written: said before the work
        with locked(target.parent):  # a second demo waits here while the first makes it, then finds it made
            if not complete():
                shutil.rmtree(target, ignore_errors=True)  # an interrupted one's, or an older fxglm5's (no tokenizer)
                _stage(f"making the random tiny GLM-5-FP8 checkpoint at {target}")
                make_tiny_checkpoint(target, fp8=True, seed=0)
                made = True
    from fxglm5.model.modeling import Glm5ForCausalLM
    from fxglm5.runtime.options import RunnerOptions
    from fxglm5.serve.build import build_runner

    _stage(f"loading it and compiling the model ({args.dtype})")
    model = Glm5ForCausalLM.from_pretrained(target, dtype=args.dtype, device="cpu", progress=False)
    runner = build_runner(model, RunnerOptions(kv_cache="bf16", block_size=16, dtype=model.dtype, max_cache_tokens=256))
    from fxglm5.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_checkpoint(target, model.config)
    prompt = tokenizer.encode(DEMO_TEXT)
    _stage("generating")
    tokens = runner.generate([prompt], DEMO_TOKENS)[0]
    print(f"fxglm5 demo: {'made' if made else 'cached'} random tiny GLM-5-FP8 checkpoint at {target}; greedy "
          f"{DEMO_TOKENS} tokens after the prompt {DEMO_TEXT!r}, then their ids (the weights are random, so the text "
          "means nothing):")
    print(json.dumps(DEMO_TEXT + tokenizer.decode(tokens), ensure_ascii=False))
    print(" ".join(map(str, tokens)))
    passes = ", ".join(f"{r.name} {r.num_matches}" for r in runner.pass_results)
    _stage("checking against the full-recompute model")
    agree = greedy_agrees(model, prompt, tokens)
    print(f"compiled graph over a paged KV cache ({passes}); every token the full-recompute model's greedy token "
          f"after the same tokens, within {args.dtype} rounding: {'yes' if agree else 'NO'}")
    return 0 if agree else 1


def greedy_agrees(model, prompt: list[int], tokens: list[int], ulps: int = 4) -> bool:
    """Whether each of ``tokens`` is the greedy token of ``model`` recomputing the whole sequence before it (one
    teacher-forced forward over ``prompt + tokens``): its logit is the best, or within ``ulps`` units of the compute
    dtype's rounding at the logits' scale of it (the paged graph and full recompute sum in other orders: in
    bfloat16 a near-tie may go either way; in float32 the margin is 1e-6 of the scale)."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens]))[0, len(prompt) - 1:-1].float()
    best = logits.max(-1).values
    chosen = logits.gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    margin = ulps * torch.finfo(model.dtype).eps * logits.abs().max()
    return bool((best - chosen <= margin).all())


# ---- serve -------------------------------------------------------------------------------------
def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory, or an artifact file (fxglm5 export)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on; 0: any free port, printed once "
                                                          "listening (default: %(default)s)")
    p.add_argument("--served-model-name", metavar="NAME",
                   help="the model name clients give (default: the --model argument as written)")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help=f"compute dtype (default: {DEFAULT_DTYPE} for a checkpoint directory, as generate's, the "
                        "artifact's own for a .pt2)")
    p.add_argument("--kv-cache", choices=["bf16", "fp8"], default="bf16",
                   help="paged latent cache: the compute dtype (bf16) or FP8 ds_mla rows (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=64, help="paged cache block size in tokens (default: %(default)s)")
    p.add_argument("--max-cache-tokens", type=int, default=8192,
                   help="tokens the paged cache holds over all requests (default: %(default)s)")
    p.add_argument("--max-step-tokens", type=int, default=16384,
                   help="the most tokens one step computes: prompt chunks beside the decodes (default: %(default)s)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="unfinished requests at most; past it a request gets 429 (default: %(default)s)")
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor-parallel ranks (gloo on cpu, NCCL on cuda): rank 0 serves HTTP, every rank runs each "
                        "step (default: %(default)s)")
    p.add_argument("--ep", type=int, metavar="N",
                   help="expert groups with --tp, a divisor of it: N (the default: whole experts per rank), 1 (every "
                        "expert split over all ranks) or between (each group's experts split over its ranks)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the model runs (default: %(default)s)")
    p.add_argument("--speculative", choices=["mtp"],
                   help="speculative decoding with the checkpoint's MTP layer (default: none)")
    p.add_argument("--num-speculative-tokens", type=int, metavar="K",
                   help="drafts per step with --speculative, 1..4 (no default: give it with --speculative)")
    _pass_options(p, dump=False)


def _serve(args: argparse.Namespace) -> int:
    """``fxglm5 serve``: build the engine (every rank at --tp), then serve the OpenAI API until interrupted."""
    from fxglm5.model.config import Glm5Config
    from fxglm5.runtime.options import RunnerOptions
    from fxglm5.serve.app import ServeSettings, serve
    from fxglm5.serve.build import build_engine, load_source, on_ranks, serve_on_rank

    check_device(args.device)
    if not 0 <= args.port <= 65535:
        raise InputError(f"--port: {args.port} is not a port number (0..65535)")
    if args.max_queue < 1:
        raise InputError(f"--max-queue: must be a positive integer, got {args.max_queue}")
    args.backend = "paged"
    artifact = None if Path(args.model).is_dir() else load_source(args.model)
    speculative = _speculative(args, artifact)
    dtype = args.dtype or (str(artifact.dtype).removeprefix("torch.") if artifact is not None else DEFAULT_DTYPE)
    options = RunnerOptions(dtype=dtype, device=args.device, kv_cache=args.kv_cache, block_size=args.block_size,
                            max_cache_tokens=args.max_cache_tokens, max_step_tokens=args.max_step_tokens,
                            disabled_passes=disabled_passes(args.disable_passes), speculative=speculative, tp=args.tp,
                            ep=args.ep, act_quant=act_quant(args, artifact))
    settings = ServeSettings(args.host, args.port, args.served_model_name or args.model, args.max_queue)
    if args.tp != 1:
        if artifact is not None:
            raise InputError(f"--tp {args.tp}: each rank reads its slices of a checkpoint directory; {args.model} "
                             "is an exported artifact")
        from fxglm5.parallel import Mapping

        Mapping(tp=args.tp, ep=args.tp if args.ep is None else args.ep).check(
            Glm5Config.from_json(Path(args.model) / "config.json"))
        on_ranks(serve_on_rank, args.model, options, settings)
        return 0
    serve(build_engine(artifact or args.model, options), settings)
    return 0


# ---- inspect ------------------------------------------------------------------------------------
def _inspect_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint directory (weights are loaded)")
    src.add_argument("--preset", choices=["tiny", "glm5"], help="a built-in config on the meta device (no weights)")
    src.add_argument("--config", help="a GLM-5 config.json, compiled on the meta device (no weights)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16", help="compute dtype")
    _pass_options(p)
    p.add_argument("--device", type=device_arg, metavar="cpu|cuda|cuda:N",
                   help="also lower the graph for this device (without running it) and print what runs where "
                        "(default: match and fuse only)")


def _inspect_config(args: argparse.Namespace):
    """The config ``inspect`` compiles without weights: ``--config FILE`` or ``--preset NAME``."""
    from fxglm5.model.config import Glm5Config

    return Glm5Config.from_json(args.config) if args.config else Glm5Config.preset(args.preset)


def _inspect(args: argparse.Namespace) -> int:
    import torch

    from fxglm5.compiler import Stage, compile_graph, compile_model, report
    from fxglm5.model.modeling import Glm5ForCausalLM

    disabled = disabled_passes(args.disable_passes)
    with dump_into(args.dump_dir) as dump:
        if args.model:
            model = Glm5ForCausalLM.from_pretrained(args.model, dtype=args.dtype, device="cpu", progress=False)
        else:
            model = Glm5ForCausalLM(_inspect_config(args), dtype=getattr(torch, args.dtype), device="meta")
        compiled = compile_model(model, stages=(Stage.MATCH, Stage.FUSE), strict=True, disabled_passes=disabled,
                                 act_quant=args.act_quant, dump_dir=dump)
    lowered = None
    if args.device:  # lowered for the device without running it: what would run where
        *before_lower, lowered = compile_graph(compiled.graph, model.config, stages=(Stage.FUSE_KERNELS, Stage.LOWER),
                                               device=args.device, act_quant=args.act_quant)
        compiled = compiled._replace(results=compiled.results + before_lower)
    print(report(compiled, lowered=lowered, device=args.device))
    return 0


SUBCOMMANDS: dict[str, Subcommand] = {
    "make-tiny": Subcommand("write a random tiny GLM-5 checkpoint", _make_tiny_args, _make_tiny),
    "quantize": Subcommand("quantize a bf16 checkpoint to GLM-5-FP8 block-FP8", _quantize_args, _quantize),
    "generate": Subcommand(
        "generate text (or token ids) from prompts, greedily, through the compiled model", _generate_args,
        _generate_cmd,
        "Greedy generation from --prompt text (the checkpoint's tokenizer and EOS ids; --chat: its chat template) or\n"
        "--prompt-ids, through the compiled graph over a paged KV cache (--backend reference: full recompute), on a\n"
        "checkpoint directory or an exported artifact; --tp N ranks; --speculative mtp drafts from the MTP layer."),
    "export": Subcommand("export a checkpoint as one artifact file (matched and fused program + safetensors "
                         "weights + its tokenizer)", _export_args, _export),
    "serve": Subcommand("serve the OpenAI API (completions, chat, streaming) over HTTP", _serve_args, _serve),
    "demo": Subcommand("make the tiny FP8 checkpoint (cached) and generate from it, checked against full recompute",
                       _demo_args, _demo),
    "inspect": Subcommand("print the pass pipeline: matches and time per pass, op histogram before/after", _inspect_args, _inspect),
}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fxglm5", description="Serve GLM-5-FP8 through a compiler.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    for name, cmd in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.description or cmd.help)
        cmd.add_arguments(p)
        p.set_defaults(_run=cmd.run)
    return parser


def _attach_negative_values(argv: list[str]) -> list[str]:
    """``--prompt-ids -1,2`` as ``--prompt-ids=-1,2``: argparse takes a value that starts with '-' (and is no plain
    number) for an option and ends in its usage text; attached, the id check names the bad id."""
    out = []
    for arg in argv:
        if out and out[-1] == "--prompt-ids" and arg.startswith("-") and arg[1:2].isdigit():
            out[-1] = f"--prompt-ids={arg}"
        else:
            out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand. From the console (argv None) this exits with its code; else it returns it."""
    words = _attach_negative_values(sys.argv[1:] if argv is None else argv)
    _Parser.argv = words  # what an argparse error names an unknown flag from
    args = build_parser().parse_args(words)
    try:
        code = args._run(args)
    except Fxglm5Error as err:
        code = _fail(str(err))
    except OSError as err:  # the machine's: a file that cannot be read or written, a directory under a file
        code = _fail(f"{err.filename}: {err.strerror}" if err.filename and err.strerror else str(err))
    except KeyboardInterrupt:  # what was being written is removed as it unwinds (fxglm5.model.st_files)
        print("fxglm5: interrupted", file=sys.stderr)
        code = 130
    if argv is None:
        sys.exit(code)
    return code


def _fail(message: str) -> int:
    print(f"fxglm5: error: {' '.join(message.split())}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    main()
