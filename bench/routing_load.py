"""The routed load of the rank that sets the pace (issue 45, item 1): in a TP x EP step every rank waits for the
slowest, and under uniform top-k routing a batch's experts land on the expert groups unevenly.

``simulate``: uniform top-k routing of ``batch`` tokens over ``experts`` experts in ``ep`` groups (group g holds
experts [g E/ep, (g+1) E/ep)), many trials: per trial the distinct experts and the (token, expert) pairs each group
gets; the busiest group is the one with the most distinct experts (their weights are what a decode step reads; ties:
the most pairs). Its expected distinct experts is the figure a busiest-rank measurement steers to. The tp / ep ranks
of a group each hold a slice of every expert of the group, so they all read as many distinct experts: the busiest
group's ranks are the busiest ranks. With ``ep == 1`` every rank holds a slice of every expert, so the busiest rank is
the mean one.

``SteeredRouting``: the measured rank's router made to give, per MoE layer, the routing of one simulated busiest group
(remapped to the rank's own experts, its group's local ids; the rank is rank 0, in group 0): a context manager that
wraps the router ops' implementations (``moe_route``, ``moe_route_local`` and ``moe_router``, every backend) before
the compile binds them. The real router still runs (its kernel stays in the step and its weights are used); only its
expert ids are replaced, by a static tensor per layer, so the substitution adds no kernel and replays inside a CUDA
graph. Calls whose token count is not a steered batch (a prefill) pass through. The MoE ops that hold their router
(``moe_router_fp8_shared``, fuse_router_into_moe; ``add_rms_norm_moe_router_fp8_shared``, its residual add and norm
too, fuse_add_rms_norm_into_moe) are wrapped too: their experts take the pattern's ids, their router still runs in
its launch (the Triton op's ``steered_ids``; on the reference backend, the norm where the op has one, ``moe_router``,
then ``moe_fp8_shared`` with the pattern).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

ROUTER_OPS = ("moe_route", "moe_route_local", "moe_router")
# op -> the arguments before the router's 9 and the experts': (x,), or (x, residual, norm weight, eps)
FUSED_ROUTER_OPS = {"moe_router_fp8_shared": 1, "add_rms_norm_moe_router_fp8_shared": 4}


@dataclasses.dataclass
class Simulation:
    """Per trial: the busiest group's ids ``[batch, top_k]`` local to the group (-1: another group's expert), and
    the distinct experts / pairs of the busiest group and of an average group."""

    busiest_ids: torch.Tensor  # int32 [trials, batch, top_k]
    busiest_distinct: torch.Tensor  # float [trials]
    busiest_pairs: torch.Tensor
    mean_distinct: float
    mean_pairs: float

    def summary(self) -> dict:
        return dict(trials=int(self.busiest_distinct.numel()),
                    busiest_distinct_experts=round(self.busiest_distinct.mean().item(), 3),
                    busiest_pairs=round(self.busiest_pairs.mean().item(), 3),
                    mean_distinct_experts=round(self.mean_distinct, 3), mean_pairs=round(self.mean_pairs, 3))


def simulate(experts: int, top_k: int, ep: int, batch: int, trials: int, seed: int = 0) -> Simulation:
    """Uniform top-k routing (each token ``top_k`` distinct experts, uniformly) of ``batch`` tokens, ``trials`` times."""
    if experts % ep:
        raise ValueError(f"simulate: {experts} experts do not split into ep={ep} groups")
    gen = torch.Generator().manual_seed(seed)
    per_group = experts // ep
    ids = torch.rand(trials, batch, experts, generator=gen).topk(top_k, dim=-1).indices  # [trials, batch, k]
    group = ids // per_group
    hit = torch.zeros(trials, ep, experts, dtype=torch.bool).scatter_(
        2, ids.reshape(trials, 1, -1).expand(trials, ep, -1), True)
    owned = (torch.arange(experts) // per_group)[None, None, :] == torch.arange(ep)[None, :, None]
    distinct = (hit & owned).sum(-1).float()  # [trials, ep]
    pairs = torch.stack([(group == g).sum((1, 2)) for g in range(ep)], 1).float()
    busiest = (distinct * (batch * top_k + 1) + pairs).argmax(1)  # most distinct, then most pairs
    rows = torch.arange(trials)
    local = ids - (busiest * per_group)[:, None, None]
    mine = group == busiest[:, None, None]
    return Simulation(torch.where(mine, local, -1).to(torch.int32), distinct[rows, busiest], pairs[rows, busiest],
                      distinct.mean().item(), pairs.mean().item())


class SteeredRouting:
    """While open: each MoE layer of a decode step of a steered ``batch`` routes as one simulated busiest group
    (layer i of the step takes trial i), on ``device``. ``patterns``: batch size -> int32 [layers, rows, top_k]
    (rows: the decode graph's bucket, padding rows routed nowhere)."""

    def __init__(self, patterns: dict[int, torch.Tensor], device):
        self.patterns = {rows: p.to(device) for rows, p in patterns.items()}
        self.calls = dict.fromkeys(self.patterns, 0)
        self._saved: dict = {}

    @classmethod
    def busiest(cls, config, ep: int, buckets: dict[int, int], device, seed: int = 0) -> tuple["SteeredRouting", dict]:
        """Patterns for each decode batch (``buckets``: batch -> the rows its step runs) and the simulation's
        summaries (over 4096 trials; the patterns use the first ``layers`` of them)."""
        layers = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
        patterns, summaries = {}, {}
        for batch, rows in buckets.items():
            sim = simulate(config.n_routed_experts, config.num_experts_per_tok, ep, batch, max(4096, layers), seed)
            pattern = torch.full((layers, rows, config.num_experts_per_tok), -1, dtype=torch.int32)
            pattern[:, :batch] = sim.busiest_ids[:layers]
            patterns[rows] = pattern
            summaries[batch] = dict(sim.summary(), steered_distinct_experts=round(
                sim.busiest_distinct[:layers].mean().item(), 3), layers=layers)
        return cls(patterns, device), summaries

    def __enter__(self):
        from fxglm5.lowering import implementations as table

        for op in ROUTER_OPS + tuple(FUSED_ROUTER_OPS):
            wrap = self._wrap if op in ROUTER_OPS else functools.partial(self._wrap_fused, op)
            for backend, impl in table.implementations(op).items():
                self._saved[(op, backend)] = table._IMPLS.get(op, {}).get(backend)
                table._IMPLS.setdefault(op, {})[backend] = dataclasses.replace(
                    impl, fn=wrap(impl.fn, backend), unchecked=impl.unchecked and wrap(impl.unchecked, backend))
        return self

    def __exit__(self, *exc):
        from fxglm5.lowering import implementations as table

        for (op, backend), impl in self._saved.items():
            if impl is None:
                table._IMPLS[op].pop(backend, None)
            else:
                table._IMPLS[op][backend] = impl
        self._saved.clear()

    def _next(self, rows: int, top_k: int) -> torch.Tensor | None:
        """The ids of the next steered MoE layer of a ``rows``-row step, or None where ``rows`` is not steered."""
        pattern = self.patterns.get(rows)
        if pattern is None or top_k != pattern.shape[2]:
            return None
        layer = self.calls[rows] % pattern.shape[0]
        self.calls[rows] += 1
        return pattern[layer]

    def _wrap(self, route, backend):
        def steered(*args, **kwargs):
            weights, ids = route(*args, **kwargs)
            pattern = self._next(*ids.shape)
            return weights, ids if pattern is None else pattern

        return steered

    def _wrap_fused(self, op, moe, backend):
        lead = FUSED_ROUTER_OPS[op]

        def steered(x, *args):
            router, experts = args[lead - 1:lead + 8], args[lead + 8:]
            pattern = self._next(x.numel() // x.shape[-1], router[2])
            if pattern is None:
                return moe(x, *args)
            if backend != "reference":
                return moe(x, *args, steered_ids=pattern)
            if lead == 1:
                weights, _ = torch.ops.fxglm5.moe_router(x, *router)
                return torch.ops.fxglm5.moe_fp8_shared(x, pattern, weights, *experts)
            normed, total = torch.ops.fxglm5.add_rms_norm(x, *args[:lead - 1])
            tokens = normed.reshape(-1, normed.shape[-1])
            weights, _ = torch.ops.fxglm5.moe_router(tokens, *router)
            return torch.ops.fxglm5.moe_fp8_shared(tokens, pattern, weights, *experts), total

        return steered
