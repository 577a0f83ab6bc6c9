"""Every environment variable fxglm5 reads, in one place (a leaf module: it imports nothing of fxglm5).

Each is read when its setting is used, never at import, so a process (or a test) that sets one before the
call is obeyed and importing a kernel module has no hidden dependence on the environment of that moment.

- ``TRITON_INTERPRET=1``: run the Triton kernels in Triton's interpreter (CPU tensors; slow, exact). Triton
  itself reads it too; fxglm5 uses it to allow its Triton backend on CPU and to pick interpreter-safe code.
- ``FXGLM5_NO_AUTOTUNE=1``: the Triton kernels use their fixed default configs (no tuning compiles).
- ``FXGLM5_BACKEND=aiter|triton|reference``: the backend the ``lower`` pass puts first (checked by
  ``fxglm5.lowering.backend_choice.preferred_backend``); the ``backend`` option of each front door wins over it.
- ``FXGLM5_CACHE``: where ``fxglm5 demo`` keeps its tiny checkpoint (default ``~/.cache/fxglm5``).
- ``FXGLM5_PDL=1|0``: launch the decode path's Triton and Gluon kernels with programmatic dependent launch on
  Hopper and later (``fxglm5.lowering.triton.device.pdl``; default 0). Every kernel the lowering launches takes
  part but the prefill-only ones (``tests/kernels/test_pdl_coverage.py`` holds the list).
- ``FXGLM5_SPARSE_MLA_TILE=1|0``: sparse MLA of prefill-shaped steps runs the query-tile kernel
  (``fxglm5.lowering.triton.sparse_mla_tile``) where it applies (default 1); 0 keeps the per-token kernel
  everywhere (to time one against the other in a whole prefill).
- ``FXGLM5_SPARSE_MLA_TILE_GLUON=1|0``: on Hopper (sm_90) that query-tile kernel is the Gluon one
  (``fxglm5.lowering.triton.sparse_mla_tile_hopper``) where it applies (default 1: its GPU tests passed and at 8k,
  8 heads, one layer it took 4.53 ms against the Triton tile's 5.77 ms with an FP8 cache on an H100,
  bench/results/sparse_mla_tile_gluon_h100_bb561ff); 0 keeps the Triton tile kernel (the A/B of the two).
- ``FXGLM5_DECODE_JOINS=name,name,...|all|none``: which one-launch joins of a decode step (at most 16 tokens) run
  their joined launch; each falls back to the launches of the chain it joins, same op, same graph
  (:data:`DECODE_JOINS` names them). Default: the MoE router's only. On an H100 at 39 layers (bench/results/
  decode_joins_h100_fee09c4) a B=1 step took 9.42 to 9.51 ms with them and 9.18 ms without the q_b GEMM's two, and each
  joined kernel took longer than the launches it replaced (the profile there), so they stay opt-in until they win.
  At bb561ff the default was the fastest of default, all, none and PDL at B=1 and B=8
  (bench/results/decode_default_h100_bb561ff).
- ``FXGLM5_RTP_ACT_QUANT=1|0``: the RTP-LLM plugin compiles W8A8 FP8 GEMMs (activations quantized 1x128 on the
  fly; default 0: W8A16, as every fxglm5 front door). The plugin's only option channel: RTP parses its own
  arguments strictly, and every process it spawns inherits the environment (``fxglm5.rtpllm.config.act_quant``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional


def _flag(name: str, default: bool = False) -> bool:
    return os.environ.get(name, "1" if default else "0") == "1"


def triton_interpret() -> bool:
    return _flag("TRITON_INTERPRET")


def no_autotune() -> bool:
    return _flag("FXGLM5_NO_AUTOTUNE")


def pdl() -> bool:
    return _flag("FXGLM5_PDL")


def sparse_mla_tile() -> bool:
    return _flag("FXGLM5_SPARSE_MLA_TILE", default=True)


def sparse_mla_tile_gluon() -> bool:
    return _flag("FXGLM5_SPARSE_MLA_TILE_GLUON", default=True)


# the one-launch joins a decode step may run, each chosen per call inside its op (the chain's launches otherwise)
DECODE_JOINS = {
    "q_b": "the latent query (and, with 'indexer', the indexer) as tasks of the q_b | wq_b GEMM's launch",
    "indexer": "the indexer's logits and top-k in one launch",
    "norm_gemm": "a residual add + RMSNorm in the A loads of the GEMM (or GEMV) that reads it",
    "mla_project": "the MLA's W_UV combine as the last tasks of the MLA's launch",
    "moe_router": "the MoE's router (and the residual add + RMSNorm before it) as the first tasks of its gate|up "
                  "launch",
}
# on by default: the MoE's router join; a B=1 step took 9.53 ms without it, 8.6 ms with it (decode_default_h100_bb561ff)
DEFAULT_DECODE_JOINS: frozenset = frozenset({"moe_router"})


def decode_joins() -> frozenset:
    """The names of :data:`DECODE_JOINS` that run joined (``FXGLM5_DECODE_JOINS``; unset: the default)."""
    raw = os.environ.get("FXGLM5_DECODE_JOINS")
    if raw is None:
        return DEFAULT_DECODE_JOINS
    names = {n.strip() for n in raw.split(",") if n.strip()}
    if names == {"all"}:
        return frozenset(DECODE_JOINS)
    unknown = names - set(DECODE_JOINS) - {"none"}
    if unknown:
        raise ValueError(f"FXGLM5_DECODE_JOINS={raw!r}: unknown {sorted(unknown)}; known: {sorted(DECODE_JOINS)}, "
                         f"'all' or 'none'")
    return frozenset(names - {"none"})


def joins(name: str) -> bool:
    """Whether the decode join ``name`` (a key of :data:`DECODE_JOINS`) runs joined."""
    if name not in DECODE_JOINS:
        raise KeyError(f"no decode join {name!r}; known: {sorted(DECODE_JOINS)}")
    return name in decode_joins()


def rtp_act_quant() -> bool:
    return _flag("FXGLM5_RTP_ACT_QUANT")


def backend() -> Optional[str]:
    return os.environ.get("FXGLM5_BACKEND") or None


def cache_dir() -> Path:
    return Path(os.environ.get("FXGLM5_CACHE") or Path.home() / ".cache" / "fxglm5")
