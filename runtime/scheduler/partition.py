"""Balanced partitioning of weighted items over bins (one algorithm per function, testable alone,
in the style of verl's ``seqlen_balancing.py``).

``lpt`` is Graham's longest-processing-time list scheduling (4/3-approximate for makespan); it is
the workhorse because it is O(m log k) and keeps the order in which items reach a bin.
``karmarkar_karp`` is the largest-differencing method for small sets where balance matters more
than speed; ``snake`` is the vectorised deal that LPT reduces to on sorted equal-speed input.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np


def lpt(
    weights: Sequence[float] | np.ndarray,
    speeds: Sequence[float],
    loads: Sequence[float] | None = None,
    presorted: bool = False,
    caps: Sequence[int] | None = None,
) -> list[list[int]]:
    """Assign items to bins, heaviest first, each to the bin that would finish first.

    ``speeds[j]`` scales bin j's capacity (a bin with twice the speed takes twice the load);
    ``loads`` are initial loads in time units. Returns per-bin item indices in assignment
    order (so heaviest first inside a bin). ``presorted`` keeps the given order. ``caps`` limits
    the number of items per bin (a full bin leaves the heap); they must add up to at least the
    number of items."""
    w = np.asarray(weights, dtype=float)
    order = np.arange(len(w)) if presorted else np.argsort(-w, kind="stable")
    heap = [((loads[j] if loads is not None else 0.0), j) for j in range(len(speeds))]
    heapq.heapify(heap)
    out: list[list[int]] = [[] for _ in speeds]
    sp = list(speeds)
    wl = w.tolist()
    pop, push = heapq.heappop, heapq.heappush
    if caps is not None and sum(caps) < len(w):
        raise ValueError(f"caps: {sum(caps)} places for {len(w)} items")
    for i in order.tolist():
        t, j = pop(heap)
        out[j].append(i)
        if caps is None or len(out[j]) < caps[j]:
            push(heap, (t + wl[i] / sp[j], j))
    return out


def snake(count: int, bins: int) -> np.ndarray:
    """Bin of each of ``count`` sorted items dealt boustrophedon: 0..k-1, k-1..0, ..."""
    pos = np.arange(count) % (2 * bins)
    return np.where(pos < bins, pos, 2 * bins - 1 - pos)


def karmarkar_karp(weights: Sequence[float], bins: int) -> list[list[int]]:
    """Largest differencing method for k-way partitioning: repeatedly merge the two partial
    partitions with the largest spread, pairing the heaviest part of one with the lightest of
    the other. Returns per-bin item indices."""
    if bins < 1:
        raise ValueError(f"bins: {bins} must be >= 1")
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []
    for i, w in enumerate(weights):
        parts = [(float(w), [i])] + [(0.0, []) for _ in range(bins - 1)]
        heapq.heappush(heap, (-float(w), i, parts))
    if not heap:
        return [[] for _ in range(bins)]
    tie = len(weights)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        a = sorted(a, key=lambda p: -p[0])
        b = sorted(b, key=lambda p: p[0])
        merged = [(x[0] + y[0], x[1] + y[1]) for x, y in zip(a, b, strict=True)]
        merged.sort(key=lambda p: -p[0])
        tie += 1
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), tie, merged))
    return [p[1] for p in heap[0][2]]
