"""The Runner over the parts ``fxglm5.runtime.parts.build_parts`` makes, the builder's way (``fxglm5.serve.build``):

- ``Runner(build_parts(model, options))`` serves the full-recompute model's greedy tokens and logits, and runs the
  very parts it was given;
- the parts carry their options: ``Runner(parts, ...)`` with anything beside them is refused (InputError), as are
  options given both as a RunnerOptions and as keywords (one rule, ``RunnerOptions.given``, for the Runner's shim and
  ``Artifact.runner``).
"""

import pytest
import torch

from fxglm5.errors import InputError
from fxglm5.runtime.options import RunnerOptions
from fxglm5.runtime.parts import RunnerParts, build_parts
from fxglm5.runtime.runner import Runner
from tests.paged_helpers import model_and_graph, prompts, reference_logits

OPTIONS = RunnerOptions(block_size=4, max_cache_tokens=64, keep_logits=True)


def test_a_runner_over_built_parts_serves_the_full_recompute_tokens():
    model, graph = model_and_graph("exact")
    parts = build_parts(model, OPTIONS, program=graph)
    runner = Runner(parts)
    assert (runner.program, runner.cache, runner.blocks, runner.options) == (graph, parts.cache, parts.blocks, OPTIONS)
    for seq in runner.run(prompts(torch.Generator().manual_seed(0), [5, 13]), 8):
        ref = reference_logits(model, seq)
        assert seq.output == ref.argmax(dim=1).tolist()
        torch.testing.assert_close(torch.stack(seq.logits), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_parts_built_without_a_program_compile_one_and_keep_its_pass_results():
    model, _ = model_and_graph("short")
    parts = build_parts(model, block_size=4, num_blocks=4)
    assert isinstance(parts, RunnerParts)
    assert {r.name: r.num_matches for r in parts.pass_results}["insert_paged_cache"] == 1
    assert parts.blocks.num_free == parts.cache.num_blocks - 1 == 3  # block 0 is reserved
    assert parts.decode_graphs is None and parts.drafter is None and parts.mapping is None  # a CPU, no drafts, tp 1


@pytest.mark.parametrize("extra", [dict(options=OPTIONS), dict(keep_logits=False), dict(program=None)])
def test_a_runner_over_parts_takes_nothing_beside_them(extra):
    model, graph = model_and_graph("exact")
    parts = build_parts(model, OPTIONS, program=graph)
    with pytest.raises(InputError, match=r"Runner\(parts\): the parts carry their options and program"):
        Runner(parts, **extra)


def test_options_are_given_one_way_not_both():
    model, graph = model_and_graph("exact")
    with pytest.raises(InputError, match=r"Runner: give a RunnerOptions or its fields as keywords, not both "
                                         r"\(got \['block_size'\]\)"):
        Runner(model, OPTIONS, program=graph, block_size=4)
    with pytest.raises(InputError, match="options: expected a RunnerOptions, got dict"):
        Runner(model, dict(block_size=4), program=graph)
