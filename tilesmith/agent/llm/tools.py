"""The agent's own tools, and the per-turn state they share with the outer loop.

Tools (in addition to deepagents' file tools, which are rooted at the track folder):

* ``evaluate_attempt(note)`` — the host checks the agency rule (:mod:`.launches`) and then runs the
  gate through :meth:`Session.evaluate`; the verdict (status, reasons, failures, timing, report path)
  is the tool result.
* ``profile_attempt()`` — per-kernel times of the current attempt (:mod:`.profiling`, subprocess with
  no secrets in its environment).
* ``read_fx_program()`` — the FX program the wrapper was generated from.
* ``read_exact_source(file_path, start_line=1, line_count=200)`` — exact text of a track file (no line-number
  gutters, whitespace kept) for edits that must match byte for byte; ``line_count`` 1..1000 (0.1.4's bounds).
* ``gpu_shell(command, timeout_seconds=300)`` — only when the sandbox works (:mod:`.shell`, :mod:`.sandbox`).

Tools never raise into the agent: a host-side failure comes back as text.
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


MAX_EXACT_LINES = 1000
MAX_EXACT_FILE_BYTES = 64 * 1024 * 1024


def read_exact(workspace: Path, file_path: str, start_line: Any = 1, line_count: Any = 200) -> str:
    """Lines ``start_line .. start_line + line_count - 1`` (1-based) of the track file at virtual ``file_path``,
    exactly as stored (line endings kept, no gutters); an error text for a bad path or range.

    The path must stay inside ``workspace`` after resolving links (``..`` and links that leave it are refused);
    the file must be a regular UTF-8 file of at most 64 MiB.
    """
    for name, value, low, high in (("start_line", start_line, 1, None), ("line_count", line_count, 1,
                                                                         MAX_EXACT_LINES)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (high and value > high):
            bounds = f"from {low} through {high}" if high else f"at least {low}"
            return f"Error: {name} must be an integer {bounds}; got {value!r}"
    root = Path(workspace).resolve()
    virtual = "/" + str(file_path).lstrip("/")
    if ".." in Path(virtual).parts:
        return "Error: path traversal is not allowed"
    target = (root / virtual.lstrip("/")).resolve()
    if target != root and root not in target.parents:
        return f"Error: {virtual} is outside the workspace"
    try:
        if not target.is_file():
            return f"Error: {virtual} is not a file"
        if target.stat().st_size > MAX_EXACT_FILE_BYTES:
            return f"Error: {virtual} is larger than {MAX_EXACT_FILE_BYTES} bytes"
        with open(target, encoding="utf-8", newline="") as handle:
            lines = handle.read().splitlines(keepends=True)
    except (OSError, UnicodeDecodeError) as exc:
        return f"Error: cannot read {virtual}: {exc}"
    if start_line > max(1, len(lines)):
        return f"Error: {virtual} has {len(lines)} lines; start_line {start_line} is past the end"
    return "".join(lines[start_line - 1:start_line - 1 + line_count])


def make_tools(state: TurnState, *, profile: Callable[[Path], str], shell: Any = None) -> list[BaseTool]:
    """The host tools bound to one turn's :class:`TurnState`.

    Args:
        state: this turn's state.
        profile: ``profile(attempt_path) -> text`` (usually :func:`.profiling.profile_source` bound to
            the graph and the worker timeout).
        shell: the graph's :class:`~.shell.GraphShell`, or ``None`` (no ``gpu_shell`` tool).
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

    @tool
    def read_exact_source(file_path: str, start_line: int = 1, line_count: int = 200) -> str:
        """Read exact text of a workspace file (e.g. your attempt) without line-number gutters: whitespace and
        line endings exactly as stored. Use it for text you copy into edit_file's old_string. start_line is
        1-based; line_count is 1 to 1000."""
        return read_exact(state.session.workspace, file_path, start_line, line_count)

    tools: list[BaseTool] = [evaluate_attempt, profile_attempt, read_fx_program, read_exact_source]
    if shell is not None:

        @tool
        def gpu_shell(command: str, timeout_seconds: int = 300) -> str:
            """Run a bash command in this graph's sandboxed GPU workspace (/workspace): Python, Triton, nvcc,
            profilers, timing experiments. candidate.py there is your attempt file, synced both ways;
            `python runner.py --time` times it against baseline.py on the graph's real inputs. No network."""
            return shell.run(command, timeout_seconds, state.attempt_path, state.attempt_virtual, state.lock)

        tools.insert(0, gpu_shell)
    return tools
