"""A gate phase's outcome as a :class:`~tilesmith.records.Verdict`: the acceptance rule applied to a phase's
timing (:func:`classify`), and the wording of rejections (:func:`reject` for failed checks, :func:`slow` for a
candidate that is correct but does not clear the rule). Pure functions of the phase records and the gate's
settings; the rule itself is :mod:`tilesmith.gate.host.stats`'s (docs/gate.md, "Acceptance rule")."""

from __future__ import annotations

import dataclasses
from typing import Any

from tilesmith.gate.host import stats
from tilesmith.gate.host.phase import PhaseResult
from tilesmith.records import CheckFailure, Verdict
from tilesmith.secrets import redact

#: The most failed checks a verdict's ``reasons`` spell out (the report has them all).
MAX_REASONS = 8


def classify(phase: PhaseResult, min_improvement: float, allowance: float) -> str:
    """The phase's verdict, ``"pass"``, ``"slower"`` or ``"marginal"``: the sequential test's decision, or the rule
    on all pairs (both with the looks' corrected interval, which ``phase.timing`` carries). With the in-process
    control arm the rule compares against it, and a pass also needs the guard (the speedup over the baseline in
    its own process) and the control (the baseline as fast in the candidate's process) to hold."""
    assert phase.timing is not None
    if phase.decision in ("pass", "slower", "marginal"):
        return phase.decision
    t = phase.timing
    if t.speedup_vs_control is not None and t.speedup_vs_control_ci is not None:
        lo, hi = t.speedup_vs_control_ci
        verdict = stats.classify(stats.PairedStats(t.speedup_vs_control, lo, hi, len(t.candidate_ms)),
                                 min_improvement, allowance)
        held = stats.guard_holds(t.speedup, allowance) and stats.control_holds(
            t.baseline_ms, t.control_ms or (), allowance)
        return "marginal" if verdict == "pass" and not held else verdict
    return stats.classify(stats.PairedStats(t.speedup, t.ci_low, t.ci_high, len(t.baseline_ms)),
                          min_improvement, allowance)


def reject(label: str, status: str, failures: list[CheckFailure], timing: Any, confirmation: Any,
           phase: str) -> Verdict:
    """A rejection for failed checks: each failure's message redacted (tilesmith.secrets), the first
    :data:`MAX_REASONS` as ``"<graph>: [<phase>] <check>: <message>"`` reasons."""
    failures = [dataclasses.replace(f, message=redact(f.message)) for f in failures]
    reasons = tuple(f"{label}: [{phase}] {f.check}: {f.message}" for f in failures[:MAX_REASONS])
    if len(failures) > MAX_REASONS:
        reasons += (f"{label}: … and {len(failures) - MAX_REASONS} more failed checks (see the report)",)
    return Verdict(False, status, reasons, tuple(failures), timing=timing, confirmation=confirmation)  # type: ignore[arg-type]


def slow(label: str, kind: str, timing: Any, confirmation: Any, phase: str, *, min_improvement: float,
         allowance: float, pairs: int) -> Verdict:
    """A correct candidate that did not clear the rule: ``kind`` ``"slower"`` → ``rejected_slower``,
    ``"unconfirmed"`` → ``rejected_unconfirmed`` (the measurement passed, the confirmation did not), else
    ``rejected_marginal``. The reason gives the speedup, its interval, the samples and what acceptance needs."""
    t = confirmation if confirmation is not None else timing
    bar, low = stats.acceptance_bar(min_improvement, allowance)
    baseline = "the accepted incumbent" if t.baseline_label == "incumbent" else "the original Inductor wrapper"
    level = 100.0 * (1.0 - stats.look_alpha(pairs))
    text = (f"{label}: [{phase}] speedup over {baseline} is {t.speedup:.4f} ({level:.1f}% CI "
            f"{t.ci_low:.4f}–{t.ci_high:.4f}, {len(t.baseline_ms)} paired samples of {t.calls_per_sample} "
            f"calls); acceptance needs a median ≥ {bar:.4f} and a CI lower bound > {low:g}"
            + (" (CPU test mode: a per-process allowance, see docs/gate.md)" if allowance else ""))
    if t.speedup_vs_control is not None and t.speedup_vs_control_ci is not None:
        lo, hi = t.speedup_vs_control_ci
        text += (f"; the rule's comparison, over the same code timed in the candidate's own process, is "
                 f"{t.speedup_vs_control:.4f} (CI {lo:.4f}–{hi:.4f}), and a pass also needs the speedup over "
                 f"{baseline} in its own process ≥ {1.0 - allowance:g}")
        if t.control_ms and not stats.control_holds(t.baseline_ms, t.control_ms, allowance):
            ratio = stats.control_ratio(t.baseline_ms, t.control_ms)
            text += (f"; {baseline} ran {ratio:.4f}× as fast in the candidate's process as in its own (≥ "
                     f"{1.0 - max(allowance, stats.CONTROL_TOLERANCE):g} needed): the candidate slows other "
                     f"code in its process (process-wide state it changes, work it leaves running)")
    if kind == "slower":
        status, text = "rejected_slower", text + ". The candidate is slower."
    elif kind == "unconfirmed":
        status, text = "rejected_unconfirmed", text + (f" in a fresh process too; the first measurement gave "
                                                       f"{timing.speedup:.4f} but the confirmation did not.")
    else:
        status, text = "rejected_marginal", text + ". The gain (if any) is too small to confirm."
    return Verdict(False, status, (text,), timing=timing, confirmation=confirmation)  # type: ignore[arg-type]
