"""Work that is not Inductor's, running in Inductor's compile thread pool (a structural check, shared).

Inductor keeps one process-wide :class:`concurrent.futures.ThreadPoolExecutor` for its C++ and CUDA builds
(``torch._inductor.async_compile.AsyncCompile.pool()``, created on first use when ``compile_threads > 1``). A
wrapper can submit its own callable to it; that work runs in a thread no audit hook watches (hooks are armed per
thread, :mod:`tilesmith.install.audit`) and outlives the wrapper's import or call. The 2026-12-05 red team left a
never-ending task there in the user's process only, which kept the process from exiting (docs/gate.md, "Threat
model").

:func:`foreign_work` lists the pool's busy threads whose current work item's callable is not torch's code (Inductor
submits only its own compile tasks: ``functools.partial`` objects and closures of ``torch/_inductor``). It reads
the pool's threads and their current frames (``sys._current_frames``): no locks, no waiting, nothing created (a
pool that does not exist yet is not created). Honest wrappers end their import with ``async_compile.wait(globals())``,
so none of their work is left; Inductor's own tasks are never reported, so a user's compilation running at the same
time in another thread is not blamed.

Not seen: work still queued behind busy threads (``SimpleQueue`` cannot be read without taking it; a look waits a
little for queued work to start, :func:`foreign_work`'s ``wait_s``, and later looks see it once it runs), work
that has finished by the time of the look, a callable of torch's own code chosen to block, and executors other
than Inductor's (the user's own pools are not reachable without a ``gc`` walk, which the audit hooks refuse to
candidate code). Inductor's *process* pool (``process_pool()``, CUDA) runs pickled callables
in other processes, where no hook or look reaches (docs/verification.md, "What it cannot catch").

Used by the gate worker after every request (``pool_work`` facts) and by production verification after the
installed wrapper's import and after its run on a checked call. Standard library only; torch is read from
``sys.modules`` (never imported here).
"""

from __future__ import annotations

import functools
import os
import sys
import time
from typing import Any

_THREAD_PY = os.path.join("concurrent", "futures", "thread.py")


def _torch_root() -> str | None:
    torch = sys.modules.get("torch")
    file = getattr(torch, "__file__", None)
    return os.path.dirname(os.path.realpath(file)) + os.sep if isinstance(file, str) else None


def inductor_pool() -> Any:
    """Inductor's compile thread pool if this process created it, else ``None`` (never creates it)."""
    module = sys.modules.get("torch._inductor.async_compile")
    pool_fn = getattr(getattr(module, "AsyncCompile", None), "pool", None)
    info = getattr(pool_fn, "cache_info", None)
    if info is None:
        return None
    try:
        return pool_fn() if info().currsize else None
    except Exception:  # noqa: BLE001 - another torch: no such pool
        return None


def callable_file(fn: Any) -> str | None:
    """The code file of ``fn`` (through ``functools.partial`` and bound methods); ``None`` for a builtin."""
    for _ in range(8):
        if isinstance(fn, functools.partial):
            fn = fn.func
        elif hasattr(fn, "__func__"):
            fn = fn.__func__
        else:
            break
    code = getattr(fn, "__code__", None)
    if code is None and not isinstance(fn, type):
        code = getattr(getattr(type(fn), "__call__", None), "__code__", None)
    return code.co_filename if code is not None else None


def _work_item(frame: Any) -> Any:
    while frame is not None:
        code = frame.f_code
        if code.co_name == "run" and code.co_filename.endswith(_THREAD_PY):
            return frame.f_locals.get("self")
        frame = frame.f_back
    return None


def foreign_work(pool: Any = None, wait_s: float = 0.0) -> dict[int, str]:
    """``{id(work item): "time.sleep (builtin)"}`` for every work item running in Inductor's compile pool (or
    ``pool``) whose callable is not torch's code. Empty when the pool does not exist.

    ``wait_s``: when work is queued, wait up to this many seconds for the queue to empty before looking (a task
    submitted just before the look has not started yet; honest wrappers leave the queue empty, so they never wait)."""
    pool = inductor_pool() if pool is None else pool
    if pool is None:
        return {}
    queue = getattr(pool, "_work_queue", None)
    if wait_s > 0 and queue is not None and queue.qsize():
        deadline = time.monotonic() + wait_s
        while queue.qsize() and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(0.001)  # a worker that just took an item enters its run() before it gives up the GIL
    threads = list(getattr(pool, "_threads", ()) or ())
    if not threads:
        return {}
    root = _torch_root()
    frames = sys._current_frames()
    out: dict[int, str] = {}
    for thread in threads:
        item = _work_item(frames.get(getattr(thread, "ident", None)))
        fn = getattr(item, "fn", None)
        if fn is None:
            continue
        file = callable_file(fn)
        if file is not None and root is not None and os.path.realpath(file).startswith(root):
            continue
        name = getattr(fn, "__qualname__", None) or getattr(getattr(fn, "func", None), "__qualname__", None) \
            or type(fn).__name__
        module = getattr(fn, "__module__", None) or getattr(getattr(fn, "func", None), "__module__", None)
        where = f"{os.path.basename(file)}" if file else "builtin"
        out[id(item)] = f"{module + '.' if module else ''}{name} ({where})"[:160]
    return out
