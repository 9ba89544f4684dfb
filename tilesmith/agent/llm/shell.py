"""The agent's ``gpu_shell``: a persistent shell workspace per graph, every command in the sandbox (:mod:`.sandbox`).

Layout (the host side lives in the track folder, so it stays with the run; nothing secret is written there)::

    <track>/shell/          /workspace inside: read-write, the working directory, kept between commands
        candidate.py        the active attempt: copied in before each command, copied back after it
        baseline.py         the original Inductor wrapper (with the FX header)        read-only inside
        runner.py           tilesmith/agent/llm/shell_runner.py: run/time on inputs   read-only inside
        inputs/             inputs.pt, constants.pt of the graph's snapshot           read-only inside
                            (a bind of the host's private snapshot folder: nothing is copied into the track)
    <private temp folder>   /cache inside: HOME, Inductor and Triton caches; deleted when the graph ends

Sync rule: before each command the host writes the active attempt's text to ``candidate.py`` (replacing whatever
is there, never through a link); after it, a changed ``candidate.py`` that is a regular UTF-8 file of at most
:data:`MAX_SOURCE_BYTES` becomes the active attempt. A deleted or replaced ``candidate.py`` leaves the attempt as
it was, and the result says so. The other host files are rewritten before each command the same way, and FIFOs
and sockets a command leaves in the workspace are deleted after it (:func:`sweep_special_files`).

One command at a time per graph, never during a gate evaluation of the same turn (both hold the turn's lock), so
shell work on the GPU does not disturb the gate's timing. Time limit per command: ``timeout_seconds`` (default
:data:`DEFAULT_TIMEOUT_S`, at most :data:`MAX_TIMEOUT_S`, 0.1.4's 20 minutes), and never past the graph's own
wall-clock limit (``Session.time_left_s``, when the session has it).
"""

from __future__ import annotations

import os
import secrets
import shutil
import stat
import tempfile
import threading
from pathlib import Path
from typing import Any

from tilesmith.agent.llm.sandbox import MAX_OUTPUT_BYTES, Sandbox, ShellResult
from tilesmith.capture.source import with_fx_header
from tilesmith.secrets import Redactor

DEFAULT_TIMEOUT_S = 300
MAX_TIMEOUT_S = 1200
MAX_SOURCE_BYTES = 64 * 1024 * 1024
"""Largest candidate.py copied back (0.1.4's source cap)."""
RUNNER = Path(__file__).with_name("shell_runner.py")

HELP = """gpu_shell(command, timeout_seconds=300) runs `bash -c command` in a sandbox on this machine's GPU.
Working directory /workspace (kept for this graph):
- candidate.py: the active attempt. The host copies {attempt} here before every command and copies a changed
  candidate.py back to {attempt} after it: edit candidate.py (sed, python, patch) or the attempt file, either works.
- baseline.py (the original wrapper), runner.py and inputs/ (the graph's real inputs and constants): read-only.
- `python runner.py` runs candidate.py once and compares it with baseline.py; `python runner.py --time` also times
  both (median ms per call, CUDA events); `python runner.py other.py --time --iters 50` for another file.
- Anything else you create in /workspace persists between commands; /tmp is fresh per command; /cache holds the
  Inductor/Triton caches. There is no network, no access to files outside these folders, and no secrets.
- Output: the last {max_kib} KiB of stdout and of stderr. Limits: timeout_seconds (at most {max_s} s), CPU time,
  1 GiB per file. Timings here are a guide; the host gate's paired measurement decides."""


def _write_host_file(path: Path, data: bytes) -> None:
    """Replace ``path`` with a regular file holding ``data``; never writes through a link the shell left there."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    os.replace(tmp, path)


def _read_regular(path: Path, limit: int) -> tuple[str | None, str]:
    """``(text, "")`` for a regular UTF-8 file of at most ``limit`` bytes, else ``(None, why)``; never follows links
    and never blocks on a FIFO."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        return None, "was deleted"
    except OSError as exc:
        return None, f"cannot be read ({exc.strerror}; a symbolic link is not followed)"
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return None, "is not a regular file"
        if info.st_size > limit:
            return None, f"is larger than {limit} bytes"
        chunks, size = [], 0
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                return None, f"is larger than {limit} bytes"
    finally:
        os.close(fd)
    try:
        return b"".join(chunks).decode("utf-8"), ""
    except UnicodeDecodeError:
        return None, "is not UTF-8 text"


_SWEEP_LIMIT = 200_000


def sweep_special_files(folder: Path) -> list[str]:
    """Delete FIFOs, sockets and device files under ``folder`` (a FIFO would block a host file tool that opens
    it); return their paths relative to ``folder``. Links are left alone (never followed; the host's file tools
    refuse links that leave the track). Walks at most :data:`_SWEEP_LIMIT` entries."""
    removed: list[str] = []
    seen = 0
    for root, dirs, files in os.walk(folder, followlinks=False):
        for name in files + dirs:
            seen += 1
            if seen > _SWEEP_LIMIT:
                return removed
            path = Path(root) / name
            try:
                mode = os.lstat(path).st_mode
            except OSError:
                continue
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
                try:
                    path.unlink()
                    removed.append(str(path.relative_to(folder)))
                except OSError:
                    pass
    return removed


class GraphShell:
    """One graph's shell workspace and its sandboxed commands (module docstring).

    Args:
        sandbox: the run's working :class:`~.sandbox.Sandbox`.
        session: the graph's session (``workspace``, ``graph``; optional ``snapshot_dir`` and ``time_left_s``).
        redactor: the run's redactor; every result passes it (defence in depth: the sandbox holds no secret).
    """

    def __init__(self, sandbox: Sandbox, session: Any, redactor: Redactor) -> None:
        self.sandbox = sandbox
        self.session = session
        self.redactor = redactor
        self.folder = Path(session.workspace) / "shell"
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "inputs").mkdir(exist_ok=True)
        self.cache = Path(tempfile.mkdtemp(prefix="tilesmith-shell-cache-"))
        (self.cache / "home").mkdir()
        graph = session.graph
        self._baseline = with_fx_header(graph.fx_program, graph.canonical_source).encode("utf-8")
        self._runner = RUNNER.read_bytes()
        snapshot = getattr(session, "snapshot_dir", None)
        self._inputs = Path(snapshot) if snapshot and Path(snapshot).is_dir() else self.folder / "inputs"
        self._lock = threading.Lock()
        self._write_host_files()
        self.commands = 0

    def help(self, attempt_virtual: str) -> str:
        """The prompt section describing the shell (attempt path filled in)."""
        return HELP.format(attempt=attempt_virtual, max_kib=MAX_OUTPUT_BYTES // 1024, max_s=MAX_TIMEOUT_S)

    def _write_host_files(self) -> None:
        _write_host_file(self.folder / "baseline.py", self._baseline)
        _write_host_file(self.folder / "runner.py", self._runner)
        inputs = self.folder / "inputs"
        if inputs.is_symlink() or not inputs.is_dir():
            inputs.unlink(missing_ok=True)
            inputs.mkdir()

    def run(self, command: str, timeout_seconds: Any, attempt_path: Path, attempt_virtual: str,
            lock: threading.Lock | None = None) -> str:
        """Sync the attempt in, run ``command``, sync ``candidate.py`` back; return the tool's text (never raises)."""
        if not isinstance(command, str) or not command.strip():
            return "gpu_shell needs a non-empty command."
        if isinstance(timeout_seconds, bool) or not isinstance(timeout_seconds, int) \
                or not 1 <= timeout_seconds <= MAX_TIMEOUT_S:
            return f"timeout_seconds must be an integer from 1 to {MAX_TIMEOUT_S}; got {timeout_seconds!r}."
        time_left = getattr(self.session, "time_left_s", None)
        limit = float(timeout_seconds)
        note = ""
        if callable(time_left):
            left = float(time_left())
            if left < 1.0:
                return "This graph's wall-clock limit is reached: no more shell commands. End your turn."
            if left < limit:
                limit, note = left, f" (cut to the {left:.0f} s left of this graph's time limit)"
        with lock or threading.Lock(), self._lock:
            try:
                source = attempt_path.read_text(encoding="utf-8")
                self._write_host_files()
                _write_host_file(self.folder / "candidate.py", source.encode("utf-8"))
                result = self.sandbox.run(self.folder, self.cache, self._read_only(), command, limit)
            except OSError as exc:
                return self.redactor(f"the host could not run the command: {type(exc).__name__}: {exc}")
            self.commands += 1
            sync = self._sync_back(source, attempt_path, attempt_virtual)
            removed = sweep_special_files(self.folder)
            if removed:
                sync += (f"; removed {len(removed)} FIFO/socket file(s) the command left in /workspace "
                         f"({', '.join(removed[:5])}): the host's file tools read only regular files")
        return self.redactor(_format(result, sync, note))

    def _read_only(self) -> list[tuple[Path, str]]:
        return [(self.folder / "baseline.py", "/workspace/baseline.py"),
                (self.folder / "runner.py", "/workspace/runner.py"),
                (self._inputs, "/workspace/inputs")]

    def _sync_back(self, before: str, attempt_path: Path, attempt_virtual: str) -> str:
        text, why = _read_regular(self.folder / "candidate.py", MAX_SOURCE_BYTES)
        if text is None:
            return f"candidate.py {why}; {attempt_virtual} is unchanged"
        if text == before:
            return "candidate.py unchanged"
        attempt_path.write_text(text, encoding="utf-8")
        return f"candidate.py changed: copied to {attempt_virtual}"

    def close(self) -> None:
        """Delete the cache folder (the workspace stays with the track)."""
        shutil.rmtree(self.cache, ignore_errors=True)


def _format(result: ShellResult, sync: str, note: str) -> str:
    if result.timed_out:
        head = f"killed after {result.duration_s:.1f} s: the time limit was reached{note}"
    else:
        head = f"exit code {result.exit_code} after {result.duration_s:.2f} s{note}"
    parts = [head, sync]
    for name, text, size in (("stdout", result.stdout, result.stdout_bytes),
                             ("stderr", result.stderr, result.stderr_bytes)):
        cut = f", last {MAX_OUTPUT_BYTES} shown" if size > MAX_OUTPUT_BYTES else ""
        parts.append(f"--- {name} ({size} bytes{cut}) ---")
        if text:
            parts.append(text.rstrip("\n"))
    return "\n".join(parts)
