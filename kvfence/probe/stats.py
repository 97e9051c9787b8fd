"""The Mann-Whitney U test: one-sided, for "are the prefix probes' times to first token smaller?", and two-sided,
for "do these two kinds of request differ in time at all?" (tests/test_server_prefix_cache.py).

Exact (the distribution of U counted over every ordering of the pooled samples) when there are no ties and the
samples are small; otherwise the normal approximation with tie and continuity corrections. Standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import cache

EXACT_MAX_PAIRS = 400  # n1 * n2 up to this: exact counts (a few thousand additions)


def mann_whitney_less(x: Sequence[float], y: Sequence[float]) -> float:
    """One-sided p-value for H1: values in `x` tend to be smaller than values in `y`."""
    n1, n2 = len(x), len(y)
    if n1 == 0 or n2 == 0:
        return 1.0
    ranks = _ranks([*x, *y])
    u = sum(ranks[:n1]) - n1 * (n1 + 1) / 2  # pairs (xi, yj) with xi > yj, ties counting one half
    tied = len(set([*x, *y])) < n1 + n2
    if not tied and n1 * n2 <= EXACT_MAX_PAIRS:
        total = math.comb(n1 + n2, n1)
        return sum(_count(n1, n2, k) for k in range(int(u) + 1)) / total
    return _normal_less(u, n1, n2, ranks)


def mann_whitney_two_sided(x: Sequence[float], y: Sequence[float]) -> float:
    """Two-sided p-value for H1: the values in `x` and `y` differ in location, either way."""
    return min(1.0, 2 * min(mann_whitney_less(x, y), mann_whitney_less(y, x)))


def _ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties sharing the average rank, in the order of `values`."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


@cache
def _count(n1: int, n2: int, u: int) -> int:
    """Orderings of n1 x's and n2 y's (all distinct) in which exactly u pairs have x > y."""
    if u < 0:
        return 0
    if n1 == 0 or n2 == 0:
        return 1 if u == 0 else 0
    # the largest value is an x (above all n2 y's) or a y (above no x)
    return _count(n1 - 1, n2, u - n2) + _count(n1, n2 - 1, u)


def _normal_less(u: float, n1: int, n2: int, ranks: list[float]) -> float:
    n = n1 + n2
    counts: dict[float, int] = {}
    for r in ranks:
        counts[r] = counts.get(r, 0) + 1
    tie_term = sum(t**3 - t for t in counts.values()) / (n * (n - 1)) if n > 1 else 0.0
    sigma = math.sqrt(n1 * n2 / 12 * ((n + 1) - tie_term))
    if sigma == 0:
        return 1.0
    z = (u - n1 * n2 / 2 + 0.5) / sigma
    return 0.5 * math.erfc(-z / math.sqrt(2))
