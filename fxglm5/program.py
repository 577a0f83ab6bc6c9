"""PagedProgram: the one way to run a compiled paged step, between the compiler and everyone who runs it.

A paged graph (the cache stage ran: ``insert_paged_cache``) is called positionally with a convention that
only the cache stage knows: the token inputs, the MTP graph's ``hidden``, the forward context, every layer's
caches in layer order. The program owns that convention, so the Runner, its decode graphs, the MTP drafter and
both RTP forwards hand it named pieces and never spell it (TensorRT-LLM AutoDeploy's ``CachedSequenceInterface``
plays this part there):

- **The input contract, by name** (:attr:`PagedProgram.inputs`), built from what the cache stage declared in
  ``graph.meta["paged_cache"]`` (a :class:`PagedSignature`, defined here beside the program it describes): the
  context inputs, each layer's cache names and kinds, the head's outputs. This module imports no pass, so the
  cache stage's pass imports the signature from it.
- **The call**: ``program(step, input_ids, caches, hidden=None)`` with ``step`` a :class:`StepInputs`, returns
  :class:`Outputs` (``logits`` / ``hidden`` rows, None where the head has none).
- **The cache spec** (:meth:`PagedProgram.cache_spec`, :class:`CacheSpec`): for a cache kind, each cache input's
  storage dtype and row width, their bytes, the allocation, and the check of tensors someone else allocated
  (RTP's). :func:`cache_dtype` is the one place a kind name becomes a dtype.
- **Validation decided at compile time**: ``inputs_validated`` says whether the caller validates every step's
  context before the call (the Runner, RTP's step: ``ForwardContext.validate``); the lower stage then bound the
  cached ops' bodies that skip their own checks, which sync with the host and cannot be captured in a CUDA graph.

Calling the GraphModule itself is refused (a forward pre-hook): a caller that bypassed the program would bypass
the contract too.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional, Sequence

import torch
from torch import Tensor, fx

from fxglm5 import contracts
from fxglm5.errors import InputError

TOKEN_INPUTS = ("input_ids", "position_ids")
CONTEXT_INPUTS = ("slot_mapping", "block_table", "req_idx", "logits_indices")
CACHE_KINDS = ("bf16", "fp8")  # "bf16": rows in the compute dtype (RTP's non-FP8 mode); "fp8": RTP's byte rows


def check_cache_kind(field: str, kind) -> str:
    """``kind`` if it names a cache kind, else InputError naming ``field`` (the option or argument that gave it)."""
    if kind not in CACHE_KINDS:
        raise InputError(f"{field}: must be one of {CACHE_KINDS}, got {kind!r}")
    return kind


def cache_dtype(kind: str, compute_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype of a cache of ``kind``: FP8 rows are bytes (uint8), the others the compute dtype."""
    check_cache_kind("cache kind", kind)
    return torch.uint8 if kind == "fp8" else compute_dtype


def row_width(role: str, kind: str) -> int:
    """Entries per token of a ``role`` ("kv": the latent row; "index": the indexer key) cache of ``kind``."""
    fp8, plain = {"kv": (contracts.FP8_ROW_BYTES, contracts.LATENT_DIM),
                  "index": (contracts.INDEX_ROW_BYTES, contracts.INDEX_DIM)}[role]
    return fp8 if kind == "fp8" else plain


@dataclasses.dataclass(frozen=True)
class PagedSignature:
    """What the cache stage (``passes.insert_paged_cache``) made the graph take and return, in order: TOKEN_INPUTS,
    ``hidden`` (the MTP graph's), CONTEXT_INPUTS, then each attention layer's caches; ``outputs`` names the results
    (the head's). The stage records it in ``graph.meta["paged_cache"]``; :class:`PagedProgram` is built from it."""

    layers: tuple[tuple[str, str | None], ...]  # per attention layer: (kv cache name, index cache name | None)
    outputs: tuple[str, ...] = ("logits",)
    hidden_input: bool = False

    @classmethod
    def for_layers(cls, indexed, outputs: tuple[str, ...] = ("logits",), hidden_input: bool = False):
        """The signature of attention layers whose ``indexed[i]`` says layer i runs its own indexer."""
        return cls(tuple((f"kv_cache_{i}", f"index_cache_{i}" if own else None) for i, own in enumerate(indexed)),
                   outputs, hidden_input)

    @property
    def cache_names(self) -> list[str]:
        return [name for pair in self.layers for name in pair if name is not None]

    @property
    def index_names(self) -> frozenset[str]:
        return frozenset(index for _, index in self.layers if index is not None)

    @property
    def inputs(self) -> tuple[str, ...]:
        return (*TOKEN_INPUTS, *(("hidden",) if self.hidden_input else ()), *CONTEXT_INPUTS, *self.cache_names)


class StepInputs(NamedTuple):
    """The forward context of one step as the graph takes it (T flat tokens of B requests, R kept rows)."""

    positions: Tensor  # int [T]
    slot_mapping: Tensor  # int [T]; -1: a padding token, written nowhere
    block_table: Tensor  # int [B, W], kernel granularity, padded with 0
    req_idx: Tensor  # int [T]
    logits_indices: Tensor  # int [R]: the token rows whose outputs the step returns


class Outputs(NamedTuple):
    """A step's outputs, rows of ``logits_indices``: None where the program's head has none."""

    logits: Optional[Tensor]  # [R, V]
    hidden: Optional[Tensor]  # [R, H]


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """What each cache input of a program holds for a pair of cache kinds and a compute dtype."""

    signature: PagedSignature
    kv_cache: str
    index_cache: str
    dtype: torch.dtype  # the compute dtype

    def __post_init__(self):
        for name in ("kv_cache", "index_cache"):
            check_cache_kind(name, getattr(self, name))
        if self.dtype not in contracts.COMPUTE_DTYPES:
            raise InputError(f"dtype: {self.dtype} is not a compute dtype {contracts.COMPUTE_DTYPES}")

    @classmethod
    def for_config(cls, config, kv_cache: str, index_cache: str, dtype: torch.dtype) -> "CacheSpec":
        """The spec of a model's paged graph, known from its config before it is compiled (for the size check
        that must come before the slow capture)."""
        indexed = [config.has_indexer(i) for i in range(config.num_hidden_layers)]
        return cls(PagedSignature.for_layers(indexed), kv_cache, index_cache, dtype)

    @property
    def names(self) -> list[str]:
        return self.signature.cache_names

    def _role_kind(self, name: str) -> tuple[str, str]:
        """("kv" or "index", its cache kind) of the cache input ``name``."""
        return ("index", self.index_cache) if name in self.signature.index_names else ("kv", self.kv_cache)

    def storage(self, name: str) -> tuple[torch.dtype, int]:
        """(dtype, entries per token) of the cache input ``name``."""
        role, kind = self._role_kind(name)
        return cache_dtype(kind, self.dtype), row_width(role, kind)

    def token_bytes(self) -> int:
        """Bytes one token takes over every layer's caches."""
        return sum(width * torch.empty((), dtype=dtype).element_size()
                   for dtype, width in map(self.storage, self.names))

    def allocate(self, blocks: int, block_size: int, device) -> dict[str, Tensor]:
        """Zeroed caches ``[blocks, block_size, row]`` for every input, in the graph's order."""
        return {name: torch.zeros(blocks, block_size, width, dtype=dtype, device=device)
                for name, (dtype, width) in ((n, self.storage(n)) for n in self.names)}

    def check(self, tensors: Sequence[Tensor], blocks: int, block_size: int, where=None) -> None:
        """Each tensor is its cache input's ``[blocks, block_size, row]`` of the spec's dtype, contiguous;
        InputError naming it (``where(i)``: how the caller names input ``i``, default the graph's name)."""
        if len(tensors) != len(self.names):
            raise InputError(f"caches: the program takes {len(self.names)} caches {self.names}, got {len(tensors)}")
        for i, (name, t) in enumerate(zip(self.names, tensors)):
            label = where(i) if where is not None else name
            dtype, width = self.storage(name)
            if not isinstance(t, Tensor) or t.dim() != 3:
                raise InputError(f"{label}: expected a [blocks, block_size, row] tensor, got "
                                 f"{tuple(getattr(t, 'shape', ())) or type(t).__name__}")
            if t.dtype != dtype or tuple(t.shape) != (blocks, block_size, width):
                raise InputError(f"{label}: expected {dtype} [{blocks}, {block_size}, {width}] ({self.describe(name)}),"
                                 f" got {t.dtype} {tuple(t.shape)}")
            if not t.is_contiguous():
                raise InputError(f"{label}: must be contiguous")

    def describe(self, name: str) -> str:
        role, kind = self._role_kind(name)
        return f"{'indexer keys' if role == 'index' else 'latent rows'}, {kind}"


class PagedProgram:
    """A compiled paged graph and its calling convention (see the module docstring)."""

    def __init__(self, graph: fx.GraphModule, *, inputs_validated: bool):
        signature = graph.meta.get("paged_cache")
        if not isinstance(signature, PagedSignature):
            raise InputError("graph: not a paged graph (insert_paged_cache did not run on it)")
        placeholders = [n.name for n in graph.graph.find_nodes(op="placeholder")]
        if len(placeholders) != len(signature.inputs):
            raise InputError(f"graph: {len(placeholders)} inputs, its paged signature declares {list(signature.inputs)}")
        self.graph, self.signature, self.inputs_validated = graph, signature, bool(inputs_validated)
        self.inputs: tuple[str, ...] = signature.inputs
        hidden = next((n for n in graph.graph.find_nodes(op="placeholder")
                       if n.name == placeholders[2]), None) if signature.hidden_input else None
        value = None if hidden is None else hidden.meta.get("val")
        self.hidden_dtype = getattr(value, "dtype", None)
        graph._forward_pre_hooks.pop(getattr(graph, "_fxglm5_guard", None), None)
        graph._fxglm5_guard = graph.register_forward_pre_hook(_refuse_direct_call).id

    @property
    def head(self) -> tuple[str, ...]:
        """The outputs the program returns, by name ("logits", "hidden")."""
        return self.signature.outputs

    def cache_spec(self, kv_cache: str = "bf16", index_cache: str | None = None,
                   dtype: torch.dtype = torch.bfloat16) -> CacheSpec:
        """The caches this program takes for ``kv_cache`` rows and ``index_cache`` keys (default: ``kv_cache``)."""
        return CacheSpec(self.signature, kv_cache, index_cache or kv_cache, dtype)

    def __call__(self, step: StepInputs, input_ids: Tensor, caches: Sequence[Tensor],
                 hidden: Tensor | None = None) -> Outputs:
        """Run one step: ``input_ids`` [T], ``caches`` in :attr:`signature`'s order, ``hidden`` [T, H] for a program
        that takes it (the MTP layer's). The program does no host-side check of values (CUDA graphs capture this
        call): a caller that compiled with ``inputs_validated`` validated ``step``; else the ops validate it."""
        if len(caches) != len(self.signature.cache_names):
            raise InputError(f"caches: the program takes {len(self.signature.cache_names)}, got {len(caches)}")
        if (hidden is not None) != self.signature.hidden_input:
            raise InputError("hidden: the MTP program takes the target's hidden states [T, H]; other programs none"
                             if self.signature.hidden_input else "hidden: this program takes no hidden states")
        tokens = (input_ids[None], step.positions[None])
        if hidden is not None:
            tokens += (hidden[None] if self.hidden_dtype is None else hidden[None].to(self.hidden_dtype),)
        graph = self.graph
        graph.__dict__[_VIA_PROGRAM] = True
        try:
            out = graph(*tokens, step.slot_mapping, step.block_table, step.req_idx, step.logits_indices, *caches)
        finally:
            graph.__dict__[_VIA_PROGRAM] = False
        named = dict(zip(self.head, out if isinstance(out, (tuple, list)) else (out,)))
        return Outputs(*(None if named.get(k) is None else named[k][0] for k in Outputs._fields))


_VIA_PROGRAM = "_fxglm5_called_by_program"


def _refuse_direct_call(module, args):
    if module.__dict__.get(_VIA_PROGRAM):
        return
    raise InputError("paged graph: call it through its fxglm5.program.PagedProgram (program(step, input_ids, "
                     "caches)), which owns the input convention")
