"""Nothing of a candidate's may run in its worker between a timing sample's last call and the copy (red team 20).

Red team 19 (:mod:`.outside`) compares, after every sample, what could run code asynchronously with a baseline:
the signals the process *catches*, its blocked set, timers, ``O_ASYNC`` descriptors, threads. Red team 20 ran the
deferred work of the sample's calls outside the clock through two ways that leave all of those as they were:

- **glibc's own signal 33** (``SIGSETXID``: every worker catches it from its first ``pthread_create``; glibc's
  ``sigaction`` and ``pthread_sigmask`` refuse to touch it, so the worker's blocked set left it open). The candidate
  replaced glibc's handler through the raw ``rt_sigaction`` system call and had a ``dnotify`` watch
  (``F_SETSIG``/``F_NOTIFY``: no ``O_ASYNC``) send it whenever a file in ``/proc/<pid>`` was read — which the
  worker's own look after every sample does (accepted at 4.77×, confirmed 5.21×);
- **a pending call** (``Py_AddPendingCall``, CPython's C API) that re-queues itself: the main thread's interpreter
  runs it at every eval-breaker check, so it ran through the sample and, once the calls had stopped for a few hundred
  checks, computed every deferred call in the worker's own Python after the clock (accepted at 1.25×, confirmed
  1.51×). No signal, thread, timer or descriptor.

Red team 20 also had a pure-Python way (the static scan passes it): a ``__del__`` of a self-referencing object run
by the **cyclic garbage collector**, which the candidate's calls left a few allocations short of its threshold, so
that the worker's own first allocations after the clock set it off (accepted at 2.14×, confirmed 1.91×). So the
automatic collector is off in the worker for the whole timing run (:func:`start` to :func:`stop`; garbage made
meanwhile is collected after it), and :func:`seal` reports it switched back on.

And one that rewrote the interpreter's own state: a C profile function written straight into the thread state
(``c_profilefunc`` and ``use_tracing``: ``sys.setprofile`` and ``PyEval_SetProfile`` raise an audit event the worker
refuses, a store raises none), which computed the deferred calls at the worker's first call of a built-in after the
clock and then took itself out again (accepted at 3.68×, confirmed 4.27×; at 4.11×/4.02× past the first version of
this seal). So :func:`seal` also compares the thread state's profile and trace functions (fields found at the
worker's start by setting each once) and the interpreter's frame evaluator (PEP 523) with their values from before
any candidate code.

All of these are run by the worker's main thread *between bytecodes or system calls of the worker's own code*, at a moment
the candidate chose by what the worker does there. So instead of looking after the clock (when such code may already
have run, and put back whatever it changed), the worker **seals** the process *inside* every sample's clock, right
after its last call returns and before the clock stops (:func:`seal`):

- it sets the main thread's signal mask to *every* signal, through the raw ``rt_sigprocmask`` system call (glibc's
  wrapper leaves signals 32 and 33 out), and reports when the mask it replaced was not that full set (the candidate
  unblocked something during its calls). With every signal blocked no handler can run until the next sample's calls;
  a fault (``SIGSEGV`` on a page the candidate protected, ``SIGSYS`` from a seccomp filter of its own) then ends the
  process instead of running a handler (the kernel resets the handler of a blocked synchronous signal). Signals 32
  and 33 are blocked in every thread from the worker's start (:func:`block_glibc_signals`, before any thread exists:
  threads inherit the mask), so a process-directed signal 33 has no thread to go to either;
- it queues a probe pending call and runs the queue (``Py_MakePendingCalls``); the probe counts the queue's free
  slots by filling it with no-op calls (inside a pending call the interpreter runs no other: it is not re-entrant).
  A queue with fewer free slots than at the worker's start holds someone else's pending call, which would run at the
  worker's next bytecodes, outside the clock; a probe that never ran was kept from running.

Cost, inside every sample of every arm: one system call and one probe (≈ 10–30 µs on the CI VM). Also read after
every sample and at every look (:func:`handlers`): the handler and flags of every signal, through the raw
``rt_sigaction`` (a replaced handler shows, which ``SigCgt`` does not: the set of caught signals stays the same).
"""

from __future__ import annotations

import ctypes
import gc
import os
import platform
import sys
import threading
from typing import Any

from tilesmith.gate import hooktables

#: ``rt_sigaction``, ``rt_sigprocmask`` system call numbers by machine (x86-64's table; arm64 uses the generic one).
_CALLS = {"x86_64": (13, 14), "aarch64": (134, 135), "arm64": (134, 135)}
_SIG_BLOCK, _SIG_SETMASK = 0, 2
#: glibc's internal signals (``SIGCANCEL``, ``SIGSETXID``), which its wrappers never block.
_GLIBC_SIGNALS = (32, 33)
_ALL = (1 << 64) - 1


class _State:
    libc: Any = None
    numbers: tuple[int, int] | None = None
    full_free: int | None = None
    probe: Any = None
    probe_ptr: Any = None
    noop: Any = None
    add: Any = None
    make: Any = None
    seen: list[int | None] = [None]
    before: int | None = None
    sealed = False
    main = threading.main_thread().ident
    collector: bool | None = None
    hook_offsets: tuple[int, ...] | None = None
    hooks_base: tuple[int, ...] | None = None
    eval_frame: int | None = None
    get_tstate: Any = None
    get_eval: Any = None
    interp: Any = None


def _setup() -> bool:
    if _State.libc is not None:
        return _State.numbers is not None
    try:
        _State.libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        _State.libc = False
        return False
    _State.numbers = _CALLS.get(platform.machine()) if os.uname().sysname == "Linux" else None
    if _State.numbers is not None:
        _State.libc.syscall.restype = ctypes.c_long
        _State.libc.syscall.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long]
    callback = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
    api = ctypes.PyDLL(None)  # a handle of its own: argument types set here change no one else's ctypes.pythonapi
    _State.add = api.Py_AddPendingCall
    _State.add.argtypes, _State.add.restype = [ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int
    _State.make = api.Py_MakePendingCalls
    _State.make.restype = ctypes.c_int
    # A C function that takes one pointer and returns 0 with no exception set: the no-op the probe fills slots with.
    _State.noop = ctypes.cast(api.PyErr_Occurred, ctypes.c_void_p).value

    def probe(_arg: Any) -> int:  # runs inside the interpreter's pending-call loop, which is not re-entrant
        free, add, noop = 0, _State.add, _State.noop
        while not add(noop, None):
            free += 1
            if free > 100_000:
                break
        _State.seen[0] = free
        return 0

    _State.probe = callback(probe)
    _State.probe_ptr = ctypes.cast(_State.probe, ctypes.c_void_p)
    _calibrate_hooks(api)
    return _State.numbers is not None


def _calibrate_hooks(api: Any) -> None:
    """Find where the thread state keeps its C-level profile and trace functions (``c_profilefunc``,
    ``c_tracefunc``: public fields of CPython's ``PyThreadState``, found here by setting each once rather than by a
    version's layout) and record them and the interpreter's frame evaluator (PEP 523) as they are now, before any
    candidate code exists."""
    try:
        api.PyThreadState_Get.restype = ctypes.c_void_p
        tstate = api.PyThreadState_Get()
        span = 48
        words = (ctypes.c_uint64 * span).from_address(tstate)

        def dummy(*_args: Any) -> None:
            return None

        offsets = []
        for setter, getter in ((sys.setprofile, sys.getprofile), (sys.settrace, sys.gettrace)):
            old = getter()
            before = list(words)
            setter(dummy)
            after = list(words)
            setter(old)
            changed = [i for i in range(span) if before[i] != after[i] and after[i] != id(dummy)]
            if len(changed) != 1:
                return
            offsets.append(changed[0] * 8)
        _State.get_tstate = api.PyThreadState_Get
        _State.hook_offsets = tuple(offsets)
        _State.hooks_base = _hook_words()
        api.PyInterpreterState_Get.restype = ctypes.c_void_p
        api._PyInterpreterState_GetEvalFrameFunc.restype = ctypes.c_void_p
        _State.interp = ctypes.c_void_p(api.PyInterpreterState_Get())
        _State.get_eval = api._PyInterpreterState_GetEvalFrameFunc
        _State.eval_frame = _State.get_eval(_State.interp)
    except (AttributeError, OSError, ValueError):
        return


def _hook_words() -> tuple[int, ...] | None:
    if _State.hook_offsets is None:
        return None
    tstate = _State.get_tstate()
    return tuple(ctypes.c_uint64.from_address(tstate + off).value for off in _State.hook_offsets)


_NEW, _OLD = ctypes.c_uint64(0), ctypes.c_uint64(0)
_NEW_REF, _OLD_REF = ctypes.byref(_NEW), ctypes.byref(_OLD)


def _mask(how: int, new: int | None) -> int | None:
    """``rt_sigprocmask(how, new, &old)`` on the calling thread; the old mask (``None`` if the call failed)."""
    if not _setup():
        return None
    if new is not None:
        _NEW.value = new
    rc = _State.libc.syscall(_State.numbers[1], how, _NEW_REF if new is not None else None, _OLD_REF, 8)
    return int(_OLD.value) if rc == 0 else None


def block_glibc_signals() -> None:
    """Block glibc's signals 32 and 33 in the calling thread (call before any other thread starts; they inherit it)."""
    _mask(_SIG_BLOCK, sum(1 << (s - 1) for s in _GLIBC_SIGNALS))


def _pending_free() -> int | None:
    """Free slots of the pending-call queue, counted by the probe (``-1``: full; ``None``: the probe did not run)."""
    _State.seen[0] = None
    if _State.add(_State.probe_ptr, None) != 0:
        return -1  # the queue is full: someone else's calls fill it
    _State.make()
    return _State.seen[0]


def start() -> int | None:
    """Before a timing run's first call: block every signal in the main thread (until :func:`stop`) and measure the
    pending-call queue's free slots with nothing queued. Returns the mask :func:`stop` gives back."""
    if not _setup():
        return None
    _State.make()
    free = _pending_free() if threading.get_ident() == _State.main else None
    if free is not None and free >= 0:
        _State.full_free = max(_State.full_free or 0, free)
    if _State.collector is None:
        _State.collector = gc.isenabled()
        hooktables.COLLECTOR_BEFORE[0] = _State.collector
    gc.disable()
    old = _mask(_SIG_SETMASK, _ALL)
    if _State.before is None:
        _State.before = old
    _State.sealed = old is not None
    return _State.before


def stop() -> None:
    """After the timing run: the main thread's mask as it was before the first :func:`start`."""
    if _State.before is not None:
        _mask(_SIG_SETMASK, _State.before)
    _State.sealed = False
    if _State.collector:
        gc.enable()
    _State.collector = None
    hooktables.COLLECTOR_BEFORE[0] = None


def blocked_view(sigblk: str | None) -> str | None:
    """``SigBlk`` as :mod:`.outside` compares it: during a timing run (between :func:`start` and :func:`stop`) the
    full set the seal keeps reads as the mask from before the run; anything else as it is."""
    if not _State.sealed or sigblk is None or _State.before is None:
        return sigblk
    try:
        value = int(sigblk, 16)
    except ValueError:
        return sigblk
    return f"{_State.before:016x}" if (value | (1 << 8) | (1 << 18)) == _ALL else sigblk


def seal() -> list[str]:
    """Inside a sample's clock, right after its last call: block every signal, run the pending calls and probe the
    queue. Returns what the candidate left that could run its code after the clock (empty when nothing)."""
    if not _setup():
        return []
    found = []
    if _State.collector is not None and gc.isenabled():
        gc.disable()
        found.append("the garbage collector was switched on during the calls")
    old = _mask(_SIG_SETMASK, _ALL)
    if old is not None and (old | (1 << 8) | (1 << 18)) != _ALL:  # SIGKILL and SIGSTOP are never blocked
        found.append(f"signals unblocked during the calls (mask {old:#x})")
    if _State.get_eval is not None and _State.get_eval(_State.interp) != _State.eval_frame:
        found.append("the interpreter's frame evaluator was replaced (PEP 523)")
    if threading.get_ident() != _State.main:
        return found  # pending calls run only on the main thread (the tests' in-process workers use another)
    hooks = _hook_words()
    if hooks is not None and hooks != _State.hooks_base:
        found.append("a C-level profile or trace function was set in the thread state")
    free = _pending_free()
    if free is None:
        found.append("a pending call kept the worker's probe from running")
    elif _State.full_free is not None and free < _State.full_free:
        found.append(f"pending calls queued ({_State.full_free - max(free, 0)})")
    return found


def handlers() -> dict[str, str]:
    """``{"signal N handler": "<handler>:<flags>"}`` for every signal with a handler (not default, not ignored), read
    with the raw ``rt_sigaction`` (native handlers included, which Python's ``signal.getsignal`` does not see)."""
    if not _setup():
        return {}
    out = {}
    buf = (ctypes.c_uint64 * 4)()
    for sig in range(1, 65):
        if _State.libc.syscall(_State.numbers[0], sig, None, ctypes.byref(buf), 8) != 0:
            continue
        if buf[0] > 1:  # SIG_DFL 0, SIG_IGN 1
            out[f"signal {sig} handler"] = f"{buf[0]:#x}:{buf[1]:#x}"
    return out
