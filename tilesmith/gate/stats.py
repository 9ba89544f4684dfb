"""Host-side statistics of paired timing samples and the acceptance rule.

Rule (applied to the first measurement and, separately, to the fresh confirmation; both must pass):

    speedup = median_i( baseline_ms[i] / candidate_ms[i] )        (pairs from the same round)
    accept  ⇔  speedup ≥ 1 + min_improvement   and   ci_low > 1.0

``ci_low``/``ci_high`` are the 2.5 % / 97.5 % percentiles of the median over ``BOOTSTRAP_RESAMPLES``
percentile-bootstrap resamples of the pairs (Criterion.rs uses the same construction with 100 000
resamples; 2 000 give the 2.5 % quantile to about ±0.1 % of the interval width here). The median of
per-pair ratios, not a ratio of medians, because pairing cancels drift common to both arms of a round
(Google Benchmark's random interleaving, https://google.github.io/benchmark/random_interleaving.html;
Kalibera & Jones, "Rigorous benchmarking in reasonable time", ISMM 2013, https://kar.kent.ac.uk/33611/).

Why this is safe: with n = 30 pairs and a per-pair ratio spread σ, the median's
standard error is about 1.25·σ/√30 = 0.23·σ. An identical candidate (A/A) passes one phase only when
its median exceeds 1 + θ: for σ = 1 % and θ = 2 % that is 8.7 standard errors; even at σ = 5 % it is
1.7 (≈ 4.5 %), and the independent confirmation squares that (≈ 0.2 %), while the CI condition removes
most of the remainder. A true 5 % gain sits (5 − 2)/(0.23·σ) standard errors above the bar: ≥ 99.9 %
per phase for σ ≤ 3 %. ``bench/gate_calibration.py`` measures both rates on the H200.

Computed with torch on the CPU in float64 (numpy is not a runtime dependency): the median of an even count is
the mean of the two middle values and the percentiles interpolate linearly (``torch.quantile``'s default,
the same as numpy's ``median``/``percentile``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

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
    b = _as_float64(baseline_ms)
    c = _as_float64(candidate_ms)
    if b.shape != c.shape or b.numel() == 0:
        raise ValueError(f"need equally many baseline and candidate samples (got {b.numel()} and {c.numel()})")
    if not (bool(torch.isfinite(b).all()) and bool(torch.isfinite(c).all()) and bool((b > 0).all())
            and bool((c > 0).all())):
        raise ValueError("timing samples must be finite and positive")
    ratios = b / c
    speedup = float(torch.quantile(ratios, 0.5))
    generator = torch.Generator().manual_seed(int(seed))
    picks = torch.randint(0, ratios.numel(), (BOOTSTRAP_RESAMPLES, ratios.numel()), generator=generator)
    resampled = ratios[picks].sort(dim=1).values
    n = ratios.numel()
    medians = 0.5 * (resampled[:, (n - 1) // 2] + resampled[:, n // 2])  # numpy's median, also for even n
    low, high = torch.quantile(medians, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return PairedStats(speedup, float(low), float(high), int(ratios.numel()))


def passes(stats: PairedStats, min_improvement: float) -> bool:
    """The acceptance rule above (``min_improvement`` as a fraction, e.g. 0.02)."""
    return stats.speedup >= 1.0 + min_improvement and stats.ci_low > 1.0


def classify(stats: PairedStats, min_improvement: float) -> str:
    """``"pass"``, ``"slower"`` (median ratio below 1) or ``"marginal"`` (not slower, not clearly faster)."""
    if passes(stats, min_improvement):
        return "pass"
    return "slower" if stats.speedup < 1.0 else "marginal"


def median(values: list[float] | tuple[float, ...]) -> float:
    """The median (mean of the two middle values for an even count); NaN for no values."""
    return float(torch.quantile(_as_float64(values), 0.5)) if len(values) else math.nan


def _as_float64(values: Any) -> torch.Tensor:
    """A 1-D float64 CPU tensor of ``values`` (a list, tuple, or anything ``float()`` accepts per item)."""
    return torch.tensor([float(v) for v in values], dtype=torch.float64)
