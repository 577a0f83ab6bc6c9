"""Small modules that several pass files rewrite: the generic dense MLA core (match_mla's pattern and a near miss
of match_sparse_mla's), a module whose attention is already the canonical ``fxglm5::mla`` (what the cache stage
and the lower pass take), and the hypothesis settings of the property tests."""

import torch
from hypothesis import settings
from hypothesis import strategies as st
from torch import nn

from fxglm5.capture import capture
from fxglm5.model.attention import naive_mla
from fxglm5.model.layers import Linear
from fxglm5.passes.registry import passes_for
from tests.helpers import randomize_
from tests.passes.template import assert_untouched, export_small, paged_args, paged_dims, run_one

# the passes' correctness properties: at least 8 examples (the CI profile's 4 is the kernels' budget), half the
# profile's where that is more (50 with HYPOTHESIS_PROFILE=local); each example exports its module
exporting = settings(max_examples=max(8, settings.default.max_examples // 2))


def tol(dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 3e-2


class DenseMLA(nn.Module):
    """The model's naive MLA core with a plain causal mask; ``variant`` makes a near-miss: another softmax scale
    ("scale"), an additive score bias ("bias") or no mask at all ("nomask": not causal)."""

    def __init__(self, heads, rank, nope, rope, v_dim, fp8, dtype, variant=None):
        super().__init__()
        self.kv_b_proj = Linear(rank, heads * (nope + v_dim), fp8, dtype)
        self.v_dim, self.variant = v_dim, variant
        self.scale = (nope + rope) ** -0.5 * (1.5 if variant == "scale" else 1.0)
        self.bias = nn.Parameter(torch.tensor([0.3], dtype=dtype), requires_grad=False)

    def forward(self, q_nope, q_pe, c_kv, k_pe):
        seq = q_nope.shape[1]
        idx = torch.arange(seq, device=q_nope.device)
        allowed = (idx[None, :] <= idx[:, None])[None]
        if self.variant == "nomask":
            allowed = torch.ones_like(allowed)
        if self.variant == "bias":
            return naive_mla_with_bias(q_nope, q_pe, c_kv, k_pe, self.kv_b_proj, allowed, self.v_dim, self.scale, self.bias)
        return naive_mla(q_nope, q_pe, c_kv, k_pe, self.kv_b_proj, allowed, self.v_dim, self.scale)


def naive_mla_with_bias(q_nope, q_pe, c_kv, k_pe, kv_b_proj, allowed, v_dim, scale, bias):
    """naive_mla with an extra additive score bias (ALiBi-like): not MLA's math."""
    bsz, seq, heads, nope = q_nope.shape
    k_nope, v = kv_b_proj(c_kv).view(bsz, seq, heads, nope + v_dim).split([nope, v_dim], dim=-1)
    query = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2)
    key = torch.cat([k_nope, k_pe.expand(bsz, seq, heads, k_pe.shape[-1])], dim=-1).transpose(1, 2)
    scores = torch.matmul(query, key.transpose(2, 3)) * scale + bias
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q_nope.dtype)
    return torch.matmul(probs, v.transpose(1, 2)).transpose(1, 2).reshape(bsz, seq, heads * v_dim)


mla_shapes = st.fixed_dictionaries({
    "heads": st.integers(1, 4), "rank": st.sampled_from([32, 64, 160]), "nope": st.sampled_from([8, 16]),
    "rope": st.sampled_from([4, 8]), "v_dim": st.sampled_from([8, 24]), "batch": st.integers(1, 3),
    "seq": st.integers(1, 20), "fp8": st.booleans(), "dtype": st.sampled_from([torch.float32, torch.bfloat16]),
})
MLA_EXAMPLE = dict(heads=2, rank=64, nope=8, rope=4, v_dim=8, batch=2, seq=7, fp8=True, dtype=torch.float32)


def dense_mla(p, variant=None) -> DenseMLA:
    return randomize_(DenseMLA(p["heads"], p["rank"], p["nope"], p["rope"], p["v_dim"], p["fp8"], p["dtype"], variant))


def assert_leaves_dense_mla(name: str, p, variant: str) -> None:
    """Pass ``name`` leaves a near-miss DenseMLA (``variant``) of shapes ``p`` untouched, its softmax included."""
    module = dense_mla(p, variant)
    args = mla_inputs(p)
    gm = export_small(module, args)
    assert_untouched(name, gm, module, args)
    assert "aten.softmax" in gm.code


def mla_inputs(p, seed=0):
    gen = torch.Generator().manual_seed(seed)
    b, s, h = p["batch"], p["seq"], p["heads"]
    shapes = [(b, s, h, p["nope"]), (b, s, h, p["rope"]), (b, s, p["rank"]), (b, s, 1, p["rope"])]
    return tuple(torch.randn(shape, generator=gen).to(p["dtype"]) for shape in shapes)


class CanonicalMLA(nn.Module):
    """A module whose attention is the canonical dense ``fxglm5::mla`` (GLM-5 itself has none), with the latent
    RMSNorm and the q / k RoPE as fxglm5 ops: what the cache stage rewrites. ``head``: end in a vocabulary
    projection (a row-wise op select_sampled_rows moves the row selection above). ``variant="unfoldable"``: the
    normed latent also feeds the output and the key's RoPE turns by other angles than the query's, so neither
    may be folded into the cache write. ``q_norm``: the query is GLM-5's, projected (q_b) from an RMS-normed query
    latent (q_a), whose norm the latent write can join; ``variant="cycle"`` with it: the latent is projected from the
    normed query latent too, so the write cannot run where the norm runs."""

    def __init__(self, heads=2, dn=8, dr=16, rank=64, dv=8, width=32, head=False, variant=None, q_norm=False):
        super().__init__()
        self.shape, self.variant = (heads, dn, dr), variant
        self.emb = nn.Embedding(50, width)
        self.q_nope, self.q_pe = nn.Linear(width, heads * dn), nn.Linear(width, heads * dr)
        self.kv_c, self.k_pe = nn.Linear(width, rank), nn.Linear(width, dr)
        self.w_uk = nn.Parameter(torch.randn(heads, dn, rank) * 0.2)
        self.w_uv = nn.Parameter(torch.randn(heads, dv, rank) * 0.2)
        self.kv_norm = nn.Parameter(1 + 0.1 * torch.randn(rank))
        self.head = nn.Linear(heads * dv, 50, bias=False) if head else None
        if q_norm:
            self.q_a, self.q_b = nn.Linear(width, width), nn.Linear(width, heads * (dn + dr))
            self.q_a_norm = nn.Parameter(1 + 0.1 * torch.randn(width))
        self.q_norm = q_norm

    def forward(self, input_ids, position_ids):
        b, s = input_ids.shape
        h, dn, dr = self.shape
        x = self.emb(input_ids) + 0.1 * position_ids[..., None].float()
        angles = position_ids[..., None].float() * torch.linspace(1.0, 0.01, dr // 2)
        cos, sin = angles.cos(), angles.sin()
        k_cos, k_sin = ((2 * angles).cos(), (2 * angles).sin()) if self.variant == "unfoldable" else (cos, sin)
        rope = torch.ops.fxglm5.rope_interleaved
        latent = x
        if self.q_norm:
            q_latent = torch.ops.fxglm5.rms_norm(self.q_a(x), self.q_a_norm, 1e-6)
            q_nope, q_pe = self.q_b(q_latent).view(b, s, h, dn + dr).split([dn, dr], dim=-1)
            latent = q_latent if self.variant == "cycle" else x
        else:
            q_nope, q_pe = self.q_nope(x).view(b, s, h, dn), self.q_pe(x).view(b, s, h, dr)
        q_pe = rope(q_pe, cos, sin)
        k_pe = rope(self.k_pe(x).view(b, s, 1, dr), k_cos, k_sin).squeeze(2)
        kv_c = torch.ops.fxglm5.rms_norm(self.kv_c(latent), self.kv_norm, 1e-6)
        out = torch.ops.fxglm5.mla(q_nope, q_pe, kv_c, k_pe, self.w_uk, self.w_uv, 0.3)
        out = out.reshape(b, s, -1)
        if self.variant == "unfoldable":
            out = out + kv_c[..., : out.shape[-1]]
        return out if self.head is None else self.head(out)


def canonical_mla(cls=CanonicalMLA, **options) -> CanonicalMLA:
    torch.manual_seed(0)
    return cls(**options).requires_grad_(False)


def canonical_graph(upto: str, module: CanonicalMLA | None = None) -> "torch.fx.GraphModule":
    """``module``'s (default: a CanonicalMLA) captured graph, rewritten by the passes declared before ``upto`` in the
    cache, fuse_kernels and lower stages: the graph pass ``upto`` gets in the pipeline."""
    gm = capture(module or canonical_mla())
    for spec in passes_for(("cache", "fuse_kernels", "lower")):
        if spec.name == upto:
            return gm
        run_one(gm, spec.name)
    raise ValueError(f"{upto!r} is no pass of the cache, fuse_kernels or lower stage")


def seqs(lengths, seed=0) -> list[torch.Tensor]:
    """Requests of ``lengths`` tokens from CanonicalMLA's 50-token vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 50, (n,), generator=gen) for n in lengths]


def paged_reexport(name: str, module: CanonicalMLA | None = None) -> tuple:
    """The template's ``reexport()`` for a pass over a paged graph: ``module``'s (a CanonicalMLA) graph as pass
    ``name`` gets it, a two-request example, its dynamic shapes and a three-request step keeping 3 rows."""
    gm = canonical_graph(name, module)
    example = paged_args(gm, seqs([6, 3]), torch.float32)
    other = paged_args(gm, seqs([5, 4, 2], 1), torch.float32, rows=torch.tensor([4, 8, 10]))
    return gm, example, paged_dims(gm), other, None
