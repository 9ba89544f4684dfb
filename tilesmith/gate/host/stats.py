"""Host-side statistics of paired timing samples and the acceptance rule, applied sequentially.

Rule (applied to the first measurement and, separately, to the fresh confirmation; both must pass):

    speedup = median_i( baseline_ms[i] / candidate_ms[i] )        (pairs from the same round)
    accept  ⇔  speedup ≥ 1 + min_improvement   and   ci_low > 1.0

``ci_low``/``ci_high`` are percentiles of the median over ``BOOTSTRAP_RESAMPLES`` percentile-bootstrap
resamples of the pairs (Criterion.rs uses the same construction). The median of per-pair ratios, not a ratio
of medians, because pairing cancels drift common to both arms of a round (Google Benchmark's random
interleaving, https://google.github.io/benchmark/random_interleaving.html; Kalibera & Jones, "Rigorous
benchmarking in reasonable time", ISMM 2013).

Sequential test (:func:`decide`): the host looks at the pairs after every :data:`LOOK_EVERY` rounds and after
the last (``looks(n_max)``: 10, 20, 30 for the default 30 pairs) and stops as soon as the decision is clear:

- **accept** when the rule above holds at this look;
- **slower** when the interval is entirely below 1 (``ci_high < 1``);
- **futile** (``marginal``) when the interval is entirely below the bar (``ci_high < 1 + min_improvement``):
  no later look can pass with such data unless the samples change character;
- otherwise sample the next block; at the last look the classification of :func:`classify` applies.

Correction for the repeated looks: **Bonferroni** over the ``K`` looks of a phase — every look uses the
two-sided ``1 − 0.05/K`` interval (``K = 3``: the 0.83 % / 99.17 % percentiles). Why Bonferroni: the
probability that an A/A phase passes at *some* look is at most the sum over looks of the per-look
probabilities, whatever their dependence (the looks share their first pairs), and it needs no normality
of the median (group-sequential boundaries such as Pocock or O'Brien–Fleming assume normal increments, the
bootstrap median here is not); it is conservative, and the simulation in ``tests/test_gate_stats.py`` shows
the power it keeps. Only acceptance can be a false positive: stopping for "slower" or "futile" can only
reject, which costs power, never A/A safety, so those stops use the same interval without further
correction.

Rates (``tests/test_gate_stats.py``, 3 % per-sample noise plus a 5 % drift common to both arms, two phases):
A/A ≤ 0.1 % per gate, a true 5 % gain accepted ≥ 95 %; with 1 % noise (the H200's launch-bound graphs) an
A/A phase stops after its first look (10 pairs) and a 5 % gain is accepted there. ``bench/gate_calibration.py``
measures both rates on the H200.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

BOOTSTRAP_RESAMPLES = 4000
"""Resamples per interval: 4 000 put ~33 resamples beyond the 0.83 % percentile of a 3-look test."""
LOOK_EVERY = 10
"""Rounds (pairs) between two looks of the sequential test."""
ALPHA = 0.05
"""Two-sided level of one look's interval before the Bonferroni split over the looks."""


@dataclass(frozen=True)
class PairedStats:
    speedup: float
    ci_low: float
    ci_high: float
    n: int


def paired_speedup(baseline_ms: list[float] | tuple[float, ...], candidate_ms: list[float] | tuple[float, ...],
                   seed: int = 0, alpha: float = ALPHA) -> PairedStats:
    """Median per-pair ratio ``baseline/candidate`` and its two-sided ``1 − alpha`` percentile-bootstrap interval.

    Raises:
        ValueError: the lists differ in length, are empty, or hold a non-positive or non-finite time; ``alpha``
            is not in (0, 1).
    """
    b = _as_float64(baseline_ms)
    c = _as_float64(candidate_ms)
    if b.shape != c.shape or b.numel() == 0:
        raise ValueError(f"need equally many baseline and candidate samples (got {b.numel()} and {c.numel()})")
    if not (bool(torch.isfinite(b).all()) and bool(torch.isfinite(c).all()) and bool((b > 0).all())
            and bool((c > 0).all())):
        raise ValueError("timing samples must be finite and positive")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha={alpha!r} must be in (0, 1)")
    ratios = b / c
    speedup = float(torch.quantile(ratios, 0.5))
    generator = torch.Generator().manual_seed(int(seed))
    n = ratios.numel()
    picks = torch.randint(0, n, (BOOTSTRAP_RESAMPLES, n), generator=generator)
    resampled = ratios[picks].sort(dim=1).values
    medians = 0.5 * (resampled[:, (n - 1) // 2] + resampled[:, n // 2])  # numpy's median, also for even n
    q = torch.tensor([0.5 * alpha, 1.0 - 0.5 * alpha], dtype=torch.float64)
    low, high = torch.quantile(medians, q).tolist()
    return PairedStats(speedup, float(low), float(high), int(n))


def looks(max_pairs: int) -> list[int]:
    """Pair counts at which the sequential test looks: every :data:`LOOK_EVERY` and at ``max_pairs``."""
    if max_pairs < 1:
        raise ValueError(f"max_pairs={max_pairs!r} must be ≥ 1")
    points = list(range(LOOK_EVERY, max_pairs, LOOK_EVERY))
    return points + [max_pairs]


def look_alpha(max_pairs: int) -> float:
    """The Bonferroni-split two-sided level of one look: ``ALPHA / len(looks(max_pairs))``."""
    return ALPHA / len(looks(max_pairs))


CPU_PROCESS_ALLOWANCE = 0.15
"""CPU test mode only: the bar is at least ``1 + CPU_PROCESS_ALLOWANCE`` and the interval's low end must exceed
``1 + CPU_PROCESS_ALLOWANCE / 2``. Why: the arms run in different processes, and on the 2-core CI VM identical
code timed 0.95–1.12× between two worker processes even with their allocator settings fixed
(:data:`tilesmith.gate.host.process.CPU_THREAD_ENV`) and their threads on one CPU: a factor of the process (it
stays with the process across runs and reference runs), which more pairs do not average out; the measurement
and the confirmation compare independent process pairs (a second trusted worker), which squares what is left.
CUDA samples (device time) have no such allowance; ``bench/gate_calibration.py`` measures the per-process A/A
spread on the H200."""


def decide(baseline_ms: list[float] | tuple[float, ...], candidate_ms: list[float] | tuple[float, ...],
           max_pairs: int, min_improvement: float, seed: int = 0, allowance: float = 0.0) -> tuple[str, PairedStats]:
    """One look of the sequential test on the pairs so far (``len(baseline_ms)`` of at most ``max_pairs``).

    Returns ``(decision, stats)``: ``"pass"``, ``"slower"`` or ``"marginal"`` (stop), or ``"continue"`` (sample
    the next block); at ``max_pairs`` pairs never ``"continue"``. ``stats`` carries the look's corrected interval.
    ``allowance``: see :func:`passes`.
    """
    st = paired_speedup(baseline_ms, candidate_ms, seed=seed, alpha=look_alpha(max_pairs))
    if passes(st, min_improvement, allowance):
        return "pass", st
    if st.ci_high < 1.0:
        return "slower", st
    if st.ci_high < acceptance_bar(min_improvement, allowance)[0]:
        return classify(st, min_improvement, allowance), st
    if st.n >= max_pairs:
        return classify(st, min_improvement, allowance), st
    return "continue", st


def acceptance_bar(min_improvement: float, allowance: float = 0.0) -> tuple[float, float]:
    """``(median_at_least, ci_low_above)`` of the acceptance rule, as speedup factors: ``1 + max(min_improvement,
    allowance)`` and ``1 + allowance / 2`` (both arguments fractions; ``allowance`` e.g.
    :data:`CPU_PROCESS_ALLOWANCE`, for a per-process bias the samples cannot show)."""
    return 1.0 + max(min_improvement, allowance), 1.0 + allowance / 2


def passes(stats: PairedStats, min_improvement: float, allowance: float = 0.0) -> bool:
    """The acceptance rule above (``min_improvement`` as a fraction, e.g. 0.02): the median reaches and the
    interval's low end exceeds :func:`acceptance_bar`."""
    median_at_least, ci_low_above = acceptance_bar(min_improvement, allowance)
    return stats.speedup >= median_at_least and stats.ci_low > ci_low_above


def guard_holds(speedup_vs_baseline: float, allowance: float = 0.0) -> bool:
    """The controlled rule's guard: the candidate is not slower than the baseline in its own process (median
    per-pair ratio ≥ ``1 - allowance``)."""
    return speedup_vs_baseline >= 1.0 - allowance


CONTROL_TOLERANCE = 0.03
"""How much slower (median per-pair ratio) the baseline's code may run in the candidate's process (the control arm)
than in its own before the gate concludes the candidate slows other code in its process. Honest processes run it
as fast or faster: per candidate process, median 1.004–1.019× on an H100 (docs/gate_calibration_h100_2026-12-07.json)
and 1.010–1.024× on the H200 (docs/h200-runs.md, session 6). Red team 17 accepted a candidate 2 % slower than the
original at a reported 1.8× over the control by turning MKL's verbose mode on as its call returned and off as the
next began, so only the control paid (tests/test_gate_redteam17.py)."""


def control_holds(baseline_ms: list[float] | tuple[float, ...], control_ms: list[float] | tuple[float, ...],
                  allowance: float = 0.0) -> bool:
    """The control arm is trustworthy: the baseline's code in the candidate's process is not slower than in its own
    process beyond ``max(allowance, CONTROL_TOLERANCE)`` (median per-pair ratio ``baseline/control``). A candidate
    that leans process-wide state (library modes without getters, work left running, caches it poisons) against
    the control fails it, whatever the mechanism."""
    return control_ratio(baseline_ms, control_ms) >= 1.0 - max(allowance, CONTROL_TOLERANCE)


def control_ratio(baseline_ms: list[float] | tuple[float, ...], control_ms: list[float] | tuple[float, ...]) -> float:
    """Median per-pair ratio ``baseline/control`` (> 1: the baseline's code ran faster in the candidate's process
    than in its own); NaN without a positive control sample."""
    return median([b / c for b, c in zip(baseline_ms, control_ms, strict=True) if c > 0])


def decide_controlled(baseline_ms: list[float] | tuple[float, ...], control_ms: list[float] | tuple[float, ...],
                      candidate_ms: list[float] | tuple[float, ...], max_pairs: int, min_improvement: float,
                      seed: int = 0, allowance: float = 0.0) -> tuple[str, PairedStats]:
    """One look of the sequential test with an in-process control arm.

    ``control_ms``: the baseline's own code timed in the candidate's process (same CPU, CUDA context and
    allocator as the candidate), ``baseline_ms``: the baseline in its own process (the trusted worker, or the
    incumbent's worker). The rule of :func:`decide` is applied to candidate vs control, where no factor of the
    process can lean the ratio (seen on the H200: the same wrapper timed 1.010–1.024× faster in each of four
    candidate processes than in the trusted worker, which let A/A candidates pass a 2 % bar); a pass then also
    needs the candidate not slower than the baseline in its own process (median ratio ≥ ``1 - allowance``) and the
    control not slower than the baseline in its own process (:func:`control_holds`), so a candidate that slows its
    own process's control gains at most :data:`CONTROL_TOLERANCE`. Before the last look an in-process pass with a
    failed guard continues sampling; at the last it is ``"marginal"``.
    """
    decision, st = decide(control_ms, candidate_ms, max_pairs, min_improvement, seed=seed, allowance=allowance)
    if decision != "pass":
        return decision, st
    guard = paired_speedup(baseline_ms, candidate_ms, seed=seed + 1, alpha=look_alpha(max_pairs))
    if guard_holds(guard.speedup, allowance) and control_holds(baseline_ms, control_ms, allowance):
        return "pass", st
    return ("marginal" if len(candidate_ms) >= max_pairs else "continue"), st


def classify(stats: PairedStats, min_improvement: float, allowance: float = 0.0) -> str:
    """``"pass"``, ``"slower"`` (median ratio below 1) or ``"marginal"`` (not slower, not clearly faster)."""
    if passes(stats, min_improvement, allowance):
        return "pass"
    return "slower" if stats.speedup < 1.0 else "marginal"


def median(values: list[float] | tuple[float, ...]) -> float:
    return float(torch.quantile(_as_float64(values), 0.5)) if len(values) else math.nan


def _as_float64(values: Any) -> torch.Tensor:
    """A 1-D float64 CPU tensor of ``values`` (numpy is not a runtime dependency: torch computes in float64, the
    median of an even count is the mean of the two middle values and percentiles interpolate linearly, as numpy's
    ``median``/``percentile`` do)."""
    return torch.tensor([float(v) for v in values], dtype=torch.float64)
