"""Host-side statistics of paired timing samples and the acceptance rule.

Rule (applied to the first measurement and, separately, to the fresh confirmation; both must pass):

    speedup = median_i( baseline_ms[i] / candidate_ms[i] )        (pairs from the same round)
    accept  ⇔  speedup ≥ 1 + min_improvement   and   ci_low > 1.0

``ci_low``/``ci_high`` are the 2.5 % / 97.5 % percentiles of the median over ``BOOTSTRAP_RESAMPLES``
percentile-bootstrap resamples of the pairs (Criterion.rs uses the same construction with 100 000
resamples; 2 000 give the 2.5 % quantile to about ±0.1 % of the interval width here). The median of
per-pair ratios, not a ratio of medians, because pairing cancels drift common to both arms of a round
(anchors.md §5: Google Benchmark random interleaving, Kalibera & Jones).

Why this is safe (anchors.md §5): with n = 30 pairs and a per-pair ratio spread σ, the median's
standard error is about 1.25·σ/√30 = 0.23·σ. An identical candidate (A/A) passes one phase only when
its median exceeds 1 + θ: for σ = 1 % and θ = 2 % that is 8.7 standard errors; even at σ = 5 % it is
1.7 (≈ 4.5 %), and the independent confirmation squares that (≈ 0.2 %), while the CI condition removes
most of the remainder. A true 5 % gain sits (5 − 2)/(0.23·σ) standard errors above the bar: ≥ 99.9 %
per phase for σ ≤ 3 %. ``bench/gate_calibration.py`` measures both rates on the H200.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

BOOTSTRAP_RESAMPLES = 2000


@dataclass(frozen=True)
class PairedStats:
    speedup: float
    ci_low: float
    ci_high: float
    n: int


def paired_speedup(baseline_ms: list[float] | tuple[float, ...], candidate_ms: list[float] | tuple[float, ...],
                   seed: int = 0) -> PairedStats:
    """Median per-pair ratio ``baseline/candidate`` and its 95 % percentile-bootstrap interval.

    Raises:
        ValueError: the lists differ in length, are empty, or hold a non-positive or non-finite time.
    """
    b = np.asarray(baseline_ms, dtype=np.float64)
    c = np.asarray(candidate_ms, dtype=np.float64)
    if b.shape != c.shape or b.size == 0:
        raise ValueError(f"need equally many baseline and candidate samples (got {b.size} and {c.size})")
    if not (np.all(np.isfinite(b)) and np.all(np.isfinite(c)) and np.all(b > 0) and np.all(c > 0)):
        raise ValueError("timing samples must be finite and positive")
    ratios = b / c
    speedup = float(np.median(ratios))
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, ratios.size, size=(BOOTSTRAP_RESAMPLES, ratios.size))
    medians = np.median(ratios[picks], axis=1)
    low, high = np.percentile(medians, [2.5, 97.5])
    return PairedStats(speedup, float(low), float(high), int(ratios.size))


def passes(stats: PairedStats, min_improvement: float) -> bool:
    """The acceptance rule above (``min_improvement`` as a fraction, e.g. 0.02)."""
    return stats.speedup >= 1.0 + min_improvement and stats.ci_low > 1.0


def classify(stats: PairedStats, min_improvement: float) -> str:
    """``"pass"``, ``"slower"`` (median ratio below 1) or ``"marginal"`` (not slower, not clearly faster)."""
    if passes(stats, min_improvement):
        return "pass"
    return "slower" if stats.speedup < 1.0 else "marginal"


def median(values: list[float] | tuple[float, ...]) -> float:
    return float(np.median(np.asarray(values, dtype=np.float64))) if len(values) else math.nan
