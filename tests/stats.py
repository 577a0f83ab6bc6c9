"""Pearson's chi-square goodness-of-fit test, for the sampling tests (no scipy: the p-value is the upper
regularized incomplete gamma function, ``torch.special.gammaincc``)."""

import torch

SIGNIFICANCE = 1e-3  # a sampler is rejected when its counts are this unlikely under the exact distribution


def chi_square_p(counts: dict, probs: dict, n: int) -> float:
    """The p-value of ``counts`` (outcome -> count, ``n`` draws) under ``probs`` (outcome -> probability, the exact
    distribution). Cells with fewer than 5 expected draws are pooled with the next smallest until each has 5 (the
    test's usual condition). An outcome of probability 0 that was drawn fails the test outright (p = 0)."""
    if any(k not in probs or probs[k] == 0 for k, c in counts.items() if c):
        return 0.0
    cells = sorted(([n * p, counts.get(k, 0)] for k, p in probs.items()), key=lambda c: c[0])
    while len(cells) > 1 and cells[0][0] < 5:
        expected, observed = cells.pop(0)
        cells[0][0] += expected
        cells[0][1] += observed
        cells.sort(key=lambda c: c[0])
    stat = sum((o - e) ** 2 / e for e, o in cells)
    df = len(cells) - 1
    if df == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))
