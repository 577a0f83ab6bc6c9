"""Test stand-in of PR #1266's external-package loader (``rtp_llm/utils/import_util.py`` at 6a6024414; not
RTP-LLM code). The list comes from ``--external_model_packages`` only (see ``standin_engine.parse_args``)."""

import importlib
import sys


def load_external_model_packages(package_names):
    """Import each name in order; any failure becomes RuntimeError naming the package, chained to the cause."""
    for name in package_names or ():
        try:
            importlib.import_module(name)
        except Exception as error:
            raise RuntimeError(f"Failed to import external model package {name!r}; module search path: "
                               f"{sys.path!r}") from error
