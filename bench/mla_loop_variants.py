"""A/B experiment behind the MLA kernel's loop structure (dense decode, bf16, GLM-5 shapes, H200).

Triton gives a ``tl.dot`` whose result feeds another dot in the same loop iteration ("chained", as QK^T feeds
P @ V) all warps along M. With the 64 heads of one token as M and 8 warps, both warpgroups then compute the
same QK^T tile: the QK^T MMAs run twice. This script times the dense decode main loop (B=64, 32k context,
2 KV splits, TMA tiles, no combine) in these forms on the same cache:

- ``halves``: what ``fxglm5/lowering/triton/mla.py`` does: 256-column latent halves, QK^T chained into P @ V;
- ``full``: one 512-wide latent operand (fewer, larger MMAs, same chaining);
- ``deferred``: P @ V of the previous tile first, from the loop-carried P and a TMA reload of its rows, so QK^T
  chains into no dot in its iteration and Triton splits it across the warpgroups (no duplicate MMAs), at the
  price of a second V buffer per stage (which limits the tile to 32 rows, or one stage at 64);
- ``+hop``: P and the rescale factor pass through a per-program global scratch (see ``_hop_step``), which cuts
  the SSA chain instead: QK^T splits across the warpgroups with no extra V buffer (verified [4, 2] with no
  spills in an offline sm_90 compile), at the price of a barrier, a global round trip and more layout
  conversions per tile.

Each row's error is the max |difference| to the ``halves`` output. Saves bench/results/mla_loop_variants.*.

    python bench/mla_loop_variants.py
"""

from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.harness import Results, copy_bandwidth_gbs, time_graph_us  # noqa: E402

B, CTX, H, SPLITS = 64, 32768, 64, 2


@triton.jit
def _softmax_step(qk, m_i, l_i):
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), alpha, p


@triton.jit
def _hop_step(qk, m_i, l_i, scr_p, scr_a, slot, BN: tl.constexpr, HOP: tl.constexpr):
    """The softmax step. With HOP, P and the rescale factor reach P @ V through a per-program global scratch
    (two slots): stores, one CTA barrier, and relaxed CTA-scope atomic reads. In SSA terms QK^T then feeds no
    dot, so Triton splits it across the warpgroups instead of running it in both. The barrier is inline PTX
    (``tl.debug_barrier`` stops the software pipeliner) and the reads are atomics (plain loads would be
    pipelined ahead of the stores)."""
    m_new, l_i, alpha, p = _softmax_step(qk, m_i, l_i)
    pb = p.to(tl.bfloat16)
    if HOP:
        h = tl.arange(0, 64)
        n = tl.arange(0, BN)
        tl.store(scr_a + slot * 64 + h, alpha)
        tl.store(scr_p + slot * 64 * BN + h[:, None] * BN + n[None, :], pb)
        tl.inline_asm_elementwise("bar.sync 0;\n\tmov.b32 $0, 0;", "=r,r,~{memory}", [h], dtype=tl.int32,
                                  is_pure=False, pack=1)
        alpha = tl.atomic_add(scr_a + slot * 64 + h, 0.0, sem="relaxed", scope="cta")
        pb = tl.atomic_add(scr_p + slot * 64 * BN + h[:, None] * BN + n[None, :], tl.zeros([64, BN], tl.bfloat16),
                           sem="relaxed", scope="cta")
    return m_new, l_i, alpha, pb


@triton.jit
def _dense_loop(q_ptr, cache_ptr, bt_ptr, po_ptr, scr_p_ptr, scr_a_ptr, n_rows, rows_per_split, stride_bt, scale,
                BN: tl.constexpr, MODE: tl.constexpr, HOP: tl.constexpr):
    """MODE 0 = halves, 1 = full, 2 = deferred (see the module docstring); HOP: see _hop_step."""
    t = tl.program_id(0)
    sp = tl.program_id(1)
    h = tl.arange(0, 64)
    c256 = tl.arange(0, 256)
    c512 = tl.arange(0, 512)
    cp = tl.arange(0, 64)
    qrow = q_ptr + t.to(tl.int64) * 64 * 576 + h[:, None] * 576
    q_pe = tl.load(qrow + 512 + cp[None, :])
    desc_pe = tl.make_tensor_descriptor(cache_ptr, shape=[n_rows, 576], strides=[576, 1], block_shape=[BN, 64])
    m_i = tl.full([64], float("-inf"), tl.float32)
    l_i = tl.zeros([64], tl.float32)
    start = sp * rows_per_split
    end = start + rows_per_split
    base = (t * 2 + sp) * 64 + h
    prog = (t * 2 + sp).to(tl.int64)
    scr_p = scr_p_ptr + prog * 2 * 64 * BN
    scr_a = scr_a_ptr + prog * 2 * 64
    if MODE == 0:
        desc = tl.make_tensor_descriptor(cache_ptr, shape=[n_rows, 576], strides=[576, 1], block_shape=[BN, 256])
        q_a = tl.load(qrow + c256[None, :])
        q_b = tl.load(qrow + 256 + c256[None, :])
        acc_a = tl.zeros([64, 256], tl.float32)
        acc_b = tl.zeros([64, 256], tl.float32)
        for n0 in range(start, end, BN):
            r0 = tl.load(bt_ptr + t * stride_bt + n0 // 64) * 64 + n0 % 64
            k_a = desc.load([r0, 0])
            k_b = desc.load([r0, 256])
            if HOP:
                qk = tl.dot(q_a, tl.trans(k_a)) * scale
                qk += tl.dot(q_b, tl.trans(k_b)) * scale
                qk += tl.dot(q_pe, tl.trans(desc_pe.load([r0, 512]))) * scale
            else:
                qk = tl.dot(q_a, tl.trans(k_a))
                qk = tl.dot(q_b, tl.trans(k_b), qk)
                qk = tl.dot(q_pe, tl.trans(desc_pe.load([r0, 512])), qk) * scale
            m_i, l_i, alpha, pb = _hop_step(qk, m_i, l_i, scr_p, scr_a, ((n0 - start) // BN) % 2, BN, HOP)
            acc_a = tl.dot(pb, k_a, acc_a * alpha[:, None])
            acc_b = tl.dot(pb, k_b, acc_b * alpha[:, None])
        tl.store(po_ptr + base[:, None] * 512 + c256[None, :], acc_a / l_i[:, None])
        tl.store(po_ptr + base[:, None] * 512 + 256 + c256[None, :], acc_b / l_i[:, None])
    else:
        desc = tl.make_tensor_descriptor(cache_ptr, shape=[n_rows, 576], strides=[576, 1], block_shape=[BN, 512])
        q_a = tl.load(qrow + c512[None, :])
        acc = tl.zeros([64, 512], tl.float32)
        if MODE == 1:
            for n0 in range(start, end, BN):
                r0 = tl.load(bt_ptr + t * stride_bt + n0 // 64) * 64 + n0 % 64
                k = desc.load([r0, 0])
                if HOP:  # separate products: an accumulate chain would make the first dot "chained" again
                    qk = tl.dot(q_a, tl.trans(k)) * scale
                    qk += tl.dot(q_pe, tl.trans(desc_pe.load([r0, 512]))) * scale
                else:
                    qk = tl.dot(q_a, tl.trans(k))
                    qk = tl.dot(q_pe, tl.trans(desc_pe.load([r0, 512])), qk) * scale
                m_i, l_i, alpha, pb = _hop_step(qk, m_i, l_i, scr_p, scr_a, ((n0 - start) // BN) % 2, BN, HOP)
                acc = tl.dot(pb, k, acc * alpha[:, None])
        else:
            # invariant at the top of an iteration: acc is relative to the max before the previous tile;
            # a_prev rescales it to the previous tile's max, which p_prev is already relative to
            prev = tl.load(bt_ptr + t * stride_bt + start // 64) * 64 + start % 64
            p_prev = tl.zeros([64, BN], tl.float32)
            a_prev = tl.zeros([64], tl.float32)
            for n0 in range(start, end, BN):
                acc = tl.dot(p_prev.to(tl.bfloat16), desc.load([prev, 0]), acc * a_prev[:, None])
                r0 = tl.load(bt_ptr + t * stride_bt + n0 // 64) * 64 + n0 % 64
                # two products summed after scaling: a plain add would be folded into a chained accumulate
                qk = tl.dot(q_a, tl.trans(desc.load([r0, 0]))) * scale
                qk += tl.dot(q_pe, tl.trans(desc_pe.load([r0, 512]))) * scale
                m_i, l_i, a_prev, p_prev = _softmax_step(qk, m_i, l_i)
                prev = r0
            acc = tl.dot(p_prev.to(tl.bfloat16), desc.load([prev, 0]), acc * a_prev[:, None])
        tl.store(po_ptr + base[:, None] * 512 + c512[None, :], acc / l_i[:, None])


VARIANTS = [("halves", 0, 64, 2, False), ("full", 1, 64, 2, False), ("halves+hop", 0, 64, 2, True),
            ("full+hop", 1, 64, 2, True), ("full+hop", 1, 32, 3, True), ("deferred", 2, 32, 2, False)]


def main():
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    results = Results(copy_gbs=copy_bandwidth_gbs())
    nblk = CTX // 64
    total = B * nblk + 1
    cache = (torch.randn(total, 64, 576, device="cuda") * 0.5).to(torch.bfloat16)
    bt = (torch.randperm(total - 1, device="cuda") + 1).view(B, nblk).int().contiguous()
    q = torch.randn(B, H, 576, device="cuda", dtype=torch.bfloat16)
    po = torch.empty(B * SPLITS * H, 512, device="cuda")
    bytes_ = B * CTX * 576 * cache.element_size()
    ref = None
    scr_p = torch.empty(B * SPLITS * 2 * 64 * 64, device="cuda", dtype=torch.bfloat16)
    scr_a = torch.empty(B * SPLITS * 2 * 64, device="cuda", dtype=torch.float32)
    for name, mode, bn, ns, hop in VARIANTS:
        def run():
            _dense_loop[(B, SPLITS)](q, cache, bt, po, scr_p, scr_a, total * 64, CTX // SPLITS, bt.stride(0),
                                     0.0625 * 1.4427, BN=bn, MODE=mode, HOP=hop, num_warps=8, num_stages=ns)
        run()
        ref = po.clone() if ref is None else ref
        err = (po - ref).abs().max().item()
        us = time_graph_us(run)
        tbs = bytes_ / (us * 1e-6) / 1e12
        results.add(variant=name, BLOCK_N=bn, num_stages=ns, us=round(us, 1), **{"TB/s": round(tbs, 3)},
                    pct_copy=round(100 * tbs * 1e3 / results.copy_gbs, 1), max_err=f"{err:.1e}")
    print("saved", results.save("mla_loop_variants"))


if __name__ == "__main__":
    main()
