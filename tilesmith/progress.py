"""Progress display on stderr while graphs are optimized, mirrored to the ``tilesmith`` logger.

The pipeline calls, per graph::

    progress.graph_started("1a2b3c4d (0_inference)")
    progress.update("1a2b3c4d (0_inference)", loop=1, loops=2, turn=3, calls_used=12, calls_budget=70,
                    best_speedup=1.31)
    progress.graph_finished("1a2b3c4d (0_inference)", "installed, 1.31x")

Display (``TILESMITH_PROGRESS``, read at each call): ``off`` prints nothing; ``on`` always prints;
``auto`` (default) prints every change only when stderr is a terminal, and off a terminal one line when a graph's
optimization starts and one when it ends, so a script's or a batch job's log shows what its first call waits for
without a line per turn (a new user took the silence for a hang). On a terminal the status line is rewritten in
place (``\\r`` and erase-line); elsewhere each change is a new line. Lines finished with ``graph_finished`` stay
on screen.

Logging: every message also goes to the ``tilesmith.progress`` logger (start/finish at INFO, updates at
DEBUG), whatever the display mode. Standard ``logging`` configuration applies.

Secrets: every text is passed through :func:`redact`, which replaces the value of any provider-key
variable that is set (the rule of :mod:`tilesmith.secrets`) by ``<redacted>``.

Thread safety: one lock per :class:`Progress`; graphs may be optimized from several threads.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TextIO

from tilesmith import settings
from tilesmith.secrets import redact

log = logging.getLogger("tilesmith.progress")

_ERASE = "\r\x1b[2K"


@dataclass
class _GraphState:
    label: str
    started: float
    loop: int | None = None
    loops: int | None = None
    turn: int | None = None
    calls_used: int | None = None
    calls_budget: int | None = None
    best_speedup: float | None = None
    touched: float = field(default_factory=time.monotonic)


def _format_duration(seconds: float) -> str:
    seconds = int(seconds)
    minutes, sec = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{sec:02d}" if hours else f"{minutes}:{sec:02d}"


def format_status(state: _GraphState, now: float, others: int = 0) -> str:
    """One status line, e.g. ``tilesmith 1a2b3c4d (0_inference) loop 1/2 turn 3 calls 12/70 best 1.31x 0:42``."""
    parts = [f"tilesmith {state.label}"]
    if state.loop is not None:
        parts.append(f"loop {state.loop}/{state.loops}" if state.loops else f"loop {state.loop}")
    if state.turn is not None:
        parts.append(f"turn {state.turn}")
    if state.calls_used is not None:
        budget = "∞" if state.calls_budget is None else str(state.calls_budget)
        parts.append(f"calls {state.calls_used}/{budget}")
    parts.append("best " + (f"{state.best_speedup:.2f}x" if state.best_speedup is not None else "-"))
    parts.append(_format_duration(now - state.started))
    if others:
        parts.append(f"(+{others} more graph{'s' if others > 1 else ''})")
    return " ".join(parts)


class Progress:
    """Progress display for one process.

    Args:
        stream: where to write (default ``sys.stderr``, looked up at each write so redirection works).
        mode: ``"auto"``, ``"on"`` or ``"off"``; ``None`` reads ``TILESMITH_PROGRESS`` at each call.
        clock: monotonic clock in seconds (tests pass a fake one).
    """

    def __init__(self, stream: TextIO | None = None, mode: str | None = None, clock=time.monotonic):
        if mode is not None and mode not in {"auto", "on", "off"}:
            raise ValueError(f"progress mode must be 'auto', 'on' or 'off', got {mode!r}")
        self._stream = stream
        self._mode = mode
        self._clock = clock
        self._lock = threading.Lock()
        self._graphs: dict[str, _GraphState] = {}
        self._live = False  # a status line without newline is on screen
        self._last_line: str | None = None

    # -- output plumbing -------------------------------------------------------------------------------
    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stderr

    def _is_tty(self) -> bool:
        try:
            return bool(self.stream.isatty())
        except (AttributeError, ValueError):
            return False

    def _mode_now(self) -> str:
        if self._mode is not None:
            return self._mode
        try:
            return settings.get("TILESMITH_PROGRESS")
        except ValueError:
            return "auto"  # an invalid value must not break a model call; settings checks report it

    def enabled(self) -> bool:
        """Whether the display prints every change (logging happens regardless)."""
        mode = self._mode_now()
        if mode == "off":
            return False
        return mode == "on" or self._is_tty()

    def _write(self, line: str, *, final: bool, milestone: bool = False) -> None:
        """``milestone``: a graph's start or end, which ``auto`` also prints off a terminal (one line each: a
        script's or a job's log shows what its first call is waiting for)."""
        if not (self.enabled() or (milestone and self._mode_now() == "auto")):
            return
        tty = self._is_tty()
        try:
            if tty:
                self.stream.write(_ERASE + line + ("\n" if final else ""))
                self._live = not final
            elif line != self._last_line or final:
                self.stream.write(line + "\n")
            self._last_line = line
            self.stream.flush()
        except (OSError, ValueError):
            pass  # a closed or broken stderr never breaks optimization

    # -- interface for the pipeline --------------------------------------------------------------------
    def graph_started(self, label: str) -> None:
        """A graph's optimization began. ``label``: cache-key prefix and graph name."""
        label = redact(label)
        with self._lock:
            now = self._clock()
            self._graphs[label] = _GraphState(label=label, started=now, touched=now)
            log.info("optimizing %s", label)
            if self.enabled():
                self._write(format_status(self._graphs[label], now, len(self._graphs) - 1), final=False)
            else:
                self._write(f"tilesmith {label}: optimizing its first call (TILESMITH_PROGRESS=off silences this)",
                            final=True, milestone=True)

    def update(self, label: str, *, loop: int | None = None, loops: int | None = None, turn: int | None = None,
               calls_used: int | None = None, calls_budget: int | None = None,
               best_speedup: float | None = None) -> None:
        """New counters for a graph; arguments left ``None`` keep their previous value (except
        ``calls_budget``, where ``None`` means unlimited once ``calls_used`` is given)."""
        label = redact(label)
        with self._lock:
            now = self._clock()
            state = self._graphs.get(label)
            if state is None:
                state = self._graphs[label] = _GraphState(label=label, started=now)
            for name, value in (("loop", loop), ("loops", loops), ("turn", turn), ("calls_used", calls_used),
                                ("best_speedup", best_speedup)):
                if value is not None:
                    setattr(state, name, value)
            if calls_used is not None:
                state.calls_budget = calls_budget
            state.touched = now
            line = format_status(state, now, len(self._graphs) - 1)
            log.debug("%s", line)
            self._write(line, final=False)

    def graph_finished(self, label: str, outcome: str) -> None:
        """A graph's optimization ended; ``outcome`` is one short phrase (``"installed, 1.31x"``)."""
        label, outcome = redact(label), redact(outcome)
        with self._lock:
            now = self._clock()
            state = self._graphs.pop(label, None)
            elapsed = _format_duration(now - state.started) if state else "-"
            line = f"tilesmith {label}: {outcome} ({elapsed})"
            log.info("%s", line)
            self._write(line, final=True, milestone=True)
            if self._graphs:  # show the next most recently active graph again
                other = max(self._graphs.values(), key=lambda s: s.touched)
                self._write(format_status(other, now, len(self._graphs) - 1), final=False)

    def trace(self, text: str, *, force: bool = False) -> None:
        """One live agent-trace line (a tool call), logged at INFO to ``tilesmith.progress``.

        Shown when the display is enabled, or with ``force`` (``TILESMITH_DEBUG=1``) also when ``auto`` finds no
        terminal; never with ``TILESMITH_PROGRESS=off``. The status line of the most recently active graph is
        shown again below it on a terminal.
        """
        text = redact(text)
        with self._lock:
            log.info("%s", text)
            if self._mode_now() == "off" or not (force or self.enabled()):
                return
            try:
                self.stream.write((_ERASE if self._is_tty() else "") + text + "\n")
                if self._is_tty() and self._graphs:
                    other = max(self._graphs.values(), key=lambda s: s.touched)
                    self.stream.write(_ERASE + format_status(other, self._clock(), len(self._graphs) - 1))
                self.stream.flush()
            except (OSError, ValueError):
                pass

    def message(self, text: str) -> None:
        """A one-off line (e.g. "starting the private proxy"), logged at INFO."""
        text = redact(text)
        with self._lock:
            log.info("%s", text)
            self._write(f"tilesmith: {text}", final=True)


_default = Progress()


def default() -> Progress:
    """The process-wide :class:`Progress` used by the module-level functions."""
    return _default


def graph_started(label: str) -> None:
    _default.graph_started(label)


def update(label: str, **counters) -> None:
    _default.update(label, **counters)


def graph_finished(label: str, outcome: str) -> None:
    _default.graph_finished(label, outcome)


def message(text: str) -> None:
    _default.message(text)
