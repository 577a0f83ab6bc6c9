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
from typing import Callable, Iterable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def reports_from_subprocess(module: str, function: str = "_reports_of_every_variant") -> dict[str, dict]:
    """``module.function()`` (a JSON-serializable dict of reports) run in a subprocess with TRITON_INTERPRET=0."""
    code = f"import json, sys; from {module} import {function}; json.dump({function}(), sys.stdout)"
    env = dict(os.environ, TRITON_INTERPRET="0")
    return json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                     env=env, cwd=ROOT).stdout)


def report_each(variants: Iterable[tuple], report: Callable[..., dict]) -> dict[str, dict]:
    """``report(*variant)`` of each variant by ``repr(variant)``, or the error that stopped it (reported to the
    variant's own test rather than failing every variant's)."""
    out = {}
    for variant in variants:
        try:
            out[repr(variant)] = report(*variant)
        except Exception as err:  # noqa: BLE001 - reported to the variant's own test
            out[repr(variant)] = dict(error=f"{type(err).__name__}: {err}")
    return out


def ptxas_report(kernel) -> dict:
    """A compiled kernel's shared memory, ``ptxas -v`` log for sm_90a (registers, spills, serialization warnings),
    PTX, and how often each SASS opcode occurs in its cubin (``nvdisasm``, Triton's own copy). Only in a process
    where Triton does not interpret."""
    import re
    import tempfile
    from collections import Counter

    from triton import knobs
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as d:
        with open(f"{d}/k.ptx", "w") as f:
            f.write(kernel.asm["ptx"])
        log = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", f"{d}/k.ptx", "-o", f"{d}/k.cubin"],
                             capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([knobs.nvidia.nvdisasm.path, "-c", f"{d}/k.cubin"], capture_output=True, text=True,
                              check=True).stdout
    opcodes = Counter(re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass, re.M))
    return dict(shared=kernel.metadata.shared, ptxas=log, ptx=kernel.asm["ptx"], sass_opcodes=dict(opcodes))
