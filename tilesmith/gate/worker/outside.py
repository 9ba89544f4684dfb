"""What could run a candidate's code in its worker *outside* a timing sample's clock (red team 19).

CPU test mode times the worker's CPU time from a sample's first call to its last (:mod:`.timing`); CUDA times the
device between two events. Work done in the worker after the clock stopped (or before it started) and before the
worker copies a picked call out is in no sample, yet makes the copied outputs right. Red team 19 had three ways to run
it, all accepted before: a native signal handler fired by a POSIX timer the calls re-armed (it computed every call
while the worker built its answer), a native thread started in a call that lived past the sample and took the GIL
(so the worker could not copy until it was done), and a helper process forked during the timing warm-up — before
the no-new-processes filter (:func:`.confine.no_new_processes`) — that left before the host's last look.

The worker's own code between its samples never needs a signal, a thread or a process of the candidate's, so:

- :func:`block_async_signals` (at the worker's start, before any thread exists: every thread inherits it) blocks
  every asynchronous signal; nothing the worker does needs one (the host stops, continues and kills it with
  ``SIGSTOP``/``SIGCONT``/``SIGKILL``, which no mask holds back);
- :func:`snapshot` reads what would let code run asynchronously — the signals the process catches (``SigCgt``:
  a native ``sigaction`` handler shows there, which Python's ``signal.getsignal`` does not), the main thread's
  blocked set (``SigBlk``: a candidate that unblocks), its POSIX timers (``/proc/self/timers``) and interval
  timers, descriptors set to signal on I/O (``O_ASYNC``), and its OS threads; the worker compares it with its
  baseline at every look and after **every sample**, right after the clock (:func:`changes`);
- :func:`session_processes` counts the processes in the worker's session besides itself once the timing warm-up
  is over and the filter is on: any still alive could work through the run unseen.

Red team 20 (:mod:`.seal`): a handler that *replaced* one the process already catches (glibc's signal 33, fired by
``F_NOTIFY``; a ``SIGSEGV`` handler in ``faulthandler``'s place) kept ``SigCgt`` as it was, and code run between the
worker's own bytecodes (a pending call, a garbage-collector finalizer) needs no signal at all; :mod:`.seal` blocks
every signal and probes the pending-call queue *inside* the clock, and :func:`snapshot` also compares every signal's
handler address (:func:`.seal.handlers`).
"""

from __future__ import annotations

import fcntl
import os
import signal
from typing import Any

from tilesmith import _proc
from tilesmith.gate.protocol import OUTSIDE_CLOCK
from tilesmith.gate.worker import seal

#: Signals delivered at a fault in the thread that caused it (a mask cannot hold them back), plus the two no mask
#: holds; every other signal is asynchronous.
_SYNCHRONOUS = {getattr(signal, n) for n in ("SIGKILL", "SIGSTOP", "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGTRAP",
                                             "SIGSYS", "SIGABRT") if hasattr(signal, n)}


def block_async_signals() -> None:
    """Block every asynchronous signal in the calling thread (call before any other thread starts)."""
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, set(signal.valid_signals()) - _SYNCHRONOUS)
    except (AttributeError, OSError, ValueError):  # no pthread_sigmask (not Linux): nothing to compare either
        pass


def _status_fields(path: str, names: tuple[str, ...]) -> dict[str, str]:
    try:
        with open(path, encoding="ascii") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return {}
    found = {}
    for line in lines:
        key, _, value = line.partition(":")
        if key in names:
            found[key] = value.strip()
    return found


def _timers() -> int:
    count = 0
    try:
        with open("/proc/self/timers", encoding="ascii") as handle:
            count = sum(1 for line in handle if line.startswith("ID:"))
    except OSError:
        pass
    for which in ("ITIMER_REAL", "ITIMER_VIRTUAL", "ITIMER_PROF"):
        if hasattr(signal, which) and signal.getitimer(getattr(signal, which)) != (0.0, 0.0):
            count += 1
    return count


def _async_fds() -> int:
    count = 0
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return 0
    for name in fds:
        try:
            if fcntl.fcntl(int(name), fcntl.F_GETFL) & getattr(os, "O_ASYNC", 0o20000):
                count += 1
        except (OSError, ValueError):
            continue
    return count


def snapshot(threads: bool = False) -> dict[str, Any]:
    """The process's asynchronous-execution facts (empty off Linux); ``threads``: with its OS thread count. Read on
    the main thread (``SigBlk`` is that thread's)."""
    status = _status_fields("/proc/thread-self/status", ("SigBlk",))
    status.update(_status_fields("/proc/self/status", ("SigCgt",)))
    if not status:
        return {}
    facts: dict[str, Any] = {"signals caught (SigCgt)": status.get("SigCgt"),
                             "signals blocked (SigBlk)": seal.blocked_view(status.get("SigBlk")),
                             "timers armed": _timers(), "descriptors signalling on I/O (O_ASYNC)": _async_fds()}
    facts.update(seal.handlers())  # a replaced handler (red team 20: glibc's signal 33), which SigCgt does not show
    if threads:
        try:
            facts["OS threads"] = len(os.listdir("/proc/self/task"))
        except OSError:
            pass
    return facts


def changes(base: dict[str, Any], now: dict[str, Any], where: str) -> dict[str, list[Any]]:
    """``{"outside the clock: <fact> (<where>)": [before, after]}`` for every fact of ``now`` that differs from
    ``base`` (a thread count only when it grew)."""
    out = {}
    for key, value in now.items():
        before = base.get(key)
        if before is None or value == before or (key == "OS threads" and value < before):
            continue
        out[f"{OUTSIDE_CLOCK}{key} ({where})"] = [before, value]
    return out


def session_processes() -> int:
    """Live (not zombie) processes of this process's session other than its leader, the worker itself (it leads its
    own session): :func:`tilesmith._proc.session_processes`, which the host's count uses too."""
    return len(_proc.session_processes(os.getsid(0)))
