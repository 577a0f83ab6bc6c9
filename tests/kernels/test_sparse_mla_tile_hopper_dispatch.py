"""Where ``sparse_mla_tile_paged`` takes the Gluon tile (``sparse_mla_tile_hopper``), on the CPU: ``supported`` on
inputs made to look like sm_90 CUDA tensors, the switch (FXGLM5_SPARSE_MLA_TILE_GLUON) and ``cfg={"kernel": ...}``;
and what the launcher hands the Gluon kernel: its launch replaced by a torch model of the kernel's contract (walk
the tile's marked 64-key blocks, gather the rows some token of the request lists, weigh each (token, key) by its
count), which must give the reference's output over several chunks, interleaved requests, a position listed twice
and a token with nothing listed. The kernel itself only runs on the GPU (tests/gpu/test_gpu_sparse_mla_tile.py)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from fxglm5.lowering.reference import paged as ref  # noqa: E402
from tests.helpers import latent_values  # noqa: E402

triton = pytest.importorskip("triton")

from fxglm5.lowering.triton import sparse_mla_tile as ttile  # noqa: E402
from fxglm5.lowering.triton import sparse_mla_tile_hopper as th  # noqa: E402

D, DR, BS, SCALE = 576, 64, 16, 1.0 / 16


class _OnCuda:
    """A CPU tensor that says it lives on a CUDA device (what ``supported`` reads of it)."""

    is_cuda = True
    device = torch.device("cuda", 0)

    def __init__(self, t):
        self._t = t

    def __getattr__(self, name):
        return getattr(self._t, name)


@pytest.fixture
def hopper(monkeypatch):
    """sm_90, not interpreting, the switch left at its default (on)."""
    monkeypatch.setattr(th, "capability", lambda device: (9, 0))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.delenv("FXGLM5_SPARSE_MLA_TILE_GLUON", raising=False)


def test_the_gluon_tile_is_the_default_and_0_switches_it_off(hopper, monkeypatch):
    """On by default since its GPU tests passed and it timed faster than the Triton tile (settings' docstring)."""
    q, cache = _inputs()
    assert th.supported(_OnCuda(q), _OnCuda(cache), 8, 8)
    monkeypatch.setenv("FXGLM5_SPARSE_MLA_TILE_GLUON", "0")
    assert not th.supported(_OnCuda(q), _OnCuda(cache), 8, 8)


def _inputs(cdtype=torch.bfloat16, qdtype=torch.bfloat16, heads=8, width=D):
    q = torch.zeros(16, heads, width, dtype=qdtype)
    cache = torch.zeros(4, 64, 656 if cdtype == torch.uint8 else D, dtype=cdtype)
    return q, cache


@pytest.mark.parametrize("cdtype", [torch.bfloat16, torch.uint8], ids=["bf16", "fp8"])
def test_supported_on_hopper_for_bf16_queries_and_both_caches(hopper, cdtype):
    q, cache = _inputs(cdtype)
    assert th.supported(_OnCuda(q), _OnCuda(cache), 8, 8)
    assert th.supported(_OnCuda(q[:, :4]), _OnCuda(cache), 16, 4)  # 16 tokens x 4 heads


def test_not_supported_elsewhere(hopper, monkeypatch):
    q, cache = _inputs()
    Q, C = _OnCuda(q), _OnCuda(cache)
    assert th.supported(Q, C, 8, 8)
    assert not th.supported(q, cache, 8, 8)  # CPU tensors
    assert not th.supported(_OnCuda(q.half()), C, 8, 8)  # fp16 queries
    assert not th.supported(_OnCuda(q.float()), C, 8, 8)  # fp32 queries
    assert not th.supported(_OnCuda(torch.zeros(16, 8, 512, dtype=torch.bfloat16)), C, 8, 8)  # not 576 columns
    assert not th.supported(Q, C, 4, 8)  # 32 MMA rows
    assert not th.supported(_OnCuda(torch.zeros(16, 64, D, dtype=torch.bfloat16)), C, 1, 64)  # one token a tile
    assert not th.supported(Q, _OnCuda(cache.half()), 8, 8)  # fp16 cache
    assert not th.supported(Q, _OnCuda(cache.transpose(0, 1)), 8, 8)  # not contiguous
    flat = torch.zeros(cache.numel() + 1, dtype=torch.bfloat16)
    assert not th.supported(Q, _OnCuda(flat[1:].view(cache.shape)), 8, 8)  # 2-byte aligned
    monkeypatch.setattr(th, "capability", lambda device: (10, 0))
    assert not th.supported(Q, C, 8, 8)  # Blackwell
    monkeypatch.setattr(th, "capability", lambda device: (9, 0))
    monkeypatch.setenv("FXGLM5_SPARSE_MLA_TILE_GLUON", "0")
    assert not th.supported(Q, C, 8, 8)  # switched off: the Triton tile
    monkeypatch.setenv("FXGLM5_SPARSE_MLA_TILE_GLUON", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not th.supported(Q, C, 8, 8)  # the interpreter runs no Gluon


def test_cfg_picks_the_kernel(hopper):
    q, cache = _inputs()
    Q, C = _OnCuda(q), _OnCuda(cache)
    assert ttile.uses_gluon(Q, C)
    assert ttile.uses_gluon(Q, C, {"kernel": "gluon"})
    assert not ttile.uses_gluon(Q, C, {"kernel": "triton"})
    assert not ttile.uses_gluon(Q, C, {"BLOCK_N": 32})  # Triton launch options: the Triton tile
    assert not ttile.uses_gluon(q, cache)
    with pytest.raises(ValueError, match="does not serve these inputs"):
        ttile.uses_gluon(q, cache, {"kernel": "gluon"})
    with pytest.raises(ValueError, match="no launch options"):
        ttile.uses_gluon(Q, C, {"kernel": "gluon", "BLOCK_N": 32})
    with pytest.raises(ValueError, match="neither"):
        ttile.uses_gluon(Q, C, {"kernel": "hopper"})


def _emulated_launch(calls, q, cache, block_table, req_idx, counts, count_stride, n_pos, blocks, n_key_blocks,
                     n_blocks, leads, out, T, scale_log2, block_q, heads):
    """What ``_tile_hopper_kernel`` computes from its arguments, program by program, in torch (float64)."""
    calls.append(dict(T=T, block_q=block_q, heads=heads, tiles=leads.shape[0]))
    assert counts.dtype == torch.int16 and blocks.shape == (leads.shape[0], n_key_blocks)
    flat = counts.reshape(-1).long() & 0xFFFF
    H = q.shape[1]
    for tile in range(leads.shape[0]):
        walk = blocks[tile, :int(n_blocks[tile])].long()
        # the walk: the tile's 64-key blocks some token of it lists, in block order
        tile_rows = flat.view(-1, count_stride)[tile * block_q:min(T, (tile + 1) * block_q), :n_pos]
        marked = tile_rows.any(0).nonzero().view(-1) // th.BLOCK_N
        assert walk.tolist() == sorted(set(marked.tolist())), (tile, walk.tolist())
        keys = (walk[:, None] * th.BLOCK_N + torch.arange(th.BLOCK_N)).view(-1)
        keys = keys[keys < n_pos]
        for lead in leads[tile].tolist():
            if lead >= T:
                continue
            req = int(req_idx[lead])
            toks = torch.arange(tile * block_q, min(T, (tile + 1) * block_q))
            toks = toks[req_idx[toks].long() == req]
            cnt = flat[toks[:, None] * count_stride + keys[None, :]].double()  # [tokens, keys]
            listed = cnt.sum(0) > 0  # the rows the gathers copy
            if not listed.any():  # nothing walked (or nothing listed): zeros
                out[toks, :H] = 0
                continue
            slots = block_table[req, keys[listed] // BS].long() * BS + keys[listed] % BS
            rows = ref.read_latent_rows(cache, slots).double()
            c = cnt[:, listed]
            s = torch.einsum("thd,kd->thk", q[toks].double(), rows) * scale_log2 + torch.log2(c)[:, None, :]
            m = s.amax(-1, keepdim=True).nan_to_num(neginf=0.0)
            p = torch.exp2(s - m)
            l_sum = p.sum(-1, keepdim=True)
            o = torch.einsum("thk,kd->thd", p, rows[:, :512]) / torch.where(l_sum > 0, l_sum, 1.0)
            out[toks, :H] = o.to(out.dtype)


def _case(cdtype, g):
    """Three requests' prefills in one flat batch, their tokens shuffled (tiles hold several requests), over 16-row
    cache blocks whose unwritten rows hold NaN bytes; top-k 24 of each causal prefix, a quarter dropped to -1."""
    lens, prefill = (300, 90, 200), ((200, 300), (0, 90), (150, 200))
    need = [-(-n // BS) for n in lens]
    nb = sum(need) + 2
    perm = torch.randperm(nb - 1, generator=g) + 1
    bt = torch.zeros(len(lens), max(need) + 1, dtype=torch.int32)
    i = 0
    for b, n in enumerate(need):
        bt[b, :n] = perm[i:i + n].int()
        i += n
    fill = dict(dtype=torch.uint8, fill_value=0xFF) if cdtype == torch.uint8 else dict(dtype=cdtype,
                                                                                         fill_value=float("nan"))
    cache = torch.full((nb, BS, 656 if cdtype == torch.uint8 else D), **fill)
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        ref.write_latent_cache(cache, latent_values(n, generator=g), torch.randn(n, DR, generator=g),
                               ref.slots_from_positions(bt, torch.full_like(pos, b), pos, BS))
    req = torch.cat([torch.full((e - s,), b, dtype=torch.int32) for b, (s, e) in enumerate(prefill)])
    pos = torch.cat([torch.arange(s, e, dtype=torch.int32) for s, e in prefill])
    shuffle = torch.randperm(len(pos), generator=g)
    req, pos = req[shuffle], pos[shuffle]
    top = torch.full((len(pos), 24), -1, dtype=torch.int32)
    for t, p in enumerate(pos.tolist()):
        pick = torch.randperm(p + 1, generator=g)[:24]
        top[t, :len(pick)] = pick.int()
    top[torch.rand(top.shape, generator=g) < 0.25] = -1
    top[3] = -1  # nothing listed: zeros
    top[5, :2] = top[5, 2]  # one position listed three times
    return torch.randn(len(pos), 8, D, generator=g).bfloat16(), cache, bt, req, top


@pytest.mark.parametrize("cdtype", [torch.bfloat16, torch.uint8], ids=["bf16", "fp8"])
def test_the_gluon_launch_gets_what_gives_the_reference(cdtype, monkeypatch):
    """With the Gluon tile picked, ``sparse_mla_tile_paged`` counts with its 64-key blocks and launches it once per
    chunk of tokens (here three: a small counter budget); the torch model of the kernel over those arguments is the
    reference. ``{"kernel": "triton"}`` runs the Triton tile instead."""
    q, cache, bt, req, top = _case(cdtype, torch.Generator().manual_seed(0))
    expect = ref.sparse_mla_paged(q, cache, bt, req, top, SCALE)
    assert expect[3].abs().max() == 0
    calls = []
    monkeypatch.setattr(th, "supported", lambda *a: True)
    monkeypatch.setattr(th, "launch", lambda *a: _emulated_launch(calls, *a))
    words = bt.shape[1] * BS // 2
    monkeypatch.setattr(ttile, "COUNT_BUDGET", 4 * words * 96)  # 96 tokens at a time: 240 in three chunks
    out = ttile.sparse_mla_tile_paged(q, cache, bt, req, top, SCALE)
    assert [(c["T"], c["block_q"], c["heads"], c["tiles"]) for c in calls] == [(96, 8, 8, 12), (96, 8, 8, 12),
                                                                               (48, 8, 8, 6)]
    assert torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float(), expect.float(), atol=2e-2, rtol=2e-2)
    calls.clear()
    triton_out = ttile.sparse_mla_tile_paged(q[:40], cache, bt, req[:40], top[:40], SCALE, cfg={"kernel": "triton"})
    assert calls == []
    torch.testing.assert_close(triton_out.float(), expect[:40].float(), atol=2e-2, rtol=2e-2)
