"""One gate worker started ahead of need, so its interpreter start and torch import overlap with compilation.

A gate worker is a fresh ``python -m tilesmith.gate.worker`` (:mod:`tilesmith.gate.host.process`); before it
can do anything it imports torch and Inductor, which took 4.7–6.2 s on a 2-core CPU
(``python -c "import torch, torch._inductor.compile_fx"``). The first gate of a process waits for that
inside the graph's first call, which is what an artifact-cache hit's blocking re-check pays (docs/cache.md).

:func:`prestart` (called by ``tilesmith.compile()`` when a graph may be eligible: CPU test mode, or CUDA
already initialized in this process, which a model or inputs on the GPU have done) starts one such worker
at once; the first gate that needs a worker before it has a cache template takes it with :func:`adopt`
instead of starting one, by which time Dynamo and Inductor have run and the import is partly or wholly
done. The worker is exactly what the gate would start (same command, same environment, its own private
0700 folder and caches); it has received no request before it is adopted. At most one waits per process.
It is only adopted while the environment a new worker would get is the one it got, up to the folders every
worker gets its own of and the variables torch sets in this process while compiling (:func:`comparable`), so
a changed environment, e.g. a setting that affects compilation, starts a fresh worker. It is killed at exit,
or by a timer after :data:`MAX_IDLE_S` unused; a forked child never touches it. ``TILESMITH_PRESTART_WORKER=0``
turns this off.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from tilesmith import settings

MAX_IDLE_S = 900.0
"""A standby worker unused this long (seconds) is killed by a timer (it would hold memory for nothing; a fresh
start is cheap compared with a run that has not called its model for 15 minutes)."""

#: Variables torch itself sets in this process while it compiles (torch 2.11: ``cache_dir_utils.py``
#: TORCHINDUCTOR_CACHE_DIR, ``triton_heuristics.py`` TRITON_CACHE_DIR, ``compile_tasks.py`` TRITON_PTXAS_PATH,
#: ``cpp_builder.py`` CUDA_HOME and KMP_DUPLICATE_LIB_OK, ``async_compile.py`` TORCH_WARM_POOL,
#: ``fx_passes/numeric_utils.py`` CUBLAS_WORKSPACE_CONFIG, ``codecache.py`` _TORCHINDUCTOR_*): a worker's own
#: torch sets them again where it needs them, so they do not make a standby worker differ from a fresh one.
SET_BY_TORCH = frozenset({"TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TRITON_PTXAS_PATH", "CUDA_HOME",
                          "KMP_DUPLICATE_LIB_OK", "TORCH_WARM_POOL", "CUBLAS_WORKSPACE_CONFIG"})

log = logging.getLogger("tilesmith")
_LOCK = threading.Lock()
_standby: Any = None  # the waiting WorkerProcess (its parent folder in ``extra_dirs``, removed by its kill()), or None
_timer: threading.Timer | None = None  # kills it after MAX_IDLE_S
_atexit_registered = False


def prestart(device_type: str = "cuda") -> bool:
    """Start the standby worker unless a usable one is waiting or ``TILESMITH_PRESTART_WORKER=0``; never raises.

    ``device_type`` (``"cuda"`` or ``"cpu"``, test mode) picks the worker environment (CPU workers get
    :data:`tilesmith.gate.host.process.CPU_THREAD_ENV`). A waiting one whose environment no longer matches is replaced.
    Returns whether one is waiting afterwards.
    """
    global _standby, _timer, _atexit_registered
    if not settings.get("TILESMITH_PRESTART_WORKER"):
        return False
    from tilesmith.gate.host.process import WorkerProcess

    with _LOCK:
        if _standby is not None and _matches_locked(device_type):
            return True
        _discard_locked()
        parent = None
        try:
            parent = Path(tempfile.mkdtemp(prefix="tilesmith-standby-"))
            os.chmod(parent, 0o700)
            worker = WorkerProcess(parent, label="standby worker", device_type=device_type)
            worker.extra_dirs = (parent,)
        except Exception:  # noqa: BLE001 - no standby: the gate starts its workers as before
            if parent is not None:
                shutil.rmtree(parent, ignore_errors=True)
            return False
        _standby = worker
        _timer = threading.Timer(MAX_IDLE_S, _expire, args=(worker,))
        _timer.daemon = True
        _timer.start()
        if not _atexit_registered:
            atexit.register(discard)
            _atexit_registered = True
        return True


def adopt(label: str, device_type: str = "cuda") -> Any:
    """The waiting standby worker, relabelled ``label``, or ``None`` (none waiting, it died, or the environment
    a fresh worker would get differs from its own beyond :func:`comparable`). The caller owns the worker
    (``kill()`` also removes the standby's parent folder). The start deadline is counted from adoption: a
    worker that waited long before its first use is not a worker that was slow to start."""
    global _standby
    with _LOCK:
        if _standby is None:
            return None
        if not _matches_locked(device_type):
            _discard_locked()
            return None
        worker, _standby = _standby, None
        _cancel_timer()
    worker.label = f"{label}#{worker.label.rsplit('#', 1)[-1]}"
    worker.started = time.monotonic()
    return worker


def settle(timeout_s: float) -> None:
    """Wait (at most ``timeout_s`` seconds) until a waiting standby worker has finished starting, so that its
    torch import does not compete with a gate's timing samples (another ``tilesmith.compile()`` may have
    started it while a gate of an earlier one runs). The worker is taken out of the slot while it is waited
    for (no lock is held meanwhile) and put back afterwards; one that fails to start is killed."""
    global _standby
    with _LOCK:
        if _standby is None or _standby.ready_info is not None:
            return
        worker, _standby = _standby, None
    try:
        worker.wait_ready(timeout_s)
    except Exception:  # noqa: BLE001 - it died or timed out: the gate starts its own workers
        worker.kill()
        return
    with _LOCK:
        if _standby is None:
            _standby = worker
            return
    worker.kill()  # another one was started meanwhile


def discard() -> None:
    """Kill the waiting standby worker, if any (at exit, and in tests)."""
    with _LOCK:
        _discard_locked()


def comparable(environ: dict[str, str]) -> dict[str, str]:
    """The part of a worker environment that can make two workers differ: without the folders every worker gets
    its own of (``PRIVATE_CACHE_DIRS``), without :data:`SET_BY_TORCH` and ``_TORCHINDUCTOR_*``."""
    from tilesmith.gate.host.process import PRIVATE_CACHE_DIRS

    return {k: v for k, v in environ.items()
            if k not in PRIVATE_CACHE_DIRS and k not in SET_BY_TORCH and not k.startswith("_TORCHINDUCTOR_")}


def _matches_locked(device_type: str) -> bool:
    from tilesmith.gate.host.process import worker_environment

    if not _standby.alive():
        return False
    theirs, ours = comparable(_standby.environ), comparable(worker_environment(None, device_type))
    if theirs != ours:
        log.debug("tilesmith: standby worker not used: environment differs in %s",
                  sorted(k for k in theirs.keys() | ours.keys() if theirs.get(k) != ours.get(k)))
        return False
    return True


def _expire(worker: Any) -> None:
    with _LOCK:
        if _standby is worker:
            _discard_locked()


def _after_fork_in_child() -> None:
    """A child forked from this process never adopts or kills its parent's standby (the parent still owns that
    worker and its pipes), and a fork may happen while another thread holds the lock: the child gets a fresh
    lock and no standby."""
    global _LOCK, _standby, _timer
    _LOCK = threading.Lock()
    _standby = _timer = None


os.register_at_fork(after_in_child=_after_fork_in_child)


def _cancel_timer() -> None:
    global _timer
    if _timer is not None:
        _timer.cancel()
        _timer = None


def _discard_locked() -> None:
    global _standby
    worker, _standby = _standby, None
    _cancel_timer()
    if worker is not None:
        worker.kill()
