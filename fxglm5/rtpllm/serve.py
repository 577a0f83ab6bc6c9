"""Launcher: RTP-LLM's own server, with fxglm5 registered in every process RTP-LLM starts.

    python -m fxglm5.rtpllm.serve <RTP-LLM's arguments>

is ``python -m rtp_llm.start_server <RTP-LLM's arguments>`` with ``glm_5`` served by fxglm5. The arguments go to
RTP unchanged, and RTP parses them itself. It works on stock RTP-LLM, whose main branch (4b8d39cd5) has no
external-model loader, and on RTP-LLM patched with PR #1266 (head 6a6024414). With #1266, the flag
``--external_model_packages fxglm5.rtpllm.models`` may be given too. It then imports a module that this launcher
has already imported in that process, which is a no-op, so nothing registers twice.

Why every process is reached (alibaba/rtp-llm 4b8d39cd5; CPython's ``multiprocessing/spawn.py``; the whole walk,
with the settings of the GLM-5 launch, is docs/rtp_launch.md):
- ``rtp_llm/start_server.py:597-601``: ``main()`` runs ``setup_args()``, then ``setup_and_configure_server``,
  then ``start_server``. The module calls ``main()`` only as ``__main__`` (``:1034-1035``).
  ``setup_args`` parses ``sys.argv`` strictly (``server/server_args/server_args.py:523-543``, ``:293``).
  ``setup_default_args`` infers the model type from the architectures in config.json
  (``config/server_config_setup.py:397-400``).
- ``start_server.py:612-613`` makes ``spawn`` the start method. The backend (``:121-126``) and the frontend
  (``:489-490``) are ``multiprocessing`` processes. The backend starts one process per rank with
  ``multiprocessing.get_context("spawn")`` (``start_backend_server.py:289, 174-186``). Each rank looks the model
  up in ``BackendManager.start`` (``server/backend_manager.py:70``), which calls ``ModelFactory.create_model_config``
  and then ``get_model_cls`` (``model_factory.py:341, 58-63``: ``ensure_model_registered``, then
  ``_model_factory``). The frontend looks the model up the same way (``frontend/frontend_server.py:76``).
- A spawned child first re-runs the parent's ``__main__`` module by name, as ``__mp_main__``, and only then
  unpickles its target. In ``spawn.py``, ``get_preparation_data`` passes ``init_main_from_name``, and ``prepare``
  calls ``_fixup_main_from_name``, which calls ``runpy.run_module(name, run_name="__mp_main__")``.
  So when this module is ``__main__``, every process RTP spawns runs this module's top level before RTP's code in
  that process looks a model up. That holds for every process those processes spawn as well, because the new
  ``__main__`` keeps this module's spec. The top level registers fxglm5 (``fxglm5.rtpllm.models``) and checks the
  result.
- Run it with ``-m`` by this name. A package's ``__main__.py`` would not work: ``_fixup_main_from_name``
  skips names ending in ``.__main__``.

Importing this module under its own name does nothing: it registers only as ``__main__`` or ``__mp_main__``.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys

log = logging.getLogger("fxglm5.rtpllm.serve")
PROG = "fxglm5.rtpllm.serve"
PACKAGE = "fxglm5.rtpllm.models"  # the module #1266's --external_model_packages names
FLAG = "--external_model_packages"


class LaunchError(Exception):
    """The launch cannot serve fxglm5: the message is one line, for the user."""


def _import_rtp() -> None:
    """Import ``rtp_llm`` and its server entry, whose top level RTP runs in every process it spawns."""
    if importlib.util.find_spec("rtp_llm") is None:
        raise LaunchError(f"rtp_llm is not importable by {sys.executable}: run the launcher with the Python "
                          f"that has RTP-LLM installed")
    try:
        # start_server's top level (logging setup, sys.path): under `python -m rtp_llm.start_server` every
        # spawned process re-runs it as __mp_main__, so it is imported here in every process too
        importlib.import_module("rtp_llm.start_server")
    except Exception as err:  # noqa: BLE001 - one line for the user, whatever RTP's import raised
        raise LaunchError(f"rtp_llm.start_server does not import ({type(err).__name__}: {err})") from err


def _qualname(cls) -> str:
    return "nothing" if cls is None else f"{getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', cls)}"


def check_registered() -> dict:
    """Check that RTP's model lookup now gives fxglm5's classes. The lookup is the one
    ``ModelFactory.get_model_cls`` makes (``model_factory.py:58-63``): ``ensure_model_registered``, then
    ``_model_factory``. Also check that config.json's architecture infers ``glm_5``. Returns
    {model type: class}; raises LaunchError naming what RTP would serve instead."""
    from fxglm5.rtpllm import glm5, speculative

    factory = importlib.import_module("rtp_llm.model_factory_register")
    want = {glm5.NAME: glm5.Fxglm5Glm5, glm5.ALIAS: glm5.Fxglm5Glm5, speculative.MTP_NAME: speculative.Fxglm5Glm5Mtp}
    for name, cls in want.items():
        try:
            factory.ensure_model_registered(name)
        except KeyError:
            pass  # reported below as "nothing"
        got = factory._model_factory.get(name)
        if got is not cls:
            raise LaunchError(f"after registering fxglm5, RTP resolves model type {name!r} to {_qualname(got)}, "
                              f"not {_qualname(cls)}")
    arch = factory._hf_architecture_2_ft.get(glm5.ARCHITECTURE)
    if arch != glm5.NAME:
        raise LaunchError(f"after registering fxglm5, RTP infers architecture {glm5.ARCHITECTURE!r} as model type "
                          f"{arch!r}, not {glm5.NAME!r}")
    return want


def register_in_this_process() -> None:
    """Register fxglm5 with this process's RTP and check the result. This runs in the launcher, and again in
    every process RTP spawns, when that process re-runs this module as ``__mp_main__``."""
    _import_rtp()
    importlib.import_module(PACKAGE)  # registers; a later `--external_model_packages` import of it is a no-op
    check_registered()
    log.info("fxglm5: model type glm_5 is fxglm5.rtpllm.glm5.Fxglm5Glm5 in process %d (%s)", os.getpid(), __name__)


def main() -> int:
    """Register fxglm5, then run RTP's own server entry on this process's ``sys.argv``, unchanged."""
    try:
        register_in_this_process()
    except LaunchError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 1
    if os.environ.get("RTP_LLM_EXTERNAL_MODEL_PACKAGES"):
        log.warning("%s: RTP-LLM reads no RTP_LLM_EXTERNAL_MODEL_PACKAGES (neither main nor PR #1266); "
                    "this launcher registers fxglm5 itself", PROG)
    try:
        importlib.import_module("rtp_llm.start_server").main()
    except SystemExit as exit_:
        if exit_.code == 2 and any(a == FLAG or a.startswith(FLAG + "=") for a in sys.argv[1:]):
            # argparse's usage error: on RTP without PR #1266 the flag itself is the unrecognized argument
            print(f"{PROG}: note: {FLAG} exists only in RTP-LLM patched with PR #1266, and this launcher does "
                  f"not need it: drop it", file=sys.stderr)
        raise
    return 0


if __name__ == "__mp_main__":  # a process RTP spawned (multiprocessing re-runs the parent's main module)
    register_in_this_process()  # a LaunchError here ends this process, and RTP reports the rank as dead
elif __name__ == "__main__":
    sys.exit(main())
