"""Read run folders, tracks and gate reports (docs/layout.md) for the command line and the HTML report.

Everything here reads files only; it never imports torch or touches a live model. Missing or unreadable
files become ``problems`` strings on the returned objects instead of exceptions, so that one damaged track
cannot hide the others.

Gate reports (``profiles/<eval-id>.json``) are read tolerantly: timing blocks are looked up as
``timing`` / ``confirmation`` at the top level or under ``verdict`` (the shape of
``dataclasses.asdict(tilesmith.records.Verdict)``), each with ``baseline_ms`` and ``candidate_ms``
sample lists (ms per call) and optionally ``original_ms``, ``speedup``, ``ci_low``, ``ci_high``,
``method``, ``baseline_label`` (the fields of :class:`tilesmith.records.Timing`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_KEY_RE = re.compile(r"^[0-9a-f]{64}$")
_HEX_RE = re.compile(r"^[0-9a-f]+$")


class TargetNotFound(LookupError):
    """A run or track named on the command line does not exist or is ambiguous (message says which)."""


def _read_json(path: Path, problems: list[str]) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        problems.append(f"{path.name} unreadable: {exc}")
        return None
    if not isinstance(value, dict):
        problems.append(f"{path.name} is not a JSON object")
        return None
    return value


def number(value: Any) -> float | None:
    """``value`` as a finite float, else ``None``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def cpu_gate_text(doc: dict[str, Any]) -> str:
    """What the CPU test-mode gate asked of a candidate in this run (``run.json``'s ``cpu_gate_bar``), or ``""``:
    its bar is above ``min_improvement`` (tilesmith.gate.host.stats.CPU_PROCESS_ALLOWANCE)."""
    bar = doc.get("cpu_gate_bar")
    if not isinstance(bar, dict) or any(number(bar.get(k)) is None for k in ("median_at_least", "ci_low_above")):
        return ""
    return (f"CPU test-mode graphs: the gate accepts a median speedup >= {bar['median_at_least']:g}x with its "
            f"interval's low end > {bar['ci_low_above']:g}x (a per-process allowance, docs/gate.md)")


@dataclass(frozen=True)
class TimingSamples:
    """One timing block of a gate report (``label`` is ``"measurement"`` or ``"confirmation"``)."""

    label: str
    baseline_ms: tuple[float, ...]
    candidate_ms: tuple[float, ...]
    original_ms: tuple[float, ...] | None
    speedup: float | None
    ci_low: float | None
    ci_high: float | None
    method: str
    baseline_label: str


@dataclass(frozen=True)
class Evaluation:
    """One entry of ``track.json["evaluations"]`` plus the timing blocks of its gate report."""

    id: str
    attempt: int | None
    proposer: str
    status: str
    speedup: float | None
    confirmation_speedup: float | None
    reasons: tuple[str, ...]
    report: Path | None
    timings: tuple[TimingSamples, ...] = ()
    report_problem: str | None = None

    @property
    def accepted(self) -> bool:
        return self.status == "accepted"


@dataclass(frozen=True)
class TrackData:
    """One track folder: ``doc`` is ``track.json`` (``{}`` if unreadable), ``cache`` is ``cache.json``."""

    path: Path
    key: str
    doc: dict[str, Any]
    cache: dict[str, Any] | None
    problems: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return str(self.doc.get("graph_name") or "?")

    @property
    def label(self) -> str:
        return f"{self.key[:8]} ({self.name})"

    @property
    def status(self) -> str:
        return str(self.doc.get("status") or "unknown")

    @property
    def device(self) -> str:
        return str(self.doc.get("device") or "")

    @property
    def benchmark(self) -> dict[str, Any] | None:
        bench = self.doc.get("benchmark")
        return bench if isinstance(bench, dict) else None

    @property
    def speedup(self) -> float | None:
        return number(self.benchmark.get("speedup")) if self.benchmark else None

    @property
    def installed(self) -> bool:
        return self.benchmark is not None and self.status in {"installed", "cache_hit"}

    @property
    def diagnostics(self) -> list[dict[str, Any]]:
        """``track.json``'s diagnostics only; :meth:`RunData.diagnostics_of` adds the run's about this graph."""
        return [d for d in self.doc.get("diagnostics") or [] if isinstance(d, dict)]

    @property
    def gate_reports(self) -> list[Path]:
        """Every gate report on disk for this graph (``profiles/*.json``, by name), whether or not an entry of
        ``track.json``'s evaluations names it (an artifact-cache re-check's report, say)."""
        try:
            return sorted(p for p in (self.path / "profiles").glob("*.json") if p.is_file())
        except OSError:
            return []

    def evaluations(self, *, with_timings: bool = False) -> list[Evaluation]:
        out = []
        for raw in self.doc.get("evaluations") or []:
            if not isinstance(raw, dict):
                continue
            report = raw.get("report")
            report_path = (self.path / report) if isinstance(report, str) and report else None
            if report_path is None and raw.get("id"):
                guess = self.path / "profiles" / f"{raw['id']}.json"
                report_path = guess if guess.is_file() else None
            timings: tuple[TimingSamples, ...] = ()
            problem = None
            if with_timings and report_path is not None:
                timings, problem = load_report_timings(report_path)
            attempt = raw.get("attempt")
            out.append(Evaluation(
                id=str(raw.get("id") or "?"), attempt=attempt if isinstance(attempt, int) else None,
                proposer=str(raw.get("proposer") or ""), status=str(raw.get("status") or "unknown"),
                speedup=number(raw.get("speedup")), confirmation_speedup=number(raw.get("confirmation_speedup")),
                reasons=tuple(str(r) for r in raw.get("reasons") or []), report=report_path, timings=timings,
                report_problem=problem))
        return out


@dataclass(frozen=True)
class RunData:
    """One run folder: ``doc`` is ``run.json`` (``{}`` if unreadable) and its tracks."""

    path: Path
    run_id: str
    doc: dict[str, Any]
    tracks: tuple[TrackData, ...]
    problems: tuple[str, ...] = field(default=())

    @property
    def created(self) -> str:
        return str(self.doc.get("created_utc") or _time_from_run_id(self.run_id))

    @property
    def model(self) -> str:
        return str(self.doc.get("agent_model") or "-")

    @property
    def installed(self) -> list[TrackData]:
        return [t for t in self.tracks if t.installed]

    @property
    def best_speedup(self) -> float | None:
        values = [t.speedup for t in self.installed if t.speedup is not None]
        return max(values) if values else None

    @property
    def diagnostics(self) -> list[dict[str, Any]]:
        return [d for d in self.doc.get("diagnostics") or [] if isinstance(d, dict)]

    @property
    def process_ended(self) -> str | None:
        """``"process <pid> on <host> has ended"`` when ``run.json`` names a process of this host that is no longer
        running (killed, or exited with a graph undecided); ``None`` when it runs, is elsewhere or is not recorded."""
        import os
        import socket

        pid, host = self.doc.get("pid"), self.doc.get("host")
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0 or host != socket.gethostname():
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return f"process {pid} on {host} has ended"
        except OSError:  # e.g. PermissionError: it exists
            return None
        return None

    def diagnostics_of(self, track: TrackData) -> list[dict[str, Any]]:
        """Every diagnostic about ``track``'s graph, of any kind: ``track.json``'s, then those of ``run.json``
        that name its key and are not already among them (e.g. ``cache_recheck_failed``, ``cache_hit``,
        ``duplicate_graph``, which the pipeline records on the run only)."""
        own = track.diagnostics
        seen = {(d.get("kind"), d.get("message")) for d in own}
        extra = [d for d in self.diagnostics if d.get("graph_key") == track.key
                 and (d.get("kind"), d.get("message")) not in seen]
        if track.status in _DECIDED:  # "optimizing in the background ... until" no longer holds (run.json keeps it)
            extra = [d for d in extra if d.get("kind") not in _IN_PROGRESS]
        return own + extra

    @property
    def untracked_diagnostics(self) -> list[dict[str, Any]]:
        """Run diagnostics not about one of the run's tracks: ineligible graphs, run-level notes."""
        keys = {t.key for t in self.tracks}
        return [d for d in self.diagnostics if d.get("graph_key") not in keys or not d.get("graph_key")]

    @property
    def ineligible_graphs(self) -> int:
        """Distinct graphs named by diagnostics that have no track (left on Inductor before optimization)."""
        return len({d.get("graph_key") or d.get("graph_name") for d in self.untracked_diagnostics
                    if d.get("graph_key") or d.get("graph_name")})


_IN_PROGRESS = frozenset({"optimizing_in_background", "cache_rechecking"})
"""Run diagnostics that describe a background decision still running (``tilesmith.optimize``)."""
_DECIDED = frozenset({"installed", "cache_hit", "kept_inductor"})
"""``track.json`` statuses of a graph whose decision is made."""


def _time_from_run_id(run_id: str) -> str:
    m = re.match(r"^(\d{4})(\d{2})(\d{2})T(\d{2})(\d{2})(\d{2})Z", run_id)
    return f"{m[1]}-{m[2]}-{m[3]}T{m[4]}:{m[5]}:{m[6]}Z" if m else "-"


def load_track(path: Path) -> TrackData:
    problems: list[str] = []
    doc = _read_json(path / "track.json", problems)
    if doc is None and not problems:
        problems.append("track.json missing")
    cache = _read_json(path / "cache.json", problems)
    return TrackData(path=path, key=path.name, doc=doc or {}, cache=cache, problems=tuple(problems))


def load_run(path: Path) -> RunData:
    problems: list[str] = []
    doc = _read_json(path / "run.json", problems)
    if doc is None and not problems:
        problems.append("run.json missing (the run may still be starting)")
    tracks = []
    try:
        children = sorted(path.iterdir())
    except OSError as exc:
        children = []
        problems.append(f"cannot list {path}: {exc}")
    for child in children:
        if child.is_dir() and _KEY_RE.match(child.name):
            tracks.append(load_track(child))
    tracks.sort(key=lambda t: (str(t.doc.get("created_utc") or ""), t.name))
    run_id = str((doc or {}).get("run_id") or path.name)
    return RunData(path=path, run_id=run_id, doc=doc or {}, tracks=tuple(tracks), problems=tuple(problems))


def list_runs(root: Path) -> list[RunData]:
    """All runs under ``<root>/runs``, newest first (by run id, which starts with the UTC time)."""
    runs_dir = Path(root) / "runs"
    if not runs_dir.is_dir():
        return []
    runs = [load_run(p) for p in runs_dir.iterdir() if p.is_dir() and not p.name.startswith(".")]
    runs.sort(key=lambda r: (r.created, r.run_id), reverse=True)
    return runs


def resolve(root: Path, target: str) -> tuple[RunData, TrackData | None]:
    """Find what ``target`` names: a run or track folder path, a run id (or unique prefix, or ``latest``),
    ``<run>/<key-prefix>``, or a graph key prefix (≥ 6 hex characters; the newest run holding it).

    Raises:
        TargetNotFound: nothing or several things match; the message lists candidates.
    """
    path = Path(target).expanduser()
    if path.is_dir():
        if (path / "track.json").is_file() or _KEY_RE.match(path.name):
            return load_run(path.parent), load_track(path)
        return load_run(path), None
    if "/" in target:
        run_part, _, key_part = target.partition("/")
        run = _resolve_run(root, run_part)
        return run, _resolve_track_in(run, key_part)
    try:
        return _resolve_run(root, target), None
    except TargetNotFound as run_error:
        if len(target) >= 6 and _HEX_RE.match(target.lower()):
            for run in list_runs(root):
                matches = [t for t in run.tracks if t.key.startswith(target.lower())]
                if len(matches) == 1:
                    return run, matches[0]
        raise run_error


def _resolve_run(root: Path, text: str) -> RunData:
    runs = list_runs(root)
    if not runs:
        raise TargetNotFound(f"no runs under {Path(root) / 'runs'}; run tilesmith.compile(...) first or pass "
                             f"--root / set TILESMITH_CACHE_DIR to the folder that holds runs/")
    if text == "latest":
        return runs[0]
    exact = [r for r in runs if r.run_id == text or r.path.name == text]
    if exact:
        return exact[0]
    matches = [r for r in runs if r.path.name.startswith(text) or r.path.name.endswith(text)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise TargetNotFound(f"no run or graph matches {text!r}; `tilesmith runs` lists run ids "
                             f"(e.g. {runs[0].run_id}); a graph's cache-key prefix needs at least 6 hex characters")
    names = ", ".join(r.run_id for r in matches[:5])
    raise TargetNotFound(f"{text!r} matches {len(matches)} runs ({names}…); give more of the run id")


def _resolve_track_in(run: RunData, key_prefix: str) -> TrackData:
    matches = [t for t in run.tracks if t.key.startswith(key_prefix.lower()) or t.name == key_prefix]
    if len(matches) == 1:
        return matches[0]
    known = ", ".join(t.label for t in run.tracks) or "none"
    what = "no track" if not matches else f"{len(matches)} tracks"
    raise TargetNotFound(f"{what} of run {run.run_id} match {key_prefix!r}; its tracks: {known}")


def _timing_from(label: str, block: Any) -> TimingSamples | None:
    if not isinstance(block, dict):
        return None
    base = [number(v) for v in block.get("baseline_ms") or []]
    cand = [number(v) for v in block.get("candidate_ms") or []]
    base = [v for v in base if v is not None]
    cand = [v for v in cand if v is not None]
    if not base or not cand:
        return None
    orig_raw = block.get("original_ms")
    orig = tuple(v for v in (number(x) for x in orig_raw) if v is not None) if isinstance(orig_raw, list) else None
    return TimingSamples(label=label, baseline_ms=tuple(base), candidate_ms=tuple(cand), original_ms=orig or None,
                         speedup=number(block.get("speedup")), ci_low=number(block.get("ci_low")),
                         ci_high=number(block.get("ci_high")), method=str(block.get("method") or "?"),
                         baseline_label=str(block.get("baseline_label") or "inductor"))


def load_report_timings(path: Path) -> tuple[tuple[TimingSamples, ...], str | None]:
    """Timing blocks of one gate report, and a problem string when it could not be read."""
    problems: list[str] = []
    doc = _read_json(path, problems)
    if doc is None:
        return (), (problems[0] if problems else f"{path.name} missing")
    out = []
    scopes = [doc] + [doc[k] for k in ("verdict", "result") if isinstance(doc.get(k), dict)]
    for label, names in (("measurement", ("timing", "measurement")), ("confirmation", ("confirmation",))):
        for scope in scopes:
            found = next((t for n in names if (t := _timing_from(label, scope.get(n))) is not None), None)
            if found is not None:
                out.append(found)
                break
    return tuple(out), None
