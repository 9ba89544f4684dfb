"""Host side of one gate worker process: start, request/answer with deadlines, kill.

A worker is ``python -P -m tilesmith.gate.worker`` started with :mod:`subprocess` (fork+exec, never a
bare fork of the user's CUDA process, never ``multiprocessing``, so the user's ``__main__`` is not
re-run), in a new session (so the whole process group, including compiler children, can be killed), in
a private 0700 working directory, with the environment from :func:`worker_environment` and its stderr
in ``worker.log`` in that directory.

Failures surface as :class:`WorkerCrashed` (the process died: signal, exit code, log tail),
:class:`WorkerTimedOut` (a deadline passed; the worker has been killed) or :class:`WorkerProtocolError`
(the answer was not valid protocol; the worker has been killed). All are
:class:`tilesmith.errors.WorkerError`. The host never unpickles anything a worker wrote: only JSON
lines are read here, and tensors are read elsewhere with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import itertools
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import tilesmith
from tilesmith import settings
from tilesmith.errors import WorkerError
from tilesmith.gate import protocol


class WorkerCrashed(WorkerError):
    """The worker process ended while the host waited for an answer."""

    def __init__(self, message: str, returncode: int | None, log_tail: str) -> None:
        super().__init__(message)
        self.returncode = returncode
        self.log_tail = log_tail


class WorkerTimedOut(WorkerError):
    """A deadline passed; the worker was killed."""

    def __init__(self, message: str, timeout_s: float) -> None:
        super().__init__(message)
        self.timeout_s = timeout_s


class WorkerProtocolError(WorkerError):
    """The worker answered something that is not the protocol; it was killed."""


#: Substrings that mark an environment variable as a secret (case-insensitive), beyond the provider keys.
SECRET_NAME_PARTS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "COOKIE", "AUTH")


def worker_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a worker starts with: the host's, minus every secret and every TILESMITH_* setting.

    Removed: :data:`tilesmith.settings.PROVIDER_KEY_VARIABLES`, secret settings, any name containing one
    of :data:`SECRET_NAME_PARTS`, any variable whose value contains a provider key's value, and all
    ``TILESMITH_*`` variables (the worker gets its configuration in protocol messages). Added: the
    directory that holds the ``tilesmith`` package at the front of ``PYTHONPATH``;
    ``TORCHINDUCTOR_COMPILE_THREADS=1`` unless set (kernels compile in the worker process itself, so no
    compile pool outlives a kill); ``PYTHONUNBUFFERED=1``.
    """
    env = dict(os.environ if environ is None else environ)
    secrets = [v for v in settings.secret_values(env) if len(v) >= 4]
    secret_settings = {s.name for s in settings.REGISTRY.values() if s.secret}
    clean: dict[str, str] = {}
    for name, value in env.items():
        upper = name.upper()
        if name in settings.PROVIDER_KEY_VARIABLES or name in secret_settings or upper.startswith("TILESMITH_"):
            continue
        if any(part in upper for part in SECRET_NAME_PARTS):
            continue
        if any(s in value for s in secrets):
            continue
        clean[name] = value
    root = str(Path(tilesmith.__file__).resolve().parent.parent)
    clean["PYTHONPATH"] = os.pathsep.join([root] + ([clean["PYTHONPATH"]] if clean.get("PYTHONPATH") else []))
    clean.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    clean["PYTHONUNBUFFERED"] = "1"
    return clean


class WorkerProcess:
    """One running worker. Not thread-safe; one request in flight at a time is the normal use."""

    _numbers = itertools.count(1)

    def __init__(self, parent_dir: Path, *, label: str, environ: dict[str, str] | None = None) -> None:
        self.label = f"{label}#{next(self._numbers)}"
        self.dir = Path(tempfile.mkdtemp(prefix="w", dir=parent_dir))
        os.chmod(self.dir, 0o700)
        self.log_path = self.dir / "worker.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - lives as long as the process
        self._ids = itertools.count(1)
        self._buffer = b""
        self._pending: list[int] = []
        self.started = time.monotonic()
        self.ready_info: dict[str, Any] | None = None
        self.saw: set[str] = set()
        """Sources (by SHA-256) this worker has imported; a confirmation needs one that saw none of them."""
        self.proc = subprocess.Popen(  # noqa: S603 - fixed argv, no shell
            [sys.executable, "-P", "-m", "tilesmith.gate.worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, cwd=self.dir,
            env=worker_environment(environ), start_new_session=True, close_fds=True,
        )
        self._out_fd = self.proc.stdout.fileno()  # type: ignore[union-attr]

    # -- lifecycle -----------------------------------------------------------------------------------
    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self, timeout_s: float) -> dict[str, Any]:
        if self.ready_info is None:
            deadline = self.started + timeout_s
            msg = self._read_message(deadline, f"start (import torch, create the device context) of {self.label}",
                                     timeout_s)
            if msg.get("type") != "ready" or msg.get("protocol") != protocol.PROTOCOL_VERSION:
                self.kill()
                raise WorkerProtocolError(f"{self.label} started with an unexpected greeting: {str(msg)[:200]}")
            self.ready_info = msg
        return self.ready_info

    def kill(self) -> None:
        """Kill the worker's whole process group, reap it and delete its directory. Idempotent."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        try:
            self._log.close()
        except OSError:
            pass
        shutil.rmtree(self.dir, ignore_errors=True)

    def log_tail(self, limit: int = 3000) -> str:
        try:
            data = self.log_path.read_bytes()[-limit:]
        except OSError:
            return ""
        text = data.decode("utf-8", "replace")
        return redact(text)

    # -- requests ------------------------------------------------------------------------------------
    def send(self, op: str, **fields: Any) -> int:
        rid = next(self._ids)
        message = {"op": op, "id": rid, **fields}
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(protocol.dumps(message))
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            raise self._crashed(f"{self.label} could not take request {op!r}") from None
        self._pending.append(rid)
        return rid

    def receive(self, rid: int, timeout_s: float, what: str) -> dict[str, Any]:
        """Wait for the answer to request ``rid``; answers to earlier requests are read and discarded."""
        self.wait_ready(settings.get("TILESMITH_WORKER_START_TIMEOUT_S"))
        deadline = time.monotonic() + timeout_s
        while True:
            msg = self._read_message(deadline, what, timeout_s)
            answered = msg.get("id")
            if answered in self._pending:
                self._pending.remove(answered)
            if answered == rid:
                return msg
            if answered is None or not isinstance(answered, int) or answered > rid:
                self.kill()
                raise WorkerProtocolError(f"{self.label} answered request {answered!r} while {what}")

    def request(self, op: str, timeout_s: float, what: str, **fields: Any) -> dict[str, Any]:
        return self.receive(self.send(op, **fields), timeout_s, what)

    def _read_message(self, deadline: float, what: str, timeout_s: float) -> dict[str, Any]:
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.kill()
                raise WorkerTimedOut(f"{what} did not finish within {timeout_s:g} s", timeout_s)
            ready, _, _ = select.select([self._out_fd], [], [], min(remaining, 1.0))
            if not ready:
                if self.proc.poll() is not None:
                    raise self._crashed(f"{self.label} died during {what}")
                continue
            chunk = os.read(self._out_fd, 1 << 16)
            if not chunk:
                raise self._crashed(f"{self.label} died during {what}")
            self._buffer += chunk
            if len(self._buffer) > protocol.MAX_MESSAGE_BYTES:
                self.kill()
                raise WorkerProtocolError(f"{self.label} sent more than {protocol.MAX_MESSAGE_BYTES} bytes without "
                                          f"a line break during {what}")
        line, self._buffer = self._buffer.split(b"\n", 1)
        try:
            return protocol.loads(line)
        except ValueError:
            self.kill()
            raise WorkerProtocolError(f"{self.label} wrote a line that is not protocol JSON during {what}: "
                                      f"{redact(line[:200].decode('utf-8', 'replace'))!r}") from None

    def _crashed(self, message: str) -> WorkerCrashed:
        try:
            code = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # stdout closed but still running: kill it, keep its log
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            code = self.proc.wait(timeout=30)
        tail = self.log_tail()
        detail = describe_exit(code)
        self.kill()
        return WorkerCrashed(f"{message}: {detail}", code, tail)


def describe_exit(code: int | None) -> str:
    """``-11`` → ``"killed by signal SIGSEGV (11)"``; ``3`` → ``"exited with status 3"``."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by signal {name} ({-code})"
    return f"exited with status {code}"


def redact(text: str) -> str:
    """Replace every provider-key value (and anything that looks like a bearer key) with ``<redacted>``."""
    for value in settings.secret_values():
        if len(value) >= 4:
            text = text.replace(value, "<redacted>")
    return re.sub(r"\b(sk|pk|ak|key)-[A-Za-z0-9_\-]{16,}", "<redacted>", text)
