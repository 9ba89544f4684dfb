"""The acceptance statistic: median per-pair ratio with a bootstrap CI, and the two-phase rule's error rates
under a simulated timing-noise model (the real rates on the H200 come from bench/gate_calibration.py)."""

from __future__ import annotations

import numpy as np
import pytest

from tilesmith.gate.host import stats


def test_speedup_is_the_median_of_per_pair_ratios_not_a_ratio_of_medians():
    base = [10.0, 10.0, 10.0, 30.0, 30.0]
    cand = [5.0, 10.0, 20.0, 10.0, 30.0]
    st = stats.paired_speedup(base, cand)
    assert st.speedup == pytest.approx(1.0)  # ratios 2, 1, 0.5, 3, 1 → median 1
    assert np.median(base) / np.median(cand) == pytest.approx(1.0)
    assert st.ci_low <= st.speedup <= st.ci_high and st.n == 5


def test_interval_is_reproducible_for_a_seed_and_narrows_with_agreement():
    rng = np.random.default_rng(0)
    base = list(1.0 + rng.normal(0, 0.01, 30))
    cand = list(np.array(base) / 1.1)
    a, b = stats.paired_speedup(base, cand, seed=3), stats.paired_speedup(base, cand, seed=3)
    assert a == b
    assert a.speedup == pytest.approx(1.1) and a.ci_high - a.ci_low < 1e-9


@pytest.mark.parametrize("base, cand", [([], []), ([1.0], [1.0, 2.0]), ([1.0, 0.0], [1.0, 1.0]),
                                        ([1.0, float("nan")], [1.0, 1.0])])
def test_invalid_samples_are_refused(base, cand):
    with pytest.raises(ValueError):
        stats.paired_speedup(base, cand)


def test_rule_needs_both_the_threshold_and_a_ci_above_one():
    assert stats.passes(stats.PairedStats(1.05, 1.01, 1.08, 30), 0.02)
    assert not stats.passes(stats.PairedStats(1.05, 0.99, 1.08, 30), 0.02)
    assert not stats.passes(stats.PairedStats(1.019, 1.01, 1.03, 30), 0.02)
    assert stats.classify(stats.PairedStats(0.9, 0.85, 0.95, 30), 0.02) == "slower"
    assert stats.classify(stats.PairedStats(1.01, 1.0, 1.02, 30), 0.02) == "marginal"


def _simulate(true_gain: float, noise: float, trials: int, pairs: int, seed: int) -> float:
    """Fraction of two-phase gates that accept, with multiplicative log-normal noise per sample plus a
    per-phase drift common to both arms (what pairing must cancel)."""
    rng = np.random.default_rng(seed)
    accepted = 0
    for _ in range(trials):
        ok = True
        for _phase in range(2):
            drift = np.exp(rng.normal(0, 0.05))
            base = drift * np.exp(rng.normal(0, noise, pairs))
            cand = drift / (1 + true_gain) * np.exp(rng.normal(0, noise, pairs))
            ok = ok and stats.passes(stats.paired_speedup(base, cand, seed=int(rng.integers(1 << 30))), 0.02)
        accepted += ok
    return accepted / trials


def test_identical_candidate_is_almost_never_accepted_under_noisy_timing():
    # 3 % per-sample noise (above the 0.2-1.5 % median CV measured on H100, anchors.md §5).
    assert _simulate(0.0, 0.03, trials=400, pairs=30, seed=1) <= 0.001


def test_true_five_percent_gain_is_accepted_under_noisy_timing():
    assert _simulate(0.05, 0.03, trials=200, pairs=30, seed=2) >= 0.95
