"""A compiled paged step is run only through its ``fxglm5.program.PagedProgram``, which owns the positional
convention (``input_ids, positions, [hidden], slot_mapping, block_table, req_idx, logits_indices, *caches``):

- statically: no module of the package, the benches or the tests spells that convention in a call outside
  ``fxglm5/program.py`` (read with ``ast``: a call that passes ``slot_mapping, block_table, req_idx,
  logits_indices`` positionally, in that order; the cached ops take the first two among other arguments; this
  file's own direct call, which shows the refusal, aside);
- at run time: a program's graph called directly raises, naming the program (a forward pre-hook), so a new caller
  that reaches around the program fails its first test: before the program's first call, after it, and after a
  program call that raised inside the graph;
- a graph whose inputs are not the ones its paged signature declares is refused when it is made a program.
  (The MTP program's required ``hidden``: tests/frontdoors/test_mtp_compile.py.)
"""

import ast
import pathlib
import textwrap

import pytest
import torch

from fxglm5.errors import InputError
from fxglm5.program import StepInputs
from tests.paged_helpers import runner

REPO = pathlib.Path(__file__).resolve().parents[1]
OWNER = REPO / "fxglm5" / "program.py"
CONVENTION = ("slot_mapping", "block_table", "req_idx", "logits_indices")
THIS = pathlib.Path(__file__).resolve()  # its last test calls a graph directly, to see it refused


def _name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def spelled_conventions(source: str) -> list[int]:
    """The lines of calls that pass the step's four tensors positionally, in the graph's order."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and _name(node.func) != "StepInputs":  # (the program's own input record)
            names = [_name(arg) for arg in node.args]
            if any(tuple(names[i:i + 4]) == CONVENTION for i in range(len(names))):
                lines.append(node.lineno)
    return lines


def _python_files():
    for folder in ("fxglm5", "bench", "tests"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if "results" not in path.parts and path not in (OWNER, THIS):
                yield path


def test_the_detector_sees_a_spelled_convention():
    planted = textwrap.dedent("""
        def step(graph, ids, ctx, caches):
            return graph(ids[None], ctx.positions[None], ctx.slot_mapping, ctx.block_table, ctx.req_idx,
                         ctx.logits_indices, *caches)
    """)
    assert spelled_conventions(planted) == [3]
    assert spelled_conventions("program(step, ids, caches)\nf(slot_mapping=s, block_table=b)\n"
                               "op(k, slot_mapping, block_table, positions)\n") == []
    assert spelled_conventions(OWNER.read_text())  # the one place it is spelled


def test_no_module_outside_the_program_spells_the_convention():
    offenders = {str(p.relative_to(REPO)): lines for p in _python_files()
                 if (lines := spelled_conventions(p.read_text()))}
    assert not offenders, f"call the compiled step through fxglm5.program.PagedProgram: {offenders}"


def test_a_programs_graph_refuses_a_direct_call():
    r = runner("short", block_size=4, num_blocks=12)
    T = 3
    step = StepInputs(torch.arange(T), torch.arange(T) + 4, torch.tensor([[1, 2]]), torch.zeros(T, dtype=torch.long),
                      torch.arange(T))
    ids = torch.tensor([2, 7, 1])
    with pytest.raises(InputError, match="PagedProgram"):
        r.program.graph(ids[None], step.positions[None], step.slot_mapping, step.block_table, step.req_idx,
                        step.logits_indices, *r.cache.graph_inputs())
    out = r.program(step, ids, r.cache.graph_inputs())  # the same step through the program runs
    assert out.logits.shape == (T, r.config.vocab_size)
    with pytest.raises(InputError, match="PagedProgram"):  # the program's call let it through once, not for good
        r.program.graph(ids[None], step.positions[None], step.slot_mapping, step.block_table, step.req_idx,
                        step.logits_indices, *r.cache.graph_inputs())
    with pytest.raises(IndexError):  # a token id past the vocabulary: the embedding raises inside the graph
        r.program(step, torch.tensor([2, 7, 10 ** 6]), r.cache.graph_inputs())
    with pytest.raises(InputError, match="PagedProgram"):  # and after a call that raised inside the graph
        r.program.graph(ids[None], step.positions[None], step.slot_mapping, step.block_table, step.req_idx,
                        step.logits_indices, *r.cache.graph_inputs())


def test_a_graph_with_other_inputs_than_its_signature_is_refused():
    from fxglm5.program import PagedProgram
    from tests.parallel.ranks import graph_copy as graph_module_copy

    r = runner("short", block_size=4, num_blocks=12)
    declared = list(r.program.signature.inputs)
    extra = graph_module_copy(r.program.graph)
    last = list(extra.graph.find_nodes(op="placeholder"))[-1]
    with extra.graph.inserting_after(last):
        extra.graph.placeholder("stray")
    extra.recompile()
    with pytest.raises(InputError, match=rf"graph: {len(declared) + 1} inputs, its paged signature declares "
                                         rf"\['input_ids', 'position_ids'"):
        PagedProgram(extra, inputs_validated=False)
    fewer = graph_module_copy(r.program.graph)
    stray = list(fewer.graph.find_nodes(op="placeholder"))[-1]  # the last cache, read by its layer's ops
    stray.replace_all_uses_with(list(fewer.graph.find_nodes(op="placeholder"))[-2])
    fewer.graph.erase_node(stray)
    fewer.recompile()
    with pytest.raises(InputError, match=rf"graph: {len(declared) - 1} inputs, its paged signature declares"):
        PagedProgram(fewer, inputs_validated=False)
    assert PagedProgram(graph_module_copy(r.program.graph), inputs_validated=False).inputs == tuple(declared)
