"""Run folders and tracks on disk (docs/layout.md).

A :class:`RunFolder` is one ``tilesmith.compile()`` call: ``<root>/runs/<run-id>/run.json``, written only
once the run tracks a graph (:meth:`RunFolder.open`): a compile whose graphs all stay on Inductor (not
eligible, no optimizer configured) leaves nothing on disk, and its diagnostics stay in memory
(``tilesmith.diagnostics``). A :class:`Track` is one eligible graph inside it: ``<run-id>/<cache-key>/`` with ``track.json``,
``program.fx.txt``, ``attempts/`` and ``profiles/``. Every JSON file is rewritten atomically (temp file +
``os.replace``), so readers (the CLI) never see a torn file.

Disk trouble (read-only or full) never breaks the user's model call: the run moves to a private temporary folder
(removed with the run or at exit; the gate still needs its tracks' files), or where that fails too later writes
are skipped, and the caller gets a ``Diagnostic`` of kind ``disk_unwritable`` once.
"""

from __future__ import annotations

import secrets
import shutil
import tempfile
import threading
import time
import weakref
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tilesmith._atomic import write_json_atomic as _write_json
from tilesmith.capture.source import with_fx_header
from tilesmith.records import CapturedGraph, Diagnostic, Verdict
from tilesmith.track.ring import AttemptRing

FORMAT = 1


def new_run_id() -> str:
    """``YYYYmmddTHHMMSSZ-<8 hex>``: sortable by time and unique across processes."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(4)


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def write_json_atomic(path: Path, document: dict[str, Any]) -> None:
    """Write ``document`` as indented JSON, in key order, atomically (:mod:`tilesmith._atomic`), making the folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_json(path, document, indent=1, sort_keys=False, default=str)


class RunFolder:
    """``<root>/runs/<run-id>/`` and its ``run.json``, written from the first track on (:meth:`open`).

    Diagnostics added before that are kept and written with the first ``run.json``.
    """

    def __init__(self, root: Path, run_id: str, metadata: dict[str, Any]):
        self.root = Path(root)
        self.run_id = run_id
        self.folder = self.root / "runs" / run_id
        self.metadata = dict(metadata)
        self.diagnostics: list[Diagnostic] = []
        self.writable = True
        self.opened = False
        """True once a graph is tracked: only then does the folder exist on disk."""
        self._lock = threading.Lock()

    def open(self) -> Diagnostic | None:
        """Start writing the run folder (called when the run tracks its first graph); idempotent.

        Returns a ``disk_unwritable`` diagnostic when ``run.json`` cannot be written."""
        self.opened = True
        return self.save()

    def add_diagnostic(self, diagnostic: Diagnostic) -> Diagnostic | None:
        """Record a run-level diagnostic and, once the folder is open, rewrite ``run.json``; returns a disk
        diagnostic on failure."""
        with self._lock:
            self.diagnostics.append(diagnostic)
        return self.save() if self.opened else None

    def save(self) -> Diagnostic | None:
        """Write ``run.json`` now (:meth:`open` does this for a live run); a disk diagnostic on failure."""
        if not self.writable:
            return None
        document = {"format": FORMAT, "run_id": self.run_id, **self.metadata,
                    "diagnostics": [asdict(d) for d in self.diagnostics]}
        try:
            write_json_atomic(self.folder / "run.json", document)
        except OSError as exc:
            return self._move_to_temporary(exc, document)
        return None

    def _move_to_temporary(self, exc: OSError, document: dict[str, Any]) -> Diagnostic:
        """The run folder cannot be written (the cache root is a file, read-only or full): the run's tracks — the
        gate needs their snapshot inputs and attempts — go to a private temporary folder, removed when this run
        folder is collected or the process exits; the records are not kept. Where even that fails, later writes
        are skipped."""
        wanted = self.folder
        try:
            self.folder = Path(tempfile.mkdtemp(prefix=f"tilesmith-run-{self.run_id}-"))
            weakref.finalize(self, shutil.rmtree, str(self.folder), True)
            write_json_atomic(self.folder / "run.json", document)
            where = (f"this run's records go to a temporary folder, {self.folder}, removed when the run ends or the "
                     "process exits, and Tilesmith keeps optimizing")
        except OSError as again:
            self.writable = False
            where = f"nor a temporary folder ({again}); later records are skipped"
        return Diagnostic("disk_unwritable", f"run {self.run_id}: cannot write {wanted} ({exc}); {where}. Remedy: "
                          "point TILESMITH_CACHE_DIR at a writable folder to keep run records and cached artifacts.")


class Track:
    """One eligible graph's folder: metadata, FX program, attempt ring, gate profiles."""

    def __init__(self, run: RunFolder, graph: CapturedGraph, key: str, loops: int):
        self.run = run
        self.graph = graph
        self.key = key
        self.folder = run.folder / key
        self.ring = AttemptRing(self.folder / "attempts")
        self.profiles = self.folder / "profiles"
        self.state: dict[str, Any] = {
            "format": FORMAT, "run_id": run.run_id, "graph_key": key, "graph_name": graph.name,
            "kind": graph.kind, "device": graph.device, "inductor_key": graph.inductor_key,
            "status": "optimizing", "created_utc": utc_now(), "updated_utc": utc_now(),
            "loops_requested": loops, "loops_accepted": 0, "turns": 0, "evaluations": [],
            "benchmark": None, "diagnostics": [],
        }

    @property
    def label(self) -> str:
        """How messages name this graph: cache-key prefix and AOT id, e.g. ``1a2b3c4d (0_inference)``."""
        return f"{self.key[:8]} ({self.graph.name})"

    def create(self) -> Path:
        """Create the folder with ``program.fx.txt``, ``attempt_00.py`` and ``track.json``."""
        self.profiles.mkdir(parents=True, exist_ok=True)
        (self.folder / "program.fx.txt").write_text(self.graph.fx_program, encoding="utf-8")
        first = self.ring.push(with_fx_header(self.graph.fx_program, self.graph.canonical_source))
        self.save()
        return first

    def record_evaluation(self, eval_id: str, attempt: int | None, proposer: str, verdict: Verdict) -> None:
        entry = {
            "id": eval_id, "attempt": attempt, "turn": self.state["turns"], "proposer": proposer,
            "status": verdict.status, "accepted": verdict.accepted,
            "speedup": verdict.timing.speedup if verdict.timing else None,
            "confirmation_speedup": verdict.confirmation.speedup if verdict.confirmation else None,
            "reasons": list(verdict.reasons),
            "report": _relative(verdict.report_path, self.folder),
        }
        self.state["evaluations"].append(entry)
        if verdict.accepted:
            self.state["loops_accepted"] += 1
        self.save()

    def update(self, **fields: Any) -> None:
        self.state.update(fields)
        self.save()

    def add_diagnostic(self, diagnostic: Diagnostic) -> None:
        self.state["diagnostics"].append(asdict(diagnostic))
        self.save()

    def save(self) -> None:
        if not self.run.writable:
            return
        self.state["updated_utc"] = utc_now()
        try:
            write_json_atomic(self.folder / "track.json", self.state)
        except OSError:
            self.run.writable = False


def _relative(path: str | None, folder: Path) -> str | None:
    if not path:
        return None
    try:
        return str(Path(path).resolve().relative_to(folder.resolve()))
    except ValueError:
        return str(path)
