"""One decoder layer's kernels, in order, from a whole step's kernel sequence (issue 45, item 1).

Inside a CUDA graph the profiler sees each kernel, not the layers, so the layers are found in the sequence itself:
- an anchor: the first kernel of the step whose name occurs exactly once per decoder layer (the attention block
  has several: the RoPE, the indexer's logits and top-k, the MLA kernel);
- the first layer has no residual to add, so it begins at the first norm of the step (a name holding ``norm``);
  every other layer's anchor stands as far from its input norm, a residual-add norm (a name holding
  ``add_rms_norm``), or, where that norm runs inside the attention block's first GEMM (fuse_add_rms_norm_into_gemm:
  no kernel of its own), it begins one kernel later, with that GEMM;
- a layer ends where the next begins; the last layer is as long as the one before it of its kind.

Every layer of a kind must then launch the same kernels (the first layer may differ in its first, the norm
without the add, or, where the others' input norm runs in their first GEMM, in its first two: its norm, then its
GEMM); otherwise the step has no such structure and the caller keeps only its totals. Each kernel's
device time is its mean over the layers of its kind, the first layer left out where the kind has others.
"""

from __future__ import annotations

import collections


def split_layers(step: list[tuple[str, float]], dense: int, moe: int) -> dict | None:
    """``step``: (kernel, us) in launch order for one step; ``dense`` then ``moe`` decoder layers. Returns
    {'dense': [...], 'moe': [...], 'prologue', 'epilogue'} (each layer as [{'kernel', 'us'}], 'prologue' and
    'epilogue' the kernel counts before the first layer and after the last), or None where the sequence has no
    such structure."""
    names = [n for n, _ in step]
    starts = _layer_starts(names, dense + moe)
    if starts is None:
        return None
    kinds = ["dense"] * dense + ["moe"] * moe
    last = next((i for i in range(len(kinds) - 2, -1, -1) if kinds[i] == kinds[-1]), None)
    if last is None:
        return None
    ends = starts[1:] + [starts[-1] + starts[last + 1] - starts[last]]
    if ends[-1] > len(names):
        return None
    windows = collections.defaultdict(list)
    for i, (lo, hi) in enumerate(zip(starts, ends)):
        windows[kinds[i]].append((i, lo, hi))
    out = dict(prologue=starts[0], epilogue=len(names) - ends[-1])
    for kind in ("dense", "moe"):
        layers = windows.get(kind, [])
        if not layers:
            out[kind] = []
            continue
        used = [w for w in layers if w[0] > 0] or layers  # the first layer's input norm has no residual
        lo, hi = used[0][1], used[0][2]
        shape = names[lo:hi]
        if any(names[a:b] != shape for _, a, b in used) or any(
                names[b - len(shape) + 1:b] != shape[1:] for i, a, b in layers if i == 0):
            return None
        out[kind] = [dict(kernel=shape[j], us=round(sum(step[a + j][1] for _, a, _ in used) / len(used), 2))
                     for j in range(len(shape))]
    return out


def _layer_starts(names: list[str], layers: int) -> list[int] | None:
    counts = collections.Counter(names)
    anchor = next((n for n in names if counts[n] == layers), None)
    if anchor is None or layers == 0:
        return None
    anchors = [i for i, n in enumerate(names) if n == anchor]
    first = next((i for i in range(anchors[0]) if "norm" in names[i]), None)
    if first is None:
        return None
    starts = [first]
    for prev, here in zip(anchors, anchors[1:]):
        norm = here - (anchors[0] - first)
        start = norm if "add_rms_norm" in names[norm] else norm + 1
        if start <= prev:
            return None
        starts.append(start)
    return starts
