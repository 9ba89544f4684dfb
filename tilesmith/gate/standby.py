"""One gate worker started ahead of need, so its interpreter start and torch import overlap with compilation.

A gate worker is a fresh ``python -m tilesmith.gate.worker`` (:mod:`tilesmith.gate.process`); before it
can do anything it imports torch and Inductor, which took 4.7–6.2 s on a 2-core CPU
(``python -c "import torch, torch._inductor.compile_fx"``). The first gate of a process waits for that
inside the graph's first call, which is what an artifact-cache hit's blocking re-check pays (docs/cache.md).

:func:`prestart` (called by ``tilesmith.compile()`` when a graph may be eligible: CPU test mode, or CUDA
already initialized in this process, which a model or inputs on the GPU have done) starts one such worker
at once; the first gate that needs a worker before it has a cache template takes it with :func:`adopt`
instead of starting one, by which time Dynamo and Inductor have run and the import is partly or wholly
done. The worker is exactly what the gate would start (same command, same environment, its own private
0700 folder and caches); it has received no request before it is adopted. At most one waits per process.
It is only adopted while the environment a new worker would get is the one it got, up to the folders
every worker gets its own of (so a changed environment, e.g. a setting that affects compilation, starts a
fresh worker), and it is killed at exit or
after :data:`MAX_IDLE_S` unused. ``TILESMITH_PRESTART_WORKER=0`` turns this off.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

from tilesmith import settings

MAX_IDLE_S = 900.0
"""A standby worker older than this (seconds) is killed instead of adopted (a fresh start is then cheap
compared with what is left of the run; an old process would hold memory for nothing)."""

_LOCK = threading.Lock()
_standby: tuple[object, dict[str, str], Path] | None = None  # (WorkerProcess, its environment, parent folder)
_owner_pid = 0  # the process that started it: a forked child never adopts or kills its parent's standby
_atexit_registered = False


def prestart() -> bool:
    """Start the standby worker unless one is waiting or ``TILESMITH_PRESTART_WORKER=0``; never raises.

    Returns whether a standby worker is waiting after the call.
    """
    global _standby, _owner_pid, _atexit_registered
    if not settings.get("TILESMITH_PRESTART_WORKER"):
        return False
    from tilesmith.gate.process import WorkerProcess, worker_environment

    with _LOCK:
        _forget_if_forked()
        if _standby is not None and _usable(_standby[0]):
            return True
        _discard_locked()
        parent = None
        try:
            parent = Path(tempfile.mkdtemp(prefix="tilesmith-standby-"))
            os.chmod(parent, 0o700)
            environ = _comparable(worker_environment())
            worker = WorkerProcess(parent, label="standby worker")
        except Exception:  # noqa: BLE001 - no standby: the gate starts its workers as before
            if parent is not None:
                shutil.rmtree(parent, ignore_errors=True)
            return False
        _standby, _owner_pid = (worker, environ, parent), os.getpid()
        if not _atexit_registered:
            atexit.register(discard)
            _atexit_registered = True
        return True


def adopt(label: str) -> object | None:
    """The waiting standby worker, relabelled ``label``, or ``None`` (none waiting, it died, it is older than
    :data:`MAX_IDLE_S`, or the worker environment changed since it started). The caller owns the worker
    (``kill()`` removes its folder); the standby's parent folder is removed once the worker is gone."""
    global _standby
    from tilesmith.gate.process import worker_environment

    with _LOCK:
        _forget_if_forked()
        if _standby is None:
            return None
        worker, environ, parent = _standby
        if not _usable(worker) or _comparable(worker_environment()) != environ:
            _discard_locked()
            return None
        _standby = None
    worker.label = f"{label}#{worker.label.rsplit('#', 1)[-1]}"  # type: ignore[attr-defined]
    worker.extra_dirs = (parent,)  # type: ignore[attr-defined]
    return worker


def settle(timeout_s: float) -> None:
    """Wait (at most ``timeout_s`` seconds) until a waiting standby worker has finished starting, so that its
    torch import does not compete with a gate's timing samples (another ``tilesmith.compile()`` may have
    started it while a gate of an earlier one runs). A standby that fails to start is discarded."""
    with _LOCK:
        _forget_if_forked()
        if _standby is None or _standby[0].ready_info is not None:  # type: ignore[attr-defined]
            return
        try:
            _standby[0].wait_ready(timeout_s)  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - it died or timed out: the gate starts its own workers
            _discard_locked()


def discard() -> None:
    """Kill the waiting standby worker, if any (at exit, and in tests)."""
    with _LOCK:
        _forget_if_forked()
        _discard_locked()


def _forget_if_forked() -> None:
    """In a child forked from the process that started the standby, drop it without touching it (the
    parent still owns that worker and its pipes)."""
    global _standby
    if _standby is not None and _owner_pid != os.getpid():
        _standby = None


def _comparable(environ: dict[str, str]) -> dict[str, str]:
    """The part of a worker environment that can differ between two workers: without the cache and temporary
    folders every worker gets its own of (``PRIVATE_CACHE_DIRS``; Inductor also sets
    ``TORCHINDUCTOR_CACHE_DIR`` in this process at its first compile) and without ``_TORCHINDUCTOR_*``
    (values private to this process that Inductor writes while loading kernels and sets again in the worker)."""
    from tilesmith.gate.process import PRIVATE_CACHE_DIRS

    return {k: v for k, v in environ.items() if k not in PRIVATE_CACHE_DIRS and not k.startswith("_TORCHINDUCTOR_")}


def _usable(worker: object) -> bool:
    return bool(worker.alive()) and time.monotonic() - worker.started < MAX_IDLE_S  # type: ignore[attr-defined]


def _discard_locked() -> None:
    global _standby
    if _standby is None:
        return
    worker, _, parent = _standby
    _standby = None
    try:
        worker.kill()  # type: ignore[attr-defined]
    finally:
        shutil.rmtree(parent, ignore_errors=True)
