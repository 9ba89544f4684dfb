"""The private CLIProxyAPI process of one ``tilesmith.compile()`` run.

Lifecycle (facts about the binary from CLIProxyAPI v7.2.140 ``cmd/server/main.go``,
``internal/cmd/run.go``, ``internal/api/server_keepalive.go`` in https://github.com/router-for-me/CLIProxyAPI):

* **Private directory**: ``tempfile.mkdtemp`` (mode 0700) holds ``owner`` (our pid), ``config.yaml``
  and ``proxy.log`` (0600), ``logs/`` (the proxy writes its ``error-*.log`` files into ``./logs`` when
  that folder exists in its working directory), ``home/`` and ``tmp/``. The child runs with that
  directory as working directory and :func:`~tilesmith.agent.llm.redact.proxy_env` as environment, so
  neither a ``.env`` file nor a storage switch of the user's shell reaches it. Everything is deleted
  at :meth:`PrivateProxy.stop`; directories of interpreters that were killed first are swept at the
  next start (:func:`sweep_stale_private_dirs`).
  The user's auth dir (OAuth account files) is used in place, not copied: CLIProxyAPI refreshes
  tokens by rewriting those files, and a refreshed copy would invalidate the user's own refresh token.
* **Start**: a free loopback port is picked in Python; ``cli-proxy-api -config <private>/config.yaml
  -local-model -password <random>``. Ready when ``GET /healthz`` answers 200 and then ``GET /v1/models``
  answers 200 to the per-run client key while the process is alive and has not logged a bind failure.
  The binary logs ``bind: address already in use`` and exits **0** on a busy port: that is
  retried on another port (:data:`PORT_ATTEMPTS` times). Any other exit during startup, any code, is
  a :class:`~tilesmith.agent.llm.errors.ProxyStartError` quoting the logged error lines (redacted).
* **No orphans**: ``-password`` turns on CLIProxyAPI's ``/keep-alive`` dead-man switch — the server
  shuts itself down after 10 s without a ping. A daemon thread pings every
  :data:`KEEPALIVE_INTERVAL_S`; if this interpreter dies (even ``SIGKILL``) the pings stop and the
  proxy exits. The password gates nothing else: with an empty ``secret-key`` the management API is
  not served (``tests/test_proxy_real.py`` checks it). :meth:`PrivateProxy.stop` (also run by
  ``weakref.finalize`` at garbage collection and at interpreter exit) sends ``SIGTERM``, waits
  :data:`STOP_GRACE_S`, then ``SIGKILL``.
* **Restart**: :meth:`PrivateProxy.ensure_running` restarts a proxy that died mid-run once
  (:attr:`PrivateProxy.max_restarts`); a second death raises :class:`~tilesmith.errors.ProxyError`.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tilesmith import settings
from tilesmith.agent.llm.errors import ProxyStartError
from tilesmith.agent.llm.proxy_config import (
    build_private_config,
    env_provider_sections,
    load_user_config,
    write_private_config,
)
from tilesmith.agent.llm.redact import proxy_env
from tilesmith.errors import ProxyError
from tilesmith.records import Diagnostic
from tilesmith.secrets import Redactor, secret_values
import contextlib

PORT_ATTEMPTS = 5
KEEPALIVE_INTERVAL_S = 2.0
"""Ping period; CLIProxyAPI's keep-alive timeout is 10 s (``internal/cmd/run.go``)."""
STOP_GRACE_S = 5.0
_POLL_S = 0.05
_VERSION_RE = re.compile(r"CLIProxyAPI Version: ([^,\s]+)")
_ERROR_RE = re.compile(r"\[(error|fatal)\s*\]|failed to|flag provided but not defined|panic:", re.IGNORECASE)


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1 (the OS picks it; it may be taken again before use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class _Child:
    """What the finalizer needs to clean up; holds no reference to :class:`PrivateProxy`."""

    tmpdir: Path
    proc: subprocess.Popen[bytes] | None = None
    log_handle: Any = None
    stop_ping: threading.Event = field(default_factory=threading.Event)


def _terminate(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    try:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=STOP_GRACE_S)
    except ProcessLookupError:
        pass


def _shutdown(child: _Child) -> None:
    """Stop pings, stop the process, delete the private directory (idempotent)."""
    child.stop_ping.set()
    _terminate(child.proc)
    if child.log_handle is not None:
        with contextlib.suppress(OSError):
            child.log_handle.close()
        child.log_handle = None
    shutil.rmtree(child.tmpdir, ignore_errors=True)


_PREFIX = "tilesmith-proxy-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_private_dirs(root: Path | None = None) -> list[Path]:
    """Delete private directories left by interpreters that were killed before they could clean up.

    A directory ``<tmp>/tilesmith-proxy-*`` owned by this user is stale when the process id in its
    ``owner`` file is no longer running (its proxy has stopped itself by then, through the keep-alive
    switch). Returns the directories removed. Never raises.
    """
    removed: list[Path] = []
    base = Path(root or tempfile.gettempdir())
    try:
        candidates = list(base.glob(_PREFIX + "*"))
    except OSError:
        return removed
    for folder in candidates:
        try:
            if folder.stat().st_uid != os.getuid():
                continue
            owner = int((folder / "owner").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        if owner != os.getpid() and not _pid_alive(owner):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _ping_loop(url: str, password: str, stop: threading.Event, interval_s: float) -> None:
    with httpx.Client(trust_env=False, timeout=2.0) as client:
        while not stop.is_set():
            with contextlib.suppress(httpx.HTTPError):
                client.get(url, headers={"Authorization": f"Bearer {password}"})
            if stop.wait(interval_s):
                return


class PrivateProxy:
    """One private CLIProxyAPI child on 127.0.0.1 (see the module docstring for the lifecycle).

    Args:
        executable: path of the CLIProxyAPI binary (or a stand-in with the same flags).
        model: the model the run asks for (listed in the ``openai-compatibility`` entry of an
            exported OpenAI-compatible key, see :mod:`.proxy_config`).
        environ: environment snapshot to read provider keys and outbound-proxy settings from.
        user_config: the user's CLIProxyAPI YAML, or ``None``.
        auth_dir: the user's auth dir; used in place when it exists, else a private empty one.
        start_timeout_s: readiness deadline per start attempt (default
            ``TILESMITH_CLIPROXYAPI_START_TIMEOUT_S``).
        port_picker: returns the next port to try (tests inject busy ports); default :func:`free_port`.
        max_restarts: restarts allowed after a mid-run death.

    Nothing starts until :meth:`start` or :meth:`ensure_running`.
    """

    def __init__(self, *, executable: str, model: str, environ: Mapping[str, str],
                 user_config: Path | None = None, auth_dir: Path | None = None,
                 start_timeout_s: float | None = None, port_picker: Callable[[], int] | None = None,
                 max_restarts: int = 1, keepalive_interval_s: float = KEEPALIVE_INTERVAL_S) -> None:
        self.executable = executable
        self.model = model
        self._environ = dict(environ)
        self._user_config_path = user_config
        self._auth_dir = auth_dir
        self.start_timeout_s = (start_timeout_s if start_timeout_s is not None
                                else settings.get("TILESMITH_CLIPROXYAPI_START_TIMEOUT_S", self._environ))
        self._port_picker = port_picker or free_port
        self.max_restarts = max_restarts
        self._keepalive_interval_s = keepalive_interval_s
        self._client_key = "tsk-" + secrets.token_hex(24)
        self._password = secrets.token_hex(24)
        self._lock = threading.RLock()
        self._child: _Child | None = None
        self._finalizer: weakref.finalize | None = None
        self._closed = False
        self.port: int | None = None
        self.models: tuple[str, ...] = ()
        self.version: str | None = None
        self.restarts = 0
        self.port_conflicts = 0
        self.events: list[str] = []
        """Lifecycle events in words (no secrets), for diagnostics and traces."""
        self.redactor = Redactor([self._client_key, self._password, *secret_values(self._environ)])
        self.on_restart: Callable[[str], None] | None = None

    # -- public state ---------------------------------------------------------------------------
    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:<port>/v1`` of the running proxy.

        Raises:
            ProxyError: not started.
        """
        if self.port is None:
            raise ProxyError("the private CLIProxyAPI is not started")
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def client_key(self) -> str:
        """The per-run key clients present (a secret: never log it)."""
        return self._client_key

    @property
    def pid(self) -> int | None:
        child = self._child
        return child.proc.pid if child is not None and child.proc is not None else None

    @property
    def private_dir(self) -> Path | None:
        return self._child.tmpdir if self._child is not None else None

    def alive(self) -> bool:
        child = self._child
        return child is not None and child.proc is not None and child.proc.poll() is None

    def secrets(self) -> tuple[str, ...]:
        """Every secret this proxy knows (client key, password, provider keys), for redaction and scans."""
        return self.redactor.values

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the proxy (no-op when it is running).

        Raises:
            ProxyStartError: the executable could not be started, exited during startup, or did not
                answer within ``start_timeout_s`` (diagnostic kind ``"proxy_failed"``).
        """
        with self._lock:
            if self._closed:
                raise ProxyError("the private CLIProxyAPI of this run was already stopped")
            if self.alive():
                return
            self._start_locked(prefer_port=None)

    def ensure_running(self) -> None:
        """Start on first use; restart once if the process died since; else return at once.

        Raises:
            ProxyStartError: the (re)start failed.
            ProxyError: the proxy died again after its allowed restarts, or was stopped.
        """
        with self._lock:
            if self._closed:
                raise ProxyError("the private CLIProxyAPI of this run was already stopped")
            child = self._child
            if child is None or child.proc is None:
                self._start_locked(prefer_port=None)
                return
            code = child.proc.poll()
            if code is None:
                return
            tail = self._error_lines()
            if self.restarts >= self.max_restarts:
                raise ProxyError(f"the private CLIProxyAPI exited mid-run (exit code {code}) after "
                                 f"{self.restarts} restart(s); giving up. {tail}".strip())
            self.restarts += 1
            message = (f"the private CLIProxyAPI exited mid-run (exit code {code}); restarted it "
                       f"(restart {self.restarts} of {self.max_restarts}). {tail}").strip()
            self.events.append(message)
            self._start_locked(prefer_port=self.port)
        callback = self.on_restart
        if callback is not None:
            callback(message)

    def stop(self) -> None:
        """Stop the process and delete the private directory (idempotent; later use raises)."""
        with self._lock:
            self._closed = True
            if self._finalizer is not None:
                self._finalizer()

    # -- internals ------------------------------------------------------------------------------
    def _ensure_child(self) -> _Child:
        if self._child is None:
            sweep_stale_private_dirs()
            tmp = Path(tempfile.mkdtemp(prefix=_PREFIX))
            os.chmod(tmp, 0o700)
            (tmp / "owner").write_text(f"{os.getpid()}\n")
            for sub in ("logs", "home", "tmp"):
                (tmp / sub).mkdir(mode=0o700)
            self._child = _Child(tmpdir=tmp)
            self._finalizer = weakref.finalize(self, _shutdown, self._child)
        return self._child

    def _resolved_auth_dir(self, child: _Child) -> Path:
        if self._auth_dir is not None and self._auth_dir.is_dir():
            return self._auth_dir
        private = child.tmpdir / "auth"
        private.mkdir(mode=0o700, exist_ok=True)
        return private

    def _config(self, port: int, auth_dir: Path) -> dict[str, Any]:
        user_cfg = load_user_config(self._user_config_path) if self._user_config_path is not None else None
        sections = env_provider_sections(self._environ, self.model)
        cfg = build_private_config(user_cfg, sections, port=port, client_key=self._client_key, auth_dir=auth_dir)
        for section in ("openai-compatibility",):
            for entry in cfg.get(section) or []:
                for key_entry in entry.get("api-key-entries") or []:
                    self.redactor.add(str(key_entry.get("api-key") or ""))
        for section in ("claude-api-key", "gemini-api-key", "vertex-api-key", "xai-api-key", "codex-api-key",
                        "interactions-api-key"):
            for entry in cfg.get(section) or []:
                self.redactor.add(str(entry.get("api-key") or ""))
        return cfg

    def _log_text(self) -> str:
        child = self._child
        if child is None:
            return ""
        try:
            data = (child.tmpdir / "proxy.log").read_bytes()[-65536:]
        except OSError:
            return ""
        return self.redactor(data.decode("utf-8", "replace"))

    def _error_lines(self, text: str | None = None) -> str:
        text = self._log_text() if text is None else text
        lines = [ln.strip() for ln in text.splitlines() if _ERROR_RE.search(ln)]
        if not lines:
            return ""
        return "Logged: " + " | ".join(lines[-4:])

    def _fail(self, message: str) -> ProxyStartError:
        return ProxyStartError(Diagnostic(kind="proxy_failed", message=message))

    def _start_locked(self, prefer_port: int | None) -> None:
        child = self._ensure_child()
        _terminate(child.proc)
        child.stop_ping.set()
        auth_dir = self._resolved_auth_dir(child)
        cfg_path = child.tmpdir / "config.yaml"
        env = proxy_env(self._environ, home=str(child.tmpdir / "home"), tmpdir=str(child.tmpdir / "tmp"))
        last_problem = ""
        for attempt in range(PORT_ATTEMPTS):
            port = prefer_port if (attempt == 0 and prefer_port) else self._port_picker()
            try:
                write_private_config(self._config(port, auth_dir), cfg_path)
            except ProxyError as exc:
                raise self._fail(f"cannot prepare the private CLIProxyAPI config: {exc}") from None
            if child.log_handle is not None:
                child.log_handle.close()
            log_fd = os.open(child.tmpdir / "proxy.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            child.log_handle = os.fdopen(log_fd, "ab")
            child.log_handle.write(f"--- tilesmith: start attempt {attempt + 1} on port {port}\n".encode())
            child.log_handle.flush()
            start_offset = child.log_handle.tell()
            try:
                proc = subprocess.Popen(  # noqa: S603 - fixed argv, no shell
                    [self.executable, "-config", str(cfg_path), "-local-model", "-password", self._password],
                    cwd=child.tmpdir, env=env, stdin=subprocess.DEVNULL, stdout=child.log_handle,
                    stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
            except OSError as exc:
                raise self._fail(f"cannot run CLIProxyAPI at {self.executable}: {exc.strerror}; set "
                                 "TILESMITH_CLIPROXYAPI_EXECUTABLE to a working binary") from None
            child.proc = proc
            child.stop_ping = threading.Event()
            threading.Thread(target=_ping_loop, name="tilesmith-proxy-keepalive", daemon=True,
                             args=(f"http://127.0.0.1:{port}/keep-alive", self._password, child.stop_ping,
                                   self._keepalive_interval_s)).start()
            outcome, detail = self._wait_ready(proc, port, start_offset)
            if outcome == "ready":
                self.port = port
                self.models = detail
                version = _VERSION_RE.search(self._log_text())
                self.version = version.group(1) if version else None
                self.events.append(f"CLIProxyAPI {self.version or '?'} serving on 127.0.0.1:{port} "
                                   f"({len(self.models)} models)")
                return
            child.stop_ping.set()
            _terminate(proc)
            if outcome == "port_in_use":
                self.port_conflicts += 1
                self.events.append(f"port {port} was busy; retrying on another port")
                last_problem = f"port {port} was already in use"
                continue
            raise self._fail(detail)
        raise self._fail(f"the private CLIProxyAPI could not bind a loopback port in {PORT_ATTEMPTS} attempts "
                         f"({last_problem})")

    def _wait_ready(self, proc: subprocess.Popen[bytes], port: int, log_offset: int) -> tuple[str, Any]:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + float(self.start_timeout_s)
        healthy = False
        with httpx.Client(trust_env=False, timeout=httpx.Timeout(1.0, connect=0.5)) as client:
            while True:
                code = proc.poll()
                if code is not None:
                    text = self._attempt_log(log_offset)
                    if "address already in use" in text:
                        return "port_in_use", None
                    return "exited", (f"the private CLIProxyAPI ({self.executable}) exited during startup with "
                                      f"code {code}. {self._error_lines(text) or 'It logged no error.'}").strip()
                if time.monotonic() > deadline:
                    return "timeout", (f"the private CLIProxyAPI did not answer /healthz and /v1/models on "
                                       f"127.0.0.1:{port} within {self.start_timeout_s:g} s "
                                       f"(TILESMITH_CLIPROXYAPI_START_TIMEOUT_S). {self._error_lines()}").strip()
                try:
                    if not healthy:
                        healthy = client.get(base + "/healthz").status_code == 200
                    if healthy:
                        resp = client.get(base + "/v1/models", headers={"Authorization": f"Bearer {self._client_key}"})
                        if resp.status_code == 200:
                            text = self._attempt_log(log_offset)
                            if proc.poll() is None and "address already in use" not in text:
                                ids = tuple(sorted({str(m.get("id")) for m in resp.json().get("data") or []
                                                    if isinstance(m, dict) and m.get("id")}))
                                return "ready", ids
                except (httpx.HTTPError, ValueError):
                    pass
                time.sleep(_POLL_S)

    def _attempt_log(self, offset: int) -> str:
        child = self._child
        if child is None:
            return ""
        try:
            with open(child.tmpdir / "proxy.log", "rb") as handle:
                handle.seek(offset)
                return self.redactor(handle.read().decode("utf-8", "replace"))
        except OSError:
            return ""
