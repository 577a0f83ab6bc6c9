"""Tensor / expert parallelism: the rank's place (:class:`Mapping`), what it holds of each weight (:class:`Slice`,
the shard plan), the process groups by name, and the plan hash the ranks compare at start-up.

Phase 1 layout (every rank sees the same tokens): attention heads, the dense MLPs, the shared expert and the vocabulary
(padded with zero rows to a multiple of ``tp``) split over ``tp`` ranks; the routed experts in ``ep`` groups of
``tp/ep`` consecutive ranks: group g holds experts [g E/ep, (g+1) E/ep), each split along its intermediate dim over the
group's ranks (``ep == tp``: whole experts per rank; ``ep == 1``: every expert split over all ranks; between them the
mixed layout, e.g. TP8 / ep 2: ranks 0-3 hold experts 0-127 each split 4 ways). :meth:`Mapping.check` refuses, by config
field, whatever does not split into whole pieces (and, for block-FP8 weights, whole 128x128 blocks) before any weight is
read. The shard stage (``fxglm5.passes``, ``Stage.SHARD``) records in ``graph.meta[PLAN]`` which part of each attribute
the rank holds, keyed by the attribute's target (the model's parameter name); attributes not in the plan are whole.

A graph names its process group, never a c10d id: :func:`resolve_group` finds it at run time, so one rank-agnostic
program runs under torch.distributed (the default ``"tp"``: the WORLD group) or an engine's own groups
(:func:`register_group`). This module imports only torch, the standard library and ``fxglm5.errors``.
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch

from fxglm5.errors import InputError

PLAN = "shard_plan"  # graph.meta key: attribute target -> Slice
BLOCK = 128  # FP8 weight block (GLM-5-FP8's weight_block_size)


@dataclasses.dataclass(frozen=True, repr=False)
class Slice:
    """This attribute is ``full.narrow(dim, start, stop - start)``. ``halves``: the dim is two equal halves
    (a stacked gate|up weight, or its scales) and each half is narrowed to ``[start, stop)`` of its own.
    ``padded``: rows past the end of ``full`` (``stop`` beyond its size: the last ranks' part of a vocabulary that tp
    does not divide) are zeros; any other part must lie inside ``full``. ``inner``: what is then kept of that part
    along another dim (the mixed expert layout: the group's experts, then each expert's intermediate rows); a chain
    is built by :func:`nested`."""

    dim: int
    start: int
    stop: int
    halves: bool = False
    padded: bool = False
    inner: "Slice | None" = None

    def apply(self, full: torch.Tensor) -> torch.Tensor:
        """The rank's part of ``full`` (a copy on real devices, so the whole tensor can be freed; meta stays meta)."""
        if self.halves:
            pair = full.unflatten(self.dim, (2, full.shape[self.dim] // 2))
            part = pair.narrow(self.dim + 1, self.start, self.stop - self.start).flatten(self.dim, self.dim + 1).clone()
        elif not self.padded:
            part = full.narrow(self.dim, self.start, self.stop - self.start).clone()
        else:
            size, rows = full.shape[self.dim], self.stop - self.start
            part = pad_rows(full.narrow(self.dim, min(self.start, size), self.real(size)), self.dim, rows)
        return part if self.inner is None else self.inner.apply(part)

    def real(self, size: int) -> int:
        """How many of the part's rows a dim of ``size`` holds (the rest are padding)."""
        return max(0, min(self.stop, size) - self.start)

    def levels(self) -> tuple["Slice", ...]:
        """The chain's narrowings one dim each, outermost first (each without its ``inner``)."""
        own = dataclasses.replace(self, inner=None)
        return (own,) if self.inner is None else (own, *self.inner.levels())

    def __repr__(self) -> str:  # the dataclass's, with ``inner`` only when there is one (RandomReader seeds by it)
        fields = f"dim={self.dim}, start={self.start}, stop={self.stop}, halves={self.halves}, padded={self.padded}"
        return f"Slice({fields}" + ("" if self.inner is None else f", inner={self.inner!r}") + ")"


def nested(*parts: "Slice | None") -> "Slice | None":
    """The parts that are not None as one chain, each narrowing what the one before left (None: nothing narrowed)."""
    chain = None
    for part in reversed([p for p in parts if p is not None]):
        chain = dataclasses.replace(part, inner=chain)
    return chain


def pad_rows(t: torch.Tensor, dim: int, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended along ``dim`` up to ``rows`` (a copy either way)."""
    missing = rows - t.shape[dim]
    if missing <= 0:
        return t.clone()
    zeros = torch.zeros(*t.shape[:dim], missing, *t.shape[dim + 1:], dtype=t.dtype, device=t.device)
    return torch.cat([t, zeros], dim)


@dataclasses.dataclass(frozen=True)
class Mapping:
    """Where this rank sits: ``tp`` ranks (= the world in phase 1), this ``rank``, ``ep`` expert groups of
    ``tp / ep`` consecutive ranks (1: every expert split along its intermediate dim over all ranks; ``tp``: whole
    experts per rank; a divisor between: the mixed layout) and the process ``group``'s name."""

    tp: int = 1
    rank: int = 0
    ep: int = 1
    group: str = "tp"

    @property
    def world(self) -> int:
        return self.tp

    @property
    def expert_group_size(self) -> int:
        """Ranks per expert group, over which each of the group's experts is split: tp / ep."""
        return self.tp // self.ep

    def part(self, size: int) -> tuple[int, int]:
        """[start, stop) of this rank's equal share of ``size`` (split over tp)."""
        share = size // self.tp
        return self.rank * share, (self.rank + 1) * share

    def vocab_part(self, vocab: int) -> tuple[int, int]:
        """[start, stop) of this rank's vocabulary rows: ceil(vocab / tp) each, so a vocabulary that tp does not
        divide gives the last ranks rows past its end (zeros: ``Slice.apply``), cut off after the gather."""
        share = -(-vocab // self.tp)
        return self.rank * share, (self.rank + 1) * share

    def expert_part(self, experts: int) -> tuple[int, int]:
        """[start, stop) of the routed experts of this rank's group (all of them with ep == 1)."""
        share, group = experts // self.ep, self.rank // self.expert_group_size
        return group * share, (group + 1) * share

    def expert_inner_part(self, size: int) -> tuple[int, int]:
        """[start, stop) of each of its experts' intermediate dim (``size``) this rank holds: its place among the
        group's tp / ep ranks (the whole dim with ep == tp)."""
        share, place = size // self.expert_group_size, self.rank % self.expert_group_size
        return place * share, (place + 1) * share

    def check(self, config) -> None:
        """InputError naming every config field (and the mapping field) that does not split over this mapping."""
        for name in ("tp", "rank", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise InputError(f"parallel mapping: {name} must be an integer, got {value!r}")
        if self.tp < 1:
            raise InputError(f"parallel mapping: tp must be >= 1, got {self.tp}")
        if not 0 <= self.rank < self.tp:
            raise InputError(f"parallel mapping: rank must be in [0, tp={self.tp}), got {self.rank}")
        if self.ep < 1 or self.tp % self.ep:
            raise InputError(f"parallel mapping: ep must divide tp={self.tp} (ep groups of tp/ep ranks; 1: every "
                             f"expert split along its intermediate dim, tp: whole experts per rank), got ep={self.ep}")
        if not isinstance(self.group, str) or not self.group:
            raise InputError(f"parallel mapping: group must be a process group's name, got {self.group!r}")
        if self.tp == 1:
            return
        problems = _split_problems(config, self)
        if problems:
            raise InputError(f"the model does not split over tp={self.tp}, ep={self.ep}: " + "; ".join(problems))


def _split_problems(cfg, m: Mapping) -> list[str]:
    """Each field of ``cfg`` that does not give every rank a whole share (FP8: whole 128-row / column blocks)."""
    fp8 = bool(getattr(cfg, "is_fp8", False))
    problems = []

    def split(what: str, size: int, per_rank_unit: int = 1, blocked: bool = True, group: int | None = None) -> None:
        """Over the tp ranks, or over an expert ``group``'s tp / ep."""
        over, count = (f"tp={m.tp}", m.tp) if group is None else (f"tp/ep={group}", group)
        if size % count:
            problems.append(f"{what} = {size} is not divisible by {over}")
        elif fp8 and blocked and (size // count * per_rank_unit) % BLOCK:
            problems.append(f"{what} = {size} gives each rank {size // count * per_rank_unit} rows/columns of an FP8 "
                            f"weight, not a whole number of {BLOCK}-blocks")

    heads = cfg.num_attention_heads
    split("num_attention_heads", heads, blocked=False)
    if not heads % m.tp:
        split("num_attention_heads (q_b_proj rows: x qk_nope_head_dim + qk_rope_head_dim)", heads, cfg.qk_head_dim)
        split("num_attention_heads (kv_b_proj rows: x qk_nope_head_dim + v_head_dim)", heads,
              cfg.qk_nope_head_dim + cfg.v_head_dim)
        split("num_attention_heads (o_proj columns: x v_head_dim)", heads, cfg.v_head_dim)
    layers = range(cfg.num_hidden_layers)
    if any(not cfg.is_moe_layer(i) for i in layers):
        split("intermediate_size", cfg.intermediate_size)
    if any(cfg.is_moe_layer(i) for i in layers):
        if cfg.n_group != 1:
            problems.append(f"n_group = {cfg.n_group}: group-limited routing is not fused into moe_fp8, so its "
                            "experts cannot be sharded")
        if cfg.n_shared_experts:
            split("moe_intermediate_size x n_shared_experts (the shared expert)",
                  cfg.moe_intermediate_size * cfg.n_shared_experts)
        if cfg.n_routed_experts % m.ep:
            problems.append(f"n_routed_experts = {cfg.n_routed_experts} is not divisible by ep={m.ep}")
        if m.expert_group_size > 1:
            split(f"moe_intermediate_size (each expert split along it over its group's tp/ep ranks, ep={m.ep})",
                  cfg.moe_intermediate_size, group=m.expert_group_size)
    return problems  # the vocabulary: padded to a multiple of tp (Mapping.vocab_part)


# ---- process groups by name ---------------------------------------------------------------------------------
_GROUPS: dict[str, object] = {}


def register_group(name: str, group) -> None:
    """Resolve ``name`` to ``group`` (a torch.distributed ProcessGroup) from now on; None removes the name."""
    if group is None:
        _GROUPS.pop(name, None)
    else:
        _GROUPS[name] = group


def resolve_group(name: str):
    """The process group named ``name``: a registered one, else for ``"tp"`` torch.distributed's WORLD group when
    it is initialized, else None (a single process: collectives are the identity)."""
    if name in _GROUPS:
        return _GROUPS[name]
    if name == "tp" and torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.group.WORLD
    return None


# ---- the start-up agreement ---------------------------------------------------------------------------------
def plan_hash(graph, mapping: Mapping) -> str:
    """A hash of the rewritten program (``graph.code``), its shard plan without the rank's own bounds (which
    attribute, which dim, how much) and the mapping without the rank: equal on every rank of one launch, unequal
    when any rank would run another program (and hang the others in a collective)."""
    digest = hashlib.sha256(graph.code.encode())
    for target, part in sorted(graph.meta.get(PLAN, {}).items()):
        digest.update(f"\0{target}:".encode() + "|".join(f"{p.dim}:{p.stop - p.start}:{p.halves}"
                                                        for p in part.levels()).encode())
    digest.update(f"\0tp={mapping.tp},ep={mapping.ep},group={mapping.group}".encode())
    return digest.hexdigest()[:32]
