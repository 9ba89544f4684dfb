"""Host side of the gate's fork server (``TILESMITH_GATE_FORKSERVER=1``, off by default): fresh workers in
milliseconds instead of a Python start and a torch import (seconds) each.

One **zygote** per host process and device type (:mod:`tilesmith.gate.worker.zygote`) is started like a worker
(``python -P -m tilesmith.gate.worker --zygote``, the environment of :func:`.process.worker_environment`, its own
session, a private 0700 folder with private caches) and imports what a worker imports before ``ready``. A
:class:`~tilesmith.gate.host.process.WorkerProcess` then asks it for a child (:func:`start_worker`) instead of
starting ``python``: the child gets its own session, the worker's folder as working directory, the worker's exact
environment (:attr:`WorkerProcess.environ`), pipes the host created (passed with ``SCM_RIGHTS``) and its log, and
from there runs ``__main__.main`` like a started worker: audit hook, parent watch, ``ready``, requests. Each
candidate still gets a fresh process that never imported or ran candidate code: the zygote never does either.

The child is the zygote's child, not the host's: :class:`ForkedProcess` stands in for :class:`subprocess.Popen`
(``pid``, ``stdin``, ``stdout``, ``poll``, ``wait``, ``returncode``). Liveness comes from a pidfd the host opens
before it lets the zygote reap the child (so the pid cannot be reused meanwhile); the exit status from the zygote's
``exit`` report (:data:`UNKNOWN_EXIT` when the zygote ended first).

Never fails a worker start: while the zygote is still starting, after it died, when it refuses a fork or does not
answer, :func:`start_worker` returns ``None`` (and logs why at most once per cause) and the caller starts the
worker with :mod:`subprocess` as without the fork server.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO

from tilesmith import settings

log = logging.getLogger("tilesmith")

UNKNOWN_EXIT = 255
"""Return code of a forked worker whose status the zygote could not report (it ended before the worker)."""
MAX_FAILURES = 3
"""Zygotes that may die or break per host process and device type; after that every worker is started with
``subprocess``."""
REPLY_TIMEOUT_S = 10.0

_LOCK = threading.Lock()
_servers: dict[str, ForkServer] = {}
_failures: dict[str, int] = {}
_said: set[str] = set()


class ForkError(Exception):
    """The zygote refused a fork, died or did not answer."""


#: Set in the zygote's own environment only (never a forked worker's, which gets exactly its own): ``import torch``
#: starts the OpenMP pool (one thread per core) unless told otherwise, and a zygote with threads must not fork
#: (GNU OpenMP is not fork-safe). On the H100 machine the CUDA zygote had 17 threads and refused every fork
#: (2026-12-07); CPU test-mode workers already run with these. A forked worker gets the host's thread count from
#: ``init`` (``torch.set_num_threads``, the host's numeric flags), as a started one does.
ZYGOTE_THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}

#: Also the CUDA zygote's only: ``torch.cuda.is_available()`` asks ``cudaGetDeviceCount``, which runs ``cuInit``
#: and starts the driver's thread, after which no forked child can use CUDA; with this set it asks NVML instead
#: (``torch.cuda.is_available``'s docstring, torch 2.11). On the H100 machine the CUDA zygote had two threads
#: (``python3`` and the driver's ``cuda00001c00008``) after its imports and refused every fork (2026-12-07,
#: bench/worker_start.py); which import asks is what scripts/probes/zygote_cuinit.py prints (not yet run on a GPU).
ZYGOTE_CUDA_ENV = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}


class ForkServer:
    """One zygote process and its control socket. Thread-safe (one lock around the socket)."""

    def __init__(self, device_type: str, base_env: dict[str, str]) -> None:
        from tilesmith.gate.host.caches import private_folder
        from tilesmith.gate.host.process import private_environment

        self.device_type = device_type
        self.base_env = dict(base_env)
        self.dir = private_folder("tilesmith-zygote-")
        self.lock = threading.RLock()
        self.exits: dict[int, int] = {}
        self.info: dict[str, Any] | None = None
        self.broken: str | None = None
        self.started = time.monotonic()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock = ours
        with open(self.dir / "zygote.log", "wb") as log_file:
            self.proc = subprocess.Popen(  # noqa: S603 - fixed argv, no shell
                [sys.executable, "-P", "-m", "tilesmith.gate.worker", f"--device-type={device_type}", "--zygote"],
                stdin=theirs.fileno(), stdout=subprocess.DEVNULL, stderr=log_file, cwd=self.dir,
                env={**self.base_env, **ZYGOTE_THREAD_ENV, **(ZYGOTE_CUDA_ENV if device_type == "cuda" else {}),
                     **private_environment(self.dir)}, start_new_session=True,
                close_fds=True)
        theirs.close()

    # -- channel ---------------------------------------------------------------------------------------------
    def _receive(self, timeout_s: float) -> dict[str, Any] | None:
        """The next message that is not an ``exit`` report (those are kept in :attr:`exits`); ``None`` on timeout.
        Raises :class:`ForkError` when the zygote is gone."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = max(0.0, deadline - time.monotonic())
            if not select.select([self.sock], [], [], remaining)[0]:
                return None
            try:
                data = self.sock.recv(1 << 16)
            except OSError as exc:
                raise self._break(f"control socket: {exc}") from None
            if not data:
                raise self._break("the zygote ended")
            message = json.loads(data)
            if message.get("op") == "exit":
                self.exits[int(message["pid"])] = int(message["code"])
                continue
            return message

    def _break(self, why: str) -> ForkError:
        self.broken = self.broken or why
        return ForkError(why)

    def ready(self, timeout_s: float = 0.0) -> bool:
        """Whether the zygote has announced ``ready`` (waiting at most ``timeout_s``). Raises :class:`ForkError`
        when it died, refuses to fork, or took longer than ``TILESMITH_WORKER_START_TIMEOUT_S``."""
        with self.lock:
            if self.broken:
                raise ForkError(self.broken)
            if self.info is None:
                message = self._receive(timeout_s)
                if message is None:
                    if time.monotonic() - self.started > settings.get("TILESMITH_WORKER_START_TIMEOUT_S"):
                        raise self._break("the zygote did not start in time")
                    return False
                if message.get("op") != "ready":
                    raise self._break(f"unexpected greeting {str(message)[:200]}")
                if message.get("refusal"):
                    raise self._break(f"the zygote cannot fork: {message['refusal']}")
                self.info = message
            return True

    def fork(self, env: dict[str, str], cwd: Path, log_fd: int) -> ForkedProcess:
        """A forked worker whose protocol pipes the host holds and whose stderr is ``log_fd``.

        Raises:
            ForkError: the zygote is not ready, refused, died or did not answer within :data:`REPLY_TIMEOUT_S`.
        """
        with self.lock:
            if not self.ready():
                raise ForkError("the zygote is still starting")
            in_r, in_w = os.pipe()
            out_r, out_w = os.pipe()
            try:
                request = json.dumps({"op": "fork", "env": env, "cwd": str(cwd)}).encode()
                try:
                    socket.send_fds(self.sock, [request], [in_r, out_w, log_fd])
                except OSError as exc:
                    raise self._break(f"control socket: {exc}") from None
                answer = self._receive(REPLY_TIMEOUT_S)
                if answer is None:
                    raise self._break("the zygote did not answer a fork request")
                if answer.get("op") != "forked":
                    raise ForkError(str(answer.get("message") or answer)[:300])
                pid = int(answer["pid"])
                pidfd = os.pidfd_open(pid)  # the zygote reaps it only after "watch": this pid is that child
                self.sock.send(json.dumps({"op": "watch", "pid": pid}).encode())
            except BaseException:
                for fd in (in_w, out_r):
                    os.close(fd)
                raise
            finally:
                os.close(in_r)
                os.close(out_w)
        return ForkedProcess(self, pid, pidfd, open(in_w, "wb"), open(out_r, "rb"))  # noqa: SIM115

    def exit_code(self, pid: int, timeout_s: float = 2.0) -> int | None:
        """Exit status of ended child ``pid`` as the zygote reports it (``None``: the zygote is gone or silent)."""
        deadline = time.monotonic() + timeout_s
        with self.lock:
            while pid not in self.exits and not self.broken and time.monotonic() < deadline:
                try:
                    self._receive(min(0.05, max(0.0, deadline - time.monotonic())))
                except ForkError:
                    break
            return self.exits.pop(pid, None)

    def alive(self) -> bool:
        return self.broken is None and self.proc.poll() is None

    def close(self) -> None:
        """End the zygote (its forked workers go on: each is killed with its own gate) and remove its folder."""
        with self.lock:
            self.broken = self.broken or "closed"
            try:
                self.sock.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                self.proc.wait(timeout=30)
            shutil.rmtree(self.dir, ignore_errors=True)


class ForkedProcess:
    """The part of :class:`subprocess.Popen` that :class:`~tilesmith.gate.host.process.WorkerProcess` uses, for a
    worker the zygote forked (its parent is the zygote, so the host cannot ``waitpid`` it)."""

    def __init__(self, server: ForkServer, pid: int, pidfd: int, stdin: BinaryIO, stdout: BinaryIO) -> None:
        self.server = server
        self.pid = pid
        self.stdin = stdin
        self.stdout = stdout
        self.returncode: int | None = None
        self._pidfd: int | None = pidfd

    def poll(self) -> int | None:
        if self.returncode is None and self._pidfd is not None:
            if select.select([self._pidfd], [], [], 0)[0]:  # readable once the process has ended
                code = self.server.exit_code(self.pid)
                self.returncode = UNKNOWN_EXIT if code is None else code
                os.close(self._pidfd)
                self._pidfd = None
        return self.returncode

    def __del__(self) -> None:
        if self._pidfd is not None:
            try:
                os.close(self._pidfd)
            except OSError:
                pass
            self._pidfd = None

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise subprocess.TimeoutExpired(f"forked worker {self.pid}", timeout or 0.0)
            select.select([self._pidfd], [], [], 1.0 if remaining is None else min(remaining, 1.0))
        return self.returncode  # type: ignore[return-value]


def _say(cause: str, message: str) -> None:
    if cause not in _said:
        _said.add(cause)
        log.warning("tilesmith: gate fork server: %s; starting workers with subprocess", message)


VOLATILE = ("PYTEST_CURRENT_TEST",)
"""Variables that change between workers and that nothing reads while a zygote imports torch (pytest sets this one
per test); a change of another variable (beyond :func:`tilesmith.gate.host.standby.comparable`'s) replaces the
zygote. A forked worker's ``os.environ`` is always exactly the one it is given, these included."""


def _comparable(env: dict[str, str]) -> dict[str, str]:
    """``env`` without what does not change what a zygote imported: the folders every worker gets its own of and
    the variables torch sets while compiling (both dropped by :func:`.standby.comparable`), and :data:`VOLATILE`.
    (The zygote and every child get :func:`.process.private_environment`'s variables set over it.)"""
    from tilesmith.gate.host.standby import comparable

    return {k: v for k, v in comparable(env).items() if k not in VOLATILE}


def server(device_type: str, base_env: dict[str, str]) -> ForkServer | None:
    """The zygote for ``device_type`` and this environment, started (without waiting) when there is none; a
    zygote of another environment (the host's changed; private cache variables aside) is replaced. ``None`` when
    too many zygotes failed or this platform lacks what it needs."""
    base_env = _comparable(base_env)
    with _LOCK:
        current = _servers.get(device_type)
        if current is not None and (current.base_env != base_env or not current.alive()):
            if current.alive():
                changed = sorted(k for k in set(base_env) | set(current.base_env)
                                 if base_env.get(k) != current.base_env.get(k))
                log.info("tilesmith: gate fork server: the worker environment changed (%s): a new zygote",
                         ", ".join(changed)[:300])
            else:
                _failures[device_type] = _failures.get(device_type, 0) + 1
                _say(f"died:{id(current)}", f"the zygote ended ({current.broken or 'exit'})")
            _servers.pop(device_type).close()
            current = None
        if current is None:
            if not hasattr(os, "pidfd_open") or not hasattr(socket, "send_fds"):
                _say("unsupported", "needs os.pidfd_open and socket.send_fds (Linux 5.3+, Python 3.9+)")
                return None
            if _failures.get(device_type, 0) >= MAX_FAILURES:
                _say(f"failures:{device_type}", f"{MAX_FAILURES} zygotes failed already")
                return None
            try:
                current = _servers[device_type] = ForkServer(device_type, base_env)
            except OSError as exc:
                _say("spawn", f"cannot start the zygote: {exc}")
                return None
        return current


def start_worker(base_env: dict[str, str], env: dict[str, str], cwd: Path, log_fd: int,
                 device_type: str) -> ForkedProcess | None:
    """A worker forked from the zygote, or ``None`` (start it with :mod:`subprocess`): the zygote is still
    starting (it was started now if there was none), died, refused or failed (logged)."""
    zygote = server(device_type, base_env)
    if zygote is None:
        return None
    try:
        if not zygote.ready():
            return None
        return zygote.fork(env, cwd, log_fd)
    except (ForkError, OSError, ValueError) as exc:
        _say(f"fork:{id(zygote)}", f"fork failed ({exc})")
        return None


def prepare(device_type: str = "cuda", environ: dict[str, str] | None = None, timeout_s: float = 180.0) -> bool:
    """Start the zygote for workers of ``device_type`` (environment as :class:`WorkerProcess` gives it) and wait
    until it is ready; False when it cannot be (why is logged)."""
    from tilesmith.gate.host.process import worker_environment

    zygote = server(device_type, worker_environment(environ, device_type))
    try:
        return zygote is not None and zygote.ready(timeout_s)
    except ForkError as exc:
        _say(f"prepare:{id(zygote)}", str(exc))
        return False


def shutdown() -> None:
    """End every zygote of this process (at exit; tests)."""
    with _LOCK:
        for zygote in _servers.values():
            zygote.close()
        _servers.clear()
        _failures.clear()
        _said.clear()


atexit.register(shutdown)
