"""The router and the gate|up GEMMs in one launch of tasks (``moe._router_gate_up_kernel``) compiled for sm_90
without a GPU (Triton's bundled ptxas), launched as ``moe.add_rms_norm_moe_router_fp8`` launches it (its arguments
taken from the host code over meta tensors; the residual add and RMSNorm as its first tasks, the decode MoE layer's
launch) at one GLM-5 TP8 / EP8 rank's decode shapes: the router's 256 experts of 6144 features with its ids local to
the rank's 32 experts of 2048 intermediate features, top-8, the shared expert's TP8 slice (gate|up 512 x 6144), on
an H100's 132 SMs, W8A16 and W8A8, at 1, 8 and 16 tokens (and at 16 W8A8 as ``moe.moe_router_fp8`` launches it,
without the norm): no local-memory spills, the PDL wait first, the task queue's atomic, the routing's and the norm's
release signals and the spins on them, the routed ids and the normed rows read from L2, and at least two CTAs an
SM by registers (the gate|up launch's own bound: a launch of tasks holds every role's code, and the largest sets the
registers). Compiled as launched with PDL.

Registers a thread when written: 255 at 1 token W8A16 (the gate|up launch with the shared role alone took 252),
220 at 16 tokens W8A8, with the norm's tasks as without them (its rows a chunk of 1024 columns at a time: 8 values a
thread); none spilled; shared memory 72 KiB (W8A16) and 76 KiB (W8A8), the gate|up launch's own."""

import collections
import re

import pytest

triton = pytest.importorskip("triton")

from tests.kernels.sm90_reports import ptxas_report, report_each, reports_from_subprocess  # noqa: E402

H100_SMS = 132
HIDDEN, EXPERTS, LOCAL, INTER, SHARED_INTER, TOP_K = 6144, 256, 32, 2048, 2048 // 8, 8
# (tokens, act_quant, the norm's tasks): the decode MoE layer's launch, and at 16 tokens W8A8 the launch without them
VARIANTS = [(tokens, act_quant, True) for tokens in (1, 8, 16) for act_quant in (False, True)] + [(16, True, False)]
# (tokens, act_quant, the norm's tasks, WALK_CTAS_PER_SM): the expert walk (opt-in), at one and 16 tokens W8A16
WALK_VARIANTS = [(1, False, True, 2), (16, False, True, 2)]
_TYPES = {"bfloat16": "bf16", "float32": "fp32", "int32": "i32", "float8_e4m3fn": "fp8e4nv"}
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "launch_pdl")


def _launch_of_moe_router_fp8(tokens: int, act_quant: bool, norm: bool = True, walk: int = 0) -> tuple[tuple, dict]:
    """(positional arguments, keywords) of the fused launch, from the host code over meta tensors (no memory, no
    kernel run), the SMs an H100's: ``add_rms_norm_moe_router_fp8``'s (the residual add and norm its first tasks, the
    decode MoE layer's launch), or without ``norm`` ``moe_router_fp8``'s; ``walk``: WALK_CTAS_PER_SM."""
    import torch

    from fxglm5.lowering.triton import f32_linear, fp8_gemm, moe

    captured = []

    class Capture:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: captured.append((args, kwargs))

    def empty_fp8(*shape):
        return torch.empty(*shape, dtype=torch.float8_e4m3fn, device="meta")

    def scales(*shape):
        return torch.empty(*shape, dtype=torch.float32, device="meta")

    patches = [(moe, "_router_gate_up_kernel", Capture()), (moe, "_moe_gemm_kernel", Capture())]
    patches += [(module, "num_sms", lambda device: H100_SMS) for module in (moe, f32_linear, fp8_gemm)]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    for module, name, value in patches:
        setattr(module, name, value)
    try:
        x = torch.empty(tokens, HIDDEN, dtype=torch.bfloat16, device="meta")
        router = moe.Router(scales(EXPERTS, HIDDEN), scales(EXPERTS), TOP_K, 1, 1, True, 2.5,
                            torch.empty((), dtype=torch.int32, device="meta"), LOCAL)
        shared = moe.SharedExpert(empty_fp8(2 * SHARED_INTER, HIDDEN), scales(2 * SHARED_INTER // 128, HIDDEN // 128),
                                  empty_fp8(HIDDEN, SHARED_INTER), scales(HIDDEN // 128, SHARED_INTER // 128),
                                  act_quant, SHARED_INTER)
        assert moe.router_joins(x, router, LOCAL)
        experts = (empty_fp8(LOCAL, 2 * INTER, HIDDEN), scales(LOCAL, 2 * INTER // 128, 48),
                   empty_fp8(LOCAL, HIDDEN, INTER), scales(LOCAL, 48, INTER // 128), act_quant)
        config = {"WALK_CTAS_PER_SM": walk}
        if norm:
            nw = torch.empty(HIDDEN, dtype=torch.bfloat16, device="meta")
            moe.add_rms_norm_moe_router_fp8(x, torch.empty_like(x), nw, 1e-5, router, *experts, shared=shared,
                                            config=config)
        else:
            moe.moe_router_fp8(x, router, *experts, shared=shared, config=config)
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
    return captured[0]


def _compile(tokens: int, act_quant: bool, norm: bool = True, walk: int = 0):
    import inspect

    import torch
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fxglm5.lowering.triton import moe

    args, kwargs = _launch_of_moe_router_fp8(tokens, act_quant, norm, walk)
    walkers = kwargs.pop("walkers")  # a run-time argument given by keyword
    names = list(inspect.signature(moe._router_gate_up_kernel.fn).parameters)
    sig, const, aligned = {}, {}, []
    for name, value in zip(names, args):
        if isinstance(value, torch.Tensor):
            sig[name] = "*" + _TYPES[str(value.dtype).removeprefix("torch.")]
            aligned.append(name)
        elif isinstance(value, float):
            sig[name] = "fp32"
        elif value == 1:  # the JIT specializes an integer 1 to a constant
            sig[name], const[name] = "constexpr", 1
        else:
            sig[name] = "i32"
            if value % 16 == 0:
                aligned.append(name)
    const.update({name: value for name, value in kwargs.items() if name not in _LAUNCH_OPTIONS}, PDL=True)
    sig.update({name: "constexpr" for name in kwargs if name not in _LAUNCH_OPTIONS})
    if walkers == 1:  # the JIT's constant 1 (no walk)
        sig["walkers"], const["walkers"] = "constexpr", 1
    else:
        sig["walkers"] = "i32"
    sig = {name: sig[name] for name in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    kernel = triton.compile(ASTSource(moe._router_gate_up_kernel, sig, const, attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": kwargs["num_warps"], "num_stages": kwargs["num_stages"]})
    return dict(ptxas_report(kernel), split1=kwargs["SPLIT_K"], router_split=kwargs["R_SPLIT"],
                shared_role=kwargs["SHARED"], norm_role=kwargs["NORM"], walk=kwargs["WALK"], walkers=walkers)


def _reports_of_every_variant() -> dict[str, dict]:
    return report_each(VARIANTS + WALK_VARIANTS, _compile)


@pytest.fixture(scope="module")
def reports():
    return reports_from_subprocess("tests.kernels.test_moe_router_gate_up_compile")


def _ids(variant):
    return f"{variant[0]}tok_{'w8a8' if variant[1] else 'w8a16'}{'' if variant[2] else '_no_norm'}"


@pytest.mark.parametrize("variant", VARIANTS, ids=_ids)
def test_the_router_and_gate_up_launch_compiles_for_hopper_without_spills(reports, variant):
    r = reports[repr(variant)]
    assert "error" not in r, r.get("error")
    assert r["split1"] > 1 and r["router_split"] > 1 and r["shared_role"]  # every role and fix-up compiled in
    assert r["norm_role"] == variant[2]
    assert re.search(r"\b0 bytes spill stores, 0 bytes spill loads", r["ptxas"]), r["ptxas"]
    registers = int(re.search(r"Used (\d+) registers", r["ptxas"]).group(1))
    assert registers * 128 * 2 <= 65536, r["ptxas"]  # 4 warps: two CTAs an SM
    assert r["shared"] * 2 <= 227 * 1024  # and by shared memory (an H100's 227 KiB a CTA can use)
    ptx = r["ptx"]
    assert "griddepcontrol.wait" in ptx
    assert ptx.index("griddepcontrol.wait") < ptx.index("atom.global")  # the wait before the queue's atomic
    assert re.search(r"atom\.global\.gpu\.release\.add", ptx), "the routing's signal"
    assert re.search(r"ld\.global\.gpu\.acquire", ptx), "the routed tiles' spin (an add of 0: an acquire load)"
    assert re.search(r"ld\.global\.cg", ptx), "the ids read from L2"
    if variant[2]:  # the router's and the shared tiles' spins on the norm too, and the norm's release signal
        assert len(re.findall(r"ld\.global\.gpu\.acquire", ptx)) == 3
        assert len(re.findall(r"atom\.global\.gpu\.release\.add", ptx)) == 2


def test_the_normed_rows_are_read_from_l2(reports):
    """With the norm's tasks every load of the normed rows (the router's GEMV, the shared and the routed A tiles) is a
    .cg load: the launch without them at the same shapes loads the same rows as plain loads (L1 may hold a line older
    than another SM's store): the norm's launch has 4 .cg load sites more at 16 tokens W8A8 (the shared and the routed A
    tiles', the router GEMV's first K step's and its loop's)."""
    def loads(variant):
        return collections.Counter(re.findall(r"ld\.global((?:\.cg)?)\.(?:v\d\.)?b32", reports[repr(variant)]["ptx"]))

    fused, alone = loads((16, True, True)), loads((16, True, False))
    assert fused[".cg"] - alone[".cg"] == 4


@pytest.mark.parametrize("variant", WALK_VARIANTS, ids=lambda v: f"{v[0]}tok_walk{v[3]}")
def test_the_expert_walk_compiles_for_hopper_without_spills(reports, variant):
    """The expert walk (WALK_CTAS_PER_SM 2: 264 walkers on an H100, or a walker a block and column tile where more:
    512 at 16 tokens) compiles, its routed role the walk's (a run-time K split, packed partials) and the shared CTAs'
    without a second copy of the routed body (SHARED_ONLY; with it the launch spilled 8 bytes): no spills, two CTAs
    an SM by registers and by shared memory, the routing's spin still before the ids are read."""
    r = reports[repr(variant)]
    assert "error" not in r, r.get("error")
    assert r["walk"] and r["walkers"] == max(2 * H100_SMS, min(LOCAL, variant[0] * TOP_K) * (INTER // 128))
    assert re.search(r"\b0 bytes spill stores, 0 bytes spill loads", r["ptxas"]), r["ptxas"]
    registers = int(re.search(r"Used (\d+) registers", r["ptxas"]).group(1))
    assert registers * 128 * 2 <= 65536, r["ptxas"]
    assert r["shared"] * 2 <= 227 * 1024
    assert re.search(r"ld\.global\.gpu\.acquire", r["ptx"]) and re.search(r"ld\.global\.cg", r["ptx"])
