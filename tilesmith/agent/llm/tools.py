"""The agent's own tools, and the per-turn state they share with the outer loop.

Tools (in addition to deepagents' file tools, which are rooted at the track folder):

* ``evaluate_attempt(note)`` — the host checks the agency rule (:mod:`.launches`) and then runs the
  gate through :meth:`Session.evaluate`; the verdict (status, reasons, failures, timing, report path)
  is the tool result.
* ``profile_attempt()`` — per-kernel times of the current attempt (:mod:`.profiling`, subprocess with
  no secrets in its environment).
* ``read_fx_program()`` — the FX program the wrapper was generated from.

No shell tool is offered. Tools never raise into the agent: a host-side failure comes back as text.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from langchain_core.tools import BaseTool, tool

from tilesmith.agent.llm.launches import check_agency
from tilesmith.agent.protocol import Session
from tilesmith.records import Verdict

_MAX_FAILURES_SHOWN = 12


def _caller() -> str:
    try:
        from langgraph.config import get_config

        name = (get_config().get("metadata") or {}).get("lc_agent_name")
        return str(name) if name else "main"
    except Exception:  # noqa: BLE001 - outside a graph run
        return "main"


def _virtual(workspace: Path, path: str | Path | None) -> str | None:
    if not path:
        return None
    p = Path(path)
    try:
        return "/" + p.resolve().relative_to(workspace.resolve()).as_posix()
    except ValueError:
        return str(p)


def format_verdict(verdict: Verdict, workspace: Path) -> str:
    """The tool result for a gate verdict: the decision first, then what to fix."""
    lines = [("ACCEPTED: " if verdict.accepted else "REJECTED: ") + verdict.summary()]
    for reason in verdict.reasons:
        lines.append(f"- reason: {reason}")
    for failure in verdict.failures[:_MAX_FAILURES_SHOWN]:
        where = ", ".join(f"{k}={v}" for k, v in (("output", failure.output_index), ("input", failure.input_index),
                                                    ("variant", failure.variant)) if v is not None)
        lines.append(f"- failed check {failure.check}{f' ({where})' if where else ''}: {failure.message}")
    if len(verdict.failures) > _MAX_FAILURES_SHOWN:
        lines.append(f"- … {len(verdict.failures) - _MAX_FAILURES_SHOWN} more failures in the report")
    timing = verdict.timing
    if timing is not None:
        lines.append(f"- timing: baseline ({timing.baseline_label}) median {timing.baseline_median_ms:.4f} ms, "
                     f"candidate median {timing.candidate_median_ms:.4f} ms, speedup {timing.speedup:.3f} "
                     f"[{timing.ci_low:.3f}, {timing.ci_high:.3f}] over {len(timing.baseline_ms)} pairs")
    if verdict.confirmation is not None:
        lines.append(f"- confirmation (fresh process): speedup {verdict.confirmation.speedup:.3f}")
    report = _virtual(workspace, verdict.report_path)
    if report:
        lines.append(f"- full report: {report}")
    if verdict.accepted:
        lines.append("This loop is done. End your turn now with a one-paragraph summary of the change.")
    return "\n".join(lines)


@dataclass
class TurnState:
    """What one turn's tools and the outer loop share (one instance per turn, thread-safe)."""

    session: Session
    turn: int
    attempt_path: Path
    attempt_virtual: str
    start_text: str
    original_source: str
    agency: str
    proposer: str
    on_event: Callable[..., None] | None = None
    """``on_event(event, **fields)``: the trace recorder's ``write`` when traces are on."""
    verdicts: list[Verdict] = field(default_factory=list)
    host_rejections: list[str] = field(default_factory=list)
    last_evaluated_text: str | None = None
    accepted: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def evaluated(self) -> bool:
        return bool(self.verdicts or self.host_rejections)

    def current_text(self) -> str:
        try:
            return self.attempt_path.read_text(encoding="utf-8")
        except OSError as exc:
            return f"# attempt file unreadable: {exc.strerror}\n"

    def changed_since_evaluation(self) -> bool:
        text = self.current_text()
        reference = self.last_evaluated_text if self.last_evaluated_text is not None else self.start_text
        return text != reference

    def evaluate(self, by: str, note: str = "") -> str:
        """Check the agency rule, then run the gate on the attempt's current text; return the tool text."""
        with self.lock:
            if self.accepted:
                return ("This turn's candidate was already accepted. End your turn now; the next turn starts "
                        "from the accepted source.")
            text = self.current_text()
            if text == self.last_evaluated_text:
                return ("This exact source was already evaluated in this turn (see the previous result). Change "
                        f"{self.attempt_virtual} before evaluating again.")
            self.last_evaluated_text = text
            check = check_agency(self.agency, self.original_source, text)
            if not check.ok:
                self.host_rejections.append("; ".join(check.reasons))
                reject = getattr(self.session, "reject", None)
                verdict = reject(text, proposer=self.proposer, reasons=tuple(check.reasons), note=note[:200]) \
                    if callable(reject) else None
                self._emit("evaluation", by=by, status="rejected_policy", summary="host agency check",
                           reasons=list(check.reasons),
                           report=_virtual(self.session.workspace, verdict.report_path) if verdict else None)
                return ("REJECTED by the host before the gate (rejected_policy):\n"
                        + "\n".join(f"- {r}" for r in check.reasons))
            try:
                verdict = self.session.evaluate(text, proposer=self.proposer, note=note[:200])
            except Exception as exc:  # noqa: BLE001 - a host failure must not crash the agent
                self._emit("evaluation", by=by, status="host_error", summary=f"{type(exc).__name__}: {exc}")
                return f"The host could not evaluate the attempt ({type(exc).__name__}: {exc}). Try again later."
            self.verdicts.append(verdict)
            if verdict.accepted:
                self.accepted = True
            self._emit("evaluation", by=by, status=verdict.status, summary=verdict.summary(),
                       report=_virtual(self.session.workspace, verdict.report_path))
            return format_verdict(verdict, self.session.workspace)

    def _emit(self, event: str, **fields: Any) -> None:
        if self.on_event is not None:
            self.on_event(event, **fields)


def make_tools(state: TurnState, *, profile: Callable[[Path], str]) -> list[BaseTool]:
    """The three host tools bound to one turn's :class:`TurnState`.

    Args:
        state: this turn's state.
        profile: ``profile(attempt_path) -> text`` (usually :func:`.profiling.profile_source` bound to
            the graph and the worker timeout).
    """

    @tool
    def evaluate_attempt(note: str = "") -> str:
        """Submit the current attempt file to the host gate (correctness on several input variants,
        paired timing, confirmation in a fresh process). Returns ACCEPTED or REJECTED with the reasons,
        failed checks and timing. `note`: one line saying what you changed."""
        return state.evaluate(f"tool:{_caller()}", note)

    @tool
    def profile_attempt() -> str:
        """Profile the current attempt file: per-kernel time per call and launch counts (torch.profiler in
        a separate process, random inputs). Use it to find where time goes before editing."""
        try:
            return profile(state.attempt_path)
        except Exception as exc:  # noqa: BLE001
            return f"profiling failed on the host: {type(exc).__name__}: {exc}"

    @tool
    def read_fx_program() -> str:
        """Return the FX program (ATen ops with shapes, strides and dtypes) that the wrapper computes."""
        path = state.session.workspace / "program.fx.txt"
        try:
            return path.read_text(encoding="utf-8")
        except OSError:
            return state.session.graph.fx_program

    return [evaluate_attempt, profile_attempt, read_fx_program]
