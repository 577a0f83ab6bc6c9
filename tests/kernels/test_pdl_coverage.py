"""Every kernel the decode chain launches takes part in programmatic dependent launch (issue 45, item 3): one that
does not breaks the overlap on both its sides, and one launched with ``launch_pdl`` that touches memory or returns
before its wait races the kernel before it.

Read from the sources of every module of :mod:`fxglm5.lowering.triton` (no GPU needed): each launch
``kernel[grid](...)`` passes ``**pdl(device)``, and each launched kernel declares a ``PDL`` constexpr and calls
``pdl_prologue(PDL)`` (``gluon_pdl_prologue`` in Gluon) as its first statement, so no load, store or early
``return`` comes before the wait. The exemptions below name each kernel and say why; a stale one fails. Whether the
prologue does what it says is tested where it compiles (tests/kernels/test_mla_hopper_compile.py: the wait precedes
the first memory access) and runs (tests/gpu/test_gpu_pdl.py).
"""

import ast
import importlib
import importlib.util
import inspect
import pkgutil
import textwrap

import pytest
import torch

triton = pytest.importorskip("triton")

from triton.runtime.autotuner import Autotuner  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import fxglm5.lowering.triton as package  # noqa: E402
from fxglm5.lowering.triton import device  # noqa: E402

_PREFILL_GEMM = "prefill only: fp8_gemm_hopper.supported takes more than MIN_M (512) rows"
_PREFILL_TILE = ("prefill only (sparse_mla_tile.tile_applies: at least a tile of tokens per request), and launched "
                 "between torch's zero_ / argsort / sum, which take no part in PDL either")
# launched kernels that do without PDL, by "module.kernel"
EXEMPT = {
    "fp8_gemm_hopper._fp8_gemm_hopper_kernel": _PREFILL_GEMM,
    "fp8_gemm_hopper._fp8_gemm_hopper_ws_kernel": _PREFILL_GEMM,
    "sparse_mla_tile._count_listed": _PREFILL_TILE,
    "sparse_mla_tile._tile_kernel": _PREFILL_TILE,
    "sparse_mla_tile_hopper._tile_hopper_kernel": _PREFILL_TILE + " (the Gluon form of _tile_kernel on Hopper)",
}
# kernels with statements before the prologue: none may return, store or take part in an atomic
_FIRST_WEIGHTS = "requests its first weight tile (constants no kernel writes) before the wait"
BEFORE_PROLOGUE = {
    "fp8_gemv._gemv_kernel": _FIRST_WEIGHTS,
    "f32_linear._f32_gemv_kernel": _FIRST_WEIGHTS,
    "moe._router_kernel": _FIRST_WEIGHTS,
    "paged_cache._norm_write_caches_kernel": _FIRST_WEIGHTS + " (its head-weight programs; the others request none)",
}
PROLOGUES = ("pdl_prologue", "gluon_pdl_prologue")
_KERNEL_TYPES = (JITFunction, InterpretedFunction, Autotuner)


def _python_function(kernel):
    """The Python function under a JIT / interpreted / Gluon kernel or an autotuner of one."""
    while not inspect.isfunction(kernel):
        kernel = kernel.fn
    return kernel


def _name(kernel) -> str:
    fn = _python_function(kernel)
    return f"{fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__}"


def _kernels_named(expr, namespace, assigned, seen=()) -> list:
    """The kernels ``expr`` (a launch's ``kernel`` in ``kernel[grid](...)``) can be: module-level kernels named in
    it, or in what the enclosing function assigned to a local it names (``tuner = a_tuned if c else b_tuned``)."""
    found = []
    for node in ast.walk(expr):
        if not isinstance(node, ast.Name) or node.id in seen:
            continue
        if isinstance(namespace.get(node.id), _KERNEL_TYPES):
            found.append(namespace[node.id])
        for value in assigned.get(node.id, ()):
            found += _kernels_named(value, namespace, assigned, (*seen, node.id))
    return found


def _launches(module):
    """(line, call node, kernels it may launch) for every ``kernel[grid](...)`` in the module: each call read in the
    outermost function holding it (whose locals include its nested functions'), then any left at module level."""
    tree = ast.parse(inspect.getsource(module))
    namespace = vars(module)
    functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    seen = set()
    for scope in [*functions, tree]:
        assigned: dict[str, list] = {}
        if scope is not tree:
            for node in ast.walk(scope):
                if isinstance(node, ast.Assign):
                    for target in node.targets:
                        if isinstance(target, ast.Name):
                            assigned.setdefault(target.id, []).append(node.value)
        for node in ast.walk(scope):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript) and id(node) not in seen:
                seen.add(id(node))
                yield node.lineno, node, _kernels_named(node.func.value, namespace, assigned)


def _passes_pdl(call) -> bool:
    """Whether a launch spreads ``pdl(...)``'s keywords (``**pdl(x.device)``)."""
    return any(kw.arg is None and isinstance(kw.value, ast.Call) and getattr(kw.value.func, "id", None) == "pdl"
               for kw in call.keywords)


def _is_prologue(stmt) -> bool:
    """Whether a statement is ``pdl_prologue(PDL)`` / ``gluon_pdl_prologue(PDL)`` (the kernel's own flag)."""
    call = stmt.value if isinstance(stmt, ast.Expr) else None
    return (isinstance(call, ast.Call) and getattr(call.func, "id", None) in PROLOGUES and len(call.args) == 1
            and getattr(call.args[0], "id", None) == "PDL")


def _touches_memory_or_returns(stmts) -> bool:
    """Whether the statements return or call a store or an atomic directly (what no statement before the wait may
    do; a helper's own loads are the exemption's reason to vouch for)."""
    for node in (n for s in stmts for n in ast.walk(s)):
        if isinstance(node, ast.Return):
            return True
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "").startswith(("store", "atomic_")):
            return True
    return False


def _definition_violations(kernel, before_prologue) -> list[str]:
    """Where a kernel's definition breaks the rules: a ``PDL`` constexpr, the prologue first (or after statements
    that only load what no kernel writes, for the kernels of ``before_prologue``)."""
    name = _name(kernel)
    fn = ast.parse(textwrap.dedent(inspect.getsource(_python_function(kernel)))).body[0]
    params = {a.arg: a.annotation for a in fn.args.args}
    if "PDL" not in params or getattr(params["PDL"], "attr", None) != "constexpr":
        return [f"{name}: no PDL constexpr argument"]
    body = fn.body[1:] if ast.get_docstring(fn) is not None else fn.body
    at = next((i for i, stmt in enumerate(body) if _is_prologue(stmt)), None)
    if at is None:
        return [f"{name}: no pdl_prologue(PDL) among its top-level statements"]
    if at > 0 and name not in before_prologue:
        return [f"{name}: {at} statement(s) before pdl_prologue(PDL)"]
    if _touches_memory_or_returns(body[:at]):
        return [f"{name}: a store, atomic or return before pdl_prologue(PDL)"]
    return []


def pdl_violations(module, exempt=(), before_prologue=()) -> tuple[list[str], set[str]]:
    """(the rules a module breaks, the names of the kernels it launches)."""
    problems, launched, checked = [], set(), set()
    for line, call, kernels in _launches(module):
        if not kernels:
            problems.append(f"{module.__name__}:{line}: a launch whose kernel this test cannot name")
        for name, kernel in {_name(k): k for k in kernels}.items():  # two autotuners of one kernel: one kernel
            launched.add(name)
            if name in exempt:
                continue
            if not _passes_pdl(call):
                problems.append(f"{module.__name__}:{line}: {name} launched without **pdl(device)")
            if name not in checked:
                checked.add(name)
                problems += _definition_violations(kernel, before_prologue)
    return problems, launched


def _modules():
    return [importlib.import_module(f"{package.__name__}.{m.name}") for m in pkgutil.iter_modules(package.__path__)]


def test_every_launched_kernel_takes_part_in_pdl():
    problems, launched = [], set()
    for module in _modules():
        p, names = pdl_violations(module, EXEMPT, BEFORE_PROLOGUE)
        problems += p
        launched |= names
    assert not problems, "\n".join(problems)
    # the decode chain's kernels are among those seen, so a launch the scan stopped finding would show here
    for name in ("indexer._indexer_logits_kernel", "indexer._indexer_topk_kernel", "topk._segment_topk_kernel",
                 "topk._radix_write_kernel",
                 "mla._mla_fwd_kernel", "mla._mla_combine_kernel", "mla._mla_combine_project_kernel",
                 "mla._mla_project_kernel", "mla_hopper._mla_hopper_kernel", "mla_hopper._mla_hopper_project_kernel",
                 "paged_cache._write_latent_fp8_kernel", "paged_cache._write_index_kernel",
                 "paged_cache._norm_write_caches_kernel",
                 "paged_cache._latent_query_kernel", "paged_cache._gemm_latent_query_kernel",
                 "fp8_gemm._quant_kernel", "moe._moe_gemm_kernel", "moe._router_gate_up_kernel",
                 "moe._router_kernel", "f32_linear._f32_gemv_kernel",
                 # the MoE layer's norm where it is not the first tasks of _router_gate_up_kernel (its own launch)
                 "norm_rope._add_rms_norm_kernel"):
        assert name in launched, name
    stale = (set(EXEMPT) | set(BEFORE_PROLOGUE)) - launched
    assert not stale, f"exemptions of kernels no module launches: {stale}"


PLANTED = '''
import triton
import triton.language as tl

from fxglm5.lowering.triton.device import pdl, pdl_prologue


@triton.jit
def _no_pdl_kernel(x_ptr):
    tl.store(x_ptr, 1)


@triton.jit
def _late_kernel(x_ptr, n, PDL: tl.constexpr):
    if n == 0:
        return
    pdl_prologue(PDL)
    tl.store(x_ptr, 1)


@triton.jit
def _good_kernel(x_ptr, PDL: tl.constexpr):
    """A docstring comes before the prologue."""
    pdl_prologue(PDL)
    tl.store(x_ptr, 1)


_good_tuned = triton.autotune(configs=[triton.Config({})], key=[])(_good_kernel)


def launch(x, tuned):
    _no_pdl_kernel[(1,)](x)
    _late_kernel[(1,)](x, 0, **pdl(x.device))
    _good_kernel[(1,)](x)
    kernel = _good_tuned if tuned else _good_kernel
    kernel[(1,)](x, **pdl(x.device))
'''


def test_a_kernel_outside_pdl_is_found(tmp_path):
    """A kernel without PDL, one that returns before its prologue, and a good kernel launched once without
    ``**pdl`` (and once, through a local name, with it) are each reported; the good kernel's definition is not."""
    path = tmp_path / "planted_kernels.py"
    path.write_text(PLANTED)
    spec = importlib.util.spec_from_file_location("planted_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    line = {text.strip(): i for i, text in enumerate(PLANTED.splitlines(), 1)}
    bare, unflagged = line["_no_pdl_kernel[(1,)](x)"], line["_good_kernel[(1,)](x)"]
    problems, launched = pdl_violations(module)
    assert launched == {"planted_kernels._no_pdl_kernel", "planted_kernels._late_kernel",
                        "planted_kernels._good_kernel"}
    assert sorted(problems) == sorted([
        f"planted_kernels:{bare}: planted_kernels._no_pdl_kernel launched without **pdl(device)",
        "planted_kernels._no_pdl_kernel: no PDL constexpr argument",
        "planted_kernels._late_kernel: 1 statement(s) before pdl_prologue(PDL)",
        f"planted_kernels:{unflagged}: planted_kernels._good_kernel launched without **pdl(device)",
    ])
    # exempting the bare kernel silences it alone; allowing statements before a prologue still refuses a return
    problems, _ = pdl_violations(module, exempt={"planted_kernels._no_pdl_kernel": "why"},
                                 before_prologue={"planted_kernels._late_kernel": "why"})
    assert sorted(problems) == sorted([
        "planted_kernels._late_kernel: a store, atomic or return before pdl_prologue(PDL)",
        f"planted_kernels:{unflagged}: planted_kernels._good_kernel launched without **pdl(device)",
    ])


def test_pdl_is_off_under_the_interpreter_and_off_the_gpu(monkeypatch):
    """The interpreter has no griddepcontrol and no launch attributes: PDL=False, no launch_pdl, flag or not."""
    monkeypatch.setenv("FXGLM5_PDL", "1")
    assert device.pdl(torch.device("cpu")) == {"PDL": False}
