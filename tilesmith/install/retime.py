"""Production re-timing: an installed wrapper clearly slower than the original in the user's process is uninstalled.

The 2026-12-05 red team's R8 returned correct outputs but ran at 0.20–0.38× of the original in production while the
gate measured it faster: it detected the gate worker (``torch.get_num_threads() == 1``, an environment variable, its
file path) and slept or did extra work only outside it. The gate cannot see what a candidate does only elsewhere, so
production measures: every checked call already runs the original (on copies of the inputs) and then the installed
wrapper (on the caller's); :class:`Retime` keeps the pair of their times.

Clock: wall time (``time.perf_counter``) on the CPU — the user waits for wall time; process CPU time would miss a
wrapper that sleeps or waits and would count a parallel wrapper's threads against it. CUDA: events recorded on the
current stream around each call (the check synchronizes after each anyway), so host noise is not timed.

Rule (defaults below): the first :data:`WARMUP` checked calls are not kept (first calls build caches, pools and
kernels); after at least :data:`MIN_PAIRS` kept pairs, the median of the per-pair ratios ``original / installed``
(the gate's statistic, :mod:`tilesmith.gate.host.stats`) over the last :data:`WINDOW` pairs and the upper end of
its distribution-free (sign-test) ``1 − ALPHA/2`` confidence bound are computed at every check: the ``u``-th
smallest ratio, ``u`` the least count with ``P(Binomial(n, ½) ≥ u) ≤ ALPHA/2``. The wrapper fails
(``slower_in_production``) when that bound is below ``1 − ALLOWANCE``: with 99.5 % confidence the installed
wrapper is more than 1/(1−0.2) = 1.25× slower than the original on the same inputs, at the same moment. (The gate's
percentile bootstrap took ~90 ms per look here on 64 pairs under load; the order statistic costs microseconds and
needs no resampling. With 8 pairs it asks all 8 below the allowance.)

Order: the original always runs first. The installed wrapper thus runs second, on inputs the copy just read
(warm caches, a warmed-up thread pool and clock): on a machine with a core per intra-op thread the bias favours
the installed wrapper. Pairing makes machine load common to both arms: a load spike slows both halves of a pair.
Not on an oversubscribed CPU (test mode only: more runnable threads than cores): there a multi-threaded intra-op
pool waits a scheduler slice for a descheduled thread at parallel regions, and that wait can fall on one arm for
many checks in a row (2-core VM, two CPU burners, torch at 2 threads: calls of 0.1 ms took 13–15 ms in streaks,
and an honest rebinding timed at 0.02× its original, 2026-12-06). The CPU tests therefore run single-threaded
(tests/test_prod_retained.py); CUDA, where this matters, times with events.

Quarantine: yes. Both arms ran under the same load on the same inputs and the allowance is wide; a wrapper that is
1.25× slower than the original with 99.5 % confidence (one-sided) in the user's own process is of no use there, and serving it
again from the cache would repeat the slow checks.

Cost: two clock reads per checked call and one sort of ≤ 64 ratios per check (docs/verification.md).
"""

from __future__ import annotations

import collections
import math
import time
from typing import Any

import torch

WARMUP = 2
"""Checked calls whose times are not kept (first-call effects)."""
MIN_PAIRS = 8
"""Kept pairs before the rule is applied: the fewest for which the sign-test bound exists at ``ALPHA`` (all 8
below: 1/256 ≤ 0.005); with the defaults (first=8) decided at the 10th checked call."""
WINDOW = 64
"""Most recent pairs the rule looks at."""
ALLOWANCE = 0.2
"""Fails only when the ratio's interval lies below ``1 − ALLOWANCE`` (installed > 1.25× slower)."""
ALPHA = 0.01
"""Two-sided level: the rule uses the one-sided ``1 − ALPHA/2`` (99.5 %) sign-test upper bound of the median ratio."""
SLACK_S = 50e-6
"""Fixed seconds per call the installed wrapper may take beyond the original before the ratio is formed (the pair
is ``(original + SLACK_S) / installed``): the installed wrapper pays production verification's own per-call cost
(the audit hook armed and judging its events, one more Python frame), which the original does not. Measured: an
honest rebinding of a 50 µs CPU graph took 77 µs on checked calls (0.66×) without it. Graphs much shorter than
``SLACK_S`` are thus hardly judged; a 1 ms graph slowed 3× still gives 0.37."""


class Stopwatch:
    """Times one call: wall clock on the CPU, CUDA events on the current stream."""

    __slots__ = ("device", "start", "end", "t0")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.start = self.end = None
        self.t0 = 0.0

    def __enter__(self) -> Stopwatch:
        if self.device.type == "cuda":
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.end is not None:
            self.end.record()
        else:
            self.t0 = time.perf_counter() - self.t0

    def seconds(self) -> float:
        """The time (after the caller synchronized the stream on CUDA)."""
        if self.start is not None and self.end is not None:
            return float(self.start.elapsed_time(self.end)) / 1e3
        return self.t0


class Retime:
    """Paired times of one installed graph's checked calls, and the rule (module text)."""

    def __init__(self) -> None:
        self.seen = 0
        self.original: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.installed: collections.deque[float] = collections.deque(maxlen=WINDOW)

    def add(self, original_s: float, installed_s: float) -> None:
        self.seen += 1
        if self.seen > WARMUP and original_s > 0 and installed_s > 0:
            self.original.append(original_s + SLACK_S)
            self.installed.append(installed_s)

    def problem(self) -> str | None:
        """The ``slower_in_production`` detail when the rule holds now, else ``None``."""
        if len(self.original) < MIN_PAIRS:
            return None
        from tilesmith.gate.host.stats import median

        ratios = sorted(o / i for o, i in zip(self.original, self.installed))
        n = len(ratios)
        u = upper_rank(n, ALPHA / 2)
        if u is None or ratios[u - 1] >= 1.0 - ALLOWANCE:
            return None
        shown = ", ".join(f"{r:.2f}" for r in ratios[:3]) + " … " + ", ".join(f"{r:.2f}" for r in ratios[-3:])
        return (f"over its last {n} timed checked calls the installed wrapper ran at {median(ratios):.2f}× the "
                f"original's speed (median of paired ratios (original + {1e6 * SLACK_S:.0f} µs)/installed; "
                f"{100 * (1 - ALPHA / 2):.1f} % upper bound {ratios[u - 1]:.2f}, below the allowance "
                f"{1 - ALLOWANCE:.2f}; ratios {shown}; median times {_ms(self.original)} vs "
                f"{_ms(self.installed)}): the gate measured it faster, so it runs differently outside the gate")


def upper_rank(n: int, alpha: float) -> int | None:
    """The least ``u`` (1-based) with ``P(Binomial(n, ½) ≥ u) ≤ alpha`` (the ``u``-th smallest of ``n`` samples is an
    upper confidence bound of their median at ``1 − alpha``), ``None`` when even ``u = n`` is not enough."""
    tail = 0.0
    for u in range(n, 0, -1):
        tail += math.comb(n, u) / 2.0 ** n
        if tail > alpha:
            return u + 1 if u < n else None
    return 1


def _ms(values: Any) -> str:
    ordered = sorted(values)
    return f"{1e3 * ordered[len(ordered) // 2]:.3f} ms"
