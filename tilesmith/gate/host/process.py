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
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import tilesmith
from tilesmith import settings
from tilesmith._proc import session_processes
from tilesmith.errors import WorkerError
from tilesmith.gate import protocol
from tilesmith.gate.host.caches import PRIVATE_CACHE_DIRS, copy_cache_template, private_folder, seed_private_cache
from tilesmith.secrets import is_secret, redact, secret_values


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



#: Thread settings of a CPU (test mode) worker, set at start (OpenMP and MKL read them when they load): one
#: OpenMP/MKL thread, ``OMP_THREAD_LIMIT`` also capping Inductor's ``#pragma omp parallel num_threads(N)`` (N is
#: the user process's thread count when the kernel was generated), idle threads sleeping instead of spinning.
#: Why: CPU samples are the worker's CPU time (all threads), which threads spinning at a barrier while another
#: thread of the same region waits for a core on a busy machine would inflate; and the trusted and the candidate
#: worker then have the same thread count to compare (docs/gate.md, "Timing method").
#: The glibc malloc settings fix the thresholds glibc otherwise adapts to each process's allocation history
#: (``M_MMAP_THRESHOLD`` rises after large frees, ``M_TRIM_THRESHOLD`` follows it): without them a buffer of a few
#: MiB that the wrapper allocates per call came from fresh mmap'd pages (a page fault per 4 KiB, counted in the
#: CPU time) in one worker and from the reused heap in another, and identical code timed 0.82–1.36× between two
#: worker processes on the 2-core CI VM; with them 0.95–1.09× (the rest is ``stats.CPU_PROCESS_ALLOWANCE``).
CPU_THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
                  "OMP_THREAD_LIMIT": "1", "OMP_WAIT_POLICY": "PASSIVE",
                  "MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(4 << 30)}


def worker_environment(environ: dict[str, str] | None = None, device_type: str = "cuda") -> dict[str, str]:
    """The environment a worker starts with: the host's, minus every secret and every TILESMITH_* setting.

    Removed: every variable :func:`tilesmith.secrets.is_secret` marks (provider keys, credential-like
    names, URLs with a password), secret settings, any variable whose value contains a secret value, and all
    ``TILESMITH_*`` variables (the worker gets its configuration in protocol messages). Added: the
    directory that holds the ``tilesmith`` package at the front of ``PYTHONPATH``; ``TILESMITH_KERNEL_DIR``
    set to the resolved native kernel directory (the one ``TILESMITH_*`` variable a worker gets: candidates
    load prebuilt kernels from it, and the worker's audit hook allows reading it, see
    :mod:`tilesmith.kernels.runtime`);
    ``TORCHINDUCTOR_COMPILE_THREADS=1`` unless set (kernels compile in the worker process itself, so no
    compile pool outlives a kill); ``PYTHONUNBUFFERED=1``; for ``device_type="cpu"`` (test mode)
    :data:`CPU_THREAD_ENV`.
    """
    env = dict(os.environ if environ is None else environ)
    secrets = secret_values(env)
    secret_settings = {s.name for s in settings.REGISTRY.values() if s.secret}
    clean: dict[str, str] = {}
    for name, value in env.items():
        upper = name.upper()
        if is_secret(name, value) or name in secret_settings or upper.startswith("TILESMITH_"):
            continue
        if any(s in value for s in secrets):
            continue
        clean[name] = value
    from tilesmith.kernels.runtime import kernel_dir

    clean["TILESMITH_KERNEL_DIR"] = os.path.realpath(kernel_dir(env))
    extra = settings.get("TILESMITH_GATE_WRITABLE", env)
    if extra:  # the user's extra writable folders (tilesmith.gate.worker.confine.worker_folders)
        clean["TILESMITH_GATE_WRITABLE"] = os.pathsep.join(os.path.realpath(p) for p in extra)
    root = str(Path(tilesmith.__file__).resolve().parent.parent)
    clean["PYTHONPATH"] = os.pathsep.join([root] + ([clean["PYTHONPATH"]] if clean.get("PYTHONPATH") else []))
    clean.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    clean["PYTHONUNBUFFERED"] = "1"
    if device_type == "cpu":
        clean.update(CPU_THREAD_ENV)
    return clean




def private_environment(worker_dir: Path) -> dict[str, str]:
    """Variables that point every cache a worker writes into its own private directory.

    ``TORCHINDUCTOR_CACHE_DIR`` (Inductor's code cache: the original wrapper, the candidate and their
    compiled kernels), ``TRITON_CACHE_DIR`` (Triton's kernel cache), ``TMPDIR`` (``tempfile``: Triton's and
    the C++ builder's temporary files), ``CUDA_CACHE_PATH`` and ``PYTORCH_KERNEL_CACHE_PATH`` (the CUDA driver's
    and ATen's NVRTC JIT caches, else in the user's home) and ``PYTHONDONTWRITEBYTECODE=1`` (no ``__pycache__``
    writes into the installation). Why: a candidate that rewrote a shared cache file (red-team finding 1: the
    original wrapper's file in the shared Inductor cache) would change what later workers and the user's own later
    processes load; with private caches anything it writes is deleted with its worker. And the worker can write
    nowhere else (its Landlock write rules: :mod:`tilesmith.gate.worker.confine`), so a cache outside its folder
    would be a cache it cannot fill.
    """
    env = {name: str(worker_dir / sub) for name, sub in PRIVATE_CACHE_DIRS.items()}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def task_states(pid: int) -> list[str]:
    """The scheduler state letter (``R``, ``S``, ``T`` …) of every thread of process ``pid`` (empty when gone)."""
    states = []
    try:
        tasks = os.listdir(f"/proc/{int(pid)}/task")
    except OSError:
        return []
    for tid in tasks:
        try:
            with open(f"/proc/{int(pid)}/task/{tid}/stat", "rb") as handle:
                states.append(handle.read().rsplit(b")", 1)[1].split()[0].decode())
        except (OSError, IndexError):
            continue
    return states


def os_threads(pid: int) -> int:
    """Threads of process ``pid`` as the OS counts them (``/proc/<pid>/task``); 0 when unknown."""
    try:
        return len(os.listdir(f"/proc/{int(pid)}/task"))
    except OSError:
        return 0


def process_cpu_ms(pid: int) -> float | None:
    """CPU time (user + system, every thread, exited ones included) process ``pid`` has used so far, in ms,
    read by the host from ``/proc/<pid>/stat`` (fields 14-15, clock ticks; Linux keeps their sum equal to the
    scheduler's exact runtime, so the resolution is one tick, 10 ms at ``SC_CLK_TCK`` 100). ``None`` where
    there is no ``/proc`` or the process is gone. Used to cross-check the CPU-time samples a worker reports."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as handle:
            fields = handle.read().rsplit(b")", 1)[1].split()
        ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 counting from 1)
        return ticks * 1e3 / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def cpu_clock_ms(pid: int) -> float | None:
    """CPU time (every thread, exact to the nanosecond) process ``pid`` has used so far, in ms, read by the host from
    the kernel's process CPU-time clock (``clock_gettime`` on ``MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)``, what
    glibc's ``clock_getcpuclockid`` returns): no code in that process can change what it answers, unlike the
    worker's own reading of its clock, which a candidate's native code can rewrite in the worker's memory (red
    team 20). ``None`` where the clock is unavailable or the process is gone."""
    try:
        return time.clock_gettime_ns(((~int(pid)) << 3) | 2) / 1e6
    except (OSError, OverflowError, AttributeError, ValueError):
        return None


class WorkerProcess:
    """One running worker. Not thread-safe; one request in flight at a time is the normal use.

    Its private directory (0700, inside the gate's) is its working directory and holds its log, the
    files it writes for the host, and its own Inductor/Triton caches and temporary files
    (:func:`private_environment`, seeded by :func:`seed_private_cache`); all of it is deleted on kill.
    """

    _numbers = itertools.count(1)

    def __init__(self, parent_dir: Path, *, label: str, environ: dict[str, str] | None = None,
                 template: Path | None = None, device_type: str = "cuda") -> None:
        self.label = f"{label}#{next(self._numbers)}"
        self.dir = private_folder("w", parent_dir)
        try:
            self.seeded = copy_cache_template(template, self.dir) if template is not None else 0
        except BaseException:  # caches.CacheTemplateAltered: no worker starts from that template
            shutil.rmtree(self.dir, ignore_errors=True)
            raise
        self.seeded += seed_private_cache(self.dir)
        self.templated = template is not None
        """Whether the original's compiled kernels (the gate's cache template) are in its private caches."""
        self.log_path = self.dir / "worker.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - lives as long as the process
        self._ids = itertools.count(1)
        self._buffer = b""
        self._pending: list[int] = []
        self.started = time.monotonic()
        self.ready_info: dict[str, Any] | None = None
        self._affinity: set[int] | None = None
        self.stopped = False
        """Whether :meth:`stop` stopped the process group (and :meth:`resume` has not continued it)."""
        self.stopped_s = 0.0
        """Seconds the process spent stopped (ended stops): not counted against its start timeout."""
        self._stopped_at: float | None = None
        self.role = "candidate"
        """``trusted`` (the original only, ever) or ``candidate`` (imports candidate or incumbent code)."""
        self.init_rid: int | None = None
        """The ``init`` request's id; ``None`` until it is sent (a CUDA spare gets it when a gate takes it)."""
        self.init_fields: dict[str, Any] = {}
        self.init_answer: dict[str, Any] | None = None
        self.init_done_at: float | None = None
        """``time.monotonic()`` when the gate read its ``init`` answer."""
        self.loaded = False
        """Whether it was ever sent wrapper code to import (a ``load`` request: a candidate's or an incumbent's). A
        spare that was not runs only Tilesmith's worker code (its start, its ``init``), so a timing run need not stop
        it (:class:`~tilesmith.gate.host.timing.Quiescence`)."""
        self.saw: set[str] = set()
        """Sources (by SHA-256) this worker has imported; a confirmation needs one that saw none of them."""
        self.extra_dirs: tuple[Path, ...] = ()
        """Folders removed with this worker besides its own (a standby worker's parent folder)."""
        self.device_type = device_type
        base = worker_environment(environ, device_type)
        self.environ = {**base, **private_environment(self.dir)}
        """The exact environment the process started with."""
        self.proc: Any = None
        """A :class:`subprocess.Popen`, or a :class:`~tilesmith.gate.host.forkserver.ForkedProcess` (a worker forked
        by the fork server's zygote, ``TILESMITH_GATE_FORKSERVER``; ``None`` from it: start one as without)."""
        if settings.get("TILESMITH_GATE_FORKSERVER"):
            from tilesmith.gate.host import forkserver

            self.proc = forkserver.start_worker(base, self.environ, self.dir, self._log.fileno(), device_type)
        if self.proc is None:
            self.proc = subprocess.Popen(  # noqa: S603 - fixed argv, no shell
                [sys.executable, "-P", "-m", "tilesmith.gate.worker", f"--device-type={device_type}"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, cwd=self.dir,
                env=self.environ, start_new_session=True, close_fds=True,
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
            self.resume()  # a stopped spare cannot finish starting
            # A spare is stopped while anything is timed, possibly for most of its life: the start timeout
            # counts only the time it could run.
            deadline = self.started + self.stopped_s + timeout_s
            msg = self._read_message(deadline, f"start (import torch, create the device context) of {self.label}",
                                     timeout_s)
            if msg.get("type") != "ready" or msg.get("protocol") != protocol.PROTOCOL_VERSION:
                self.kill()
                raise WorkerProtocolError(f"{self.label} started with an unexpected greeting: {str(msg)[:200]}")
            self.ready_info = msg
        return self.ready_info

    # -- quiescence (docs/gate.md, "Quiescence") ----------------------------------------------------
    def stop(self, timeout_s: float = 2.0) -> bool:
        """SIGSTOP the worker's whole process group (compiler children included) and wait until every thread
        of the worker process is stopped (``/proc/<pid>/task/*/stat`` state ``T``). Returns False when the
        process is gone (it died, e.g. killed for memory; the next request reports the crash) or did not
        stop within ``timeout_s``. Idempotent; :meth:`send` resumes a stopped worker first."""
        if self.proc.poll() is not None:
            return False
        try:
            os.killpg(self.proc.pid, signal.SIGSTOP)
        except (ProcessLookupError, PermissionError):
            return False
        self.stopped = True
        if self._stopped_at is None:
            self._stopped_at = time.monotonic()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            states = task_states(self.proc.pid)
            if not states:
                return False
            if all(s in "Tt" for s in states):
                return True
            time.sleep(0.0005)
        return False

    def resume(self) -> None:
        """SIGCONT the worker's process group after :meth:`stop` (no-op otherwise, or when it is gone)."""
        if not self.stopped:
            return
        self.stopped = False
        if self._stopped_at is not None:
            self.stopped_s += time.monotonic() - self._stopped_at
            self._stopped_at = None
        try:
            os.killpg(self.proc.pid, signal.SIGCONT)
        except (ProcessLookupError, PermissionError):
            pass

    def pin(self, cpus: set[int] | None) -> None:
        """Set the CPU affinity of every thread of the worker process to ``cpus`` (``None``: back to what it had
        before the first :meth:`pin`). Best effort (a thread may end meanwhile; no ``sched_setaffinity``: no-op)."""
        if not hasattr(os, "sched_setaffinity"):
            return
        if cpus is not None and self._affinity is None:
            try:
                self._affinity = set(os.sched_getaffinity(self.proc.pid))
            except OSError:
                return
        target = cpus if cpus is not None else self._affinity
        if target is None:
            return
        try:
            tids = os.listdir(f"/proc/{self.proc.pid}/task")
        except OSError:
            return
        for tid in tids:
            try:
                os.sched_setaffinity(int(tid), target)
            except OSError:
                continue
        if cpus is None:
            self._affinity = None

    def os_counts(self) -> tuple[int, int]:
        """``(threads, other processes)``: the worker process's threads as the OS counts them (every entry of
        ``/proc/<pid>/task``, native threads included) and the live processes of its session besides itself
        (children, grandchildren, daemons that kept the session). ``(0, 0)`` without ``/proc``."""
        return os_threads(self.proc.pid), len(session_processes(self.proc.pid))

    def seed_template(self, template: Path) -> None:
        """Copy the gate's cache template into this worker's private caches (a worker started before the trusted
        worker made it; call before its ``init``: nothing reads those caches until it loads a wrapper)."""
        if self.init_rid is not None:
            raise WorkerError(f"{self.label}: its init was sent before the cache template was copied")
        self.seeded += copy_cache_template(template, self.dir)
        self.templated = True

    def kill(self) -> None:
        """Kill the worker's whole process group, reap it and delete its directory. Idempotent."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # also ends a stopped process
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
        for extra in self.extra_dirs:
            shutil.rmtree(extra, ignore_errors=True)

    def log_tail(self, limit: int = 3000) -> str:
        try:
            data = self.log_path.read_bytes()[-limit:]
        except OSError:
            return ""
        lines = data.decode("utf-8", "replace").strip().splitlines()[-8:]
        return untrusted_text("\n".join(lines), 1500, what="worker log")

    # -- requests ------------------------------------------------------------------------------------
    def send(self, op: str, **fields: Any) -> int:
        self.resume()
        if op == "load":
            self.loaded = True
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
                return sanitize_answer(msg)
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
                                      f"{untrusted_text(line.decode('utf-8', 'replace'), 200)}") from None

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


def untrusted_text(value: object, limit: int = 300, *, what: str = "candidate") -> str:
    """Worker-reported text (exception messages and types, tracebacks, log output, audit details) quoted
    for a verdict reason: secrets redacted, every non-printable and non-ASCII character escaped (one
    line, no terminal control codes), cut to ``limit`` characters and marked as coming from the
    candidate's process, e.g. ``⟦candidate: ValueError: bad⟧`` or
    ``⟦candidate, 5000 chars, first 300: ...⟧``.

    Why: the LLM agent reads verdict reasons; a candidate that read a file could otherwise have it
    echoed back verbatim through an exception message (red-team finding 10).
    """
    text = redact("" if value is None else str(value))
    escaped = text.encode("unicode_escape", "backslashreplace").decode("ascii")
    if len(escaped) <= limit:
        return f"⟦{what}: {escaped}⟧"
    return f"⟦{what}, {len(escaped)} chars, first {limit}: {escaped[:limit]}⟧"


def sanitize_answer(message: dict[str, Any]) -> dict[str, Any]:
    """Quote every worker-reported error text of an answer (``error`` dicts at any depth) with
    :func:`untrusted_text`: ``type`` ≤ 100, ``message`` ≤ 400, ``traceback`` (last 6 lines) ≤ 900 chars."""

    def walk(value: Any) -> Any:
        if isinstance(value, dict):
            out = {k: walk(v) for k, v in value.items()}
            err = out.get("error")
            if isinstance(err, dict):
                err = dict(err)
                for key, limit in (("type", 100), ("message", 400)):
                    if key in err:
                        err[key] = untrusted_text(err[key], limit)
                if "traceback" in err:
                    tail = "\n".join(str(err["traceback"]).strip().splitlines()[-6:])
                    err["traceback"] = untrusted_text(tail, 900)
                out["error"] = err
            return out
        if isinstance(value, list):
            return [walk(v) for v in value]
        return value

    return walk(message)
