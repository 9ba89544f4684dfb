"""``GraphSession``: the host's implementation of :class:`tilesmith.agent.protocol.Session`.

It connects an optimizer to one graph's track and gate: turns copy the most recently evaluated source into
the attempt ring, every evaluation goes through the host gate and is recorded in ``track.json``, an
accepted candidate becomes the incumbent, and the stop rule (protocol module docstring) ends the loop.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from tilesmith import settings
from tilesmith.agent.protocol import StopOptimization
from tilesmith.capture.source import strip_fx_header, with_fx_header
from tilesmith.records import Candidate, Diagnostic, Verdict
from tilesmith.track.run import Track

log = logging.getLogger("tilesmith")


class GraphSession:
    """One graph's optimization loop state. Not thread-safe: one optimizer drives it at a time."""

    def __init__(self, track: Track, gate: Any, *, agency: str, loops: int, on_diagnostic: Any,
                 progress: Any = None, max_turns: int | None = None, time_limit_s: float | None = None,
                 calls_used: Any = None):
        self.track = track
        self.gate = gate
        self.graph = track.graph
        self.graph_key = track.key
        self.workspace = track.folder
        self.snapshot_dir: Path | None = getattr(getattr(gate, "problem", None), "snapshot_dir", None)
        """The gate's private snapshot folder (``inputs.pt``, ``constants.pt``), shown read-only to the agent's
        sandboxed shell; ``None`` when the gate has none."""
        self.agency = agency
        self.loops = loops
        self.incumbent: Candidate | None = None
        self.incumbent_verdict: Verdict | None = None
        self.verdicts: list[Verdict] = []
        self._on_diagnostic = on_diagnostic
        self._progress = progress
        self._calls_used = calls_used
        self._turns = 0
        self._max_turns = max_turns if max_turns is not None else settings.get("TILESMITH_MAX_TURNS")
        limit = time_limit_s if time_limit_s is not None else settings.get("TILESMITH_GRAPH_TIMEOUT_S")
        self._deadline = time.monotonic() + limit
        self._stopped: str | None = None
        self._host_rejections = 0
        self._last_text = with_fx_header(self.graph.fx_program, self.graph.canonical_source)
        self._seen: dict[str, str] = {_digest(self.graph.canonical_source): "the original Inductor wrapper"}

    # -- protocol -----------------------------------------------------------------------------
    @property
    def accepted_loops(self) -> int:
        return sum(1 for v in self.verdicts if v.accepted)

    @property
    def turns_used(self) -> int:
        return self._turns

    def stop_reason(self) -> str | None:
        if self._stopped:
            return self._stopped
        if self.accepted_loops >= self.loops:
            return f"loops_done: {self.accepted_loops} of {self.loops} requested loops accepted"
        if self._turns >= self._max_turns:
            return f"turn_limit: {self._turns} turns used (TILESMITH_MAX_TURNS={self._max_turns})"
        if time.monotonic() > self._deadline:
            return "time_limit: TILESMITH_GRAPH_TIMEOUT_S elapsed"
        return None

    def time_left_s(self) -> float:
        """Seconds until ``TILESMITH_GRAPH_TIMEOUT_S`` ends this graph's optimization (≥ 0)."""
        return max(0.0, self._deadline - time.monotonic())

    def stop(self, reason: str) -> None:
        """End the loop (e.g. the budget ran out); later ``new_turn`` calls raise ``StopOptimization``."""
        self._stopped = self._stopped or reason

    def current_attempt(self) -> Path:
        newest = self.track.ring.newest()
        assert newest is not None, "track.create() writes attempt_00 before any session exists"
        return newest

    def new_turn(self) -> Path:
        reason = self.stop_reason()
        if reason:
            raise StopOptimization(reason)
        self._turns += 1
        path = self.track.ring.push(self._last_text)
        self.track.update(turns=self._turns)
        self._report_progress()
        return path

    def evaluate(self, source: str | None = None, *, proposer: str, note: str = "") -> Verdict:
        attempt_path = self.current_attempt()
        if source is None:
            text = attempt_path.read_text(encoding="utf-8")
        else:
            text = source if source.startswith("# ----") else with_fx_header(self.graph.fx_program, source)
            attempt_path.write_text(text, encoding="utf-8")
        wrapper = strip_fx_header(text)
        digest = _digest(wrapper)
        candidate = Candidate(source=wrapper, proposer=proposer, attempt=self.track.ring.slot_of(attempt_path),
                              note=note)
        started = time.monotonic()
        if digest in self._seen:
            verdict = Verdict(accepted=False, status="rejected_duplicate",
                              reasons=(f"identical to {self._seen[digest]}; change the wrapper before "
                                       "asking the gate again",))
        else:
            verdict = self.gate.evaluate(candidate, incumbent=self.incumbent)
            self._seen[digest] = f"the candidate evaluated as {verdict.evaluation_id or 'an earlier attempt'}"
        self._last_text = text
        self.verdicts.append(verdict)
        self.track.record_evaluation(verdict.evaluation_id, candidate.attempt, proposer, verdict)
        if verdict.accepted:
            self.incumbent, self.incumbent_verdict = candidate, verdict
        log.info("tilesmith: graph %s %s by %s in %.1f s: %s", self.track.label,
                 "accepted" if verdict.accepted else "rejected", proposer, time.monotonic() - started,
                 verdict.summary())
        self._report_progress()
        return verdict

    def reject(self, source: str, *, proposer: str, reasons: tuple[str, ...] | list[str],
               status: str = "rejected_policy", note: str = "") -> Verdict:
        """Record a rejection the host made without running the gate (e.g. agency low's launch-order rule).

        The verdict is recorded like a gate verdict (``track.json`` evaluations, ``profiles/<id>.json``) and
        the source becomes the most recently evaluated one.
        """
        text = source if source.startswith("# ----") else with_fx_header(self.graph.fx_program, source)
        attempt_path = self.current_attempt()
        self._host_rejections += 1
        eval_id = f"h{self._host_rejections:04d}"
        verdict = Verdict(accepted=False, status=status, reasons=tuple(reasons), evaluation_id=eval_id)  # type: ignore[arg-type]
        report = self.track.profiles / f"{eval_id}.json"
        try:
            self.track.profiles.mkdir(parents=True, exist_ok=True)
            report.write_text(json.dumps({"evaluation_id": eval_id, "graph": self.track.label, "proposer": proposer,
                                          "note": note, "verdict": asdict(verdict),
                                          "candidate_sha256": _digest(strip_fx_header(text))}, indent=1))
            verdict = replace(verdict, report_path=str(report))
        except OSError:
            log.debug("tilesmith: could not write %s", report, exc_info=True)
        self._last_text = text
        self.verdicts.append(verdict)
        self.track.record_evaluation(eval_id, self.track.ring.slot_of(attempt_path), proposer, verdict)
        self._report_progress()
        return verdict

    def incumbent_source(self) -> str:
        return self.incumbent.source if self.incumbent else self.graph.canonical_source

    def note(self, kind: str, message: str) -> Diagnostic:
        diagnostic = Diagnostic(kind, f"graph {self.track.label}: {message}", self.graph_key, self.graph.name)
        self.track.add_diagnostic(diagnostic)
        self._on_diagnostic(diagnostic)
        return diagnostic

    # -- helpers ------------------------------------------------------------------------------
    def best_speedup(self) -> float | None:
        if self.incumbent_verdict is None or self.incumbent_verdict.confirmation is None:
            return None
        timing = self.incumbent_verdict.confirmation
        return timing.speedup_vs_original or timing.speedup

    def _report_progress(self) -> None:
        if self._progress is None:
            return
        calls = self._calls_used() if callable(self._calls_used) else (None, None)
        try:
            self._progress.update(self.track.label, loop=min(self.accepted_loops + 1, self.loops),
                                  loops=self.loops, turn=self._turns, calls_used=calls[0],
                                  calls_budget=calls[1], best_speedup=self.best_speedup())
        except Exception:  # noqa: BLE001 - progress display must never break optimization
            log.debug("tilesmith: progress update failed", exc_info=True)


def _digest(wrapper: str) -> str:
    normalized = "\n".join(line.rstrip() for line in wrapper.strip().splitlines())
    return hashlib.sha256(normalized.encode("utf-8")).hexdigest()
