"""When production verification checks an installed wrapper's call: the schedule and the clock thread.

:class:`Schedule` is the part of :class:`tilesmith.install.verify.Verifier` that picks checked calls (the first
``first`` calls, then geometric gaps of mean ``gap`` — raised by the budget so that checks cost about ``budget``
of the graph's own time — and the first call after ``interval`` seconds without a check; ``TILESMITH_VERIFY``,
docs/verification.md "Which calls are checked"). :data:`CLOCK` is the one daemon thread that arms the timed check
for every installed graph.
"""

from __future__ import annotations

import math
import os
import threading
import time
import weakref
from typing import Any

MAX_GAP = 10_000_000
"""Upper bound of the mean gap between sampled checks (calls), whatever the budget computes."""
_NEVER = 1 << 62
_EMA = 0.3
"""Weight of the newest check in the running estimates of check cost and call time."""


class Schedule:
    """Mixin of :class:`tilesmith.install.verify.Verifier`: needs ``policy``, ``gap``, ``calls``, ``next_check``,
    ``check_cost_s``, ``call_s``, ``spacing_s``, ``gate_call_s``, ``last_check_at``, ``timed_pending``,
    ``_last_end``, ``_last_n`` and ``_rng`` (a private ``random.Random``)."""

    policy: Any
    gap: float
    calls: int
    next_check: int
    check_cost_s: float | None
    call_s: float | None
    spacing_s: float | None
    gate_call_s: float
    last_check_at: float
    timed_pending: bool
    _last_end: float
    _last_n: int
    _rng: Any

    def _sampled_next(self, n: int) -> int:
        """Call number of the next sampled check after call ``n``: a geometric gap of mean ``self.gap``."""
        if self.policy.every is None:
            return _NEVER
        if self.gap <= 1:
            return n + 1
        u = self._rng.random()
        return n + 1 + int(math.log1p(-u) / math.log1p(-1.0 / self.gap))

    def _reschedule(self, n: int, cost_s: float | None, call_s: float | None) -> None:
        if cost_s is not None and call_s is not None:
            self.check_cost_s = _ema(self.check_cost_s, cost_s)
            self.call_s = _ema(self.call_s, call_s)
        every, budget = self.policy.every, self.policy.budget
        if every is not None:
            gap = float(every)
            own = self.graph_time_s()
            if budget is not None and self.check_cost_s is not None and own:
                gap = max(gap, self.check_cost_s / (budget * own))
            self.gap = min(gap, float(MAX_GAP))
        self.last_check_at = time.monotonic()
        self._last_end, self._last_n = time.perf_counter(), n
        self.timed_pending = False
        self.next_check = n + 1 if n < self.policy.first else self._sampled_next(n)
        if self.policy.interval_s is not None:
            CLOCK.poke()

    def graph_time_s(self) -> float | None:
        """Estimated seconds of this graph's own time per call: the smaller of the wrapper's time measured on
        checked calls (an overestimate for tiny graphs: a rare check finds cold caches) and the wall time per call
        between checks (an overestimate when the program does other work between calls), never below half the
        gate's measured time per call (``BenchmarkRecord.tilesmith_ms``): a wrapper that skips its work on calls it
        guesses are unchecked must not shrink its own estimate and so make checks rarer."""
        known = [t for t in (self.call_s, self.spacing_s) if t]
        return max(min(known), 0.5 * self.gate_call_s) if known else None

    def _note_spacing(self, n: int, started: float) -> None:
        between = n - self._last_n - 1  # unchecked calls since the previous check ended
        if between >= 8:
            self.spacing_s = _ema(self.spacing_s, (started - self._last_end) / between)


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - _EMA) * old + _EMA * new


# -- the clock: arms the timed check --------------------------------------------------------------------------
class _Clock:
    """One daemon thread (``tilesmith-verify-clock``) that makes the next call of a graph a checked one when
    ``interval`` seconds passed since its last check. It sleeps until the earliest such moment; a graph that is
    not called then keeps its check pending (the clock does not wake for it again until that check ran)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._states: weakref.WeakSet[Any] = weakref.WeakSet()
        self._thread: threading.Thread | None = None

    def ensure_started(self) -> int | None:
        """Start the thread if needed; return its native id."""
        with self._cond:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="tilesmith-verify-clock", daemon=True)
                self._thread.start()
            thread = self._thread
        for _ in range(1000):  # native_id is set once the thread runs
            if thread.native_id is not None:
                break
            time.sleep(0.001)
        return thread.native_id

    def add(self, state: Any) -> None:
        with self._cond:
            self._states.add(state)
            self._cond.notify()

    def poke(self) -> None:
        """Wake the thread to recompute its sleep (after a check); restart it in a forked child."""
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="tilesmith-verify-clock", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                wait: float | None = None
                for state in list(self._states):
                    interval = state.policy.interval_s
                    if state.failed or interval is None or state.timed_pending:
                        continue
                    due = state.last_check_at + interval
                    if due <= now:
                        state.timed_pending = True
                        state.next_check = min(state.next_check, state.calls + 1)
                    else:
                        wait = due - now if wait is None else min(wait, due - now)
                self._cond.wait(timeout=wait)

    def after_fork(self) -> None:
        self._cond = threading.Condition()
        self._thread = None


CLOCK = _Clock()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=CLOCK.after_fork)
