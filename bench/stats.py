"""Statistics of the benchmark suite, in pure Python (no numpy at run time).

The suite measures the arms of a case in *rounds*: every round runs each arm's timed block once, in an order
that :func:`round_orders` rotates, and keeps the median of the block's calls. Host noise that lasts longer
than one round (another process, clock changes, the allocator) then hits every arm of that round alike, so the
statistic is the **median over rounds of the per-round ratio** ``other_ms[r] / tilesmith_ms[r]`` (> 1: Tilesmith
is faster), with a 95 % percentile-bootstrap interval of that median (:func:`ratio_stats`). This is the
construction of the host gate (``tilesmith/gate/host/stats.py``; Google Benchmark's random interleaving,
https://github.com/google/benchmark/blob/main/docs/random_interleaving.md; Kalibera & Jones,
"Rigorous Benchmarking in Reasonable Time", ISMM 2013), re-implemented here so the bench needs nothing beyond the standard library.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

BOOTSTRAP_RESAMPLES = 2000
"""Resamples per interval; the same count as the host gate (``tilesmith.gate.host.stats.BOOTSTRAP_RESAMPLES``)."""


def median(values: Sequence[float]) -> float:
    """Median of ``values`` (the mean of the middle two for an even count). Raises ``ValueError`` when empty."""
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        raise ValueError("median of no values")
    mid = n // 2
    return ordered[mid] if n % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])


def quantile(ordered: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0 ≤ q ≤ 1) of the *sorted* ``ordered`` by linear interpolation between closest ranks
    (numpy's default ``"linear"`` method, so the intervals match ``numpy.percentile``)."""
    if not ordered:
        raise ValueError("quantile of no values")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile: q must be in [0, 1], got {q}")
    pos = q * (len(ordered) - 1)
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def bootstrap_median_ci(values: Sequence[float], *, level: float = 0.95, resamples: int = BOOTSTRAP_RESAMPLES,
                        seed: int = 0) -> tuple[float, float]:
    """Percentile-bootstrap interval of the median of ``values``: resample ``len(values)`` values with
    replacement ``resamples`` times (seeded, so reports are reproducible), take each resample's median, and
    return the ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of those medians.

    Raises ``ValueError`` when ``values`` is empty. One value gives a zero-width interval.
    """
    if not values:
        raise ValueError("bootstrap of no values")
    rng = random.Random(seed)
    n = len(values)
    medians = sorted(median([values[rng.randrange(n)] for _ in range(n)]) for _ in range(resamples))
    tail = (1.0 - level) / 2.0
    return quantile(medians, tail), quantile(medians, 1.0 - tail)


def ratio_stats(baseline_ms: Sequence[float | None], candidate_ms: Sequence[float | None], *,
                seed: int = 0) -> dict[str, Any] | None:
    """Median over rounds of ``baseline_ms[r] / candidate_ms[r]`` and its 95 % bootstrap interval.

    Rounds where either value is missing (``None``) or not a finite positive time are left out. Returns
    ``{"ratio": float, "ci": [low, high], "n": rounds used}``, or ``None`` when no round has both.
    """
    ratios = [b / c for b, c in zip(baseline_ms, candidate_ms, strict=False)
              if _valid(b) and _valid(c)]
    if not ratios:
        return None
    low, high = bootstrap_median_ci(ratios, seed=seed)
    return {"ratio": median(ratios), "ci": [low, high], "n": len(ratios)}


def geomean(values: Sequence[float]) -> float | None:
    """Geometric mean of the finite positive ``values``; ``None`` when there are none."""
    kept = [v for v in values if _valid(v)]
    if not kept:
        return None
    return math.exp(sum(math.log(v) for v in kept) / len(kept))


def round_orders(arms: Sequence[str], rounds: int, seed: int = 0) -> list[list[str]]:
    """The arm order of each round: rounds come in cycles of ``len(arms)``; each cycle shuffles the arms
    (``random.Random(seed + cycle)``) and then rotates that order by one position per round, so within a
    complete cycle every arm runs once in every position, and the neighbours of an arm change between cycles.
    """
    arms = list(arms)
    if not arms:
        return [[] for _ in range(rounds)]
    orders = []
    for r in range(rounds):
        cycle, pos = divmod(r, len(arms))
        base = list(arms)
        random.Random(seed + cycle).shuffle(base)
        orders.append(base[pos:] + base[:pos])
    return orders


def _valid(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0
