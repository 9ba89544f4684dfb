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


#: Thread settings of a CPU (test mode) worker, set at start (OpenMP and MKL read them when they load): one
#: OpenMP/MKL thread, ``OMP_THREAD_LIMIT`` also capping Inductor's ``#pragma omp parallel num_threads(N)`` (N is
#: the user process's thread count when the kernel was generated), idle threads sleeping instead of spinning.
#: Why: CPU samples are the worker's CPU time (all threads), which threads spinning at a barrier while another
#: thread of the same region waits for a core on a busy machine would inflate; and the trusted and the candidate
#: worker then have the same thread count to compare (docs/gate.md, "Timing method").
CPU_THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
                  "OMP_THREAD_LIMIT": "1", "OMP_WAIT_POLICY": "PASSIVE"}


def worker_environment(environ: dict[str, str] | None = None, device_type: str = "cuda") -> dict[str, str]:
    """The environment a worker starts with: the host's, minus every secret and every TILESMITH_* setting.

    Removed: :data:`tilesmith.settings.PROVIDER_KEY_VARIABLES`, secret settings, any name containing one
    of :data:`SECRET_NAME_PARTS`, any variable whose value contains a provider key's value, and all
    ``TILESMITH_*`` variables (the worker gets its configuration in protocol messages). Added: the
    directory that holds the ``tilesmith`` package at the front of ``PYTHONPATH``;
    ``TORCHINDUCTOR_COMPILE_THREADS=1`` unless set (kernels compile in the worker process itself, so no
    compile pool outlives a kill); ``PYTHONUNBUFFERED=1``; for ``device_type="cpu"`` (test mode)
    :data:`CPU_THREAD_ENV`.
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
    if device_type == "cpu":
        clean.update(CPU_THREAD_ENV)
    return clean


#: Sub-directories of a worker's private directory that hold its compiler caches and temporary files.
PRIVATE_CACHE_DIRS = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton", "TMPDIR": "tmp"}


def private_environment(worker_dir: Path) -> dict[str, str]:
    """Variables that point every cache a worker writes into its own private directory.

    ``TORCHINDUCTOR_CACHE_DIR`` (Inductor's code cache: the original wrapper, the candidate and their
    compiled kernels), ``TRITON_CACHE_DIR`` (Triton's kernel cache), ``TMPDIR`` (``tempfile``: Triton's and
    the C++ builder's temporary files) and ``PYTHONDONTWRITEBYTECODE=1`` (no ``__pycache__`` writes into the
    installation). Why: a candidate that rewrote a shared cache file (red-team finding 1: the original
    wrapper's file in the shared Inductor cache) would change what later workers and the user's own later
    processes load; with private caches anything it writes is deleted with its worker.
    """
    env = {name: str(worker_dir / sub) for name, sub in PRIVATE_CACHE_DIRS.items()}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


_ISA_PROBES: tuple[tuple[str, str], ...] = ()


def _isa_probe_files() -> tuple[tuple[str, str], ...]:
    """:func:`_scan_isa_probe_files`, remembered once it has found some (an empty answer is not kept: a worker
    started before this process's first C++ compile, e.g. the standby worker, must not stop later ones from
    being seeded)."""
    global _ISA_PROBES
    if not _ISA_PROBES:
        _ISA_PROBES = _scan_isa_probe_files()
    return _ISA_PROBES


def _scan_isa_probe_files() -> tuple[tuple[str, str], ...]:
    """``(relative dir, file name)`` of the CPU vector-ISA probe sources and libraries in this process's
    Inductor cache. torch 2.11 writes each probe as ``<cache>/<key[1:3]>/<key>.cpp`` and builds
    ``<key>.so`` next to it (``cpu_vec_isa.VecISA.check_build``; the key also hashes compile flags that
    some ISAs change on the fly), so the probes are found by content: small ``.cpp`` files whose text is
    one of the ``VecISA`` classes' ``*_code`` strings, with a built ``.so``. Empty when torch has no such
    probes or none was built here."""
    found: list[tuple[str, str]] = []
    try:
        from torch._inductor import codecache, cpu_vec_isa

        codes = {getattr(c, a).strip() for c in vars(cpu_vec_isa).values() if isinstance(c, type)
                 and issubclass(c, cpu_vec_isa.VecISA) for a in dir(c)
                 if a.endswith("_code") and isinstance(getattr(c, a, None), str)}
        root = codecache.cache_dir()
        limit = max((len(c) for c in codes), default=0) + 256
        for sub in os.scandir(root):
            if not (sub.is_dir() and len(sub.name) == 2):
                continue
            for entry in os.scandir(sub.path):
                if not entry.name.endswith(".cpp") or entry.stat().st_size > limit:
                    continue
                stem = entry.name[: -len(".cpp")]
                if not os.path.isfile(os.path.join(sub.path, stem + ".so")):
                    continue
                with open(entry.path, encoding="utf-8", errors="replace") as handle:
                    if handle.read().strip() in codes:
                        found += [(sub.name, entry.name), (sub.name, stem + ".so")]
    except Exception:  # noqa: BLE001 - other torch versions or an unreadable cache: no seeding
        return ()
    return tuple(sorted(found))


def seed_private_cache(worker_dir: Path) -> int:
    """Copy the CPU vector-ISA probe files of this process's Inductor cache into a worker's private one.

    Why: ``tilesmith._compat.fast_cpu_isa_probe`` (test mode, ``TORCHINDUCTOR_VEC_ISA_OK=1``) skips
    Inductor's ~12 s of ``python -c`` ISA probes only when the probe library already exists in the cache;
    a private cache starts empty. Copies, never links: what the worker writes never reaches this cache.
    Returns the number of files copied (0 when nothing was built here, e.g. on a GPU-only host).
    """
    try:
        from torch._inductor import codecache

        root = Path(codecache.cache_dir())
    except Exception:  # noqa: BLE001
        return 0
    target = worker_dir / PRIVATE_CACHE_DIRS["TORCHINDUCTOR_CACHE_DIR"]
    copied = 0
    for rel, name in _isa_probe_files():
        try:
            (target / rel).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(root / rel / name, target / rel / name)
            copied += 1
        except OSError:
            continue
    return copied + _link_precompiled_headers(worker_dir)


_TEMPLATE_SUBDIRS = (PRIVATE_CACHE_DIRS["TORCHINDUCTOR_CACHE_DIR"], PRIVATE_CACHE_DIRS["TRITON_CACHE_DIR"])


def make_cache_template(worker: WorkerProcess, template: Path) -> Path | None:
    """Copy the compiler caches of a worker that has initialized but imported no candidate yet (only the
    trusted original wrapper and its compiled kernels are in them) to ``template``; later workers start
    from a copy (:func:`copy_cache_template`) instead of recompiling the original's kernels (CPU: the
    C++ kernels, seconds each; CUDA: every Triton kernel). Returns ``template``, or ``None`` when the
    worker has already seen a candidate or copying failed (later workers then compile for themselves).
    """
    if worker.saw:
        return None
    try:
        tmp = Path(tempfile.mkdtemp(prefix=".template-", dir=template.parent))
        for sub in _TEMPLATE_SUBDIRS:
            if (worker.dir / sub).is_dir():
                shutil.copytree(worker.dir / sub, tmp / sub, symlinks=False)
        os.replace(tmp, template)
        return template
    except OSError:
        return None


def copy_cache_template(template: Path, worker_dir: Path) -> int:
    """Copy a :func:`make_cache_template` folder into a new worker's private directory (copies, never
    links: a worker cannot change what the next one loads). Returns the number of files copied."""
    copied = 0
    for sub in _TEMPLATE_SUBDIRS:
        if not (template / sub).is_dir():
            continue
        try:
            shutil.copytree(template / sub, worker_dir / sub, symlinks=False, dirs_exist_ok=True)
            copied += sum(len(files) for _, _, files in os.walk(worker_dir / sub))
        except OSError:
            continue
    return copied


def _link_precompiled_headers(worker_dir: Path) -> int:
    """Hard-link this process's precompiled C++ headers into the worker's private temporary directory.

    torch 2.11 keeps precompiled headers (``cpp_prefix.h``, ~120 MB ``.gch`` per compiler/flag set) in
    ``<tempfile.gettempdir()>/torchinductor_<user>/precompiled_headers`` (``codecache._HEADER_DIR``, fixed
    at import, not under ``TORCHINDUCTOR_CACHE_DIR``); with the worker's private ``TMPDIR`` it would
    rebuild one (~10-20 s of CPU) before its first C++ kernel. Links cost nothing; Python code in the
    worker cannot write to them (audit hook: files that existed before the candidate's import are
    read-only to it); native code could, as it could write to the original folder — a documented
    residual risk. Nothing is copied when linking fails (another file system): the worker rebuilds.
    """
    try:
        import tempfile as _tempfile

        from torch._inductor import codecache

        header_dir = getattr(codecache, "_HEADER_DIR", None)
        if not header_dir or not os.path.isdir(header_dir):
            return 0
        rel = os.path.relpath(header_dir, _tempfile.gettempdir())
        if rel.startswith(".."):
            return 0
        target = worker_dir / PRIVATE_CACHE_DIRS["TMPDIR"] / rel
        linked = 0
        for entry in os.scandir(header_dir):
            if entry.is_file(follow_symlinks=False) and entry.name.endswith((".h", ".h.gch")):
                target.mkdir(parents=True, exist_ok=True)
                os.link(entry.path, target / entry.name)
                linked += 1
        return linked
    except Exception:  # noqa: BLE001 - no headers, other torch, other file system: the worker builds its own
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
        self.dir = Path(tempfile.mkdtemp(prefix="w", dir=parent_dir))
        os.chmod(self.dir, 0o700)
        for sub in PRIVATE_CACHE_DIRS.values():
            (self.dir / sub).mkdir(mode=0o700)
        self.seeded = copy_cache_template(template, self.dir) if template is not None else 0
        self.seeded += seed_private_cache(self.dir)
        self.log_path = self.dir / "worker.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - lives as long as the process
        self._ids = itertools.count(1)
        self._buffer = b""
        self._pending: list[int] = []
        self.started = time.monotonic()
        self.ready_info: dict[str, Any] | None = None
        self.saw: set[str] = set()
        """Sources (by SHA-256) this worker has imported; a confirmation needs one that saw none of them."""
        self.extra_dirs: tuple[Path, ...] = ()
        """Folders removed with this worker besides its own (a standby worker's parent folder)."""
        self.device_type = device_type
        self.environ = {**worker_environment(environ, device_type), **private_environment(self.dir)}
        """The exact environment the process started with."""
        self.proc = subprocess.Popen(  # noqa: S603 - fixed argv, no shell
            [sys.executable, "-P", "-m", "tilesmith.gate.worker"],
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


def redact(text: str) -> str:
    """Replace every provider-key value (and anything that looks like a bearer key) with ``<redacted>``."""
    for value in settings.secret_values():
        if len(value) >= 4:
            text = text.replace(value, "<redacted>")
    return re.sub(r"\b(sk|pk|ak|key)-[A-Za-z0-9_\-]{16,}", "<redacted>", text)


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
