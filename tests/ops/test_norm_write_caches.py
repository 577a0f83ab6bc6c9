"""fxglm5::rms_norm_write_caches: the query latent's RMSNorm and a layer's two cache writes as one op, and the
indexer's head weights given their GEMV's operands. Its reference is the chain it replaces (the reference RMSNorm,
latent write, index write and f32_linear), bit for bit; its Triton body (interpreted) gives the same; it refuses a bad
input before either cache changes; and the attention ops told ``written=True`` leave their caches as they found them
(their rows are already there)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import fxglm5.ops  # noqa: E402,F401  (registers the ops)
from fxglm5.errors import InputError  # noqa: E402
from fxglm5.lowering.reference import fused as ref_fused  # noqa: E402
from fxglm5.lowering.reference import norm_rope, paged, paged_steps  # noqa: E402

ops = torch.ops.fxglm5
BS, Q, T = 4, 48, 5
H, HEADS, SCALES = 40, 4, [0.5, 0.125]  # the head weights' GEMV: hidden width, indexer heads, the folded scales
# two requests: 3 tokens from position 2 (block 3, then 1), 2 tokens from position 0 (block 2); block 0 reserved
TABLE = torch.tensor([[3, 1], [2, 0]], dtype=torch.int32)
REQ = torch.tensor([0, 0, 0, 1, 1], dtype=torch.int32)
POS = torch.tensor([2, 3, 4, 0, 1], dtype=torch.int32)


def _step(dtype=torch.bfloat16, kv_dtype=torch.uint8, index_dtype=torch.uint8, seed=0, weights=False):
    """One step's arguments of the op, as keywords: the query latent and the raw rows of 5 tokens [1, 5, ...], the
    folded norms and RoPE tables, zeroed caches, and the forward context (one padding token, slot -1); with
    ``weights`` the head weights' GEMV operands (a hidden state in the compute dtype, a float32 weight, two
    scales)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype)

    slots = paged.slots_from_positions(TABLE, REQ, POS, BS)
    slots[4] = -1
    angles = torch.rand(1, T, 16, generator=gen) * 10
    gemv = dict(weights_x=rand(1, T, H, scale=2), weights_proj=torch.randn(HEADS, H, generator=gen),
                weights_scales=SCALES) if weights else {}
    return dict(x=rand(1, T, Q, scale=3), weight=1 + rand(Q, scale=0.1), eps=1e-6, kv_c=rand(1, T, 96, scale=2),
                k_pe=rand(1, T, 32), kv_cache=torch.zeros(4, BS, 656 if kv_dtype == torch.uint8 else 576,
                                                           dtype=kv_dtype),
                k=rand(1, T, 128, scale=2),
                index_cache=None if index_dtype is None else torch.zeros(4, BS, 132 if index_dtype == torch.uint8
                                                                         else 128, dtype=index_dtype),
                slot_mapping=slots, block_table=TABLE, req_idx=REQ, positions=POS, max_positions=64,
                rope_cos=angles.cos(), rope_sin=angles.sin(), kv_norm_weight=1 + rand(96, scale=0.1),
                kv_norm_eps=1e-6, k_norm_weight=1 + rand(128, scale=0.1), k_norm_bias=rand(128, scale=0.1),
                k_norm_eps=1e-6, **gemv)


def _chain(a):
    """What the op replaces: the reference RMSNorm and the two writes the attention ops made, standalone, and the
    head weights' f32_linear (given its operands; else no weights, [1, T, 0])."""
    rope = (a["rope_cos"][0], a["rope_sin"][0])
    paged.write_latent_cache(a["kv_cache"], a["kv_c"][0], a["k_pe"][0], a["slot_mapping"],
                             norm=(a["kv_norm_weight"], 1e-6), rope=rope)
    if a["index_cache"] is not None:
        norm = (a["k_norm_weight"], a["k_norm_bias"], 1e-6)
        if a["index_cache"].dtype == torch.uint8:
            paged.write_indexer_cache(a["index_cache"], a["k"][0], a["slot_mapping"], norm=norm, rope=rope)
        else:
            paged.write_exact_index_keys(a["index_cache"], a["k"][0], a["slot_mapping"], norm=norm, rope=rope)
    normed = norm_rope.rms_norm(a["x"], a["weight"], a["eps"])
    if "weights_proj" not in a:
        return normed, torch.empty(1, T, 0)
    return normed, ref_fused.f32_linear(a["weights_x"], a["weights_proj"], a["weights_scales"])


@pytest.mark.parametrize("index, weights", [(True, False), (False, False), (True, True)],
                         ids=["indexer", "no-indexer", "weights"])
def test_opcheck(index, weights):
    """The schema declares both caches mutated (the index cache optional), the fake matches the real outputs (the
    head weights', [..., 0] without their operands), also under AOT dispatch."""
    args = _step(dtype=torch.float32, weights=weights)
    if not index:
        args.update(k=None, index_cache=None)
    torch.library.opcheck(ops.rms_norm_write_caches.default, tuple(args.values()))


@pytest.mark.parametrize("kv_dtype, index_dtype, weights", [
    (torch.uint8, torch.uint8, False), (torch.bfloat16, torch.bfloat16, False), (torch.uint8, None, False),
    (torch.uint8, torch.uint8, True)], ids=["fp8", "exact", "no-indexer", "weights"])
def test_reference_is_the_chain_it_replaces(kv_dtype, index_dtype, weights):
    mine, theirs = (_step(kv_dtype=kv_dtype, index_dtype=index_dtype, weights=weights) for _ in range(2))
    if index_dtype is None:
        mine["k"] = None
    out, head = ops.rms_norm_write_caches(**mine)
    want, want_head = _chain(theirs)
    assert torch.equal(out, want) and out.shape == (1, T, Q)
    assert torch.equal(head, want_head) and head.dtype == torch.float32
    assert head.shape == (1, T, HEADS if weights else 0)
    for name in ("kv_cache", "index_cache"):
        assert (mine[name] is None and theirs[name] is None) or torch.equal(mine[name], theirs[name])
    rows = mine["kv_cache"].view(-1, mine["kv_cache"].shape[-1])
    assert (rows != 0).any(1).tolist() == [s in mine["slot_mapping"][:4].tolist() for s in range(rows.shape[0])]


@pytest.mark.parametrize("kv_dtype, index_dtype, weights", [
    (torch.uint8, torch.uint8, False), (torch.bfloat16, torch.bfloat16, False), (torch.uint8, torch.uint8, True)],
    ids=["fp8", "exact", "weights"])
def test_triton_body_gives_the_reference(kv_dtype, index_dtype, weights):
    """The Triton kernel set's body (one launch) against the reference op: the same normed latent and caches (bf16
    rounding points are the reference's; the RMS sums may round differently: a few values one bf16 ulp off, and an
    FP8 byte one e4m3 step where that crosses a rounding boundary); the head weights are f32_linear's Triton GEMV's
    bit for bit, within float32 sums' rounding of the reference."""
    from fxglm5.lowering.triton import f32_linear, paged_ops

    mine, theirs = (_step(kv_dtype=kv_dtype, index_dtype=index_dtype, weights=weights) for _ in range(2))
    out, head = paged_steps.norm_write_caches_step(paged_ops, **mine)
    want, want_head = ops.rms_norm_write_caches(**theirs)
    torch.testing.assert_close(out.float(), want.float(), rtol=2**-7, atol=0)
    assert (out == want).float().mean() > 0.95
    assert head.shape == want_head.shape and head.dtype == torch.float32
    if weights:
        assert torch.equal(head, f32_linear.f32_linear(mine["weights_x"], mine["weights_proj"], SCALES))
        torch.testing.assert_close(head, want_head, rtol=1e-5, atol=1e-5)
    for name in ("kv_cache", "index_cache"):
        assert (mine[name].view(torch.uint8) == theirs[name].view(torch.uint8)).float().mean() > 0.98


@pytest.mark.parametrize("change, match", [
    (lambda a: a["slot_mapping"].__setitem__(1, 5), "slot_mapping: a slot disagrees"),
    (lambda a: a["slot_mapping"].__setitem__(1, 400), "slot_mapping"),
    (lambda a: a.update(positions=torch.tensor([2, 3, 4, 0, 90], dtype=torch.int32)), "positions"),
    (lambda a: a.update(k_norm_weight=torch.ones(64)), "k layer_norm weight"),
    (lambda a: a.update(kv_norm_weight=torch.ones(64)), "kv_c rms_norm weight"),
    (lambda a: a.update(weight=torch.ones(Q + 1)), "q rms_norm weight"),
    (lambda a: a.update(x=a["x"][:, :4]), "x: expected"),
    (lambda a: a.update(k=None), "k / index_cache"),
    (lambda a: a.update(k=torch.zeros(1, T, 130, dtype=torch.bfloat16)), "k: expected"),
    (lambda a: a.update(weights_proj=a["weights_proj"].bfloat16()), "f32_linear weight"),
    (lambda a: a.update(weights_proj=torch.zeros(HEADS, H + 1)), "f32_linear weight"),
    (lambda a: a.update(weights_x=None), "weights_x / weights_proj"),
    (lambda a: a.update(weights_x=a["weights_x"][:, :4]), "weights_x: expected"),
], ids=["slot", "slot-range", "position", "k-norm", "kv-norm", "q-norm", "x-rows", "k-missing", "k-width",
        "weights-dtype", "weights-width", "weights-x-missing", "weights-x-rows"])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_a_bad_input_changes_no_cache(change, match, backend):
    """Every refusal is an InputError naming the field, raised before either cache is written (the op validates
    the norm's, both writes' and the head weights' inputs first, as the cached ops and f32_linear do)."""
    from fxglm5.lowering.triton import paged_ops

    args = _step(weights=True)
    change(args)
    with pytest.raises(InputError, match=match):
        if backend == "reference":
            ops.rms_norm_write_caches(**args)
        else:
            paged_steps.norm_write_caches_step(paged_ops, **args)
    assert (args["kv_cache"] == 0).all() and (args["index_cache"] == 0).all()


def test_attention_ops_told_written_leave_their_caches_alone():
    """With ``written=True`` rtp_indexer and rtp_sparse_mla attend over what is cached and write nothing (caches of
    zeros stay zeros); after the fused op wrote the step's rows they give what the unfused ops, which write those
    rows themselves, give."""
    fused, unfused, unwritten = _step(dtype=torch.float32), _step(dtype=torch.float32), _step(dtype=torch.float32)
    q_latent, _ = ops.rms_norm_write_caches(**fused)
    assert torch.equal(q_latent, norm_rope.rms_norm(unfused["x"], unfused["weight"], 1e-6))
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, T, 4, 128, generator=gen)
    w = torch.rand(1, T, 4, generator=gen)
    q_nope, q_pe = torch.randn(1, T, 2, 16, generator=gen), torch.randn(1, T, 2, 32, generator=gen)
    w_uk, w_uv = torch.randn(2, 16, 96, generator=gen) * 0.2, torch.randn(2, 8, 96, generator=gen) * 0.2
    results = {}
    for name, a, written in (("fused", fused, True), ("unfused", unfused, False), ("unwritten", unwritten, True)):
        context = tuple(a[n] for n in ("slot_mapping", "block_table", "req_idx", "positions", "max_positions"))
        rope = (a["rope_cos"], a["rope_sin"])
        top = ops.rtp_indexer(q, a["k"], w, 3, a["index_cache"], *context, *rope, a["k_norm_weight"],
                              a["k_norm_bias"], 1e-6, None, 1, False, written)
        out = ops.rtp_sparse_mla(q_nope, q_pe, a["kv_c"], a["k_pe"], w_uk, w_uv, top, 0.3, a["kv_cache"], *context,
                                 *rope, a["kv_norm_weight"], 1e-6, written)
        results[name] = top, out
    assert (unwritten["index_cache"] == 0).all() and (unwritten["kv_cache"] == 0).all()
    assert torch.equal(fused["index_cache"], unfused["index_cache"]) and torch.equal(fused["kv_cache"],
                                                                                    unfused["kv_cache"])
    assert torch.equal(results["fused"][0], results["unfused"][0])
    assert torch.equal(results["fused"][1], results["unfused"][1])
