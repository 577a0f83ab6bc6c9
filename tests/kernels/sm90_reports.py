"""Compile reports of Gluon kernels for sm_90, gathered in one subprocess where Triton does not interpret.

Importing triton under TRITON_INTERPRET=1 (as CI runs the Triton kernels) turns its library functions into
interpreted ones, so the compile tests ask a fresh interpreter for every variant's report at once: a process per
variant spent about as long starting (torch, Triton, fxglm5 imported) as compiling.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def reports_from_subprocess(module: str, function: str = "_reports_of_every_variant") -> dict[str, dict]:
    """``module.function()`` (a JSON-serializable dict of reports) run in a subprocess with TRITON_INTERPRET=0."""
    code = f"import json, sys; from {module} import {function}; json.dump({function}(), sys.stdout)"
    env = dict(os.environ, TRITON_INTERPRET="0")
    return json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                     env=env, cwd=ROOT).stdout)
