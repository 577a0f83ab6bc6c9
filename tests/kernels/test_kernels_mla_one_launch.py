"""The split-KV MLA and its combine with W_UV in one launch of tasks (issue 45, item 5: ``mla._mla_project_kernel``),
interpreted: the value heads of the two launches (``_mla_fwd_kernel`` then ``_mla_combine_project_kernel``) bit for bit,
dense and sparse, float32 and bf16, compute-dtype and FP8 caches, one split to many, one token to 16 (one token a
combine tile, and a tile of 16); the choice made per call (up to 16 tokens with W_UV); the dependencies each combine
task waits on; and the task counters back at zero after every launch. Under the interpreter the programs run in
program-id order, so every wait finds its producers done (the GPU's interleavings, and the Gluon Hopper kernel of the
same launch: tests/gpu/test_gpu_attention.py)."""

import os

import torch

if not torch.cuda.is_available():  # CPU CI: interpret; set before triton is imported in this process
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("CPU-tensor kernel tests run interpreted (TRITON_INTERPRET=1)", allow_module_level=True)

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from fxglm5.lowering.reference import paged as ref  # noqa: E402
from fxglm5.lowering.triton import mla, tasks  # noqa: E402

pytestmark = pytest.mark.usefixtures("all_decode_joins")  # the joined kernels (an opt-in, settings.DECODE_JOINS)

SCALE = 1.0 / 16
CPU = torch.device("cpu")


def _step(T, qdtype, fp8, seed, heads=2, V=72, RA=48):
    """Two requests' latent rows (150 and 40 positions, 16-row blocks; block tables 130 blocks wide, as a graph's
    width bucket: dense attention reaches 33 splits of 64) in a compute-dtype (float32) or FP8 ds_mla cache, T
    decode tokens spread over their positions, top-k lists of 140 (up to 3 splits; a quarter unused, token 1's all
    unused), W_UV [heads, V, RA of the 512 latent columns]: widths that are no powers of two, V over two or three
    tiles of outputs, so every mask and index of the combine is exercised."""
    g = torch.Generator().manual_seed(seed)
    bs, lens = 16, [150, 40]
    bt = torch.zeros(2, 130, dtype=torch.int32)
    bt[0, :10] = torch.tensor([3, 1, 4, 6, 9, 2, 5, 8, 7, 10])
    bt[1, :3] = torch.tensor([11, 13, 12])
    cache = torch.zeros(14, bs, 656, dtype=torch.uint8) if fp8 else torch.zeros(14, bs, 576)
    for b, n in enumerate(lens):
        p = torch.arange(n)
        ref.write_latent_cache(cache, torch.randn(n, 512, generator=g), torch.randn(n, 64, generator=g),
                               ref.slots_from_positions(bt, torch.full_like(p, b), p, bs))
    req = (torch.arange(T) % 2).int()
    pos = (torch.rand(T, generator=g) * torch.tensor(lens)[req.long()]).int()
    topk = (torch.rand(T, 140, generator=g) * (pos.unsqueeze(1) + 1)).int()
    topk[torch.rand(T, 140, generator=g) < 0.25] = -1
    topk[min(1, T - 1)] = -1
    q = torch.randn(T, heads, 576, generator=g).to(qdtype)
    w_uv = (torch.randn(heads, V, RA, generator=g) * RA**-0.5).to(qdtype)
    return cache, bt, req, pos, topk, q, w_uv


def _launched(monkeypatch):
    """The names of the kernels launched from now on."""
    seen, launch = [], InterpretedFunction.run
    monkeypatch.setattr(InterpretedFunction, "run", lambda self, *a, **k: seen.append(self.fn.__name__) or
                        launch(self, *a, **k))
    return seen


@pytest.mark.parametrize("T, num_splits", [(1, 1), (1, 5), (2, 3), (5, 40), (16, 1), (16, 4), (16, 40)],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("qdtype, fp8", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)],
                         ids=["f32", "bf16", "bf16-fp8cache"])
@pytest.mark.parametrize("sparse", [False, True], ids=["mla", "sparse_mla"])
def test_one_launch_gives_the_two_launches_bits(T, num_splits, qdtype, fp8, sparse, monkeypatch):
    """Up to 16 tokens with W_UV, ``launch_mla`` is one launch whose value heads are the two launches' bit for bit
    (one token a combine tile below 16 tokens, a 16-token tile at 16 and up to 32 splits, one token a tile again past
    them), within a rounding of the reference op; a token with no listed position gives zeros; the counters are
    back at zero."""
    cache, bt, req, pos, topk, q, w_uv = _step(T, qdtype, fp8, seed=T * 100 + num_splits)
    keys = topk if sparse else pos
    launched = _launched(monkeypatch)
    two = mla.launch_mla(q, cache, bt, req, keys, SCALE, sparse=sparse, num_splits=num_splits, w_uv=w_uv, fuse=False)
    assert launched == ["_mla_fwd_kernel", "_mla_combine_project_kernel"] and not mla._LAST["fused"]
    launched.clear()
    one = mla.launch_mla(q, cache, bt, req, keys, SCALE, sparse=sparse, num_splits=num_splits, w_uv=w_uv)
    assert launched == ["_mla_project_kernel"] and mla._LAST["fused"]
    assert one.shape == (T, 2, 72) and one.dtype == qdtype
    assert torch.equal(one, two)
    assert not tasks.counters(CPU, mla.FUSE_MAX_TOKENS).any()
    attend = ref.sparse_mla_paged if sparse else ref.mla_paged
    want = attend(q, cache, bt, req, keys, SCALE, w_uv=w_uv)
    tol = 1e-4 if qdtype == torch.float32 else 2e-2
    torch.testing.assert_close(one.float(), want.float(), atol=tol * max(1.0, want.abs().max().item()), rtol=0)
    if sparse and T > 1:
        assert (one[1] == 0).all()


def test_the_choice_is_made_per_call(monkeypatch):
    """One launch up to FUSE_MAX_TOKENS (16) tokens with W_UV; two past them, and the MLA's own combine without
    W_UV; through the op's dispatcher, one launch on its split-KV (decode) path, and the prefill path's one pass and
    einsum from 2 x SMs tokens (8 on CPU) as before; ``fuse=True`` where it cannot apply is an error."""
    from fxglm5.lowering.triton import sparse_mla

    assert mla.FUSE_MAX_TOKENS == 16
    w = torch.zeros(1)
    assert mla.project_fuses(1, w) and mla.project_fuses(16, w)
    assert not mla.project_fuses(17, w) and not mla.project_fuses(0, w) and not mla.project_fuses(4, None)
    launched = _launched(monkeypatch)
    for T, want in ((16, ["_mla_project_kernel"]), (17, ["_mla_fwd_kernel", "_mla_combine_project_kernel"])):
        cache, bt, req, pos, topk, q, w_uv = _step(T, torch.float32, True, seed=T)
        launched.clear()
        mla.launch_mla(q, cache, bt, req, topk, SCALE, sparse=True, w_uv=w_uv)
        assert launched == want, T
    for T, want in ((4, ["_mla_project_kernel"]), (8, ["_mla_fwd_kernel"])):
        assert (mla.dispatch_num_splits(q[:T]) is None) == (T == 4)
        launched.clear()
        sparse_mla.sparse_mla_paged(q[:T], cache, bt, req[:T], topk[:T], SCALE, w_uv=w_uv)
        assert launched == want, T
    launched.clear()
    mla.launch_mla(q[:4], cache, bt, req[:4], pos[:4], SCALE, sparse=False, num_splits=3)
    assert launched == ["_mla_fwd_kernel", "_mla_combine_kernel"]
    with pytest.raises(ValueError, match="at most 16 tokens"):
        mla.launch_mla(q, cache, bt, req, pos, SCALE, sparse=False, w_uv=w_uv, fuse=True)
    with pytest.raises(ValueError, match="needs W_UV"):
        mla.launch_mla(q[:4], cache, bt, req[:4], pos[:4], SCALE, sparse=False, fuse=True)


@pytest.mark.parametrize("T, num_splits, tile", [(5, 3, 1), (16, 3, 16), (16, 40, 1)])
def test_each_combine_task_waits_for_every_split_of_its_tokens(T, num_splits, tile, monkeypatch):
    """The dependencies, recorded: every split task signals its token tile's counter (dependency t // BT), and every
    combine task waits on its own tile's counter for all of that tile's splits (tokens x head blocks x splits),
    which, with the programs in id order, have all signalled by then: the count it waits for is the count there.
    The waits' and signals' own code runs as recorded (a wait whose count is not there is recorded, not spun)."""
    cache, bt, req, pos, topk, q, w_uv = _step(T, torch.float32, False, seed=7)
    counters = tasks.counters(CPU, mla.FUSE_MAX_TOKENS)
    waits, signals = [], []
    wait, signal = tasks.wait, tasks.signal

    def value(x):
        return int(x.handle.data.reshape(-1)[0]) if hasattr(x, "handle") else int(x)

    def recorded_wait(ptr, dep, count):
        dep, count = value(dep), value(count)
        waits.append((dep, count, int(counters[tasks.DEPS.value + dep])))
        if waits[-1][2] >= count:  # else the spin would not end here: the record fails the test instead
            wait(ptr, dep, count)

    def recorded_signal(ptr, dep):
        signals.append(value(dep))
        return signal(ptr, dep)

    monkeypatch.setattr(tasks, "wait", recorded_wait)
    monkeypatch.setattr(tasks, "signal", recorded_signal)
    mla.launch_mla(q, cache, bt, req, pos, SCALE, sparse=False, num_splits=num_splits, w_uv=w_uv)
    keys = bt.shape[1] * 16
    num_splits = triton.cdiv(keys, triton.cdiv(triton.cdiv(keys, num_splits), 64) * 64)  # the launch's, of 64 keys
    S_PAD, BT, BV, BK = mla.project_tiles(T, num_splits, w_uv.shape[2])
    assert BT == tile
    tiles = triton.cdiv(T, BT)
    assert signals == [t // BT for t in range(T) for _ in range(num_splits)]  # one head block (2 heads)
    per_tile = [(min(BT, T - i * BT) * num_splits) for i in range(tiles)]
    tasks_per_tile = 2 * triton.cdiv(72, BV)  # heads x V tiles
    assert waits == [(i, per_tile[i], per_tile[i]) for i in range(tiles) for _ in range(tasks_per_tile)]
    assert not counters.any()
