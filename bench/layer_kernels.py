"""One decoder layer's kernels, in order, from a whole step's kernel sequence (issue 45, item 1).

A decode step runs ``prologue + dense layers + MoE layers + epilogue`` kernels, and every layer of a kind launches
the same kernels in the same order (inside a CUDA graph the profiler sees each kernel, not the layers). So the
sequence is periodic over each kind's layers: the dense run is the earliest run of ``dense`` equal windows after a
short prologue, and the MoE run follows it with ``moe`` equal windows. Both kinds start with the same attention
block, so the window boundaries are where the first dense layer begins; a layer's kernels are one window, with the
device time of each kernel averaged over the layers of its kind.
"""

from __future__ import annotations

MAX_PROLOGUE = 16  # kernels before the first decoder layer (the embedding gather and its neighbours)


def _repeats(names: list[str], start: int, period: int, count: int) -> bool:
    end = start + period * count
    return end <= len(names) and all(names[i] == names[i + period] for i in range(start, end - period))


def split_layers(step: list[tuple[str, float]], dense: int, moe: int) -> dict | None:
    """``step``: (kernel, us) in launch order for one step. Returns {'dense': [...], 'moe': [...], 'prologue',
    'epilogue'} (each layer as [{'kernel', 'us'}] averaged over its kind's layers), or None where the sequence has no
    such structure (then the caller keeps only the step's totals)."""
    names = [n for n, _ in step]
    windows = _windows(names, dense, moe)
    if windows is None:
        return None
    (d0, dp), (m0, mp) = windows
    out = dict(prologue=d0, epilogue=len(names) - (m0 + mp * moe))
    for kind, first, period, count in (("dense", d0, dp, dense), ("moe", m0, mp, moe)):
        out[kind] = [dict(kernel=names[first + j],
                          us=round(sum(step[first + i * period + j][1] for i in range(count)) / count, 2))
                     for j in range(period)] if count else []
    return out


def _windows(names: list[str], dense: int, moe: int):
    """((dense start, dense period), (moe start, moe period)), or None: the shortest prologue whose dense run is
    followed by a MoE run that leaves a short epilogue (shortest first). A boundary kernel shared by the epilogue and a
    layer's start (the final norm after the last layer is the kernel each layer starts with) could rotate the windows
    found from the end, but not those found from the start, which begins at the first layer's first kernel. Each
    candidate is checked in one pass, so a step of thousands of kernels splits in well under a second."""
    n = len(names)
    runs = [(n - e - mp * moe, mp) for e in range(min(MAX_PROLOGUE, n) + 1)
            for mp in (range(1, (n - e) // moe + 1) if moe else (0,))
            if not moe or _repeats(names, n - e - mp * moe, mp, moe)]
    for start in range(min(MAX_PROLOGUE, n) + 1):
        for m0, mp in runs:
            span = m0 - start
            if dense == 0:
                if span == 0:
                    return (start, 0), (m0, mp)
                continue
            if span <= 0 or span % dense:
                continue
            dp = span // dense
            if _repeats(names, start, dp, dense) and (not moe or names[start] == names[m0]):
                return (start, dp), (m0, mp)
    return None
