"""The one template of tests/passes/test_<pass>.py, and the machinery those files share.

A pass's file subclasses :class:`PassTemplate` with its data; the template's tests then check, for that pass:
- matches: the exact match count on tiny GLM-5 models whose count is known (``fp8``: dense layer 0 + MoE layers
  1-3, a full indexer in every layer; ``shared``: the same with layers 1 and 3 reusing the previous top-k;
  ``bf16``: ``fp8``'s model computing in bf16), equal to what the pass expects of the model;
- ops before / after: which ops the pass removed and which it added, with their exact numbers;
- numerics: on three requests of 11, 4 and 7 tokens (more than index_topk = 8, so the selection selects), the
  graph after the pass gives what the graph before it gives: in float32 to ``FLOAT32_TOL`` (max error relative
  to the largest output); in bf16 the fused ops round less than the generic graph, so the bound is the one the
  pipeline documents: against the float32 model on the same weights the graph after the pass is no further off
  than 1.5x the graph before it, plus 1e-3;
- a near miss untouched: a small module that looks almost like the pattern but must not match gets 0 matches,
  the same graph code and the same output;
- re-export: a small module's graph rewritten by the pass exports again with torch.export (dynamic tokens) and
  gives the rewritten graph's outputs at sizes other than the example's, caches written included.

The tiny models are captured and run through the whole pipeline once per test run (:func:`pipeline`, a
process-wide cache; the exports are the ones tests/passes/test_pipeline.py makes, shared through the run's export
cache), one pass at a time, keeping the graph before and after every pass: each pass's file reads its own two.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import torch
from torch import fx
from torch.export import Dim

from fxglm5 import contracts
from fxglm5.capture import capture, export_graph
from fxglm5.lowering.reference.paged import slots_from_positions
from fxglm5.model.config import Glm5Config
from fxglm5.passes import REGISTRY, PassContext, PassManager, PassResult
from fxglm5.passes.manager import cleanup
from fxglm5.passes.pipeline import STAGES
from fxglm5.passes.registry import passes_for
from tests.helpers import copy_to_dtype, random_model, rel_err

FLOAT32_TOL = 1e-5
BLOCK = 4  # cache block size of the paged runs
LENGTHS = (11, 4, 7)  # the numerics' requests
SHARED = ["full", "shared", "full", "shared"]
# name -> (tiny preset overrides, compute dtype)
CONFIGS = {
    "fp8": ({}, torch.float32),
    "shared": ({"indexer_types": SHARED}, torch.float32),
    "bf16": ({}, torch.bfloat16),
    "bf16ckpt": ({"quantization_config": None}, torch.float32),
    "shared_bf16ckpt": ({"indexer_types": SHARED, "quantization_config": None}, torch.float32),
    "bf16_bf16ckpt": ({"quantization_config": None}, torch.bfloat16),
}
DIMS = {0: Dim("batch", min=1, max=16), 1: Dim("seq", min=1, max=512)}


def config(name: str) -> Glm5Config:
    return Glm5Config.preset("tiny").replace(**CONFIGS[name][0])

@dataclasses.dataclass
class Pipeline:
    """One tiny model through every declared pass: the graph before and after each, and each pass's result."""

    config: Glm5Config
    dtype: torch.dtype
    model: torch.nn.Module
    before: dict[str, fx.GraphModule]
    after: dict[str, fx.GraphModule]  # after one pass is the graph before the next, the same object
    results: dict[str, PassResult]
    _outputs: dict = dataclasses.field(default_factory=dict)

    def outputs(self, gm: fx.GraphModule) -> torch.Tensor:
        """:func:`outputs` of one of this pipeline's graphs on :func:`requests` (computed once per graph)."""
        if id(gm) not in self._outputs:
            self._outputs[id(gm)] = outputs(gm, requests(self.config), self.dtype)
        return self._outputs[id(gm)]


@functools.lru_cache(maxsize=None)
def pipeline(name: str) -> Pipeline:
    cfg, dtype = config(name), CONFIGS[name][1]
    model = random_model(cfg, dtype)
    gm = capture(model)
    before, after, results = {}, {}, {}
    snapshot = copy.deepcopy(gm)
    for index, spec in enumerate(passes_for(STAGES)):
        before[spec.name] = snapshot
        results[spec.name] = PassManager(PassContext(config=cfg), stages=(spec.stage,)).run_one(gm, spec, index)
        after[spec.name] = snapshot = copy.deepcopy(gm)
    return Pipeline(cfg, dtype, model, before, after, results)


def ops_changed(result: PassResult) -> dict[str, int]:
    """Op name -> (count after) - (count before), for the ops whose count the pass changed."""
    before, after = result.ops_before, result.ops_after
    return {op: after.get(op, 0) - before.get(op, 0) for op in sorted({*before, *after})
            if after.get(op, 0) != before.get(op, 0)}


def requests(cfg: Glm5Config) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in LENGTHS]


def paged_args(gm: fx.GraphModule, seqs, dtype, rows=None) -> tuple:
    """``gm``'s inputs (a paged graph: gm.meta['paged_cache']) for one flat step of ``seqs`` on fresh blocks of
    zeroed caches in the compute dtype (rows of the contracts' widths), keeping the output ``rows`` (default: every
    token). Block 0 belongs to no request."""
    lengths = [len(s) for s in seqs]
    req = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    pos = torch.cat([torch.arange(n) for n in lengths])
    per_req = [-(-n // BLOCK) for n in lengths]
    table = torch.zeros(len(lengths), max(per_req), dtype=torch.long)
    for i, blocks in enumerate(torch.arange(1, 1 + sum(per_req)).split(per_req)):
        table[i, :len(blocks)] = blocks
    widths = {"kv": contracts.LATENT_DIM, "index": contracts.INDEX_DIM}
    caches = [torch.zeros(1 + sum(per_req), BLOCK, widths[name.split("_")[0]], dtype=dtype)
              for name in gm.meta["paged_cache"].cache_names]
    rows = torch.arange(len(req)) if rows is None else rows
    return (torch.cat(seqs)[None], pos[None], slots_from_positions(table, req, pos, BLOCK), table, req, rows, *caches)


def paged_dims(gm: fx.GraphModule) -> tuple:
    """Dynamic shapes of a paged graph's inputs: the step's tokens (and the kept rows) dynamic, the block table and
    the caches of any size."""
    tokens, rows, auto = Dim("tokens", min=2, max=4096), Dim("rows", min=1, max=4096), Dim.AUTO
    caches = [{0: auto} for _ in gm.meta["paged_cache"].cache_names]
    return ({1: tokens}, {1: tokens}, {0: tokens}, {0: auto, 1: auto}, {0: tokens}, {0: rows}, *caches)


def outputs(gm, seqs, dtype) -> torch.Tensor:
    """Every token's output [tokens, ...] of ``seqs``: for a token graph (or the eager model) one batch, each
    request padded at its end (causal: what follows a token changes nothing of it); for a paged graph one flat
    step on fresh caches in ``dtype``."""
    if "paged_cache" in getattr(gm, "meta", {}):
        return gm(*paged_args(gm, seqs, dtype))[0]
    longest = max(len(s) for s in seqs)
    ids = torch.stack([torch.cat([s, s.new_zeros(longest - len(s))]) for s in seqs])
    out = gm(ids, torch.arange(longest)[None].expand(len(seqs), -1))
    return torch.cat([out[i, :len(s)] for i, s in enumerate(seqs)])


def export_small(module: torch.nn.Module, args: tuple, dims=None) -> fx.GraphModule:
    """The graph of ``module(*args)`` (every arg dynamic in dims 0 / 1 unless ``dims``), as the passes get it.

    Export traces size-2 examples (a size-1 dim would be specialised); the checks run ``args``."""
    example = tuple(torch.zeros(max(a.shape[0], 2), max(a.shape[1], 2), *a.shape[2:], dtype=a.dtype) for a in args)
    return export_graph(module, example, dims or small_dims(args))


def small_dims(args: tuple) -> tuple:
    return tuple(DIMS for _ in args)


def run_small(name: str, module: torch.nn.Module, args: tuple, cfg=None) -> tuple[fx.GraphModule, PassResult]:
    """:func:`export_small` ``module(*args)`` and run pass ``name`` on the graph."""
    gm = export_small(module, args)
    return gm, run_one(gm, name, cfg)


def run_one(gm: fx.GraphModule, name: str, cfg=None) -> PassResult:
    return PassManager(PassContext(config=cfg), stages=(REGISTRY[name].stage,)).run_one(gm, REGISTRY[name])


def assert_same_output(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """``out`` equals ``ref`` to ``tol`` relative to ref's largest value (the same NaNs: a near-miss module may make
    NaN itself, e.g. a selection with no causal key)."""
    out, ref = out.float(), ref.float()
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol * ref.nan_to_num().abs().max().item(), equal_nan=True)


def assert_untouched(name: str, gm: fx.GraphModule, reference, args: tuple, cfg=None) -> None:
    """Pass ``name`` finds nothing in ``gm``: 0 matches, the same code (as the pass manager's clean-up after every
    pass leaves it: dead nodes, such as an unused weight's get_attr, go), and ``reference(*args)``'s output."""
    cleanup(gm)
    code = gm.code
    assert run_one(gm, name, cfg).num_matches == 0
    assert gm.code == code
    assert_same_output(gm(*args), reference(*args), 1e-6)


def assert_reexports(gm: fx.GraphModule, example: tuple, dynamic_shapes, other: tuple) -> None:
    """``gm`` exports again (``dynamic_shapes`` over ``example``) and the program gives ``gm``'s outputs on ``other``
    (other sizes), the tensors it writes in place included."""
    program = torch.export.export(gm, tuple(a.clone() for a in example), dynamic_shapes=dynamic_shapes, strict=False)
    mine, theirs = tuple(a.clone() for a in other), tuple(a.clone() for a in other)
    assert_same_output(program.module()(*theirs), gm(*mine), 1e-6)
    for a, b in zip(theirs, mine):
        assert torch.equal(a, b)


class PassTemplate:
    """The template's tests for pass ``name`` (a subclass per pass file, named Test<Pass>), from its data:
    ``matches``: config -> the exact match count; ``ops``: config -> :func:`ops_changed` exactly; ``numerics``: the
    configs whose outputs are compared; ``near_misses``: the cases ``near_miss(case)`` builds, each
    (graph, reference, args, cfg) that the pass must leave untouched; ``reexport()`` -> (a small float32 graph the pass
    rewrites, example args of the rewritten graph, their dynamic shapes, args of other sizes, config). tests/passes/conftest.py parametrizes each test over the
    keys its data names (``PARAMS``)."""

    name: str
    matches: dict[str, int]
    ops: dict[str, dict[str, int]]
    numerics: tuple[str, ...] = ("fp8", "shared", "bf16")
    near_misses: tuple[str, ...]
    PARAMS = {"test_matches": ("config", "matches"), "test_ops_before_after": ("config", "ops"),
              "test_numerics": ("config", "numerics"), "test_near_miss_untouched": ("case", "near_misses")}

    def test_matches(self, config):
        result = pipeline(config).results[self.name]
        assert result.num_matches == self.matches[config], result.summary()
        if result.expected is not None:
            assert result.expected == result.num_matches

    def test_ops_before_after(self, config):
        assert ops_changed(pipeline(config).results[self.name]) == self.ops[config]

    def test_numerics(self, config):
        run = pipeline(config)
        out, before = run.outputs(run.after[self.name]), run.outputs(run.before[self.name])
        if run.dtype == torch.float32:
            assert rel_err(out, before) <= FLOAT32_TOL
            return
        ref = outputs(copy_to_dtype(run.model, torch.float32), requests(run.config), torch.float32)

        def err(x):
            return ((x.float() - ref).norm() / ref.norm()).item()

        assert err(out) <= 1.5 * err(before) + 1e-3, (err(out), err(before))

    def test_near_miss_untouched(self, case):
        assert_untouched(self.name, *self.near_miss(case))

    def test_reexports(self):
        gm, example, dynamic_shapes, other, cfg = self.reexport()
        assert run_one(gm, self.name, cfg).num_matches >= 1
        assert_reexports(gm, example, dynamic_shapes, other)
