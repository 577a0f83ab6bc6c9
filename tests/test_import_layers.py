"""Imports flow one way: every fxglm5 module's imports (module level and inside functions, read with ``ast``)
form no cycle and never reach a higher layer than the module's own.

The layers, lowest first. A module may import its own layer and the layers below it. The order is the
dependency order of the compiler's data flow (model -> capture -> passes -> lowering -> runtime -> front
doors) with what each step needs placed under it: the passes emit the ops and the ``lower`` pass asks the
lowering registry, so ``kernels`` (the torch references and Triton kernels, plain functions), ``lowering`` (the
backend table and choice, which names the ops by name and imports none of them), ``ops`` (the op schemas, whose
default implementations are those references) and ``program`` (the paged program's signature, which the cache
stage records, and the one way to run a compiled step) sit below ``passes``. ``compiler`` (capture + the declared
stages, the one compile of every caller) sits between the passes and the runtime that runs its programs.
``base`` holds the shared contracts, settings and error types.

Above the compiler, nothing reaches past it: the runtime and the front doors never import ``fxglm5.passes`` (the
compiler re-exports the stage and pass names they need) nor the kernels' torch references
(``fxglm5.lowering.reference``: what validates a step, and its switch, is the lowering's business).

At the root of tests/: it checks the whole fxglm5 package, no one folder of it.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "fxglm5"

LAYERS = [
    ("base", ["fxglm5.errors", "fxglm5.contracts", "fxglm5.settings", "fxglm5.parallel"]),
    ("model", ["fxglm5.model"]),
    ("capture", ["fxglm5.capture"]),
    ("kernels", ["fxglm5.lowering.reference", "fxglm5.lowering.triton"]),
    ("lowering", ["fxglm5.lowering"]),
    ("ops", ["fxglm5.ops"]),
    ("program", ["fxglm5.program"]),
    ("passes", ["fxglm5.passes"]),
    ("compiler", ["fxglm5.compiler"]),
    ("runtime", ["fxglm5.runtime"]),
    ("front doors", ["fxglm5", "fxglm5.cli", "fxglm5.backend", "fxglm5.artifact", "fxglm5.artifact_format",
                     "fxglm5.serve", "fxglm5.rtpllm"]),
]


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _imported(name: str, path: pathlib.Path, node, mods) -> list[str]:
    """The fxglm5 modules one import statement names (``from pkg import mod`` names ``pkg.mod``)."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
            base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
        targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base for alias in node.names]
    out = []
    for target in targets:
        while target not in mods and "." in target:
            target = target.rsplit(".", 1)[0]
        if target in mods and target.split(".")[0] == "fxglm5":
            out.append(target)
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the fxglm5 modules it imports anywhere in its body. Importing one's own ancestor package is
    left out: Python runs every ancestor's ``__init__`` before the module anyway, so it adds no dependency."""
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                deps.update(_imported(name, path, node, mods))
        graph[name] = {d for d in deps if d != name and not name.startswith(d + ".")}
    return graph


def layer_of(module: str) -> int:
    """Index in LAYERS of the longest declared prefix of ``module``."""
    best, index = "", None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > len(best):
                best, index = prefix, i
    if index is None:
        raise AssertionError(f"{module}: in no layer of LAYERS; add it to the one it belongs to")
    return index


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_no_import_reaches_a_higher_layer():
    upward = [f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
              for a, deps in sorted(import_graph().items()) for b in sorted(deps) if layer_of(b) > layer_of(a)]
    assert upward == []


ABOVE_THE_COMPILER = ("runtime", "front doors")
BEHIND_THE_COMPILER = ("fxglm5.passes", "fxglm5.lowering.reference")


def test_runtime_and_front_doors_never_reach_past_the_compiler():
    above = {i for i, (name, _) in enumerate(LAYERS) if name in ABOVE_THE_COMPILER}
    reached = [f"{a} imports {b}" for a, deps in sorted(import_graph().items()) if layer_of(a) in above
               for b in sorted(deps) if any(b == p or b.startswith(p + ".") for p in BEHIND_THE_COMPILER)]
    assert reached == []


def test_the_checks_see_function_level_imports_and_cycles(tmp_path):
    """The graph includes imports inside functions, and a cycle through one is found."""
    graph = import_graph()
    assert "fxglm5.model.generate" in graph["fxglm5.cli"]  # imported inside cli's _generate only
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    with pytest.raises(AssertionError, match="in no layer"):
        layer_of("elsewhere.module")
