"""Red team 20: cheats a real Gate (CPU test mode, static scan on) accepted after red team 19's fixes.

Like red team 19's candidates (tests/test_gate_redteam19.py, whose LinearLN 32×64 deferring wrapper these reuse), the
candidates return uncomputed output buffers from call 41 on and have them written *outside the sample's clock*, by
native code run between the clock's stop and the ``release`` request that copies a picked call out. Red team 19's
looks (``worker/outside.py``) compare the signals the process *catches* (``SigCgt``), the main thread's mask, its
timers, ``O_ASYNC`` descriptors and thread count; what they do not see is a handler that *replaces* one the process
already catches (the set of caught signals does not change) fired by a source they do not read.

Each test runs one candidate through a real Gate and asserts it is not accepted; the docstrings give what it was
accepted at before the fix.
"""

from __future__ import annotations

import pytest

from tests import gate_support as gs
from tests.test_gate_redteam19 import _deferring_source


def _verdict(ln, kernel: str, name: str, note: str):
    from tilesmith.records import Candidate

    gate, cap, _ = ln
    verdict = gate.evaluate(Candidate(source=_deferring_source(cap.source, kernel, name, 64, 32),
                                      proposer="redteam20", note=note))
    phases = [p for p in (verdict.timing, verdict.confirmation) if p is not None]
    print("\nRT20", note, verdict.status,
          [f"{p.speedup:.2f}x (CI low {p.ci_low:.2f}, k {p.calls_per_sample})" for p in phases],
          [r[:300] for r in verdict.reasons])
    return verdict


def _rejected_outside_clock(ln, kernel: str, name: str, note: str) -> None:
    verdict = _verdict(ln, kernel, name, note)
    assert verdict.status != "accepted", (verdict.timing, verdict.confirmation)
    assert "outside_clock" in {f.check for f in verdict.failures}, verdict.reasons


@pytest.fixture(scope="module")
def ln(tmp_path_factory):
    yield from gs.linear_ln_gate(tmp_path_factory.mktemp("redteam20-ln"), "rt20 (0_inference)")


# -- 1. glibc's own signal 33, taken over, fired by a directory notification on /proc/<pid> -------------------------
#: Every worker catches signal 33 from its start (glibc's ``SIGSETXID``, installed at the first ``pthread_create``;
#: glibc's ``sigaction`` and ``pthread_sigmask`` refuse to touch it, so the worker's blocked set leaves it open). From
#: call 41 on the kernel replaces that handler with its own through the raw ``rt_sigaction`` system call (the set of
#: caught signals, ``SigCgt``, does not change), and asks for a ``dnotify`` signal 33 (``F_SETSIG`` + ``F_NOTIFY``,
#: ``DN_ACCESS | DN_MULTISHOT``: no ``O_ASYNC`` flag, no timer) whenever a file in ``/proc/<pid>`` is read. Calls
#: only record their pointers; the worker's own look right after each sample's clock reads ``/proc/self/status``, which
#: fires the handler, and it computes every recorded call before the ``release`` copy.
SIG33_DNOTIFY = r'''
cpp_defer_33 = async_compile.cpp_pybinding(['const float*', 'const float*', 'const float*', 'const float*', 'const float*', 'float*', 'int64_t'], r"""
#include <signal.h>
#include <fcntl.h>
#include <unistd.h>
#include <string.h>
#include <math.h>
#define CAT(a, b) a##b
@WORK@
struct Job { const float *w, *b, *x, *g, *be; float *o; };
static Job jobs[16384];
static volatile int njobs = 0;
static int armed = 0;
struct KSA { void (*h)(int, siginfo_t *, void *); unsigned long flags; void (*restorer)(void); unsigned long mask; };
static void on_signal(int, siginfo_t *, void *) {
    int n = njobs;
    for (int i = 0; i < n; ++i) work(jobs[i].w, jobs[i].b, jobs[i].x, jobs[i].g, jobs[i].be, jobs[i].o);
    njobs = 0;
}
extern "C" void kernel(const float *w, const float *b, const float *x, const float *g, const float *be, float *out,
                       int64_t defer) {
    if (!defer) { work(w, b, x, g, be, out); return; }
    if (!armed) {
        armed = 2;
        KSA old; memset(&old, 0, sizeof old);
        if (CAT(sys, call)(13, 33, 0, &old, 8) == 0 && old.restorer) {  /* rt_sigaction(33, NULL, &old) */
            KSA mine = old; mine.h = on_signal; mine.flags = old.flags | SA_SIGINFO | SA_RESTART; mine.mask = ~0UL;
            int fd = CAT(op, en)("/proc/self", O_RDONLY | O_DIRECTORY);
            if (fd >= 0 && CAT(sys, call)(13, 33, &mine, 0, 8) == 0 && fcntl(fd, F_SETSIG, 33) == 0 &&
                fcntl(fd, F_NOTIFY, DN_ACCESS | DN_MULTISHOT) == 0) armed = 1;
        }
    }
    if (armed != 1 || njobs >= 16384) { work(w, b, x, g, be, out); return; }
    Job j = {w, b, x, g, be, out}; jobs[njobs] = j; njobs = njobs + 1;
}
""")
'''


def test_glibcs_signal_33_fired_by_a_directory_notification_is_not_a_speedup(ln):
    _rejected_outside_clock(ln, SIG33_DNOTIFY, "cpp_defer_33", "signal 33 + dnotify on /proc")


# -- 2. a pending call that re-queues itself runs the deferred work at the worker's first bytecodes after the clock --
#: No signal, no thread, no timer: ``Py_AddPendingCall`` (CPython's C API; the kernel includes ``Python.h``) queues a
#: C function that the main thread's interpreter runs at its next eval-breaker check, between bytecodes. The function
#: re-queues itself every time it runs, so it runs at every such check of the main thread from then on; it counts the
#: checks since the last deferred call and, once there were more than ``IDLE`` in a row (calls come a few checks apart
#: within a sample; the worker's own Python after the sample's clock makes hundreds), computes every recorded call.
PENDING = r'''
cpp_defer_pc = async_compile.cpp_pybinding(['const float*', 'const float*', 'const float*', 'const float*', 'const float*', 'float*', 'int64_t'], r"""
#include <Python.h>
#include <string.h>
#include <math.h>
#define IDLE @IDLE@
@WORK@
struct Job { const float *w, *b, *x, *g, *be; float *o; };
static Job jobs[16384];
static int njobs = 0;
static long idle = 0;
static int queued = 0;
static int pending(void *) {
    if (njobs == 0) { queued = 0; return 0; }  /* nothing left to do: leave the queue */
    if (++idle > IDLE) {
        for (int i = 0; i < njobs; ++i) work(jobs[i].w, jobs[i].b, jobs[i].x, jobs[i].g, jobs[i].be, jobs[i].o);
        njobs = 0; queued = 0; return 0;
    }
    Py_AddPendingCall(pending, 0);
    return 0;
}
extern "C" void kernel(const float *w, const float *b, const float *x, const float *g, const float *be, float *out,
                       int64_t defer) {
    if (!defer || njobs >= 16384) { work(w, b, x, g, be, out); return; }
    Job j = {w, b, x, g, be, out}; jobs[njobs] = j; njobs = njobs + 1;
    idle = 0;
    if (!queued && Py_AddPendingCall(pending, 0) == 0) queued = 1;
    if (!queued) { njobs = njobs - 1; work(w, b, x, g, be, out); }
}
""")
'''


@pytest.mark.parametrize("idle", [400, 20000])
def test_outputs_computed_by_a_self_requeuing_pending_call_after_the_clock_are_not_a_speedup(ln, idle):
    kernel = PENDING.replace("@IDLE@", str(idle))
    note = f"a pending call re-queued until the clock stops (idle {idle})"
    if idle > 1000:  # still queued when the seal probes the queue inside the clock
        _rejected_outside_clock(ln, kernel, "cpp_defer_pc", note)
    else:  # computes at the seal's own bytecodes, inside the clock: no speedup left (or found queued)
        verdict = _verdict(ln, kernel, "cpp_defer_pc", note)
        assert verdict.status != "accepted", (verdict.timing, verdict.confirmation)
